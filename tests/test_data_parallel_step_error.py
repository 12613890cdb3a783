"""One data-parallel rank's step error (engine/engine_thread.py, ranks/data_parallel.py): a
decode node of 2 DP ranks (a tiny random DeepSeek-V3, real processes, gloo), rank 1 started
with ``--fault step_error`` (engine/step_fault.py: its step raises as it prefills a prompt while
another request decodes, the first time before the forward's collectives, the second inside
the last MoE layer, after its first ones). Requests go straight to each rank's /generate
(local prefill).

- Twice (each fault): a long request decodes on each rank; a third prompt makes rank 1's step
  fail: every rank's running request ends with an "error" frame within seconds (no wait for a
  collective's 60 s timeout), on both ranks.
- Neither rank exits; afterwards each rank serves again with the greedy tokens it gave before
  the faults (the MoE exchange still matched), and every pool is free.
"""

import asyncio
import os
import time
from typing import NamedTuple

import aiohttp
import msgspec
import pytest

from splitserve.benchmarks.harness import wait_pools_free
from splitserve.common.prompt_ref import WirePrompt
from splitserve.common.protocol import FrameReader, GenerateRequest, TokenDelta
from splitserve.common.sampling_params import SamplingParams
from splitserve.deploy.launcher import Cluster, free_port
from splitserve.tests.test_deepseek import DS
from splitserve.tests.test_tp_cluster import get_json

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")

PROMPTED_S = 15.0  # every running request ends this soon after the failing step (the collectives' timeout: 60)


class Streamed(NamedTuple):
    tokens: list[int]
    finish_reason: str | None  # None: the stream was cut without a final frame
    ended: float  # monotonic


def _request(rid: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt=WirePrompt.of(prompt),
                           sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _stream(session: aiohttp.ClientSession, addr: str, req: GenerateRequest,
                  started: asyncio.Event | None = None) -> Streamed:
    """One request's frames from a decode node; ``started`` is set at its first token."""
    reader, tokens, finish = FrameReader(TokenDelta), [], None
    async with session.post(f"{addr}/generate", data=msgspec.msgpack.encode(req),
                            headers={"Content-Type": "application/msgpack"}) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            for delta in reader.feed(chunk):
                tokens += delta.token_ids
                finish = delta.finish_reason or finish
                if tokens and started is not None:
                    started.set()
    return Streamed(tokens, finish, time.monotonic())


@pytest.fixture(scope="module")
def model_path(served_tiny_model):
    return served_tiny_model("deepseek_v3", **DS, max_position_embeddings=2048)  # room for long answers


def test_one_ranks_step_error_fails_the_nodes_step_on_every_rank_and_it_serves_on(model_path):
    c = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="tcp", kv_cache_memory="8MiB", model=str(model_path),
                extra_node_args=["--drain-grace", "2"])
    address = f"127.0.0.1:{free_port()}"
    dp = lambda rank: ["--data-parallel-size", "2", "--data-parallel-rank", str(rank),  # noqa: E731
                       "--data-parallel-address", address]
    try:
        procs = [c.start_node("decode", 0, dp(0)), c.start_node("decode", 1, [*dp(1), "--fault", "step_error"])]
        for p in procs:
            c.wait_ready(p, 180)
        addrs = [c.node(f"decode-{r}").addr for r in range(2)]
        pids = [get_json(f"{a}/debug/state")["pid"] for a in addrs]
        after = [[(7 * i + 3 * r) % 30000 + 200 for i in range(24)] for r in range(2)]  # each rank's check prompt

        async def scenario():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                before = [await _stream(s, a, _request(f"before-{r}", after[r], 12)) for r, a in enumerate(addrs)]
                ended = []
                for fault in range(2):
                    started = [asyncio.Event(), asyncio.Event()]
                    tasks = [asyncio.create_task(_stream(s, a, _request(f"long-{fault}-{r}", [101 + r] * 20, 1500),
                                                         started[r])) for r, a in enumerate(addrs)]
                    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                    t0 = time.monotonic()
                    tasks.append(asyncio.create_task(_stream(s, addrs[1], _request(
                        f"trigger-{fault}", list(range(300, 340)), 8))))
                    done, _ = await asyncio.wait(tasks, timeout=PROMPTED_S)
                    if len(done) < len(tasks):
                        ends = [(t.result().finish_reason, len(t.result().tokens)) if t in done else "running"
                                for t in tasks]
                        logs = "\n".join(f"--- {p.name}\n" + "\n".join(p.log[-6:]) for p in procs)
                        raise AssertionError(f"a running request did not end within {PROMPTED_S:g} s of rank 1's "
                                             f"step error {fault + 1} (long-0, long-1, trigger: {ends})\n{logs}")
                    completed = [ln for ln in procs[1].log if "completing the failed step's forward" in ln]
                    ended.append((t0, [t.result() for t in tasks], completed[-1] if completed else None))
                again = [await _stream(s, a, _request(f"again-{r}", after[r], 12)) for r, a in enumerate(addrs)]
                return before, ended, again

        before, ended, again = asyncio.run(scenario())
        for (t0, streams, completed), issued in zip(ended, ("(0 of", "(3 of")):  # the faults' places
            assert [e.finish_reason for e in streams] == ["error"] * 3, streams
            assert max(e.ended for e in streams) - t0 < PROMPTED_S
            assert completed is not None and issued in completed, completed
        assert [p.popen.poll() for p in procs] == [None, None], "a rank exited"
        assert [get_json(f"{a}/debug/state")["pid"] for a in addrs] == pids
        for b, a in zip(before, again):
            assert a.finish_reason == "length" and a.tokens == b.tokens, (b, a)
        asyncio.run(wait_pools_free(addrs, {}, 20))
    finally:
        c.stop()
