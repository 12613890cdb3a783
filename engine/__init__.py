"""The model executor both node kinds run: the step loop and scheduler here, and beside them
models/ (the families, their loading and sharding), kv/ (block pool, prefix cache, tier
store), sampling/, parallel/ (a node's tensor-parallel ranks) and attention/ (the backends).
Knows nothing about HTTP, Redis or the network beyond its node's own ranks (the step
channel, parallel/step_channel.py, and their torch.distributed group, parallel/group.py)."""
