"""The prefill server: chunked-prefill scheduling and the KV sender (issue 3)."""
