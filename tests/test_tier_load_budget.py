"""Lower-tier loads on the step's budget (issue 53, finding 5; engine/scheduler.py,
engine/kv/cache_manager.py ``lower_plan``, engine/kv/tier_policy.py ``load_tokens``).

A prompt whose prefix is in host memory or on disk loads it instead of computing it, and
that load takes step time the running decodes wait for. So a step's loads draw from its
prefill budget, each block priced in the prompt tokens the engine computes meanwhile (the
measured rates), and a long run loads over several steps, a budget's worth each, beside the
decodes, without losing a block of the hit. A request waiting to be admitted reads none of
its disk blocks; each is read once, when it loads. On a simulated node the runner's priced
times are the measurements, so a decode step beside a long host-tier turn stays within what
the budget allows there too.

Beside running decodes a step's loads also take no longer than a step of the batch alone
(measured), so they hide behind its forward, layer by layer.

The scheduler tests run without a model: a step is schedule, the loads issued (not timed:
the rates stay the ones the test measured), the computed counts advanced.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.hashing import hash_blocks, salt_id
from splitserve.common.prompt_ref import PromptKeys, PromptRef
from splitserve.common.kv_events import Tier
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import get_profile
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.engine.kv.disk_tier import DiskLayout, DiskTier
from splitserve.engine.kv.tier_spec import Move, TierSpec
from splitserve.engine.request import Request
from splitserve.engine.scheduler import Row, Scheduler, SchedulerOutput
from splitserve.engine.sim_runner import standin_tiers

BS = 16
KEYS = PromptKeys(model="m").hash_keys()
BLOCK_BYTES = 2 * BS * 4  # the KV tensor below: 1 layer, K and V, 16 tokens, 1 head of 1 float
PREFILL = 10_000.0  # tokens/s: the measured recompute rate of these tests
HOST_BLOCK_TOKENS = 4.0  # a host block loads in the time of 4 prompt tokens (at the rates below)
HOST_RATE = BLOCK_BYTES * PREFILL / HOST_BLOCK_TOKENS  # bytes/s
P = get_profile("llama3-8b-h100")


class Moves:
    """The tier observer (node/metrics.py implements the same calls): the moves."""

    def __init__(self) -> None:
        self.moves: list[Move] = []

    def moved(self, move): self.moves.append(move)
    def looked_up(self, queried, hits): ...
    def evicted(self, tier, blocks): ...
    def fault(self, tier, fault): ...

    def disk_reads(self) -> int:
        return sum(m.blocks for m in self.moves if m.tier is Tier.DISK and m.load)


def scheduler(num_blocks: int, host_blocks: int, budget: int, chunk: int = 512,
              disk: DiskTier | None = None) -> Scheduler:
    kv = torch.zeros((1, 2, num_blocks, BS, 1, 1))
    mgr = KVCacheManager(num_blocks, BS, True, TierSpec(kv, host_blocks, disk))
    assert mgr.tiers is not None
    mgr.observe_prefill(int(PREFILL), 1.0)  # measured: what the scheduler prices loads in
    mgr.tiers.policy.rates[Tier.HOST].add(HOST_RATE, 1.0)
    return Scheduler(mgr, max_num_seqs=16, max_num_batched_tokens=2048, prefill_chunk_size=chunk,
                     max_model_len=1 << 16, prefill_step_budget=budget)


def request(rid: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(rid, PromptRef.hashed(tokens, PromptKeys(model="m"), BS), SamplingParams(max_tokens=max_tokens, temperature=0),
                   frozenset())


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: the loads issued (their copies not timed), computed
    counts advanced, the blocks written through to the host, a token sampled per verifying
    row, max_tokens ending a request."""
    out = s.schedule()
    s.kv.take_loads()
    s.update_after_step(out)
    s.kv.save_cached()
    for row in out.rows:
        if row.num_verify:
            row.request.append_tokens([1], [None])
            if len(row.request.output_token_ids) >= row.request.sampling_params.max_tokens:
                s.finish(row.request.request_id, "length")
    return out


def serve(s: Scheduler, req: Request) -> None:
    s.add(req)
    while not req.finished:
        step(s)


def prompt_tokens(rows: list[Row]) -> int:
    return sum(r.num_tokens for r in rows if not (r.num_tokens == 1 and r.num_verify == 1))


