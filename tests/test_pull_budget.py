"""A holder's pull budget on real nodes in this process (tests/pull_nodes.py, a tiny random
Llama; the budget's arithmetic in virtual time is tests/test_pull_pacing.py):

- 8 pulls of one prefix from a busy holder together copy for at most about PULL_STEP_SHARE
  of its steps' time, as one pull does, not 8 times it (the engine thread is watched from
  outside the budget: the seconds its ``ExportCached`` commands took against its steps');
- a holder serving PULLS_SERVED_MAX pulls answers the next one 503 at once;
- what a holder packs for its pulls at once stays under ``--kv-pull-memory``
  (``NodeConfig.kv_pull_memory``), and its pulls still land whole;
- a chunk's cost, which sizes the next ones, counts its lower tier's reads: a prefix the
  holder keeps on disk costs at least the disk reads the tier store timed.
"""

import asyncio
import time

import aiohttp
import msgspec
import pytest

from splitserve.common import metric_names as names
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.kv_events import Tier
from splitserve.common.protocol import PullRequest, PullSource
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_thread import ExportCached
from splitserve.kvtransfer.tp_send import ShardSender
from splitserve.node.app import NODE, RUNTIME
from splitserve.node.pull_budget import PULL_STEP_SHARE, PULLS_SERVED_MAX
from splitserve.tests.pull_nodes import BS, client, decode_node, generate, metric, pool_idle, until

pytestmark = pytest.mark.slow


def prompt(seed: int, blocks: int) -> list[int]:
    return [(37 * j + 101 * seed + 11) % 30000 + 200 for j in range(blocks * BS)]


@pytest.fixture(scope="module")
def model(served_tiny_model):
    return served_tiny_model("llama", max_position_embeddings=4096)


class EngineWatch:
    """The holder's engine thread seen from outside the budget: each step's span and each
    ``ExportCached``'s (monotonic seconds), recorded on the engine thread."""

    def __init__(self, app):
        self.steps: list[tuple[float, float]] = []
        self.copies: list[tuple[float, float]] = []
        et = app[RUNTIME].engine_thread
        handle, observe = et._handle, et._step_observer

        def timed_handle(cmd):
            t0 = time.monotonic()
            try:
                return handle(cmd)
            finally:
                if isinstance(cmd, ExportCached):
                    self.copies.append((t0, time.monotonic()))

        def timed_step(out, started, deltas, live):
            self.steps.append((started, time.monotonic()))
            observe(out, started, deltas, live)

        et._handle, et._step_observer = timed_handle, timed_step

    def share(self) -> float:
        """The copies' seconds over the steps' seconds, from the first copy to the last."""
        t0, t1 = self.copies[0][0], self.copies[-1][1]
        return sum(b - a for a, b in self.copies) / sum(b - a for a, b in self.steps if a >= t0 and b <= t1)


@pytest.mark.anyio
async def test_eight_pulls_of_a_busy_holder_share_one_share_of_its_steps(model):
    prefix = prompt(1, 100)
    async with decode_node(model, 16 << 20) as (holder, h_addr), decode_node(model, 32 << 20) as (_, p_addr):
        want = await generate(h_addr, "warm", prefix + [7])
        busy = asyncio.create_task(generate(h_addr, "busy", prompt(2, 1), params=SamplingParams(
            max_tokens=3500, temperature=0, ignore_eos=True)))
        await until(lambda: holder[RUNTIME].engine_thread.stats.load.running == 1)
        watch = EngineWatch(holder)
        source = PullSource(node_id="holder", addr=h_addr, tokens=len(prefix))
        got = await asyncio.gather(*(generate(p_addr, f"p{i}", prefix + [7], source) for i in range(8)))
        assert not busy.done(), "the holder was busy throughout"
        busy.cancel()
        assert got == [want] * 8
        assert await metric(p_addr, names.KV_PULLS, outcome="pulled") == 8
        # one pull's share, not eight: 8 pulls each paced alone copy up to 8 x PULL_STEP_SHARE (one
        # chunk may overshoot its share when its cost was not foreseen, the engine thread waiting
        # for the GIL here; the next chunks wait that debt out)
        assert watch.share() <= 1.5 * PULL_STEP_SHARE, (watch.share(), len(watch.copies))
        await until(lambda: pool_idle(holder))


