"""User-facing errors. Each names the offending field so the router can answer
with an OpenAI-style 400 body (``{"error": {"message", "type", "param", "code"}}``).
"""


class InvalidRequest(ValueError):
    """A request field is invalid. ``field`` is the request's parameter name
    (``max_tokens``, ``messages``, ...); the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
