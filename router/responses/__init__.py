"""The Responses API (``/v1/responses``): its request, its objects and streamed events, the chat
request it means, and the Redis store behind ``previous_response_id``."""