def test_a_long_host_run_loads_over_steps_within_the_prefill_budget_beside_the_decodes():
    s = scheduler(num_blocks=120, host_blocks=400, budget=64)
    history = list(range(1000, 1000 + 100 * BS))  # 100 blocks: a conversation's earlier turns
    serve(s, request("a", history + [7], 1))
    serve(s, request("b", list(range(50_000, 50_000 + 119 * BS + 1)), 1))  # pushes a's blocks to the host
    assert not any(h in s.kv.pool.cached for h in hash_blocks(history, BS, KEYS))
    decodes = [request(f"d{i}", list(range(90_000 + 100 * i, 90_000 + 100 * i + 8)), 1000) for i in range(4)]
    for d in decodes:
        s.add(d)
    step(s)  # their prompts: from now on they decode
    turn = request("a2", history + list(range(7, 17)), 2)  # the next turn: 10 new tokens
    s.add(turn)
    steps = 0
    while not turn.finished:
        before = turn.num_computed_tokens
        out = step(s)
        steps += 1
        rows = [r for r in out.rows if r.request is turn]
        loaded = (turn.num_computed_tokens - before - sum(r.num_tokens for r in rows)) // BS
        assert prompt_tokens(out.rows) + HOST_BLOCK_TOKENS * loaded <= 64, \
            f"step {steps}: {prompt_tokens(out.rows)} prompt tokens and {loaded} host blocks beside the decodes"
        assert {r.request.request_id for r in out.rows} >= {"d0", "d1", "d2", "d3"}  # decodes every step
        assert steps < 20
    assert turn.num_cached_tokens == len(history)  # every block of the history came from the host
    assert steps >= -(-100 * HOST_BLOCK_TOKENS // 64)  # 400 tokens' worth of loads at 64 a step


def test_a_waiting_request_reads_its_disk_blocks_once_however_long_it_waits(tmp_path):
    disk = DiskTier(tmp_path, DiskLayout("m", "float32", (1, 2, BS, 1, 1)), BLOCK_BYTES, 1 << 20, bytes(range(32)))
    s = scheduler(num_blocks=40, host_blocks=8, budget=64, chunk=64, disk=disk)
    obs = Moves()
    assert s.kv.tiers is not None
    s.kv.tiers.observer = obs
    try:
        history = list(range(1000, 1000 + 30 * BS))
        serve(s, request("a", history + [7], 1))
        serve(s, request("b", list(range(50_000, 50_000 + 39 * BS + 1)), 1))  # a's blocks: device -> host -> disk
        hashes = hash_blocks(history, BS, KEYS)
        deadline = time.monotonic() + 10
        while not all(disk.contains(h) for h in hashes[:20]):
            assert time.monotonic() < deadline, "the disk writer did not store the history"
            time.sleep(0.01)
        long = request("r", list(range(70_000, 70_000 + 640)), 1)  # 10 steps of the whole prefill budget
        s.add(long)
        step(s)
        turn = request("a2", history + [8, 9], 1)
        s.add(turn)
        assert obs.disk_reads() == 0
        while long.num_computed_tokens < len(long.prompt_token_ids):
            step(s)
            assert turn.status.name == "WAITING"
        assert obs.disk_reads() == 0, f"{obs.disk_reads()} disk blocks read while the request waited"
        while not all(disk.contains(h) for h in hashes):  # r's blocks pushed the rest of a's to disk
            assert time.monotonic() < deadline + 10, "the disk writer did not store the history"
            time.sleep(0.01)
        while not turn.finished:
            step(s)
        assert turn.num_cached_tokens == len(history)  # the whole history: from disk and host, none computed
        assert obs.disk_reads() == 30  # each disk block read once
    finally:
        disk.close()


class SimNode(NamedTuple):
    engine: EngineCore
    history: list[int]  # a 16k-token conversation, all but its first blocks in host memory
    decode_s: float  # simulated seconds of a step of its 8 running decodes alone
    on_device: int  # the history's leading tokens the device holds


def sim_decode_node(model_dir, budget: int, speedup: float = 1000.0) -> SimNode:
    """A simulated llama3-8b-h100 decode node (its --local-prefill-budget ``budget``) whose
    rates are measured (a prompt computed, a host load), holding a 16k-token history in its
    host tier, 8 requests decoding."""
    pool = 17_000 * P.kv_bytes_per_token  # the device holds one 16k-token history and a few more blocks
    engine = EngineCore(standin_tiers(EngineConfig(
        model=str(model_dir), kv_cache_memory=pool, block_size=BS, prefill_chunk_size=P.prefill_chunk_size,
        max_num_batched_tokens=P.max_num_batched_tokens, prefill_step_budget=budget, kv_offload_memory=4 * pool,
        sim=P.sim_config(speedup=speedup))))
    history = list(range(1000, 1000 + 16_000))

    def serve_alone(rid: str, prompt: list[int]) -> None:
        engine.add_request(rid, engine.prompt_ref(prompt), SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()

    serve_alone("a", history + [7])  # computed: the prefill rate the loads are priced in
    serve_alone("b", list(range(20_000, 20_000 + 16_000)))  # a's blocks go to the host tier
    hashes = hash_blocks(history, BS, PromptKeys(model=engine.config.model_id).hash_keys())
    kept = next(i for i, h in enumerate(hashes) if h not in engine.kv.pool.cached)  # the rest: host only
    serve_alone("warm", history[:(kept + 2) * BS] + [9])  # 2 blocks loaded from the host: its rate
    assert engine.kv.tiers is not None and engine.kv.tiers.policy.rates[Tier.HOST].value > 0
    for i in range(8):
        engine.add_request(f"d{i}", engine.prompt_ref(list(range(40_000 + 100 * i, 40_000 + 100 * i + 64))),
                           SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()  # their prompts, then decodes
    before = engine.runner.simulated_seconds
    engine.step()
    return SimNode(engine, history, engine.runner.simulated_seconds - before, (kept + 2) * BS)


def test_a_long_host_tier_turn_loads_beside_the_decodes_without_lengthening_their_steps_on_a_simulated_node(
        bundled_dir):
    budget = 512  # a decode node's --local-prefill-budget default
    engine, history, decode_s, _ = sim_decode_node(bundled_dir, budget)
    r = engine.runner
    assert engine.kv.tiers is not None
    engine.add_request("a2", engine.prompt_ref(history + list(range(7, 107))), SamplingParams(max_tokens=1))
    per_token = 1 / engine.kv.tiers.policy.prefill_rate.value  # simulated seconds of one prompt token
    loading: list[float] = []  # the steps that loaded a2's history (no row of a2's)
    worst, cached = 0.0, None
    while engine.scheduler.requests.get("a2") is not None:
        before = r.simulated_seconds
        deltas = {d.request_id: d for d in engine.step()}
        seconds = r.simulated_seconds - before
        worst = max(worst, seconds)
        if "a2" in deltas:
            cached = deltas["a2"].num_cached_tokens
        else:
            loading.append(seconds)
    # the history's loads ran beside the decodes' forwards, layer by layer, each step's no longer
    # than the forward hides: the decodes' steps hardly grew (a layer's share)
    assert len(loading) >= 2 and max(loading) <= 1.05 * decode_s, \
        f"loading steps of {max(loading) * 1e3:.1f} ms beside decodes of {decode_s * 1e3:.1f} ms"
    # and the step computing the turn's 100 new tokens stays within the budget
    assert worst <= decode_s + budget * per_token
    assert cached is not None and cached >= len(history) - 2 * BS  # the history came back (the hit is kept)


def test_a_reservation_beside_running_decodes_loads_nothing_below_the_device_and_the_sender_fills_it(bundled_dir):
    """The turn goes to a prefill node (the router's choice for a long history below the
    device): the decode node reserves its blocks. The step after a reservation waits for its
    loads whole (they hide behind no forward), so beside running decodes it loads none of the
    history it holds in host memory: the prefill node sends those blocks, and no step of the
    decodes grows. At real time: the timing model's pace, as a deployment measures its rates."""
    engine, history, decode_s, on_device = sim_decode_node(bundled_dir, 512, speedup=1.0)
    r = engine.runner
    prompt = history + list(range(7, 107))
    res = engine.reserve("a2", engine.prompt_ref(prompt))
    assert res is not None and res.num_cached_tokens == on_device, (on_device, res.num_cached_tokens)
    steps = []
    for _ in range(3):
        before = r.simulated_seconds
        engine.step()
        steps.append(r.simulated_seconds - before)
    assert max(steps) <= 1.05 * decode_s, [f"{s * 1e3:.1f} ms" for s in steps] + [f"alone {decode_s * 1e3:.1f} ms"]
    delta = engine.add_prefilled("a2", engine.prompt_ref(prompt), SamplingParams(max_tokens=2), first_token=5,
                                 logprobs=None, num_cached_tokens=res.num_cached_tokens)
    assert delta.num_cached_tokens == on_device
    engine.abort("a2")
