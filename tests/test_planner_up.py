"""``splitserve up --planner`` with real nodes on this CPU (the bundled model): a load
step makes the planner start a second prefill node, a quiet period makes it drain one,
and no request fails on the way. The planner's intervals, cooldowns and bounds are
flags, set short here so the whole story takes tens of seconds. The planner reacts to the
latency it measures, so this test needs the machine to itself (marked ``alone``: the test
command runs it after the rest, not beside another test file)."""

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import aiohttp
import pytest

from splitserve.common import metric_names as names
from splitserve.deploy.launcher import free_port

pytestmark = [pytest.mark.slow, pytest.mark.alone]

MODEL = "SmolLM2-135M-Instruct"


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


async def one(session: aiohttp.ClientSession, url: str, prompt_len: int, max_tokens: int) -> str | None:
    """One streamed completion; None when it succeeded, else why not."""
    body = {"model": MODEL, "prompt": [random.randrange(1000, 40000) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                return f"HTTP {r.status}: {await r.text()}"
            text = await r.text()
            if "data: [DONE]" not in text or '"error"' in text:
                return f"stream: {text[-300:]}"
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as e:
        return repr(e)
    return None


async def open_loop(url: str, rate: float, seconds: float, prompt_len: int, max_tokens: int,
                    until=None) -> list[str | None]:
    """Requests at ``rate`` per second for ``seconds`` (or until ``until()`` holds); every result."""
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        start = time.monotonic()
        while time.monotonic() - start < seconds and not (until and until()):
            tasks.append(asyncio.create_task(one(session, url, prompt_len, max_tokens)))
            await asyncio.sleep(1 / rate)
        return list(await asyncio.gather(*tasks))


def planner_state(url: str) -> dict:
    return get_json(f"{url}/debug/planner?n=200")


class Up(NamedTuple):
    url: str  # the router's
    planner: str  # the planner's base URL
    status: str  # the supervisor's base URL
    lines: list[str]  # what up printed so far (a thread appends)


@contextmanager
def up_with_planner(*flags: str, start_s: float = 240, stop_s: float = 60) -> Iterator[Up]:
    """``splitserve up --planner *flags`` on a free port, once it serves; Ctrl-C after, and it must
    exit 0 within ``stop_s``."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_QUIET="1")
    env.pop("SPLITSERVE_CLUSTER_TOKEN", None)
    up = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "up", "--port", str(port), "--planner", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        planner = status = None
        deadline = time.monotonic() + start_s
        while planner is None:
            assert time.monotonic() < deadline and up.poll() is None, "\n".join(lines[-40:])
            line = up.stdout.readline()
            lines.append(line.rstrip())
            if m := re.search(r"supervisor status: (http://\S+)/status", line):
                status = m.group(1)
            if m := re.search(r"planner: (http://\S+)/debug/planner", line):
                planner = m.group(1)
        assert status is not None, "\n".join(lines)
        threading.Thread(target=lambda: lines.extend(ln.rstrip() for ln in up.stdout), daemon=True).start()
        yield Up(f"http://127.0.0.1:{port}", planner, status, lines)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(stop_s)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert code == 0, "\n".join(lines[-40:])


def test_up_planner_scales_prefill_up_on_a_load_step_and_drains_on_quiet():
    # --planner-down-after 6 (12 s of wanting fewer): the load step's last requests take ~10 s to
    # answer on this CPU, an interval without arrivals that must not drain the node just started
    with up_with_planner("--kv-cache-memory", "64MiB", "--planner-interval", "2", "--planner-cooldown-up", "0",
                         "--planner-cooldown-down", "4", "--planner-down-after", "6", "--planner-min-samples", "2",
                         "--planner-max-prefill", "2", "--planner-max-decode", "1", "--planner-ttft-p90", "3000",
                         "--planner-itl-p90", "1000") as (url, planner, _, lines):
        assert planner_state(planner)["actuator"]["kind"] == "local"

        def prefill_nodes() -> int:
            return get_json(f"{url}/health").get("prefill_nodes", 0)

        seen_two: list[bool] = []  # the router routed to two prefill nodes at some point

        def scaled_up() -> bool:
            if prefill_nodes() >= 2:
                seen_two.append(True)
            return bool(seen_two)

        # the load step: 300-token prompts at 1.5/s, about twice what one CPU prefill node computes,
        # until the router routes to a second prefill node (a started node loads and registers in
        # seconds, more while another test file shares the cores: up to 120 s, then 30 s more).
        # Seen once is enough: while the step's backlog drains, no new load arrives, and the
        # planner may already be draining the node again.
        step = asyncio.run(open_loop(url, 1.5, 120, 300, 4, until=scaled_up))
        settle = time.monotonic() + 30
        while not scaled_up() and time.monotonic() < settle:
            time.sleep(0.5)
        assert scaled_up(), "\n".join(lines[-40:])
        # the new node takes requests too
        step += asyncio.run(open_loop(url, 1.5, 6, 300, 4))
        ups = [d for d in planner_state(planner)["decisions"] if d.get("change", {}).get("prefill", 0) > 0]
        assert ups, planner_state(planner)["decisions"]
        first = ups[0]
        assert first["target"]["prefill"] == 2 and first["current"]["prefill"] == 1
        assert first["observed"]["rate"] > 0.5 and first["sizing"]["prefill"]["load"] > 0

        # quiet: a trickle of short prompts with longer answers, so requests are in flight throughout
        def drained() -> bool:
            nodes = planner_state(planner)["actuator"]["nodes"]
            return any(n["role"] == "prefill" and n["state"] == "stopped" for n in nodes)
        quiet = asyncio.run(open_loop(url, 0.5, 90, 20, 16, until=drained))
        quiet += asyncio.run(open_loop(url, 0.5, 4, 20, 16))
        state = planner_state(planner)
        stopped = [n for n in state["actuator"]["nodes"] if n["state"] == "stopped"]
        assert stopped and stopped[0]["role"] == "prefill" and stopped[0]["exit_code"] == 0, state["actuator"]
        downs = [d for d in state["decisions"] if d.get("change", {}).get("prefill", 0) < 0]
        assert downs and any("draining" in r for r in downs[0]["reasons"]), downs
        settle = time.monotonic() + 15  # the router drops the drained node at its next node registry read
        while prefill_nodes() != 1 and time.monotonic() < settle:
            time.sleep(0.5)
        assert prefill_nodes() == 1

        failed = [e for e in step + quiet if e is not None]
        assert failed == [], failed[:3]
        # every decision is exported
        with urllib.request.urlopen(f"{planner}/metrics", timeout=10) as r:
            text = r.read().decode()
        changes = ([ln for ln in text.splitlines() if ln.startswith(names.PLANNER_NODES_CHANGED)],
                   [(d["seq"], d["reasons"], d["observed"], d["sizing"], d["correction"]) for d in state["decisions"] if any(d.get("change", {}).values())])
        assert f'{names.PLANNER_NODES_CHANGED}{{action="started",model_name="{MODEL}",role="prefill"}} 1.0' in text, changes
        assert f'{names.PLANNER_NODES_CHANGED}{{action="drained",model_name="{MODEL}",role="prefill"}} 1.0' in text, changes
        assert names.PLANNER_PREDICTION_ERROR in text and names.PLANNER_TARGET_REPLICAS in text
        errors = state["prediction_errors"]["rate"]
        assert errors["moving_average"]["scored"] > 0 and errors["holt"]["scored"] > 0
