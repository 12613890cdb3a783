"""What does one routing decision cost the router with 64 and 256 prefill nodes and
100k-token prompts, how much memory does its prefix mirror take, and do routers
sharing one Redis agree (with and without lost updates)?

    .venv/bin/python benchmarks/router/bench_router_cost.py [--nodes 64 256] [--seconds 5]

Per node count: a real redis-server; the nodes' index writes (``KVIndex.apply``,
the same Lua write + PUBLISH a node's publisher makes) of ``--conversations``
long conversations (a shared 2k-token system prompt, a document of 20k-60k tokens
shared by a few conversations, turns up to ~100k tokens), each held by 1-4 prefill
nodes up to a random depth; two routers' prefix mirrors (``PrefixMirror``, kept by
their ``MirrorFollower``) follow the updates.
Then, in this process pinned to one core:

- decisions: the router's work per request on 100k-token prompts (each a held
  conversation plus a new turn, or a new conversation sharing only the system
  prompt), as ``Dispatcher.open`` does it from the `Prompt` that request preparation
  validated (the client's list read once into a u32 array): the block hashes over
  that array (``Prompt.ref``, once per request), the mirror lookup over
  them (no I/O), ``cache_aware`` over every node ("decision"), then the msgpack
  `GenerateRequest` carrying the prompt's bytes and the hashes to the nodes
  ("routed"). Per second of that work, p50/p99, and each part's p50. Preparing the
  client's JSON body (``prepare.prepare_completion``: parse, shape check, the ids
  validated and read into the array) is timed apart (``parse_body_p50_ms``, with its
  parts): it is per-request work too, but proportional to the body and the same for
  every policy; tokenizing a text prompt is not measured. Socket I/O (aiohttp) is not
  in these figures.
- agreement: two routers take alternate requests of a steady stream, each with its
  own mirror and policy history; the share of requests for which the other router
  would have made the same (prefill, decode) choice.
- memory: the mirror's bytes (tracemalloc) per million (block, node) entries.
- agreement: a router started late catches up from the snapshots; it and the two
  running ones answer the same for every probe prompt. Then the nodes churn
  (store new turns, evict tails) while one mirror drops 1% of the updates; its
  predicted cached tokens during the churn and after one catch-up interval are
  compared with a lossless mirror's.

Targets: >= 1000 routed requests/s on one core, decision p99 <= 2 ms. Writes
``benchmarks/results/router_cost.json`` and ``router_cost.png``.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import tracemalloc

from splitserve.benchmarks.harness import RESULTS

MODEL = "bench-model"
BS = 16
SYSTEM_TOKENS = 2048
VOCAB = 49152  # token ids are drawn below it: the bundled tokenizer validates the parsed bodies


def conversations(n: int, rng: random.Random) -> list[list[int]]:
    """``n`` token sequences of ~100k tokens: system prompt + shared document + turns."""
    system = [rng.randrange(100, VOCAB) for _ in range(SYSTEM_TOKENS)]
    docs = [[rng.randrange(100, VOCAB) for _ in range(rng.randrange(20000, 60000))]
            for _ in range(max(1, n // 3))]
    out = []
    for _ in range(n):
        doc = rng.choice(docs)
        turns = [rng.randrange(100, VOCAB) for _ in range(100_000 - SYSTEM_TOKENS - len(doc))]
        out.append(system + doc + turns)
    return out


async def build(redis_url: str, prefills: int, decodes: int, convs: list[list[int]], rng: random.Random):
    """Write every node's index entries; (nodes, writer, per-node (epoch, seq, held hashes))."""
    from splitserve.common.hashing import hash_blocks
    from splitserve.common.kv_index import IndexDelta, KVIndex
    from splitserve.common.load import NodeLoad
    from splitserve.common.node_registry import NodeInfo, new_epoch

    writer = KVIndex(redis_url, ttl_s=600.0, timeout_s=10.0)
    nodes = [NodeInfo(node_id=f"p{i}", role="prefill", http_addr="http://127.0.0.1:1", model=MODEL,
                      epoch=new_epoch(), block_size=BS,
                      load=NodeLoad(running=rng.randrange(4), queued_prefill_tokens=rng.randrange(20000)))
             for i in range(prefills)]
    nodes += [NodeInfo(node_id=f"d{i}", role="decode", http_addr="http://127.0.0.1:1", model=MODEL,
                       epoch=new_epoch(), block_size=BS, load=NodeLoad(running=rng.randrange(32)))
              for i in range(decodes)]
    held: dict[str, set[int]] = {n.node_id: set() for n in nodes}
    chains = [hash_blocks(c, BS, (MODEL,)) for c in convs]
    for chain in chains:
        for n in rng.sample(nodes[:prefills], rng.randrange(1, 5)):
            held[n.node_id].update(chain[: rng.randrange(len(chain) // 2, len(chain))])
    state = {}
    for n in nodes:
        await writer.apply(n.node_id, n.epoch, IndexDelta.full(held[n.node_id]), seq=1)
        state[n.node_id] = [n.epoch, 1, held[n.node_id]]
    return nodes, writer, state, chains


async def churn(writer, state, chains, seconds: float, rng: random.Random) -> int:
    """Nodes store deeper turns and evict tails, one delta per node in turn; updates sent."""
    from splitserve.common.kv_index import IndexDelta

    sent, stop = 0, time.perf_counter() + seconds
    ids = [k for k in state if k.startswith("p")]
    while time.perf_counter() < stop:
        nid = rng.choice(ids)
        epoch, seq, held = state[nid]
        chain = rng.choice(chains)
        depth = rng.randrange(len(chain))
        stored = set(chain[:depth]) - held
        removed = set(rng.sample(sorted(held), min(len(held), 200))) if len(held) > 2000 else set()
        removed -= stored
        held.difference_update(removed)
        held.update(stored)
        state[nid][1] = seq + 1
        assert await writer.apply(nid, epoch, IndexDelta(stored=stored, removed=removed), seq + 1)
        sent += 1
        await asyncio.sleep(0.005)
    return sent


def mirror(redis_url: str, **kw):
    from splitserve.common.kv_index import KVIndex
    from splitserve.router.metrics import RouterMetrics
    from splitserve.router.routing.mirror_follower import MirrorFollower
    from splitserve.router.routing.prefix_mirror import PrefixMirror

    px = MirrorFollower(PrefixMirror(RouterMetrics.create(MODEL), MODEL, BS),
                        KVIndex(redis_url, timeout_s=10.0), **kw)
    px.start()
    return px


async def caught_up(pxs, state, timeout_s: float = 120.0) -> float:
    t0 = time.perf_counter()
    while True:
        if all(all(px.mirror._nodes.get((nid, e)) is not None and px.mirror._nodes[(nid, e)].seq == s
                   for nid, (e, s, _) in state.items()) for px in pxs):
            return time.perf_counter() - t0
        assert time.perf_counter() - t0 < timeout_s, "mirrors did not catch up"
        await asyncio.sleep(0.05)


def decide(px, policy, prompts, nodes, seconds: float) -> dict:
    """The router's work per routed request, in this process on one core, as
    ``Dispatcher.open`` does it, from the `Prompt` that request preparation validated
    (its list read once into a u32 array: that read is timed in ``parse``): the block
    hashes (``Prompt.ref``: the prompt's keys, its hashes over the array), the mirror lookup over them,
    ``cache_aware`` over every node ("decision"), then the msgpack `GenerateRequest`
    with the prompt's bytes and the carried hashes (what the dispatcher sends the decode
    node): "routed". Parsing and validating the client's body is timed apart (``parse``)."""
    import msgspec

    from splitserve.common.protocol import GenerateRequest
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.router.prompt import Prompt

    params = SamplingParams(max_tokens=16)
    prepared = [Prompt.of(p, VOCAB) for p in prompts]
    lat, routed, cpu, cpu_routed, hit_tokens, done = [], [], [], [], 0, 0
    parts: dict[str, list[float]] = {"hash": [], "lookup": [], "score": [], "encode": []}  # part -> seconds
    stop = time.perf_counter() + seconds
    start = time.perf_counter()
    while time.perf_counter() < stop:
        prompt = prepared[done % len(prepared)]
        c0 = time.thread_time()
        t0 = time.perf_counter()
        ref = prompt.ref(px.model_id, px.block_size)
        hashes = ref.block_hashes()
        t1 = time.perf_counter()
        found = px.lookup(prompt.array, nodes, hashes)
        t2 = time.perf_counter()
        d = policy.choose(prompt.ids, nodes, cached=found.cached,
                          tie_key=int(hashes[-1]) if len(hashes) else None)
        t3 = time.perf_counter()
        c3 = time.thread_time()
        wire = msgspec.msgpack.encode(GenerateRequest(
            request_id="r", prompt=ref.wire(prompt.wire()), sampling_params=params,
            prefill_addr=d.prefill.http_addr, transfer_id="t"))
        t4 = time.perf_counter()
        cpu_routed.append(time.thread_time() - c0)
        cpu.append(c3 - c0)
        lat.append(t3 - t0)
        routed.append(t4 - t0)
        for k, v in (("hash", t1 - t0), ("lookup", t2 - t1), ("score", t3 - t2), ("encode", t4 - t3)):
            parts[k].append(v)
        hit_tokens += found.cached.get(d.prefill.node_id, 0)
        done += 1
        del wire
    wall = time.perf_counter() - start
    ms = lambda xs, q: round(sorted(xs)[min(len(xs) - 1, int(len(xs) * q))] * 1000, 3)
    return {"decisions": done,
            "decision_per_s": round(done / sum(lat), 1), "decision_p50_ms": ms(lat, 0.5),
            "decision_p99_ms": ms(lat, 0.99), "decision_mean_ms": round(statistics.fmean(lat) * 1000, 3),
            "routed_per_s": round(done / sum(routed), 1), "routed_p50_ms": ms(routed, 0.5),
            "routed_p99_ms": ms(routed, 0.99), "loop_per_s": round(done / wall, 1),
            "parts_p50_ms": {k: ms(v, 0.5) for k, v in parts.items()},
            # CPU time of this thread: what the work costs the core, without the time other
            # processes of the shared machine took the core away (the wall figures above)
            "decision_per_cpu_s": round(done / sum(cpu), 1), "decision_cpu_p50_ms": ms(cpu, 0.5),
            "decision_cpu_p99_ms": ms(cpu, 0.99),
            # the fastest tenth: what a decision costs when nothing else ran on the core
            "decision_cpu_p10_ms": ms(cpu, 0.1),
            "routed_per_cpu_s": round(done / sum(cpu_routed), 1), "routed_cpu_p50_ms": ms(cpu_routed, 0.5),
            "routed_cpu_p99_ms": ms(cpu_routed, 0.99),
            "mean_predicted_cached_tokens_of_choice": round(hit_tokens / max(1, done))}


def parse_cost(prompt: list[int], runs: int = 20) -> dict:
    """What preparing a completion request carrying ``prompt`` as token ids costs the
    router (``prepare.prepare_completion`` with the bundled model's tokenizer: JSON,
    shape check, typed convert, the ids validated and read into the `Prompt`'s array),
    and each part's p50."""
    import msgspec

    from splitserve.engine.models.convert import bundled_model_dir
    from splitserve.router.openai.structs import CompletionRequest
    from splitserve.router.openai.prepare import decode_body, prepare_completion
    from splitserve.router.prompt import Prompt
    from splitserve.router.tokenizer import RouterTokenizer

    tok = RouterTokenizer(bundled_model_dir(), max_model_len=len(prompt) + 64, allow_long=True)
    assert tok.vocab_size >= VOCAB, tok.vocab_size
    body = msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 16})
    times: dict[str, list[float]] = {"prepare": [], "decode_body": [], "validate_and_read": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        prep = prepare_completion(body, tok, (MODEL,))
        t1 = time.perf_counter()
        req = decode_body(body, CompletionRequest)
        t2 = time.perf_counter()
        Prompt.of(req.prompt, tok.vocab_size)
        t3 = time.perf_counter()
        for k, v in (("prepare", t1 - t0), ("decode_body", t2 - t1), ("validate_and_read", t3 - t2)):
            times[k].append(v)
    assert prep.prompts[0].ids == prompt
    p50 = {k: round(sorted(v)[len(v) // 2] * 1000, 3) for k, v in times.items()}
    return {"parse_body_p50_ms": p50["prepare"], "parse_parts_p50_ms": p50, "body_bytes": len(body)}


async def agreement(a, b, url: str, prompts, nodes, rng: random.Random, requests: int = 400,
                    share: bool = True, rate: float = 200.0) -> dict:
    """Two routers (prefix mirrors ``a`` and ``b``, each with its own cache_aware) take
    alternate requests of a steady stream at ``rate``/s; for each request the other
    router's choice at the same moment (on a copy of its policy's history, so that stays
    its own) is compared with the serving router's. ``share``: the routers share their
    recent work per node over Redis (router/routing/shared_work.py, as ``splitserve router``
    does); without it each one's balance term sees only its own half of the traffic."""
    from splitserve.common.kv_index import KVIndex
    from splitserve.router.routing.cache_aware import CacheAware
    from splitserve.router.prompt import Prompt
    from splitserve.router.routing.shared_work import SharedWork

    pols = {id(a): CacheAware(), id(b): CacheAware()}
    shared = [SharedWork(KVIndex(url), p.recent) for p in pols.values()] if share else []
    for s in shared:
        s.start()
    await asyncio.sleep(0.3)  # subscribed
    same = 0
    for i in range(requests):
        prompt = rng.choice(prompts)
        serve, other = (a, b) if i % 2 == 0 else (b, a)
        key = int(Prompt.of(prompt, VOCAB).ref(serve.model_id, serve.block_size).block_hashes()[-1])  # as dispatch
        now = time.monotonic()  # both choose at this moment (the clock moves on while the first one works)
        d = pols[id(serve)].choose(prompt, nodes, cached=serve.lookup(prompt, nodes).cached, tie_key=key,
                                   now=now)
        peek = CacheAware()  # the other router's policy with its history, choosing without recording
        peek.recent = pols[id(other)].recent.copy()
        o = peek.choose(prompt, nodes, cached=other.lookup(prompt, nodes).cached, tie_key=key, now=now)
        assert d is not None and o is not None, "the fleet has decode nodes"
        assert d.prefill is not None and o.prefill is not None, "local_prefill_tokens 0: a prefill node prefills"
        same += (d.prefill.node_id, d.decode.node_id) == (o.prefill.node_id, o.decode.node_id)
        await asyncio.sleep(1 / rate)
    for s in shared:
        await s.stop()
        await s.index.close()
    return {"requests": requests, "rate_per_s": rate, "shared_recent_work": share,
            "same_decision": same, "share": round(same / requests, 4)}


def mirror_bytes(state) -> tuple[int, int, int]:
    """(bytes, (block, node) entries, distinct blocks) of a mirror filled from the
    nodes' snapshots decoded from msgpack, as the router receives them."""
    import msgspec

    from splitserve.common.kv_events import IndexUpdate
    from splitserve.router.metrics import RouterMetrics
    from splitserve.router.routing.prefix_mirror import PrefixMirror

    # The mirror's metrics, made before the count starts: no part of its bytes.
    metrics = RouterMetrics.create(MODEL)
    payloads = [msgspec.msgpack.encode(IndexUpdate(nid, e, s, True, sorted(h))) for nid, (e, s, h) in state.items()]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    px = PrefixMirror(metrics, MODEL, BS)  # no follower: filled directly
    for p in payloads:
        u = msgspec.msgpack.decode(p, type=IndexUpdate)
        px.replace((u.node_id, u.epoch), u.seq, set(u.stored))
        del u
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used, sum(px.nodes_mirrored().values()), len(px._holders)


async def run_one(prefills: int, args) -> dict:
    from splitserve.deploy.launcher import start_redis
    from splitserve.router.routing.cache_aware import CacheAware

    rng = random.Random(prefills)
    proc, url = start_redis()
    try:
        convs = conversations(args.conversations, rng)
        a, b = mirror(url), mirror(url)
        nodes, writer, state, chains = await build(url, prefills, prefills // 4, convs, rng)
        await caught_up([a, b], state)
        late = mirror(url)
        late_s = await caught_up([late], state)
        prompts = [c + [rng.randrange(100, VOCAB) for _ in range(200)] for c in rng.sample(convs, min(16, len(convs)))]
        prompts += [c[:SYSTEM_TOKENS] + [rng.randrange(100, VOCAB) for _ in range(98_000)] for c in convs[:4]]
        agree = sum(a.mirror.lookup(p, nodes) == b.mirror.lookup(p, nodes) == late.mirror.lookup(p, nodes)
                    for p in prompts)
        await late.stop()
        agree_decisions = await agreement(a.mirror, b.mirror, url, prompts, nodes, rng)
        agree_unshared = await agreement(a.mirror, b.mirror, url, prompts, nodes, rng, share=False)
        os.sched_setaffinity(0, {0})
        decision = decide(a.mirror, CacheAware(), prompts, nodes, args.seconds)
        decision.update(parse_cost(prompts[0]))
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        nbytes, entries, distinct = mirror_bytes(state)
        # 1% of updates lost on one mirror while the nodes churn
        lossy = mirror(url, event_loss=0.01, check_interval_s=1.0)
        await caught_up([lossy], state)
        samples = []

        async def sample():
            while True:
                await asyncio.sleep(0.2)
                p = rng.choice(prompts)
                samples.append((sum(a.mirror.lookup(p, nodes).cached.values()),
                                sum(lossy.mirror.lookup(p, nodes).cached.values())))

        sampler = asyncio.create_task(sample())
        sent = await churn(writer, state, chains, args.churn_seconds, rng)
        sampler.cancel()
        await asyncio.sleep(2.5)  # two catch-up checks
        after = sum(a.mirror.lookup(p, nodes) == lossy.mirror.lookup(p, nodes) for p in prompts)
        lossless_tokens = sum(s[0] for s in samples)
        lossy_tokens = sum(s[1] for s in samples)
        result = {
            "prefill_nodes": prefills, "decode_nodes": prefills // 4, "prompt_tokens": len(prompts[0]),
            "conversations": len(convs), **decision,
            "late_router_catch_up_s": round(late_s, 2),
            "routers_agree": f"{agree}/{len(prompts)}",
            "routers_same_decision": agree_decisions,
            "routers_same_decision_without_sharing_recent_work": agree_unshared,
            "mirror_entries": entries, "mirror_distinct_blocks": distinct,
            "mirror_bytes_per_million_entries": round(nbytes / entries * 1e6),
            "event_loss": {"updates_sent": sent, "updates_lost": lossy.dropped,
                           "resyncs": lossy.resyncs,
                           "predicted_cached_tokens_ratio_during_churn": round(lossy_tokens / max(1, lossless_tokens), 4),
                           "samples": len(samples),
                           "agree_after_catch_up": f"{after}/{len(prompts)}"},
        }
        for px in (a, b, lossy):
            await px.stop()
            await px.index.close()
        await writer.close()
        return result
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="+", default=[64, 256], help="prefill node counts")
    ap.add_argument("--seconds", type=float, default=5.0, help="of decisions per node count")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--churn-seconds", type=float, default=10.0)
    args = ap.parse_args()
    rows = []
    for n in args.nodes:
        print(f"[router-cost] {n} prefill + {n // 4} decode nodes ...", file=sys.stderr, flush=True)
        row = asyncio.run(run_one(n, args))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"rows": rows, "targets": {"p99_ms_max": 2.0, "decisions_per_s_min": 1000},
              "load_average": os.getloadavg(),
              "block_size": BS, "args": vars(args)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "router_cost.json").write_text(json.dumps(result, indent=1))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (x, y) = plt.subplots(1, 2, figsize=(10, 3.5))
    xs = [f"{r['prefill_nodes']}+{r['decode_nodes']}" for r in rows]
    import numpy as np
    pos = np.arange(len(xs))
    x.bar(pos - 0.2, [r["decision_per_s"] for r in rows], 0.4, label="decision")
    x.bar(pos + 0.2, [r["routed_per_s"] for r in rows], 0.4, label="decision + wire request")
    x.set_xticks(pos, xs)
    x.axhline(1000, ls="--", color="r", lw=1)
    x.set_title("per second on one core (100k-token prompts)")
    x.set_xlabel("prefill + decode nodes")
    x.legend(fontsize=8)
    y.bar(xs, [r["decision_p99_ms"] for r in rows], label="p99")
    y.bar(xs, [r["decision_p50_ms"] for r in rows], label="p50")
    y.axhline(2.0, ls="--", color="r", lw=1)
    y.set_title("decision latency, ms")
    y.set_xlabel("prefill + decode nodes")
    y.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "router_cost.png", dpi=110)
    print(f"wrote {RESULTS / 'router_cost.json'} and router_cost.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
