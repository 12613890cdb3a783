"""The OpenAI-compatible routing proxy: validates and tokenizes requests, picks a
prefill and a decode node from the Redis node registry, streams tokens back as text.

Entry points: `splitserve.router.app.build_app` / `start_router` / `run_router` and
`python -m splitserve.router`. Never imports torch or `splitserve.engine`: the model's
context comes from config.json through common/hf_config.py, as the nodes read it.
"""
