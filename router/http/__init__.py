"""The router's HTTP edge: the listening socket, API keys and authentication, admission and
draining, request bodies before they are parsed, OpenAI-style errors, the per-key compile
budget, and the small read-only endpoints (models, health, metrics, decisions, vLLM's extras)."""
