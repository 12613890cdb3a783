"""``splitserve bench``: the arithmetic, datasets and arrivals on their own (fast), then
short runs against a real local cluster (redis, router, prefill and decode node
processes) checked against the router's own counters, the official openai client's
view of ``stream_options.include_usage``, and the error for an endpoint that is down."""

import asyncio
import json
import math
import os
import subprocess
import sys
import urllib.request

import openai
import pytest

from splitserve.benchmarks.loadgen.bench import (BenchConfig, Endpoint, EndpointError, RequestSpec, Slo,
                                                 check_endpoint, load_dataset, poisson_offsets, run,
                                                 summarize, trace_offsets)
from splitserve.benchmarks.loadgen.bench.arrivals import fixed_offsets
from splitserve.benchmarks.loadgen.bench.client import RequestResult
from splitserve.benchmarks.loadgen.bench.config import normalize_base_url
from splitserve.benchmarks.loadgen.bench.datasets import load_tokenizer, trace_specs
from splitserve.common import metric_names as names
from splitserve.common.trace import HASH_BLOCK, block_tokens
from splitserve.deploy.launcher import Cluster, free_port
from splitserve.tests.metrics_text import sample_sum

MODEL = "SmolLM2-135M-Instruct"
os.environ.setdefault("SPLITSERVE_QUIET", "1")


def result(tag="", ttft=0.1, e2e=1.0, out=10, prompt=20, cached=0, ok=True, itl=()):
    return RequestResult(tag, prompt, out, ok=ok, error="" if ok else "HTTP 500: boom", ttft_s=ttft,
                         e2e_s=e2e, itl_s=list(itl), prompt_tokens=prompt, output_tokens=out,
                         cached_tokens=cached, usage_reported=True)


@pytest.fixture(scope="module")
def tok(bundled_dir):
    return load_tokenizer(str(bundled_dir))


# -- metrics ---------------------------------------------------------------------------


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert result(ttft=0.2, e2e=2.0, out=10).tpot_s == pytest.approx(0.2)
    assert result(out=1).tpot_s is None  # one token: no decode time to share
    assert result(ok=False).tpot_s is None


def test_summary_percentiles_throughput_cache_share_and_failures():
    rs = [result(ttft=0.1 * i, e2e=1.0 + 0.1 * i, out=11, prompt=100, cached=50 if i % 2 else 0,
                 itl=[0.09] * 10) for i in range(1, 11)]
    rs.append(result(ok=False))
    s = summarize(rs, duration_s=5.0)
    assert (s.completed, s.failed) == (10, 1)
    assert s.errors == {"HTTP 500: boom": 1}
    assert s.total_output_tokens == 110 and s.total_input_tokens == 1000
    assert s.request_throughput == pytest.approx(2.0) and s.output_throughput == pytest.approx(22.0)
    assert s.total_token_throughput == pytest.approx(222.0)
    assert s.cached_share == pytest.approx(0.25)
    assert s.ttft_ms["p50"] == pytest.approx(550.0) and s.ttft_ms["mean"] == pytest.approx(550.0)
    assert s.ttft_ms["p99"] == pytest.approx(991.0)  # linear interpolation between 900 and 1000
    assert s.tpot_ms["p50"] == pytest.approx(100.0)  # e2e - ttft is 1 s for all, over 10 tokens
    assert s.itl_ms["p90"] == pytest.approx(90.0)
    assert s.goodput is None and s.by_tag == {}


def test_goodput_needs_both_bounds():
    rs = [result("a", ttft=0.1, e2e=1.0, out=10),   # TPOT 100 ms: good
          result("a", ttft=0.1, e2e=2.0, out=10),   # TPOT 211 ms: too slow
          result("b", ttft=0.6, e2e=1.0, out=10),   # TTFT over
          result("b", ttft=0.2, e2e=0.2, out=1)]    # one token: only TTFT applies
    s = summarize(rs, duration_s=2.0, slo=Slo(ttft_s=0.5, itl_s=0.15))
    assert s.good_requests == 2 and s.goodput == pytest.approx(1.0)
    assert s.slo == {"ttft_ms": 500, "tpot_ms": 150}
    assert set(s.by_tag) == {"a", "b"} and s.by_tag["a"].good_requests == 1
    assert summarize(rs, 2.0, Slo()).good_requests == 4  # no bounds: every completed request
    assert s.to_dict()["by_tag"]["b"]["completed"] == 2