@pytest.mark.anyio
async def test_a_holder_serving_its_most_pulls_refuses_the_next_at_once(model):
    async with decode_node(model, fault="stall_pull") as (holder, h_addr):
        task = PullRequest(request_id="r", transfer_id="t", prompt=WirePrompt.of(prompt(3, 1)), kv_backend="tcp",
                           kv_addrs=["127.0.0.1:9"], skip_blocks=0, dest_block_ids=[0])
        body = msgspec.msgpack.encode(task)

        async def ask(session: aiohttp.ClientSession) -> int:
            async with session.post(f"{h_addr}/kv/pull", data=body) as r:
                return r.status

        async with client() as session:
            held = [asyncio.create_task(ask(session)) for _ in range(PULLS_SERVED_MAX)]
            await until(lambda: holder[NODE].holder.stalled == PULLS_SERVED_MAX)
            async with asyncio.timeout(10):
                assert await ask(session) == 503
            assert await metric(h_addr, names.KV_PULLS_SERVED, outcome="refused") == 1
            for t in held:  # the pullers hang up: their slots come back
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        await until(lambda: holder[RUNTIME].pull_budget.serving == 0)


@pytest.mark.anyio
async def test_what_a_holder_packs_for_its_pulls_at_once_stays_under_its_cap(model, monkeypatch):
    packs: list[int] = []
    pack = ShardSender.pack

    def watched(self, decode_tp, src_ids):
        packs.append(len(src_ids))
        return pack(self, decode_tp, src_ids)

    monkeypatch.setattr(ShardSender, "pack", watched)
    prefix = prompt(4, 40)
    async with decode_node(model, kv_pull_memory=3 * 8192) as (holder, h_addr), \
            decode_node(model, 16 << 20) as (_, p_addr):
        block = holder[RUNTIME].layout.block_nbytes
        assert block == 8192  # the tiny Llama's: 2 layers x K, V x 16 tokens x 2 heads x 16 x fp32
        want = await generate(h_addr, "warm", prefix + [7])
        source = PullSource(node_id="holder", addr=h_addr, tokens=len(prefix))
        got = await asyncio.gather(*(generate(p_addr, f"p{i}", prefix + [7], source) for i in range(4)))
        assert got == [want] * 4
        assert await metric(p_addr, names.KV_PULL_TOKENS) == 4 * len(prefix)
        budget = holder[RUNTIME].pull_budget
        assert max(packs) <= 3 and budget.peak_bytes <= 3 * block and budget.packed_bytes == 0
        assert sum(packs) == 4 * 40


