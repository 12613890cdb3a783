"""Trace replay against simulated nodes: the trace generator (the format is
common/trace.py), the driver behind ``splitserve replay``, and the check behind
``splitserve plan --check`` (plan_check.py)."""