def test_empty_run_has_no_percentiles():
    s = summarize([result(ok=False)], 1.0, Slo(0.1, 0.1))
    assert s.completed == 0 and s.ttft_ms == {} and s.good_requests == 0 and s.cached_share == 0.0


# -- arrivals --------------------------------------------------------------------------


def test_poisson_offsets_are_seeded_with_the_asked_rate():
    a = poisson_offsets(4000, rate=8.0, seed=3)
    assert a == poisson_offsets(4000, rate=8.0, seed=3) != poisson_offsets(4000, 8.0, seed=4)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert (len(a) - 1) / a[-1] == pytest.approx(8.0, rel=0.06)
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(g < 0.125 for g in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.03)
    assert poisson_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request-rate"):
        poisson_offsets(3, 0.0)


def test_fixed_and_trace_offsets():
    assert fixed_offsets(3, 2.5, start_s=1.0) == [1.0, 3.5, 6.0]
    specs = [RequestSpec([1], 1, 1, timestamp_s=t) for t in (0.0, 0.5)]
    assert trace_offsets(specs) == [0.0, 0.5]
    assert trace_offsets(specs + [RequestSpec([1], 1, 1)]) is None


# -- datasets --------------------------------------------------------------------------


def cfg(**kw) -> BenchConfig:
    return BenchConfig(base_url="http://127.0.0.1:1/v1", **kw)


def test_random_dataset_lengths_and_determinism(tok):
    specs = load_dataset(cfg(num_prompts=50, random_input_len=100, random_output_len=20,
                             random_range_ratio=0.5, seed=1), tok)
    assert len(specs) == 50
    assert all(50 <= s.prompt_len == len(s.prompt) <= 150 and 10 <= s.output_len <= 30 for s in specs)
    assert all(100 <= t < tok.vocab_size for s in specs for t in s.prompt)
    assert specs == load_dataset(cfg(num_prompts=50, random_input_len=100, random_output_len=20,
                                     random_range_ratio=0.5, seed=1), tok)
    fixed = load_dataset(cfg(num_prompts=3, random_input_len=7, random_output_len=5), tok)
    assert [(s.prompt_len, s.output_len) for s in fixed] == [(7, 5)] * 3


def test_shared_prefix_dataset(tok):
    specs = load_dataset(cfg(dataset="shared-prefix", num_prompts=40, num_tenants=3, prefix_len=32,
                             random_input_len=8), tok)
    prefixes = {tuple(s.prompt[:32]) for s in specs}
    assert len(prefixes) == 3 and all(len(s.prompt) == 40 for s in specs)
    assert len({tuple(s.prompt[32:]) for s in specs}) == 40  # suffixes differ


