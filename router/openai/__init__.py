"""The OpenAI shapes: request structs, the prompt (tokenizer, chat template, tool calls,
structured outputs) prepared from a body, the generating endpoints, and the answer bodies."""
