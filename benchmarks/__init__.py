"""Benchmarks. ``splitserve.benchmarks.serve`` is the serving load generator behind
``splitserve bench``; the ``bench_*.py`` and ``compare_serving.py`` scripts are run
as files (``python benchmarks/NAME.py``) and write their results under ``results/``."""
