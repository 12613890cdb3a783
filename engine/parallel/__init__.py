"""Tensor parallelism inside one node: the rank group and its bounded collectives, rank 0's
step channel to its workers, their launch, and a worker rank's loop."""
