"""What the experiments share, in one module: every benchmark script imports its helpers
from here and never from another script.

    RESULTS          benchmarks/results/: where every script writes its current result

    engine (bench_engine, bench_gpu_engine, bench_static_decode_cpu)
      token_prompts    random token-id prompts, seeded
      ours_prefill     prompt tokens/s of one batch through EngineCore
      engine_decode    seconds of each decode step once a batch has its first tokens
      sync, copy_bandwidth   device sync; a device-to-device copy's bytes/s
    kv transfer (bench_kvtransfer, bench_gpu_transfer)
      stop_receiver    stop a receiver child process over its pipe
    side by side (serving/compare_serving, gpu/bench_gpu_serving, gpu/gpu_serving_report):
    real clusters, the same workloads
      Workload         what one workload sends: specs, send offsets, concurrency cap
      mixed_workload   short prompts decoding as a closed loop while long prompts arrive
      warm_endpoint    check an endpoint serves the model, send the warm-up requests
      run_workload     one workload against it -> (RunResult, Summary)
      node_counters    chosen counters summed over a cluster's nodes (their /metrics)
      check_alive      raise, with its last lines, when a member died during a run
      pool             every round's requests of a setup and workload as one run
    faults client (reliability/bench_faults, bench_soak, soak_control; the fault tests)
      Disconnect, Outcome, RequestResult, stream_request   one streamed chat request
                       that may hang up at a chosen point
      run_load         open-loop load at a fixed rate
      node_state, wait_pools_free   the aftermath: every KV pool free, no stream left
    prefix pulls (serving/bench_pull_holder, serving/bench_pull_memory)
      PullSink         a puller's receiving half without an engine: pulls a holder's cached
                       prefix into a scratch pool, as often as asked

Must not start or stop clusters or processes (the scripts do, through
deploy/launcher.py), judge a figure, or import a script or the tests.
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

import aiohttp

from splitserve.benchmarks.loadgen.bench import (Endpoint, RequestSpec, RunResult, Summary, check_endpoint, run,
                                                 summarize)
from splitserve.benchmarks.loadgen.bench.arrivals import fixed_offsets
from splitserve.benchmarks.loadgen.bench.datasets import Tokenizer, random_specs

if TYPE_CHECKING:
    from splitserve.common.kv_compat import KVCompat
    from splitserve.deploy.launcher import Cluster
    from splitserve.engine.engine_core import EngineCore

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "SmolLM2-135M-Instruct"  # the bundled model's served name


# ---- engine ------------------------------------------------------------------------------

def token_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids in [3, vocab - 3), the same for the same seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 3, (n, length), generator=g).tolist()


def ours_prefill(engine: EngineCore, batch: list[list[int]]) -> float:
    """Prompt tokens/s of one batch through the whole engine (one token generated each)."""
    from splitserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    for i, p in enumerate(batch):
        engine.add_request(f"p{time.monotonic_ns()}-{i}", engine.prompt_ref(p), params)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(map(len, batch)) / (time.perf_counter() - start)


def engine_decode(engine: EngineCore, batch: list[list[int]], steps: int,
                  on_decode: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each decode step once every request has its first token; ``on_decode``
    runs once the prefill is done, before the first timed step."""
    from splitserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i, p in enumerate(batch):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", engine.prompt_ref(p), params)
    started: set[str] = set()
    while len(started) < len(batch):  # prefill (chunks mixed with the first decodes)
        started.update(d.request_id for d in engine.step())
    if on_decode is not None:
        on_decode()
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()  # ends with the sampled ids on the host: the GPU work is done
        times.append(time.perf_counter() - t0)
    return times