@pytest.mark.anyio
async def test_a_chunk_from_disk_costs_its_disk_reads(model, tmp_path):
    """The holder keeps a 6-block prefix only on disk (its pool and host tier turned over):
    a pull's chunk reads and checks each file, loads it, then copies it out; the cost the
    budget sizes the next chunk by covers the reads the tier store timed."""
    tiers = dict(kv_offload_memory=2 * 8192, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    prefix = prompt(5, 6)
    async with decode_node(model, 8 * 8192, tiers) as (holder, h_addr), decode_node(model) as (_, p_addr):
        want = await generate(h_addr, "warm", prefix + [7])
        for i in range(2):  # two other prompts turn the pool and the host tier over
            await generate(h_addr, f"other{i}", prompt(6 + i, 6) + [7])

        def on_disk() -> int:
            return next(t.used_blocks for t in holder[RUNTIME].engine_thread.stats.tiers if t.tier is Tier.DISK)

        await until(lambda: on_disk() >= 6)
        read_s = await metric(h_addr, names.KV_OFFLOAD_SECONDS + "_sum", tier="disk", direction="load")
        source = PullSource(node_id="holder", addr=h_addr, tokens=len(prefix))
        assert await generate(p_addr, "p", prefix + [7], source) == want
        assert await metric(p_addr, names.KV_PULL_TOKENS) == len(prefix)
        read_s = await metric(h_addr, names.KV_OFFLOAD_SECONDS + "_sum", tier="disk", direction="load") - read_s
        assert read_s > 0, "the pull read the prefix from disk"
        assert holder[NODE].holder.block_copy_s * 6 >= read_s


@pytest.mark.anyio
async def test_a_cap_that_holds_no_block_is_refused_at_start_up_naming_the_flag(model):
    from splitserve.common.config import EngineConfig, NodeConfig

    with pytest.raises(ValueError, match="--kv-pull-memory"):
        NodeConfig(role="decode", engine=EngineConfig(model=str(model)), kv_pull_memory=0)
    with pytest.raises(ValueError, match="--kv-pull-memory: 4096 bytes cannot hold one KV block"):
        async with decode_node(model, kv_pull_memory=4096):
            pass


def test_the_cap_is_a_flag_of_every_node_and_of_up():
    from splitserve.cli import build_parser, node_config
    from splitserve.deploy.launcher import Cluster

    cap = lambda argv, role: node_config(build_parser().parse_args(argv), role).kv_pull_memory
    assert cap(["decode"], "decode") == cap(["prefill"], "prefill") == 256 << 20
    assert cap(["prefill", "--kv-pull-memory", "64MiB"], "prefill") == 64 << 20
    with pytest.raises(ValueError, match="--kv-pull-memory: cannot parse size 'lots'"):
        cap(["decode", "--kv-pull-memory", "lots"], "decode")
    assert build_parser().parse_args(["up", "--kv-pull-memory", "1GiB"]).kv_pull_memory == "1GiB"
    c = Cluster(prefill_nodes=1, decode_nodes=1, kv_pull_memory=1 << 30)  # what `up` starts its nodes with
    for role in ("prefill", "decode"):
        args = c.node_args(role, 0)
        assert args[args.index("--kv-pull-memory") + 1] == str(1 << 30)


def test_a_copy_on_the_cpu_is_timed_whole_on_the_host():
    """engine/copy_timer.py on the CPU: the copy ran when the host returned, so its host time is
    all of it."""
    import torch

    from splitserve.engine.copy_timer import CopyTimer

    src = torch.randn(256, 64 << 10)
    timer = CopyTimer(src.device)
    t0 = time.perf_counter()
    torch.index_select(src, 0, torch.arange(0, 256, 2))
    wall = time.perf_counter() - t0
    copy = timer.stop()
    assert copy.device_s() == 0.0 and copy.host_s >= wall


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_a_copy_on_a_gpu_is_timed_on_the_device_not_at_its_launch():
    """On a GPU the gather returns at its launch: the device time, read from events once it ran,
    is the copy's (a synchronized copy of the same size takes about as long), and a step queued
    before it is not counted (the first event completes when that step does)."""
    import torch

    from splitserve.engine.copy_timer import CopyTimer

    src = torch.randn(512, 1 << 20, device="cuda")  # 2 GiB
    idx = torch.arange(0, 512, 2, device="cuda")
    torch.index_select(src, 0, idx)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.index_select(src, 0, idx)
    torch.cuda.synchronize()
    synced = time.perf_counter() - t0
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):  # a "step" in flight before the copy
        busy = busy @ busy
        busy /= busy.norm()
    timer = CopyTimer(src.device)
    torch.index_select(src, 0, idx)
    copy = timer.stop()
    assert copy.host_s < 0.5 * synced  # the launch returned before the copy ran
    device = copy.device_s()
    assert 0.5 * synced <= device <= 2 * synced
