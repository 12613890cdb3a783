"""splitserve's load tools and its experiments, sorted by who uses them.

    loadgen/      product: the load tools behind ``splitserve bench``, ``make-trace`` and
                  ``replay`` (the CLI imports them)
    engine/ kvtransfer/ router/ serving/ reliability/
                  experiments by subject: each ``bench_*.py`` answers one question and
                  writes its current result under ``results/`` (README.md: the table)
    gpu/          the GPU suite (suite.sh) and the GPU experiments it runs
    harness.py    the one module of helpers the experiments share
    results/      one current file per benchmark; superseded runs in results/archive/

A script runs as a file (``.venv/bin/python benchmarks/engine/bench_engine.py``) or as a
module (``python -m splitserve.benchmarks.engine.bench_engine``): scripts import
everything by its full ``splitserve.`` name. No script imports another script, and
nothing here imports the tests (``tests/kit/`` is the tests' own).
"""
