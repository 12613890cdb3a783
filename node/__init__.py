"""What every node process has, prefill or decode: the engine thread, the KV cache placement, the node registry heartbeat, metrics and the health/debug routes."""
