"""``splitserve bench``: a load generator for any OpenAI-compatible endpoint.

    datasets.py             -> list[RequestSpec]       what to send (a routing trace
                                                       read through common/trace.py)
    arrivals.py             -> send offsets (seconds)  when to send it
    client.py               -> RequestResult           one streamed request, timed
    runner.py               -> RunResult               a schedule under a concurrency cap
    metrics.py              -> Summary                 percentiles, throughput, goodput
    report.py               -> table, JSON, PNG
    cli.py                  -> the flags

Other code (the comparison script, tests) uses the library directly: build specs,
``await run(...)``, ``summarize(...)``.
"""

from splitserve.deploy.planner.slo import Slo

from .arrivals import poisson_offsets, trace_offsets
from .client import EndpointError, Endpoint, check_endpoint
from .config import BenchConfig
from .datasets import RequestSpec, load_dataset
from .metrics import Summary, summarize
from .runner import RunResult, run

__all__ = ["BenchConfig", "Endpoint", "EndpointError", "RequestSpec", "RunResult", "Slo",
           "Summary", "check_endpoint", "load_dataset", "poisson_offsets", "run", "summarize",
           "trace_offsets"]
