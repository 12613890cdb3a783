"""Trace replay against simulated nodes: the trace format, its generator, and the
driver behind ``splitserve replay``."""