def sync(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def copy_bandwidth(device: str, nbytes: int, reps: int = 10) -> float:
    """(bytes read + bytes written) / second of a device-to-device copy."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


# ---- kv transfer -------------------------------------------------------------------------

def stop_receiver(proc, parent, timeout_s: float) -> None:
    """Ask the receiver process to stop over its pipe, wait for its goodbye, kill it if stuck."""
    if proc.is_alive():
        parent.send("stop")
        if parent.poll(timeout_s):
            parent.recv()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()


# ---- side by side: real clusters, the same workloads -------------------------------------

class Workload(NamedTuple):
    specs: list[RequestSpec]
    offsets: list[float]  # seconds from the start, one per spec
    cap: int | dict[str, int] | None  # in flight: one cap, or per tag (runner.py)
    send_text: bool = False  # completions: text prompts instead of token ids


class MixedShape(NamedTuple):
    """The mixed workload: ``short`` requests of ``short_input`` -> ``short_output`` tokens
    as a closed loop of ``short_concurrency`` streams; ``long`` prompts of ``long_input``
    tokens (``long_output`` generated), one every ``long_interval`` s from ``long_start``."""
    short: int
    short_concurrency: int
    short_input: int
    short_output: int
    long: int
    long_input: int
    long_output: int
    long_start: float
    long_interval: float


def mixed_workload(rng: random.Random, tok: Tokenizer, shape: MixedShape) -> Workload:
    """Token-id prompts (exact lengths), tagged "short" and "long"; shorts drawn first."""
    s = shape
    short = random_specs(rng, tok, s.short, s.short_input, s.short_output, tag="short")
    long = random_specs(rng, tok, s.long, s.long_input, s.long_output, tag="long")
    return Workload(short + long, [0.0] * len(short) + fixed_offsets(len(long), s.long_interval, s.long_start),
                    {"short": s.short_concurrency})


async def warm_endpoint(url: str, tok: Tokenizer, warmup: list[RequestSpec], model: str | None = None) -> Endpoint:
    """The endpoint at ``url`` (/v1) serving ``model`` (None: the first it lists), after
    ``warmup`` was sent to it all at once (load, compile, touch; not measured)."""
    model = await check_endpoint(url, model)
    ep = Endpoint(url, model, "completions", ignore_eos=True)
    await run(ep, warmup, [0.0] * len(warmup), tok.decode, progress=False)
    return ep


async def run_workload(ep: Endpoint, name: str, w: Workload, tok: Tokenizer,
                       progress: bool = True) -> tuple[RunResult, Summary]:
    r = await run(ep._replace(send_text=w.send_text), w.specs, w.offsets, tok.decode, w.cap,
                  progress=progress, desc=name)
    return r, summarize(r.results, r.duration_s)


def node_counters(c: Cluster, prefixes: tuple[str, ...]) -> dict[str, float]:
    """{'name{labels}': value} of the series starting with ``prefixes``, summed over the
    cluster's nodes (the routers left out)."""
    out: dict[str, float] = {}
    for p in c.procs:
        if p.role == "router":
            continue
        with urllib.request.urlopen(f"{p.addr}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(prefixes):
                    key, value = line.rsplit(" ", 1)
                    out[key] = out.get(key, 0.0) + float(value)
    return out


def check_alive(c: Cluster) -> None:
    """Raise RuntimeError naming every member that exited, with its last lines: its
    figures are not the setup's."""
    dead = [p for p in c.procs if p.popen.poll() is not None]
    if dead:
        raise RuntimeError("; ".join(
            f"{p.name} exited with status {p.popen.returncode} during the run (negative: killed "
            "by that signal), its last lines:\n  " + "\n  ".join(p.log[-15:]) for p in dead))


def pool(rounds: list[dict]) -> dict:
    """Rounds of {setup: {workload: (RunResult, Summary)}} -> the same with every round's
    requests of a setup and workload as one run (durations added)."""
    out: dict[str, dict] = {}
    for got in rounds:
        for setup, loads in got.items():
            for w, (r, _) in loads.items():
                prev = out.setdefault(setup, {}).get(w)
                out[setup][w] = r if prev is None else RunResult(prev.results + r.results,
                                                                 prev.duration_s + r.duration_s)
    return {s: {w: (r, summarize(r.results, r.duration_s)) for w, r in loads.items()}
            for s, loads in out.items()}


# ---- faults client: requests that may hang up, and the aftermath -------------------------

class Disconnect(enum.Enum):
    NONE = "none"  # read the stream to its end
    BEFORE_FIRST_BYTE = "before_first_byte"  # hang up before the response headers
    AFTER_ROLE = "after_role"  # chat: hang up right after the role-only first chunk
    MID_STREAM = "mid_stream"  # hang up after a few content chunks


class Outcome(enum.Enum):
    OK = "ok"  # streamed to [DONE] without an error event
    FAILED = "failed"  # an HTTP error, an error event, or a stream cut short
    DISCONNECTED = "disconnected"  # the client hung up on purpose


class RequestResult(NamedTuple):
    outcome: Outcome
    started: float  # time.monotonic() at send
    ended: float  # when the outcome was known
    text: str
    error: str | None
    longest_gap_s: float = 0.0  # longest silence between two events of the stream (a stall)


async def stream_request(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                         disconnect: Disconnect = Disconnect.NONE, mid_chunks: int = 2,
                         timeout_s: float = 120.0) -> RequestResult:
    """One streamed chat completion through the router at ``url`` (greedy)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.monotonic()
    text: list[str] = []
    chunks = 0
    t_last, gap = None, 0.0  # time of the last event, the longest silence between two
    if disconnect is Disconnect.BEFORE_FIRST_BYTE:
        task = asyncio.ensure_future(session.post(f"{url}/v1/chat/completions", json=body))
        await asyncio.sleep(random.uniform(0.0, 0.05))
        task.cancel()
        try:
            resp = await task
            resp.close()  # the headers came first: hang up now
        except (asyncio.CancelledError, aiohttp.ClientError):
            pass
        return RequestResult(Outcome.DISCONNECTED, t0, time.monotonic(), "", None)
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                if resp.status != 200:
                    return RequestResult(Outcome.FAILED, t0, time.monotonic(), "",
                                         f"HTTP {resp.status}: {(await resp.text())[:200]}")
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    now = time.monotonic()
                    if t_last is not None:
                        gap = max(gap, now - t_last)
                    t_last = now
                    if data == b"[DONE]":
                        return RequestResult(Outcome.OK, t0, now, "".join(text), None, gap)
                    event = json.loads(data)
                    if "error" in event:
                        return RequestResult(Outcome.FAILED, t0, time.monotonic(), "".join(text),
                                             str(event["error"])[:200])
                    chunks += 1
                    for choice in event.get("choices", []):
                        text.append(choice.get("delta", {}).get("content") or "")
                    if (disconnect is Disconnect.AFTER_ROLE and chunks == 1) or \
                            (disconnect is Disconnect.MID_STREAM and chunks == 1 + mid_chunks):
                        resp.close()
                        return RequestResult(Outcome.DISCONNECTED, t0, time.monotonic(), "".join(text), None)
        return RequestResult(Outcome.FAILED, t0, time.monotonic(), "".join(text), "stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return RequestResult(Outcome.FAILED, t0, time.monotonic(), "".join(text), repr(e)[:200])


async def run_load(url: str, rate: float, duration_s: float, prompts: list[str], max_tokens: int,
                   disconnect_fraction: float = 0.0, seed: int = 0, count: int | None = None) -> list[RequestResult]:
    """Open-loop load: a request every 1/rate s for ``duration_s`` (or exactly ``count``
    requests); a ``disconnect_fraction`` of them hang up at a random point. Returns every result."""
    rng = random.Random(seed)
    points = [Disconnect.BEFORE_FIRST_BYTE, Disconnect.AFTER_ROLE, Disconnect.MID_STREAM]
    tasks = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.monotonic()
        i = 0
        while (i < count) if count is not None else (time.monotonic() < t0 + duration_s):
            d = rng.choice(points) if rng.random() < disconnect_fraction else Disconnect.NONE
            tasks.append(asyncio.create_task(stream_request(
                session, url, prompts[i % len(prompts)], max_tokens, d, mid_chunks=rng.randint(1, 4))))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))  # no drift
        return list(await asyncio.gather(*tasks))


async def node_state(session: aiohttp.ClientSession, addr: str, headers: dict) -> dict:
    async with session.get(f"{addr}/debug/state", headers=headers,
                           timeout=aiohttp.ClientTimeout(total=10)) as r:
        r.raise_for_status()
        return await r.json()


async def wait_pools_free(addrs: list[str], headers: dict, timeout_s: float) -> tuple[float, dict]:
    """Poll every node's /debug/state until each pool is 100% free with no stream or
    transfer left; (seconds it took, last states). Raises TimeoutError with the states."""
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            states = {a: await node_state(session, a, headers) for a in addrs}
            if all(s["kv_blocks_free"] == s["kv_blocks_total"] and not s.get("streams") and not s.get("transfers")
                   and not s.get("outgoing") for s in states.values()):
                return time.monotonic() - t0, states
            if time.monotonic() - t0 > timeout_s:
                brief = {a: {k: s.get(k) for k in ("kv_blocks_free", "kv_blocks_total", "streams", "outgoing",
                                                  "transfers")} for a, s in states.items()}
                raise TimeoutError(f"pools not free after {timeout_s}s: {brief}")
            await asyncio.sleep(0.2)


class PullSink:
    """The receiving half of a puller, without an engine: a KV receiver over a scratch pool of
    ``num_blocks`` blocks of the holder's layout (``compat``: its KV key, /debug/state's
    ``kv``), and the transfer table its reports go to. ``pull`` has the holder send the
    cached blocks of a prefix into chosen blocks of the pool, as a puller's transfer does
    (node/kv_pull.py ``Puller._land``), so a benchmark pulls one prefix again and again while
    no engine of its own caches it. ``start`` before, ``stop`` after; on the event loop."""

    def __init__(self, compat: KVCompat, num_blocks: int, backend: str = "tcp", host: str = "127.0.0.1"):
        from splitserve.kvtransfer import make_receiver
        from splitserve.kvtransfer.block_store import KVBlockStore, allocate_kv_cache
        from splitserve.kvtransfer.layout import KVShard
        from splitserve.kvtransfer.state import TransferTable

        shard = KVShard(compat, 0)
        store = KVBlockStore(allocate_kv_cache(shard.layout, num_blocks), shard.layout)
        self.table = TransferTable()
        self.receiver = make_receiver(backend, shard.layout, store, host, self._on_block, shard=shard)
        self.receiver.accepts = self.table.is_live
        self.backend = backend

    def _on_block(self, transfer_id: str, dest_block_id: int, ok: bool, reason: str | None) -> None:
        self.table.on_block(transfer_id, dest_block_id, ok, reason)

    async def start(self) -> None:
        await self.receiver.start()

    async def stop(self) -> None:
        await self.receiver.stop()

    async def pull(self, session: aiohttp.ClientSession, holder: str, prefix: list[int], dest: list[int],
                   lease_s: float = 30.0) -> int:
        """Blocks the holder at ``holder`` sent of ``prefix`` (whole blocks) into ``dest``, once
        every one landed; raises ``RuntimeError`` naming the failure."""
        import uuid

        import msgspec

        from splitserve.common.http import MSGPACK, decode_error_body
        from splitserve.common.prompt_ref import WirePrompt
        from splitserve.common.protocol import PullRequest, PullResult
        from splitserve.kvtransfer.state import TransferFailure

        tid = uuid.uuid4().hex
        transfer = self.table.reserve(tid, tid, dest, lease_s)
        task = PullRequest(request_id=tid, transfer_id=tid, prompt=WirePrompt.of(prefix), kv_backend=self.backend,
                           kv_addrs=[self.receiver.address], skip_blocks=0, dest_block_ids=dest)
        try:
            async with session.post(f"{holder}/kv/pull", data=msgspec.msgpack.encode(task),
                                    headers={"Content-Type": MSGPACK}) as r:
                body = await r.read()
                if r.status != 200:
                    raise RuntimeError(f"holder answered {r.status}: {decode_error_body(body)}")
            self.table.prefilled(tid, msgspec.msgpack.decode(body, type=PullResult))
            outcome = await asyncio.wait_for(asyncio.shield(transfer.done), lease_s)
            if isinstance(outcome, TransferFailure):
                raise RuntimeError(f"pull failed: {outcome.reason}")
            self.table.own(tid)
            return len(transfer.dest_block_ids)
        finally:
            self.table.abort(tid, "done")  # a no-op once owned
            self.table.remove(tid)
