"""A prefill node's export of a cached prefix (engine/block_export.py ``ExportKV``): the
blocks a request finds cached are packed before its first forward, once they are in place
on the device (after their load, when a lower tier held them), so they cross the network
while the rest of the prompt computes; what the forward computes is packed after it. A load
runs beside the forward, layer by layer, so the rest follows the prefix by less than a
step when the load takes longer than the forward.

Simulated ``llama3-8b-h100`` engines, slowed down so a step's modelled time stands out of
this machine's own."""

import asyncio
import time

import pytest

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.planner.sim_profiles import get_profile
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.block_export import BlockExporter, BlocksReady, ExportKV
from splitserve.engine.engine_thread import AddRequest, EngineThread
from splitserve.engine.sim_runner import standin_tiers

P = get_profile("llama3-8b-h100")
SPEEDUP = 0.1  # a modelled second takes 10 s here
PROMPT = list(range(1000, 1000 + 8000))  # 500 blocks
NEW = 160  # the second request's own tokens: 10 blocks computed after the cached 500


def engine(model_dir, host_tier: bool) -> EngineCore:
    """With a host tier, the device holds 512 blocks (one 8k prompt) and the host 4x that."""
    pool = 8192 * P.kv_bytes_per_token if host_tier else P.kv_pool_bytes
    return EngineCore(standin_tiers(EngineConfig(
        model=str(model_dir), kv_cache_memory=pool, block_size=16, prefill_chunk_size=P.prefill_chunk_size,
        max_num_batched_tokens=P.max_num_batched_tokens, kv_offload_memory=4 * pool if host_tier else 0,
        sim=P.sim_config(speedup=SPEEDUP))))


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_cached_prefix_is_packed_before_the_forward_that_computes_the_rest(bundled_dir, tier):
    e = engine(bundled_dir, host_tier=tier == "host")
    sim = P.sim_config(speedup=SPEEDUP)

    async def main() -> tuple[list[tuple[BlocksReady, float]], float]:
        loop = asyncio.get_running_loop()
        ready: list[tuple[BlocksReady, float]] = []
        done: dict[str, asyncio.Event] = {}

        def on_deltas(deltas):
            for d in deltas:
                if d.finish_reason is not None:
                    done[d.request_id].set()

        packed_at: list[float] = []  # on the engine thread, as each pack happens (the loop's delivery lags)

        def pack(export, ids, dest_ids):
            packed_at.append(time.monotonic())
            return list(ids)

        exporter = BlockExporter(pack=pack, on_blocks=lambda ev: ready.append((ev, packed_at[len(ready)])))
        et = EngineThread(e, loop, on_deltas, exporter=exporter)
        et.start()
        try:
            async def serve(rid: str, prompt: list[int], export: bool) -> None:
                done[rid] = asyncio.Event()
                if export:
                    await et.submit(ExportKV(rid, f"t-{rid}", [], 0, list(range(len(prompt) // 16))))
                await et.submit(AddRequest(rid, e.prompt_ref(prompt), params=SamplingParams(max_tokens=1)))
                await asyncio.wait_for(done[rid].wait(), 60)

            await serve("a", PROMPT, False)
            if tier == "host":  # another prompt takes the device: a's blocks are only on the host now
                await serve("other", list(range(20000, 28000)), False)
                await asyncio.sleep(0.5)  # its blocks' write-through copies land: b's forward waits for none
            t0 = time.monotonic()
            await serve("b", PROMPT + list(range(40000, 40000 + NEW)), True)
            return ready, t0
        finally:
            et.stop()

    ready, t0 = asyncio.run(main())
    assert [(ev.request_id, ev.start, ev.end) for ev, _ in ready] == [("b", 0, 500), ("b", 500, 510)]
    (prefix, at_prefix), (_, at_rest) = ready
    assert len(prefix.packed) == 500
    step_s = sim.step_seconds(0, [(NEW, 8000)]) / SPEEDUP
    load_s = (500 * P.block_bytes / sim.host_bytes_per_s if tier == "host" else 0.0) / SPEEDUP
    # the prefix left once in place: after its load; the rest once the forward is done
    assert load_s * 0.9 <= at_prefix - t0 < load_s + step_s  # (the host's own overhead is part of it)
    if tier == "device":
        assert at_rest - at_prefix >= 0.9 * step_s
    else:  # the forward ran beside the load, layer by layer, and ended one layer's compute after it
        assert load_s > step_s and P.layers == 32
        assert 0.5 * step_s / 32 <= at_rest - at_prefix < 0.5 * step_s
