"""The collectives of a node's ranks: the rank group and its bounded collectives, a
data-parallel node's step clock and ledger (group.py), and rank 0's step channel to its
workers (step_channel.py). Imports nothing above what a step is made of; the rank processes and
their bring-up, which build runners, sit above the runners in engine/ranks/."""
