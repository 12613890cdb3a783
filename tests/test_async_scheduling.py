"""Async scheduling (engine/engine_core.py): step N+1 is scheduled and launched before
step N's tokens land, its decode inputs read on the device. On the CPU nothing
overlaps, but every rule is the same, so these tests force it on and check it gives
exactly the tokens of the synchronous engine: greedy and seeded sampling, logprobs,
requests joining mid-run, EOS-style stops found one step late, aborts and id reuse
while a token is in flight, preemption, penalties and min_tokens (which wait for the
token to land), the eager and the padded static paths, and a simulated node. No
block leaks. On a GPU, a decode step launches without making the host wait."""

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.models.families import read_model_config
from splitserve.engine.model_runner import kv_block_bytes

TOPICS = ["tea", "maps", "owls", "clocks", "rain", "salt", "ships", "glass"]


def prompts(tokenizer, n=8):
    return [tokenizer(f"Tell me one fact about {t}.")["input_ids"] for t in TOPICS[:n]]


@pytest.fixture
def run(drive_engine):
    """run(engine, {rid: (ids, params)}, join_at) -> ({rid: tokens}, {rid: finish reason}, {rid: logprobs})."""
    def go(engine, requests, join_at=None):
        tokens = {rid: [] for rid in requests}
        reasons, logprobs = {}, {rid: [] for rid in requests}
        for d in drive_engine(engine, requests, join_at):
            tokens[d.request_id].extend(d.new_token_ids)
            logprobs[d.request_id].extend(d.new_logprobs)
            if d.finish_reason is not None:
                reasons[d.request_id] = d.finish_reason
        return tokens, reasons, logprobs
    return go


def assert_no_leak(engine):
    assert not engine.has_unfinished() and engine._in_flight is None
    assert engine.kv.num_free_blocks == engine.num_blocks  # cached blocks count as free


def both(run, make_engine, requests, join_at=None, **engine_args):
    engine_args.setdefault("num_threads", 1)
    sync = make_engine(async_scheduling=False, **engine_args)
    out_sync = run(sync, requests, join_at)
    overlapped = make_engine(async_scheduling=True, **engine_args)
    out_async = run(overlapped, requests, join_at)
    assert_no_leak(sync)
    assert_no_leak(overlapped)
    return out_sync, out_async


def test_async_is_the_gpu_default_and_a_cli_flag():
    import argparse

    from splitserve.cli import _add_engine_args, engine_config

    assert EngineConfig().async_scheduling is False
    assert EngineConfig(device="cuda").async_scheduling is True
    assert EngineConfig(device="cuda", async_scheduling=False).async_scheduling is False
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    assert engine_config(p.parse_args([])).async_scheduling is False
    assert engine_config(p.parse_args(["--async-scheduling"])).async_scheduling is True
    assert engine_config(p.parse_args(["--device", "cuda", "--no-async-scheduling"])).async_scheduling is False


@pytest.mark.slow
@pytest.mark.parametrize("eager", [False, True], ids=["static", "eager"])
def test_greedy_and_seeded_tokens_equal_sync_with_requests_joining(make_engine, tokenizer, eager, run):
    ids = prompts(tokenizer)
    requests = {f"g{i}": (p, SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True))
                for i, p in enumerate(ids[:5])}
    requests.update({f"s{i}": (p, SamplingParams(temperature=0.9, top_p=0.9, seed=10 + i, max_tokens=5,
                                                  ignore_eos=True, logprobs=2))
                     for i, p in enumerate(ids[5:])})
    (tok_s, why_s, lp_s), (tok_a, why_a, lp_a) = both(
        run, make_engine, requests, join_at={"g3": 2, "s1": 4}, enforce_eager=eager, max_num_seqs=8,
        cuda_graph_sizes=(2, 4, 8))
    assert tok_a == tok_s and why_a == why_s
    assert all(len(tok_s[r]) == p.max_tokens and why_s[r] == "length" for r, (_, p) in requests.items())
    for r in lp_s:  # logprobs come from the same logits
        for a, s in zip(lp_a[r], lp_s[r]):
            assert (a is None) == (s is None)
            if s is not None:
                assert a.token_id == s.token_id and a.logprob == pytest.approx(s.logprob, abs=1e-5)


@pytest.mark.slow
def test_a_stop_token_found_one_step_late_ends_the_request_the_same(make_engine, tokenizer, run):
    """The request that samples its stop id was already scheduled again: that extra token is
    computed, dropped, and its blocks freed; the other requests do not notice."""
    ids = prompts(tokenizer, 4)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    probe = make_engine(num_threads=1)
    free_run, _, _ = run(probe, {"p": (ids[0], greedy)})
    stop_id = free_run["p"][3]  # the 4th token it samples
    first_at = free_run["p"].index(stop_id)
    requests = {"p": (ids[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                             stop_token_ids=[stop_id]))}
    requests.update({f"o{i}": (p, greedy) for i, p in enumerate(ids[1:])})
    (tok_s, why_s, _), (tok_a, why_a, _) = both(run, make_engine, requests)
    assert tok_a == tok_s and why_a == why_s
    assert why_a["p"] == "stop" and tok_a["p"] == free_run["p"][:first_at + 1]
    assert all(tok_a[f"o{i}"] == tok_s[f"o{i}"] and len(tok_a[f"o{i}"]) == 8 for i in range(3))


