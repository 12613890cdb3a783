"""splitserve: a disaggregated prefill/decode LLM serving cluster.

The top-level folders are the architecture (see ../shared/DESIGN.md):
``common`` (configs, wire types, hashing), ``engine`` (model, KV cache, scheduler,
sampler), ``prefill_node``, ``decode_node``, ``kvtransfer``, ``router``, ``csrc``,
``deploy``.
"""

__version__ = "0.1.0"
