"""Experiments on the engine alone: throughput against transformers (bench_engine), the
static decode path on the CPU (bench_static_decode_cpu), structured outputs
(bench_structured), and the simulated node's timing model fitted to it (fit_timing)."""
