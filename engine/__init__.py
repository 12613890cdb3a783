"""The model executor both node kinds run: Llama model (sharded over a node's ranks with
tensor parallelism), attention backends, block pool and prefix cache, scheduler, sampler.
Knows nothing about HTTP, Redis or the network beyond its node's own ranks (the step
channel, tp_channel.py, and their torch.distributed group, parallel.py)."""
