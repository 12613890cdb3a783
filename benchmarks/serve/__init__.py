"""``splitserve bench``: a load generator for any OpenAI-compatible endpoint.

    datasets.py / trace.py  -> list[RequestSpec]       what to send
    arrivals.py             -> send offsets (seconds)  when to send it
    client.py               -> RequestResult           one streamed request, timed
    runner.py               -> RunResult               a schedule under a concurrency cap
    metrics.py              -> Summary                 percentiles, throughput, goodput
    report.py               -> table, JSON, PNG
    cli.py                  -> the flags

Other code (the comparison script, tests) uses the library directly: build specs,
``await run(...)``, ``summarize(...)``.
"""

from splitserve.benchmarks.serve.arrivals import poisson_offsets, trace_offsets
from splitserve.benchmarks.serve.client import EndpointError, Endpoint, check_endpoint
from splitserve.benchmarks.serve.config import BenchConfig, Slo
from splitserve.benchmarks.serve.datasets import RequestSpec, load_dataset
from splitserve.benchmarks.serve.metrics import Summary, summarize
from splitserve.benchmarks.serve.runner import RunResult, run

__all__ = ["BenchConfig", "Endpoint", "EndpointError", "RequestSpec", "RunResult", "Slo",
           "Summary", "check_endpoint", "load_dataset", "poisson_offsets", "run", "summarize",
           "trace_offsets"]
