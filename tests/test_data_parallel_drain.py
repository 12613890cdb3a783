"""A data-parallel node drains as a whole (engine/engine_thread.py: its ranks stop at one agreed
turn; deploy/launcher.py ``Cluster.retire_members``): a decode node of 2 DP ranks (a tiny random
DeepSeek-V3, real processes, gloo, Redis), a short stream on rank 0 and a long one on rank 1,
then the node is retired as the planner retires one (SIGTERM to every rank at once).

- Rank 0 has nothing left to do at once, rank 1 for seconds more: rank 0 keeps joining rank
  1's forwards until both are done, both streams end with every token ("length"), both ranks
  deregister and exit 0, and the supervisor restarts neither.
"""

import asyncio
import os
import time

import aiohttp
import pytest

from splitserve.deploy.launcher import Cluster
from splitserve.tests.test_data_parallel_step_error import DS, _request, _stream

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")


@pytest.fixture(scope="module")
def model_path(served_tiny_model):
    return served_tiny_model("deepseek_v3", **DS, max_position_embeddings=2048)  # room for long answers


def test_a_retired_dp_node_drains_its_ranks_together(model_path):
    c = Cluster(prefill_nodes=0, decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB", model=str(model_path),
                dp={"decode": 2}, extra_node_args=["--drain-grace", "20"])
    try:
        c.start(timeout=180)
        c.supervise()
        addrs = [c.node(f"decode-{r}").addr for r in range(2)]

        async def scenario():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                started = [asyncio.Event(), asyncio.Event()]
                streams = [asyncio.create_task(_stream(s, a, _request(f"drain-{r}", [101 + r] * 20, n), started[r]))
                           for r, (a, n) in enumerate(zip(addrs, (30, 800)))]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
                retired = c.retire_members("decode", 0)
                return retired, await asyncio.gather(*streams)

        retired, (short, long) = asyncio.run(scenario())
        assert retired == ["decode-0", "decode-1"]
        assert (short.finish_reason, len(short.tokens)) == ("length", 30), short
        assert (long.finish_reason, len(long.tokens)) == ("length", 800), (long, c.node("decode-0").log[-5:])
        deadline = time.monotonic() + 40
        while any(c.exit_code(n) is None for n in retired) and time.monotonic() < deadline:
            time.sleep(0.2)
        logs = {n: c.node(n).log[-8:] for n in retired}
        assert [c.exit_code(n) for n in retired] == [0, 0], logs
        time.sleep(1)  # a supervisor poll or more
        assert len(c.procs) == 2 + 1, "a retired rank was started again"  # the ranks and the router
    finally:
        c.stop()