@pytest.mark.slow
def test_penalties_and_min_tokens_wait_for_their_token_and_match_sync(make_engine, tokenizer, run):
    ids = prompts(tokenizer, 4)
    requests = {
        "rep": (ids[0], SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.5, ignore_eos=True)),
        "freq": (ids[1], SamplingParams(temperature=0, max_tokens=6, frequency_penalty=1.0,
                                        presence_penalty=0.5, ignore_eos=True)),
        "min": (ids[2], SamplingParams(temperature=0, max_tokens=6, min_tokens=4)),
        "plain": (ids[3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    }
    (tok_s, why_s, _), (tok_a, why_a, _) = both(run, make_engine, requests)
    assert tok_a == tok_s and why_a == why_s
    assert len(tok_a["min"]) >= 4


@pytest.mark.slow
def test_abort_while_a_token_is_in_flight_and_reuse_the_id(make_engine, tokenizer, run):
    ids = prompts(tokenizer, 3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference, _, _ = run(make_engine(num_threads=1), {"x": (ids[1], params)})
    engine = make_engine(num_threads=1, async_scheduling=True)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    engine.add_request("a", engine.prompt_ref(ids[0]), params)
    engine.add_request("b", engine.prompt_ref(ids[2]), params)
    for _ in range(3):
        for d in engine.step():
            tokens[d.request_id].extend(d.new_token_ids)
    assert engine._in_flight is not None and any(r.request_id == "a" for r in engine._in_flight.requests)
    assert engine.abort("a")
    engine.add_request("a", engine.prompt_ref(ids[1]), params)  # same id, new prompt, its old token in flight
    again = []
    while engine.has_unfinished():
        for d in engine.step():
            (again if d.request_id == "a" else tokens["b"]).extend(d.new_token_ids)
    assert again == reference["x"]  # nothing of the aborted request leaked into the new one
    assert len(tokens["b"]) == 6
    assert_no_leak(engine)


@pytest.mark.slow
def test_preemption_with_tokens_in_flight_gives_the_same_tokens(make_engine, tokenizer, bundled_dir, run):
    """A pool of 20 blocks of 4 tokens for 6 requests that grow to ~24 tokens each: requests
    are preempted, some while their last token is still in flight, and recomputed."""
    ids = prompts(tokenizer, 6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    requests = {f"r{i}": (p, params) for i, p in enumerate(ids)}
    block_bytes = kv_block_bytes(read_model_config(bundled_dir), 4, torch.float32)
    engine_args = {"block_size": 4, "kv_cache_memory": 20 * block_bytes, "max_num_seqs": 6,
                   "enable_prefix_caching": False}
    sync = make_engine(async_scheduling=False, num_threads=1, **engine_args)
    overlapped = make_engine(async_scheduling=True, num_threads=1, **engine_args)
    tok_s, _, _ = run(sync, requests)
    preempted_in_flight = []
    preempt = overlapped.scheduler._preempt

    def watch(req):
        if req.pending_tokens:
            preempted_in_flight.append(req.request_id)
        preempt(req)

    overlapped.scheduler._preempt = watch
    tok_a, _, _ = run(overlapped, requests)
    assert sync.num_preemptions_total > 0 and overlapped.num_preemptions_total > 0
    assert preempted_in_flight  # the case this test is for happened
    assert tok_a == tok_s
    assert_no_leak(sync)
    assert_no_leak(overlapped)


def test_a_simulated_node_runs_with_async_scheduling(bundled_dir, run):
    from splitserve.common.config import SimConfig
    from splitserve.engine.engine_core import EngineCore

    sim = SimConfig(step_s=0.0, prefill_token_s=0.00001, prefill_attn_s=0.0, decode_s=((1, 0.0005),), speedup=1)
    requests = {f"r{i}": (list(range(1000 + i, 1100 + 7 * i)), SamplingParams(max_tokens=3 + i)) for i in range(4)}
    outs = []
    for overlap in (False, True):
        engine = EngineCore(EngineConfig(model=str(bundled_dir), kv_cache_memory=64 << 20, sim=sim,
                                         prefill_chunk_size=64, async_scheduling=overlap))
        outs.append(run(engine, requests, join_at={"r3": 2}))
        assert_no_leak(engine)
    assert outs[0] == outs[1]
    assert all(len(outs[1][0][r]) == p.max_tokens for r, (_, p) in requests.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_decode_step_launches_without_waiting_for_the_device(make_engine, tiny_kernel_llama, run):
    """The launch of a decode step whose inputs are the previous step's unlanded tokens makes
    no host wait; the tokens equal the synchronous engine's on the same GPU."""
    path, _ = tiny_kernel_llama()  # head_dim 64: the CUDA kernels, in captured graphs
    ids = [[(5 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate((9, 4, 23, 12))]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine_args = dict(model=str(path), kv_cache_memory=32 << 20, device="cuda", dtype="bfloat16", num_threads=1)
    engine = make_engine(**engine_args)
    assert engine.config.async_scheduling and engine.runner.static_decode.use_graphs
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ids))}

    def collect(deltas):
        for d in deltas:
            tokens[d.request_id].extend(d.new_token_ids)

    for i, p in enumerate(ids):
        engine.add_request(f"r{i}", engine.prompt_ref(p), params)
    for _ in range(4):  # prefill, then decodes through the captured graphs
        collect(engine.step())
    out = engine.scheduler.schedule()
    assert all(n == 1 for _, n in out.scheduled)
    assert engine._in_flight is not None  # the previous step has not landed: this launch reads its tokens
    torch.cuda.set_sync_debug_mode("error")  # any host wait on the device raises
    try:
        engine._in_flight, prev = engine._launch(out), engine._in_flight
    finally:
        torch.cuda.set_sync_debug_mode("default")
    collect(engine._land(prev))
    while engine.has_unfinished():
        collect(engine.step())
    assert_no_leak(engine)
    sync_tokens, _, _ = run(make_engine(async_scheduling=False, **engine_args),
                            {f"r{i}": (p, params) for i, p in enumerate(ids)})
    assert tokens == sync_tokens and all(len(t) == 32 for t in tokens.values())
