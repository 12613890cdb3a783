"""``splitserve up --planner`` with a data-parallel decode pool (``--decode-dp 2``; a tiny random
DeepSeek-V3, real processes): the planner scales whole DP nodes (deploy/planner/actuator.py).

Its ITL bound is out of reach (0.01 ms), so any load makes it want its most decode nodes
(``--planner-max-decode 4``: 4 ranks, 2 DP nodes) and no load its fewest (``--planner-min-decode
1``, rounded up to one DP node of 2 ranks); what the test watches is how it gets there, not the
sizing (tests/test_planner_up.py measures that on the bundled model):

- under load it starts one whole DP node: both its ranks start together, meet at their own
  rendezvous and serve (the router sees 4 decode ranks);
- with no load it drains one whole DP node: both ranks exit 0 together, the supervisor restarts
  no member, the router is back to 2 decode ranks, and the pool still serves;
- no request fails on the way; every decision moves the pool by whole DP nodes.
"""

import asyncio
import random
import time

import aiohttp
import pytest

from splitserve.tests.test_data_parallel_step_error import DS
from splitserve.tests.test_planner_up import get_json, up_with_planner

pytestmark = pytest.mark.slow
NAME = "tiny-ds"


async def one(session: aiohttp.ClientSession, url: str) -> str | None:
    """One streamed completion; None when it succeeded, else why not."""
    body = {"model": NAME, "prompt": [random.randrange(1000, 40000) for _ in range(24)], "max_tokens": 48,
            "ignore_eos": True, "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            text = await r.text()
            if r.status != 200 or "data: [DONE]" not in text or '"error"' in text:
                return f"HTTP {r.status}: {text[-300:]}"
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        return repr(e)
    return None


async def load(url: str, rate: float, seconds: float, until=None) -> list[str | None]:
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        start = time.monotonic()
        while time.monotonic() - start < seconds and not (until and until()):
            tasks.append(asyncio.create_task(one(session, url)))
            await asyncio.sleep(1 / rate)
        return list(await asyncio.gather(*tasks))


@pytest.fixture(scope="module")
def model_path(served_tiny_model):
    return served_tiny_model("deepseek_v3", **DS, max_position_embeddings=2048)


def test_up_planner_scales_a_dp_pool_by_whole_nodes(model_path):
    with up_with_planner("--model", str(model_path), "--served-model-name", NAME, "--kv-cache-memory", "8MiB",
                         "--prefill-nodes", "1", "--decode-nodes", "1", "--decode-dp", "2", "--planner-interval", "1",
                         "--planner-cooldown-up", "0", "--planner-cooldown-down", "2", "--planner-down-after", "2",
                         "--planner-min-samples", "1", "--planner-max-prefill", "1", "--planner-max-decode", "4",
                         "--planner-ttft-p90", "60000", "--planner-itl-p90", "0.01", stop_s=90) as up:
        url, lines = up.url, up.lines
        state = lambda: get_json(f"{up.planner}/debug/planner?n=200")  # noqa: E731
        decode_ranks = lambda: get_json(f"{url}/health").get("decode_nodes", 0)  # noqa: E731

        # load until the router routes to both ranks of a second DP node (a lone rank of a new DP
        # node never gets there: it waits at its rendezvous for its peer)
        grown: list[bool] = []
        failed = asyncio.run(load(url, 3, 150, until=lambda: grown.append(decode_ranks() >= 4) or any(grown)))
        assert any(grown), ("the decode pool did not grow to 4 ranks", state()["actuator"], lines[-30:])
        failed += asyncio.run(load(url, 3, 4))  # the new ranks take requests too
        started = [n["name"] for n in state()["actuator"]["nodes"]
                   if n["role"] == "decode" and n["name"] not in ("decode-0", "decode-1")]
        assert sorted(started) == ["decode-2", "decode-3"], state()["actuator"]

        # no load: one DP node drains whole
        def drained() -> list[dict]:
            return [n for n in state()["actuator"]["nodes"] if n["state"] == "stopped"]
        deadline = time.monotonic() + 120
        while len(drained()) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        stopped = drained()
        assert sorted(n["name"] for n in stopped) in (["decode-0", "decode-1"], ["decode-2", "decode-3"]), \
            (state()["actuator"], lines[-30:])
        assert [n["exit_code"] for n in stopped] == [0, 0], (stopped, lines[-30:])
        deadline = time.monotonic() + 15  # the routers drop the drained ranks at their next node registry read
        while decode_ranks() != 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert decode_ranks() == 2, ("decode ranks the router sees after the drain", decode_ranks(),
                                     state()["actuator"]["recent_actions"], get_json(f"{up.status}/status"))
        failed += asyncio.run(load(url, 3, 3))
        assert [e for e in failed if e is not None] == []
        sup = get_json(f"{up.status}/status")
        assert sup["restarts_total"] == 0, sup
        changes = [d["change"]["decode"] for d in state()["decisions"] if d.get("change", {}).get("decode")]
        assert changes and all(n % 2 == 0 for n in changes), changes  # whole DP nodes only
        assert state()["bounds"]["min_decode"] == 2, state()["bounds"]  # --planner-min-decode 1: one DP node
