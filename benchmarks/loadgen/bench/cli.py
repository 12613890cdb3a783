"""``splitserve bench``: flags -> `BenchConfig` -> one run per request rate ->
table on stdout, JSON and PNG when ``--result-json`` is given.

Exit status: 0 when requests completed, 1 when the endpoint is unusable (one line
on stderr, no traceback) or no request completed; 2 for bad flags (cli.py).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from pathlib import Path

from splitserve.deploy.planner.slo import Slo

from .arrivals import poisson_offsets, trace_offsets
from .client import Endpoint, EndpointError, check_endpoint
from .config import BenchConfig, EndpointType, normalize_base_url
from .datasets import load_dataset, load_tokenizer
from .metrics import slo_ms, summarize
from .report import format_summary, plot_cdfs, plot_vs_rate, request_records, write_json
from .runner import run


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server; /v1 is appended unless given (default %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    p.add_argument("--endpoint-type", choices=("completions", "chat"), default=None,
                   help="/v1/completions or /v1/chat/completions (default completions)")
    p.add_argument("--backend", choices=tuple(BACKENDS), default=None,
                   help="vLLM's name for the same: openai = completions, openai-chat = chat")
    p.add_argument("--request-rate", type=float, nargs="+", default=None, metavar="RATE",
                   help="Poisson arrivals, requests/s; several values run one after another; "
                        "inf sends all at once (default: inf, or a trace's own timestamps)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per run (default 100; "
                   "a trace: all its lines)")
    p.add_argument("--dataset", default=None,
                   help="random | shared-prefix | sharegpt:PATH | custom:PATH | trace:PATH (default random)")
    p.add_argument("--dataset-name", choices=DATASET_NAMES, default=None,
                   help="vLLM's spelling: the dataset's name, its file in --dataset-path")
    p.add_argument("--dataset-path", default=None, help="the file of sharegpt, custom (JSONL of "
                   "{\"prompt\": ...}) and trace datasets")
    p.add_argument("--custom-output-len", type=int, default=256, help="custom: max_tokens of each request")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random lengths uniform in len*(1-r)..len*(1+r)")
    p.add_argument("--prefix-len", "--prefix-repetition-prefix-len", dest="prefix_len", type=int,
                   default=512, help="shared-prefix: tokens per tenant prefix")
    p.add_argument("--num-tenants", "--prefix-repetition-num-prefixes", dest="num_tenants", type=int,
                   default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-repetition-suffix-len", dest="random_input_len", type=int,
                   help="prefix-repetition: tokens after the prefix (= --random-input-len)")
    p.add_argument("--prefix-repetition-output-len", dest="random_output_len", type=int,
                   help="prefix-repetition: max_tokens (= --random-output-len)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: fixed output length instead of the reply's")
    p.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="trace: multiply the timestamps (0.5 = twice as fast)")
    p.add_argument("--tokenizer", default=None, help="model folder with tokenizer.json (default: "
                   "the bundled SmolLM2)")
    p.add_argument("--send-text", action="store_true",
                   help="completions: send prompts as text, not token-id arrays")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos=true (vLLM extension): "
                   "every request generates its full output length")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:100 (milliseconds)")
    p.add_argument("--percentiles", default="50,90,99", help="comma list (default %(default)s)")
    p.add_argument("--result-json", default=None, help="write results here, and PNG plots beside it")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))


SLO_FIELDS = {"ttft": "ttft_s", "tpot": "itl_s"}  # --goodput term -> Slo field (bench's TPOT is its ITL)


def parse_slo(items: list[str] | None) -> Slo | None:
    if not items:
        return None
    bounds = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_FIELDS or not value:
            raise ValueError(f"--goodput: {item!r}; use ttft:MS and/or tpot:MS")
        try:
            bounds[SLO_FIELDS[key]] = float(value) / 1000
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: {value!r} is not a number of milliseconds") from None
    return Slo(**bounds)


# vLLM's --backend -> endpoint type
BACKENDS: dict[str, EndpointType] = {"openai": "completions", "openai-chat": "chat"}
DATASET_NAMES = ("random", "prefix-repetition", "shared-prefix", "custom", "sharegpt", "trace")
_NEEDS_PATH = ("custom", "sharegpt", "trace")


def _dataset(a: argparse.Namespace) -> str:
    """--dataset, or --dataset-name with --dataset-path, as one dataset string."""
    if a.dataset_name is None:
        if a.dataset_path is not None:
            raise ValueError("--dataset-path: give --dataset-name with it")
        return a.dataset or "random"
    if a.dataset is not None:
        raise ValueError("--dataset-name: give it or --dataset, not both")
    if (a.dataset_path is None) == (a.dataset_name in _NEEDS_PATH):
        raise ValueError(f"--dataset-path: {'required' if a.dataset_path is None else 'not used'} "
                         f"with --dataset-name {a.dataset_name}")
    return f"{a.dataset_name}:{a.dataset_path}" if a.dataset_path else a.dataset_name


def _endpoint_type(a: argparse.Namespace) -> EndpointType:
    from_backend = BACKENDS[a.backend] if a.backend else None
    if from_backend and a.endpoint_type and from_backend != a.endpoint_type:
        raise ValueError(f"--backend {a.backend}: contradicts --endpoint-type {a.endpoint_type}")
    chosen: EndpointType = from_backend or a.endpoint_type or "completions"  # argparse's choices: a valid name
    return chosen


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    try:
        percentiles = tuple(float(x) for x in a.percentiles.split(","))
    except ValueError:
        raise ValueError(f"--percentiles: {a.percentiles!r} is not a comma list of numbers") from None
    for name in ("num_prompts", "max_concurrency", "custom_output_len"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    return BenchConfig(
        base_url=normalize_base_url(a.base_url), model=a.model, endpoint_type=_endpoint_type(a),
        request_rates=tuple(a.request_rate or ()), max_concurrency=a.max_concurrency,
        num_prompts=a.num_prompts, dataset=_dataset(a), custom_output_len=a.custom_output_len,
        random_input_len=a.random_input_len,
        random_output_len=a.random_output_len, random_range_ratio=a.random_range_ratio,
        prefix_len=a.prefix_len, num_tenants=a.num_tenants, sharegpt_output_len=a.sharegpt_output_len,
        trace_time_scale=a.trace_time_scale, tokenizer=a.tokenizer, send_text=a.send_text,
        ignore_eos=a.ignore_eos, temperature=a.temperature, seed=a.seed, slo=parse_slo(a.goodput),
        percentiles=percentiles, result_json=a.result_json, disable_tqdm=a.disable_tqdm,
        request_timeout_s=a.request_timeout, api_key=a.api_key)


async def bench(cfg: BenchConfig) -> int:
    model = await check_endpoint(cfg.base_url, cfg.model, cfg.api_key)
    tok = load_tokenizer(cfg.tokenizer)
    specs = load_dataset(cfg, tok)
    ep = Endpoint(cfg.base_url, model, cfg.endpoint_type, cfg.api_key, cfg.ignore_eos,
                  cfg.temperature, cfg.send_text)
    schedule = trace_offsets(specs) if not cfg.request_rates else None
    rates = list(cfg.request_rates) or [math.inf]
    runs = []
    for rate in rates:
        offsets = schedule or poisson_offsets(len(specs), rate, cfg.seed)
        label = "trace schedule" if schedule else f"rate {rate:g} req/s"
        print(f"{len(specs)} requests to {cfg.base_url} ({model}, {cfg.endpoint_type}, {cfg.dataset}), "
              f"{label}, max concurrency {cfg.max_concurrency or 'none'}", file=sys.stderr, flush=True)
        result = await run(ep, specs, offsets, tok.decode, cfg.max_concurrency,
                           progress=not cfg.disable_tqdm, desc=label, timeout_s=cfg.request_timeout_s)
        summary = summarize(result.results, result.duration_s, cfg.slo, cfg.percentiles)
        print(format_summary(summary, label), flush=True)
        runs.append((label, rate, result, summary))
        if schedule:
            break
    if cfg.result_json:
        _write(Path(cfg.result_json), cfg, model, runs)
    return 0 if any(s.completed for *_, s in runs) else 1


def _write(path: Path, cfg: BenchConfig, model: str, runs: list) -> None:
    write_json(path, {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model,
        "config": {k: (slo_ms(v) if isinstance(v := getattr(cfg, k), Slo) else v)
                   for k in cfg.__slots__ if k != "api_key"},
        "runs": [{"label": label, "request_rate": rate, "summary": s.to_dict(),
                  "requests": request_records(r.results)} for label, rate, r, s in runs]})
    plot_cdfs(path.with_suffix(".png"), [(label, r.results) for label, _, r, _ in runs],
              title=f"{model} at {cfg.base_url}")
    written = [path, path.with_suffix(".png")]
    if len(runs) > 1:
        rates_png = path.with_name(path.stem + "_rates.png")
        plot_vs_rate(rates_png, [rate for _, rate, _, _ in runs], [s for *_, s in runs])
        written.append(rates_png)
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    try:
        return asyncio.run(bench(cfg))
    except EndpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
