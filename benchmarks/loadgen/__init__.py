"""The load tools splitserve ships, behind its CLI: ``bench/`` is the load generator of
``splitserve bench`` (any OpenAI-compatible endpoint), ``replay/`` the trace generator
and replay of ``splitserve make-trace`` and ``splitserve replay`` (simulated nodes) and
the replay behind ``splitserve plan --check``.

    bench/datasets.py, replay/ --> common/trace.py --> common/jsonl.py
    (the trace format is shared with the offline planner, deploy/planner/offline/)

Product code: the CLI and tests import it; it must not import the experiments around it
(``benchmarks/<subject>/``) or the tests.
"""
