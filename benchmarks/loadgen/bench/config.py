"""The one frozen config of a ``splitserve bench`` run, resolved from the flags
before anything starts (cli.py) and never written back to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from splitserve.deploy.planner.slo import Slo

EndpointType = Literal["chat", "completions"]  # /v1/chat/completions or /v1/completions


@dataclass(frozen=True, slots=True)
class BenchConfig:
    base_url: str  # ends with /v1
    model: str | None = None  # None: the first model the endpoint lists
    endpoint_type: EndpointType = "completions"
    # One run per rate (requests/s, inf = all at once). Empty: the dataset's own
    # schedule (trace timestamps), or all at once when it has none.
    request_rates: tuple[float, ...] = ()
    max_concurrency: int | None = None  # None: no cap
    num_prompts: int | None = None  # None: 100, or every line of a trace
    dataset: str = "random"  # random | shared-prefix | sharegpt:PATH | custom:PATH | trace:PATH
    random_input_len: int = 256
    random_output_len: int = 64
    random_range_ratio: float = 0.0  # lengths uniform in [len*(1-r), len*(1+r)]
    prefix_len: int = 512  # shared-prefix: tokens each tenant's requests share
    num_tenants: int = 4  # shared-prefix: distinct prefixes
    sharegpt_output_len: int | None = None  # None: the length of the dataset's own answer
    trace_time_scale: float = 1.0  # trace: multiply the timestamps by this
    custom_output_len: int = 256  # custom: max_tokens of every request (vLLM's default)
    tokenizer: str | None = None  # model folder with tokenizer.json; None: the bundled model
    send_text: bool = False  # completions: send decoded text instead of token-id arrays
    ignore_eos: bool = False  # send ignore_eos=true (a vLLM extension splitserve supports)
    temperature: float = 0.0
    seed: int = 0
    slo: Slo | None = None  # --goodput's bounds (its attainment is not used)
    percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    result_json: str | None = None  # also writes <stem>.png (and <stem>_rates.png)
    disable_tqdm: bool = False
    request_timeout_s: float = 600.0
    api_key: str | None = None


def normalize_base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all mean ``http://h:p/v1``."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url: {url!r} must start with http:// or https://")
    return url if url.endswith("/v1") else url + "/v1"
