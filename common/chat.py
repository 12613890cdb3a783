"""The chat roles splitserve accepts, for the router's /v1/chat/completions and the
offline ``LLM.generate`` alike (OpenAI's roles; ``developer`` is the newer name of
``system``). The model's chat template decides how each is rendered."""

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
