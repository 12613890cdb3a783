"""splitserve: a disaggregated prefill/decode LLM serving cluster.

The top-level folders are the architecture (ARCHITECTURE.md walks through them):
``common`` (configs, wire types, hashing, outcomes, metric names), ``engine`` (model,
KV cache, scheduler, sampler, the engine thread), ``node`` (what every node process
shares: runtime, app, KV-event publisher, simulated fleets), ``prefill_node``,
``decode_node``, ``kvtransfer`` (KV block transports and the transfer state machine),
``router`` (the OpenAI endpoint and routing), ``csrc`` (CUDA kernels), ``deploy``
(``splitserve up``, Kubernetes, Docker, dashboards) and ``benchmarks`` (load tools
and measurements); ``tests`` is not installed with the package.

The offline API is importable from the top, as in vLLM::

    from splitserve import LLM, SamplingParams

Those names are resolved on first use (PEP 562 ``__getattr__``), so ``import
splitserve`` stays light: it never imports torch unless ``LLM`` is used.
"""

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it (imported when the name is first read)
_LAZY = {
    "LLM": "splitserve.engine.llm",
    "RequestOutput": "splitserve.engine.llm",
    "SamplingParams": "splitserve.common.sampling_params",
    "StructuredOutputsParams": "splitserve.common.structured_outputs",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
