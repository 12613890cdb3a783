"""The OpenAI-compatible routing proxy (issue 3)."""
