"""The load tools splitserve ships, behind its CLI: ``bench/`` is the load generator of
``splitserve bench`` (any OpenAI-compatible endpoint), ``replay/`` the trace generator
and replay of ``splitserve make-trace`` and ``splitserve replay`` (simulated nodes), and
``jsonl.py`` the JSON-lines reader both use.

    bench/datasets.py --> replay/trace.py --> jsonl.py     (the trace format is the replay's)

Product code: the CLI and tests import it; it must not import the experiments around it
(``benchmarks/<subject>/``) or the tests.
"""
