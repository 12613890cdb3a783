"""The decode server: continuous batching, KV receiver, local-prefill fallback (issue 3)."""
