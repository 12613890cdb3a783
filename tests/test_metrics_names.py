"""Metric names: defined once (common/metric_names.py), vLLM's suffixes with our prefix,
``model_name`` on every series; the node's request timing and prefix-cache counters
measured on a real engine."""

import ast
import re
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from splitserve.common import metric_names as names
from splitserve.common.sampling_params import SamplingParams
from splitserve.node.metrics import NodeMetrics
from splitserve.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[1]
NAME_RE = re.compile(r"^splitserve:[a-z][a-z0-9_]*$")
# vLLM's names (without the vllm: prefix) that dashboards written for vLLM use.
VLLM_NAMES = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "prompt_tokens_total", "generation_tokens_total",
              "request_success_total", "num_requests_running", "num_requests_waiting",
              "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total",
              "num_preemptions_total", "request_prompt_tokens", "request_generation_tokens")


def defined_names() -> dict[str, str]:
    return {k: v for k, v in vars(names).items()
            if isinstance(v, str) and k.isupper() and v.startswith(names.PREFIX) and k != "PREFIX"}


def samples(text: str):
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def test_names_are_unique_prefixed_and_follow_vllm():
    defined = defined_names()
    assert len(set(defined.values())) == len(defined), "two constants share a name"
    for const, name in defined.items():
        assert NAME_RE.match(name), (const, name)
    for suffix in VLLM_NAMES:
        assert names.PREFIX + suffix in defined.values(), suffix


def test_metric_names_module_imports_nothing():
    tree = ast.parse((ROOT / "common" / "metric_names.py").read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def test_no_metric_name_literal_outside_metric_names():
    """Every exported name comes from common/metric_names.py: no other module spells one."""
    pattern = re.compile(r"[\"']splitserve[:_][a-z_]+_(total|seconds|perc)[\"']")
    offenders = [str(p.relative_to(ROOT)) for folder in ("router", "node", "prefill_node",
                                                         "decode_node", "common", "engine",
                                                         "kvtransfer", "benchmarks")
                 for p in (ROOT / folder).rglob("*.py")
                 if p.name != "metric_names.py" and pattern.search(p.read_text())]
    assert offenders == []


def test_every_router_series_has_model_name():
    m = RouterMetrics.create("my-model")
    m.ttft.observe(0.2)
    m.itl.observe(0.01)
    m.finished.labels(finished_reason="stop").inc()
    m.failures.labels(reason="node_error").inc()
    m.decisions.labels(node_id="p0", role="prefill").inc()
    text = m.render()[0].decode()
    found = samples(text)
    assert found and all(s.labels.get("model_name") == "my-model" for s in found)
    by_name = {s.name for s in found}
    for name in (names.TIME_TO_FIRST_TOKEN + "_bucket", names.REQUEST_SUCCESS,
                 names.REQUEST_FAILURES, names.PREFIX_PREDICTIONS, names.REDIS_ERRORS):
        assert name in by_name, name
    # known label values start at 0, so rate() and alerts see them before the first event
    assert any(s.name == names.REQUEST_SUCCESS and s.labels["finished_reason"] == "length"
               and s.value == 0 for s in found)


def step_and_observe(engine, m: NodeMetrics) -> None:
    """One engine step, then the metrics' look at it, as the EngineThread does on its thread."""
    scheduled = []
    engine.on_launch = scheduled.append
    started = time.monotonic()
    deltas = engine.step()
    m.observe_step(scheduled[0], started, deltas, len(engine.scheduler.requests))


def test_node_timing_and_prefix_cache_on_a_real_engine(make_engine):
    """Two requests sharing a 64-token prefix through a real engine: queue, prefill and
    decode intervals are observed once each per request, and the second request's
    prefix hit shows in prefix_cache_hits."""
    engine = make_engine(block_size=16)
    m = NodeMetrics("my-model", "decode")
    shared = list(range(100, 164))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for rid, tail in (("a", [7, 8, 9]), ("b", [10, 11, 12])):
        engine.add_request(rid, engine.prompt_ref(shared + tail), params)
        while engine.has_unfinished():
            step_and_observe(engine, m)
    m.set_load(engine.load(), engine.num_preemptions_total, 0)
    text = m.render()[0].decode()
    found = samples(text)
    assert all(s.labels.get("model_name") == "my-model" and s.labels.get("role") == "decode"
               for s in found)

    def value(name):
        return sum(s.value for s in found if s.name == name)

    for hist in (names.REQUEST_QUEUE_TIME, names.REQUEST_PREFILL_TIME, names.REQUEST_DECODE_TIME):
        assert value(hist + "_count") == 2, hist
    assert value(names.PREFIX_CACHE_QUERIES) == 2 * 67
    assert value(names.PREFIX_CACHE_HITS) == 64  # b reuses a's four full blocks
    assert value(names.NUM_REQUESTS_RUNNING) == 0 and value(names.KV_CACHE_USAGE) == 0
    assert m._times == {}  # finished requests leave no timing entry behind


def test_a_prompt_computed_in_its_first_step_counts_that_step_as_prefill_not_queue(make_engine):
    """On an idle engine a request waits for nothing: its queue interval ends where its first
    step begins, and that step's compute is its prefill interval."""
    engine = make_engine(block_size=16)
    m = NodeMetrics("my-model", "prefill")
    engine.add_request("a", engine.prompt_ref(list(range(100, 400))),
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        step_and_observe(engine, m)
    found = samples(m.render()[0].decode())

    def value(name):
        return sum(s.value for s in found if s.name == name)

    queued, prefill = value(names.REQUEST_QUEUE_TIME + "_sum"), value(names.REQUEST_PREFILL_TIME + "_sum")
    assert value(names.REQUEST_PREFILL_TIME + "_count") == 1 and prefill > 0
    assert queued < prefill, (queued, prefill)


def test_aborted_requests_leave_no_timing_entries(make_engine, tiny_llama_dir):
    engine = make_engine(model=str(tiny_llama_dir()[0]), block_size=16)
    m = NodeMetrics("my-model", "decode")
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(100):  # aborted after one step: no finishing delta reaches observe_step
        engine.add_request(f"r{i}", engine.prompt_ref([5, 6, 7, i]), params)
        step_and_observe(engine, m)
        engine.abort(f"r{i}")
    assert len(m._times) <= 64 + 1