def test_sharegpt_dataset(tok, tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"Question number {i}: why is the sky blue?"},
                                {"from": "gpt", "value": "Because of Rayleigh scattering of sunlight. " * (i + 1)}]}
             for i in range(6)]
    convs += [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there friend"}]},
              {"conversations": [{"from": "human", "value": "one turn only"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    specs = load_dataset(cfg(dataset=f"sharegpt:{path}", num_prompts=10), tok)
    assert len(specs) == 6  # "hi" is under 4 tokens; the single turn has no answer
    assert all(isinstance(s.prompt, str) and s.prompt_len == len(tok.encode(s.prompt)) for s in specs)
    answers = {c["conversations"][0]["value"]: len(tok.encode(c["conversations"][1]["value"])) for c in convs[:6]}
    assert all(s.output_len == answers[s.prompt] for s in specs)
    fixed = load_dataset(cfg(dataset=f"sharegpt:{path}", num_prompts=2, sharegpt_output_len=9), tok)
    assert [s.output_len for s in fixed] == [9, 9]
    with pytest.raises(ValueError, match="sharegpt"):
        load_dataset(cfg(dataset=f"sharegpt:{tmp_path / 'missing.json'}"), tok)
    with pytest.raises(ValueError, match="unknown"):
        load_dataset(cfg(dataset="nope"), tok)


@pytest.mark.parametrize("kind", [dict(send_text=True), dict(endpoint_type="chat"),
                                  dict(send_text=True, dataset="prefix-repetition", prefix_len=48)])
def test_text_prompts_encode_to_the_requested_length(tok, kind):
    """Decoded random ids re-encode to more tokens than asked (about 67 for 64); the text
    sent must encode to the asked count, as the router counts it."""
    specs = load_dataset(cfg(num_prompts=30, random_input_len=64, seed=3, **kind), tok)
    want = 64 + kind.get("prefix_len", 0)
    assert all(isinstance(s.prompt, str) and s.prompt_len == len(tok.encode(s.prompt)) for s in specs)
    assert all(s.prompt_len == want for s in specs), [s.prompt_len for s in specs]
    ids = load_dataset(cfg(num_prompts=30, random_input_len=64, seed=3), tok)
    assert sum(len(tok.encode(tok.decode(s.prompt))) for s in ids) > 30 * 64  # the drift this fixes


def test_custom_jsonl_dataset(tok, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Tell me about the sea."}\n\n{"prompt": "And the sky?", "x": 1}\n')
    specs = load_dataset(cfg(dataset=f"custom:{path}", custom_output_len=12), tok)
    assert [(s.prompt, s.prompt_len, s.output_len) for s in specs] == [
        ("Tell me about the sea.", len(tok.encode("Tell me about the sea.")), 12),
        ("And the sky?", len(tok.encode("And the sky?")), 12)]
    assert len(load_dataset(cfg(dataset=f"custom:{path}", num_prompts=1), tok)) == 1
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_dataset(cfg(dataset=f"custom:{path}"), tok)
    with pytest.raises(ValueError, match="custom"):
        load_dataset(cfg(dataset=f"custom:{tmp_path / 'missing.jsonl'}"), tok)


def bench_config(*argv) -> BenchConfig:
    import argparse
    from splitserve.benchmarks.loadgen.bench.cli import add_bench_args, config_from_args
    p = argparse.ArgumentParser()
    add_bench_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_vllm_style_dataset_and_backend_flags(tmp_path):
    assert bench_config().dataset == "random" and bench_config().endpoint_type == "completions"
    c = bench_config("--dataset-name", "prefix-repetition", "--prefix-repetition-prefix-len", "40",
                     "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
                     "--prefix-repetition-output-len", "3", "--backend", "openai-chat")
    assert (c.dataset, c.prefix_len, c.random_input_len, c.num_tenants, c.random_output_len,
            c.endpoint_type) == ("prefix-repetition", 40, 8, 2, 3, "chat")
    c = bench_config("--dataset-name", "custom", "--dataset-path", "p.jsonl", "--custom-output-len", "7",
                     "--backend", "openai")
    assert (c.dataset, c.custom_output_len, c.endpoint_type) == ("custom:p.jsonl", 7, "completions")
    assert bench_config("--random-input-len", "9").random_input_len == 9
    for argv, flag in [(("--dataset-name", "custom"), "--dataset-path"),
                       (("--dataset-name", "random", "--dataset-path", "x"), "--dataset-path"),
                       (("--dataset-path", "x"), "--dataset-path"),
                       (("--dataset", "random", "--dataset-name", "random"), "--dataset-name"),
                       (("--backend", "openai", "--endpoint-type", "chat"), "--backend")]:
        with pytest.raises(ValueError, match=flag):
            bench_config(*argv)


def test_trace_expansion_shares_blocks_and_keeps_the_schedule(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 1100, "output_length": 4, "hash_ids": [7, 8, 9]},
            {"timestamp": 1250, "input_length": 600, "output_length": 5, "hash_ids": [7, 10]},
            {"timestamp": 3000, "input_length": 700, "output_length": 6, "hash_ids": [11, 12]}]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    specs = trace_specs(path, vocab_size=49152, limit=None, time_scale=0.5)
    assert [s.timestamp_s for s in specs] == [0.0, 0.125, 1.0]
    assert [(len(s.prompt), s.prompt_len, s.output_len) for s in specs] == [(1100, 1100, 4), (600, 600, 5),
                                                                            (700, 700, 6)]
    b7 = list(block_tokens(7, 49152))
    assert len(b7) == HASH_BLOCK and b7 == list(block_tokens(7, 49152))  # fixed per id
    assert specs[0].prompt[:512] == specs[1].prompt[:512] == b7  # the shared first block
    assert specs[0].prompt[512:1024] == list(block_tokens(8, 49152))
    assert specs[0].prompt[1024:] == list(block_tokens(9, 49152)[:76])  # the last block cut
    assert specs[1].prompt[512:] == list(block_tokens(10, 49152)[:88])
    assert max(max(s.prompt) for s in trace_specs(path, vocab_size=1000, limit=None)) < 900  # small vocab
    assert [s.prompt for s in trace_specs(path, 49152, limit=2)] == [s.prompt for s in specs[:2]]
    path.write_text('{"timestamp": 1, "input_length": 3}\n')
    with pytest.raises(ValueError, match="line 1"):
        trace_specs(path, 49152, None)


def test_base_url_normalization():
    assert normalize_base_url("http://h:8000") == normalize_base_url("http://h:8000/v1/") == "http://h:8000/v1"
    with pytest.raises(ValueError, match="base-url"):
        normalize_base_url("h:8000")


# -- the endpoint down -----------------------------------------------------------------


def bench_cli(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve.cli", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_endpoint_down_is_one_line_and_exit_1():
    port = free_port()  # nothing listens there
    p = bench_cli("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "2")
    assert p.returncode == 1
    assert p.stderr.strip().startswith(f"error: cannot connect to http://127.0.0.1:{port}/v1")
    assert "is the server running" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_bad_flag_value_is_exit_2():
    p = bench_cli("--goodput", "e2e:100")
    assert p.returncode == 2 and "error: --goodput" in p.stderr and "Traceback" not in p.stderr


# -- against a real cluster ------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="shm", kv_cache_memory="96MiB") as c:
        yield c


def router_counter(cluster, name: str) -> float:
    with urllib.request.urlopen(f"{cluster.url}/metrics", timeout=10) as r:
        return sample_sum(r.read().decode(), name)


def test_endpoint_checks(cluster):
    assert asyncio.run(check_endpoint(f"{cluster.url}/v1", None)) == MODEL
    with pytest.raises(EndpointError, match="does not serve model 'nope'"):
        asyncio.run(check_endpoint(f"{cluster.url}/v1", "nope"))


def test_short_run_metrics_are_sane_and_match_the_router(cluster, tok):
    specs = load_dataset(cfg(num_prompts=6, random_input_len=24, random_output_len=6, seed=5), tok)
    chat = load_dataset(cfg(dataset="shared-prefix", num_prompts=2, num_tenants=1, prefix_len=16,
                            random_input_len=4, random_output_len=5), tok)
    gen0, prompt0 = router_counter(cluster, names.GENERATION_TOKENS), router_counter(cluster, names.PROMPT_TOKENS)
    ep = Endpoint(f"{cluster.url}/v1", MODEL, "completions", ignore_eos=True)
    r = asyncio.run(run(ep, specs, poisson_offsets(6, 20.0, seed=1), tok.decode, max_concurrency=3,
                        progress=False))
    rc = asyncio.run(run(ep._replace(endpoint_type="chat"), chat, [0.0, 0.0], tok.decode,
                         max_concurrency=1, progress=False))
    everything = r.results + rc.results
    assert all(x.ok and x.usage_reported for x in everything), [x.error for x in everything]
    for x, spec in zip(everything, specs + chat):
        assert x.output_tokens == spec.output_len  # usage, with ignore_eos: exactly max_tokens
        assert 0 < x.ttft_s <= x.e2e_s
        assert len(x.itl_s) == x.content_chunks - 1 and x.content_chunks <= x.output_tokens
        assert sum(x.itl_s) <= x.e2e_s - x.ttft_s + 1e-6
        assert x.tpot_s == pytest.approx((x.e2e_s - x.ttft_s) / (x.output_tokens - 1))
        assert x.text
    for x, spec in zip(r.results, specs):
        assert x.prompt_tokens == spec.prompt_len  # token arrays go through as they are
    # the router counted what the streams' usage said
    assert router_counter(cluster, names.GENERATION_TOKENS) - gen0 == sum(x.output_tokens for x in everything)
    assert router_counter(cluster, names.PROMPT_TOKENS) - prompt0 == sum(x.prompt_tokens for x in everything)

    s = summarize(r.results, r.duration_s, Slo(ttft_s=1e6, itl_s=1e6))
    assert (s.completed, s.failed, s.usage_reported) == (6, 0, 6)
    for stats in (s.ttft_ms, s.tpot_ms, s.itl_ms, s.e2e_ms):
        assert set(stats) == {"mean", "p50", "p90", "p99"}
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"]
    assert s.ttft_ms["p99"] <= s.e2e_ms["p99"] and s.tpot_ms["p50"] <= s.e2e_ms["p50"]
    assert s.total_output_tokens == 36 and s.output_throughput == pytest.approx(36 / r.duration_s)
    assert s.request_throughput == pytest.approx(6 / r.duration_s)
    assert r.duration_s >= max(x.start_s + x.e2e_s for x in r.results)
    assert 0.0 <= s.cached_share <= 1.0
    assert s.good_requests == 6 and s.goodput == pytest.approx(s.request_throughput)
    assert summarize(r.results, r.duration_s, Slo(ttft_s=1e-6)).good_requests == 0
    # the chat pair shares a 16-token prefix + template, one after the other: the second hits
    sc = summarize(rc.results, rc.duration_s)
    assert 0.0 < sc.cached_share <= 1.0


def test_sent_text_is_counted_as_requested(cluster, tok, tmp_path):
    """--send-text with 64 input tokens: the router's usage counts 64 for each prompt."""
    for kind in (dict(send_text=True), dict(send_text=True, dataset="prefix-repetition", prefix_len=32)):
        specs = load_dataset(cfg(num_prompts=4, random_input_len=64, random_output_len=2, **kind), tok)
        ep = Endpoint(f"{cluster.url}/v1", MODEL, "completions", send_text=True)
        r = asyncio.run(run(ep, specs, [0.0] * 4, tok.decode, max_concurrency=2, progress=False))
        assert all(x.ok and x.usage_reported for x in r.results), [x.error for x in r.results]
        want = 64 + kind.get("prefix_len", 0)
        assert all(abs(x.prompt_tokens - want) <= 2 for x in r.results), [x.prompt_tokens for x in r.results]
    # custom JSONL through the chat backend (vLLM's flags)
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in ("Hi there", "Name a colour")) + "\n")
    p = bench_cli("--base-url", cluster.url, "--backend", "openai-chat", "--dataset-name", "custom",
                  "--dataset-path", str(path), "--custom-output-len", "3", "--ignore-eos", "--disable-tqdm",
                  "--result-json", str(tmp_path / "custom.json"))
    assert p.returncode == 0, p.stderr
    summary = json.loads((tmp_path / "custom.json").read_text())["runs"][0]["summary"]
    assert summary["completed"] == 2 and summary["total_output_tokens"] == 6


def test_cli_run_writes_json_and_plots(cluster, tmp_path):
    out = tmp_path / "run.json"
    p = bench_cli("--base-url", cluster.url, "--endpoint-type", "chat", "--num-prompts", "3",
                  "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "50", "inf",
                  "--max-concurrency", "2", "--goodput", "ttft:60000", "tpot:60000", "--ignore-eos",
                  "--result-json", str(out), "--disable-tqdm")
    assert p.returncode == 0, p.stderr
    assert "Output token throughput (tok/s):" in p.stdout and "Goodput (req/s) under SLO:" in p.stdout
    data = json.loads(out.read_text())
    assert [run_["request_rate"] for run_ in data["runs"]] == [50, math.inf]
    summary = data["runs"][0]["summary"]
    assert summary["completed"] == 3 and summary["good_requests"] == 3
    assert summary["total_output_tokens"] == 12
    assert len(data["runs"][0]["requests"]) == 3
    for png in (out.with_suffix(".png"), tmp_path / "run_rates.png"):
        assert png.stat().st_size > 10_000


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_openai_client_include_usage_last_chunk(cluster, kind):
    """``stream_options.include_usage``: a last chunk with empty choices and the usage."""
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=60)
    common = dict(model=MODEL, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
                  stream_options={"include_usage": True})
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **common))
    else:
        chunks = list(client.completions.create(prompt="Once upon a time", **common))
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5 and last.usage.prompt_tokens > 3
