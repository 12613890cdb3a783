"""The KV cache of one engine: the block pool and prefix cache, the per-request cache manager,
its sizing, and the tier store below it (host memory, then disk)."""
