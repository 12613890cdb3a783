"""Benchmarks and the load tools shipped with splitserve: ``benchmarks.serve`` is the
serving load generator behind ``splitserve bench``, ``benchmarks.replay`` the trace
replay behind ``splitserve replay``. The ``bench_*.py`` and ``compare_serving.py``
scripts are run as files (``python benchmarks/NAME.py``) and write their results
under ``results/``."""
