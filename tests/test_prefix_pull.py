"""Reuse of a prefix wherever the fleet holds it, on real processes (redis-server, the
router, prefill and decode nodes over tcp, a tiny random Llama): a conversation's next turn
is prefilled by the decode node that generated the previous answer (decode-side reuse), or
a prefill node pulls that prefix from it (prefix pull, node/kv_pull.py); tokens equal
transformers' greedy ones either way, /debug/decisions says which, and nothing leaks. The
faults: a holder killed mid-pull, a pulled block failing its checksum (the puller computes
the prompt itself, 0 failed)."""

import json
import os
import signal
import threading
import time
import urllib.request

import openai
import pytest
import torch

from splitserve.common import metric_names as names
from splitserve.deploy.launcher import Cluster
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.tests.metrics_text import node_metric

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
TURN1, ANSWER, TURN2 = 160, 240, 100  # tokens: the first prompt, its answer, the next user message


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def model(served_tiny_model):
    from transformers import AutoModelForCausalLM
    path = served_tiny_model("llama", max_position_embeddings=2048)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), RouterTokenizer(path)


def greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly ``n`` tokens (EOS ignored, as the requests ask)."""
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def turns(hf) -> tuple[list[int], list[int], list[int]]:
    """(turn 1's prompt, its greedy answer, turn 2's prompt: the conversation so far + a new message)."""
    first = [(37 * j + 11) % 30000 + 200 for j in range(TURN1)]
    answer = greedy(hf, first, ANSWER)
    return first, answer, first + answer + [(53 * j + 5) % 30000 + 200 for j in range(TURN2)]


def ask(client, path, tok, hf, prompt: list[int], n: int):
    r = client.completions.create(model=str(path), prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [tok.token_text(t) for t in greedy(hf, prompt, n)]
    return r


def first_turn(c: Cluster, model, first: list[int]) -> openai.OpenAI:
    """A client of ``c`` once turn 1 (``first`` and its ANSWER-token answer) was served."""
    path, hf, tok = model
    client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=120)
    ask(client, path, tok, hf, first, ANSWER)
    return client


def last_decision(c: Cluster) -> dict:
    return get_json(f"{c.url}/debug/decisions?limit=1")["decisions"][-1]


def pools_idle(c: Cluster, members, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        states = {m: get_json(f"{c.node(m).addr}/debug/state") for m in members}
        if all(s["kv_blocks_free"] == s["kv_blocks_total"] for s in states.values()):
            return
        assert time.monotonic() < deadline, f"blocks leaked: {states}"
        time.sleep(0.2)


def test_the_next_turn_reuses_the_answer_the_decode_node_generated(model):
    """Default weights: turn 2 (turn 1 + its answer + 100 new tokens) goes to the decode node
    that served turn 1, which holds all but the new message (its answer's blocks included)
    and prefills the rest itself."""
    path, hf, tok = model
    first, answer, second = turns(hf)
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB",
                 model=str(path)) as c:
        client = first_turn(c, model, first)
        assert last_decision(c)["prefill"] == "prefill-0"
        time.sleep(1.0)  # the decode node's events reach the router's index
        r = ask(client, path, tok, hf, second, 8)
        d = last_decision(c)
        held = (TURN1 + ANSWER - 1) // 16 * 16  # the answer's last token has no KV yet
        assert (d["prefill"], d["decode"], d["reuse"]) == (None, "decode-0", "own"), d
        assert d["node_cached_tokens"]["decode-0"] >= held
        assert r.usage.prompt_tokens_details.cached_tokens >= held
        pools_idle(c, ["prefill-0", "decode-0"])


def test_a_prefill_node_pulls_the_conversation_from_the_decode_node(model):
    """Decode-side reuse off: turn 2 goes to the prefill node, which holds turn 1's prompt only;
    it pulls the longer prefix (the answer too) from the decode node and computes the rest."""
    path, hf, tok = model
    first, answer, second = turns(hf)
    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB", model=str(path),
                 router_args=["--score-weights", "local_prefill_tokens=0"]) as c:
        client = first_turn(c, model, first)
        time.sleep(1.0)
        r = ask(client, path, tok, hf, second, 8)
        d = last_decision(c)
        assert (d["prefill"], d["reuse"], d["pull_from"]) == ("prefill-0", "pull", "decode-0"), d
        pulled = node_metric(c, "prefill-0", names.KV_PULL_TOKENS)
        assert pulled >= ANSWER - 16  # the answer's blocks; turn 1's prompt was its own already
        assert node_metric(c, "prefill-0", names.KV_PULLS, outcome="pulled") == 1
        assert node_metric(c, "decode-0", names.KV_PULLS_SERVED, outcome="sent") == 1
        assert r.usage.prompt_tokens_details.cached_tokens >= (TURN1 + ANSWER - 1) // 16 * 16
        # the pulled blocks are the prefill node's own now, and the index says so
        time.sleep(1.0)
        ask(client, path, tok, hf, second, 8)
        d = last_decision(c)
        assert d["node_cached_tokens"]["prefill-0"] >= (TURN1 + ANSWER - 1) // 16 * 16, d
        assert (d["prefill"], d["reuse"]) == ("prefill-0", "own"), d
        pools_idle(c, ["prefill-0", "decode-0"])


class _HolderFault(Cluster):
    """A cluster whose decode node (the holder of turn 2's prefix) runs with ``--fault`` (and
    ``holder_args``)."""

    def __init__(self, fault: str, holder_args=(), **kw):
        super().__init__(**kw)
        self.fault, self.holder_args = fault, tuple(holder_args)

    def node_args(self, role, index, extra=()):
        if role != "decode":
            return super().node_args(role, index, extra)
        return super().node_args(role, index, (*extra, "--fault", self.fault, *self.holder_args))


def test_a_pulled_block_that_fails_its_checksum_is_computed_instead(model):
    path, hf, tok = model
    first, answer, second = turns(hf)
    with _HolderFault("corrupt_block", prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB",
                      model=str(path), router_args=["--score-weights", "local_prefill_tokens=0"]) as c:
        client = first_turn(c, model, first)
        time.sleep(1.0)
        ask(client, path, tok, hf, second, 8)  # the right tokens
        assert last_decision(c)["reuse"] == "pull"
        assert node_metric(c, "prefill-0", names.KV_PULLS, outcome="failed") == 1
        assert node_metric(c, "prefill-0", names.KV_PULL_TOKENS) == 0
        pools_idle(c, ["prefill-0", "decode-0"])


def test_a_stuck_holder_costs_at_most_the_pull_lease(model):
    """The decode node holds every pull back and stays up: the prefill node's pull lands nothing,
    fails when its lease (PULL_LEASE_S) runs out, and the prompt is computed instead."""
    from splitserve.node.kv_pull import PULL_LEASE_S

    path, hf, tok = model
    first, answer, second = turns(hf)
    with _HolderFault("stall_pull", prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB",
                      model=str(path), router_args=["--score-weights", "local_prefill_tokens=0"]) as c:
        client = first_turn(c, model, first)
        time.sleep(1.0)
        t0 = time.monotonic()
        ask(client, path, tok, hf, second, 8)
        took = time.monotonic() - t0
        assert last_decision(c)["reuse"] == "pull"
        assert node_metric(c, "prefill-0", names.KV_PULLS, outcome="failed") == 1
        assert PULL_LEASE_S <= took < PULL_LEASE_S + 10, took
        pools_idle(c, ["prefill-0", "decode-0"])  # the held-back pull pinned nothing


def test_the_holder_killed_mid_pull_costs_a_recompute_not_a_request(model):
    """Turn 2 goes to the idle decode node, its prefill node pulling the conversation from the
    decode node that served turn 1 (busy with another stream now); that holder stalls its pulls
    (``--fault stall_pull``) and is killed meanwhile: the pull fails, the prefill node computes
    the prompt itself and turn 2 gets its tokens."""
    path, hf, tok = model
    first, answer, second = turns(hf)
    with _HolderFault("stall_pull", prefill_nodes=1, decode_nodes=2, kv_backend="tcp", kv_cache_memory="8MiB",
                      model=str(path), router_args=["--score-weights", "local_prefill_tokens=0"]) as c:
        client = first_turn(c, model, first)
        holder = last_decision(c)["decode"]
        other = "decode-1" if holder == "decode-0" else "decode-0"
        time.sleep(1.0)
        # a long stream sharing turn 1's prompt keeps the holder busy (it goes there: it holds the prompt)
        busy = client.completions.create(model=str(path), prompt=first + [7, 8, 9], max_tokens=1500,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(busy))
        assert last_decision(c)["decode"] == holder
        result: dict = {}

        def second_turn():
            try:
                result["r"] = ask(client, path, tok, hf, second, 8)
            except Exception as e:  # noqa: BLE001 - reported below
                result["error"] = e

        t = threading.Thread(target=second_turn)
        t.start()
        deadline = time.monotonic() + 30
        while not _stalling(c, holder):
            assert time.monotonic() < deadline, "the pull never reached the holder"
            time.sleep(0.05)
        d = last_decision(c)
        assert (d["reuse"], d["pull_from"], d["decode"]) == ("pull", holder, other), d
        os.killpg(c.node(holder).popen.pid, signal.SIGKILL)
        t.join(120)
        assert "error" not in result, result
        assert node_metric(c, "prefill-0", names.KV_PULLS, outcome="failed") == 1
        busy.close()
        pools_idle(c, ["prefill-0", other])


def test_a_request_cancelled_while_its_pull_is_in_flight_frees_every_pool(model):
    """Turn 2's pull from the decode node is held back there (``--fault stall_pull``) when the
    client gives up: the router aborts the request, the decode node its prefill call, the
    prefill node its pull (counted aborted) and the holder its side of it; every pool is free
    and the holder serves no pull any more."""
    path, hf, tok = model
    first, answer, second = turns(hf)
    with _HolderFault("stall_pull", prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB",
                      model=str(path), router_args=["--score-weights", "local_prefill_tokens=0"]) as c:
        first_turn(c, model, first)
        time.sleep(1.0)
        impatient = openai.OpenAI(base_url=f"{c.url}/v1", api_key="none", max_retries=0, timeout=3)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=_try(impatient, path, second)))
        t.start()
        deadline = time.monotonic() + 30
        while not _stalling(c, "decode-0"):
            assert time.monotonic() < deadline, "the pull never reached the holder"
            time.sleep(0.05)
        t.join(30)
        assert isinstance(result["r"], openai.APITimeoutError), result
        pools_idle(c, ["prefill-0", "decode-0"])
        assert node_metric(c, "prefill-0", names.KV_PULLS, outcome="aborted") == 1
        _until(lambda: get_json(f"{c.node('decode-0').addr}/debug/state")["pull_budget"]["serving"] == 0)


def test_a_puller_killed_mid_pull_leaves_its_holder_whole(model):
    """The holder sends the first chunk of turn 2's prefix (chunks of at most 4 blocks: its
    --kv-pull-memory), then holds the rest back (``--fault stall_pull_midway``), and the
    puller, the prefill node, is killed meanwhile: the holder lets the pull go (its handler
    cancelled as the puller's connection drops, or its next send failing), serves none and
    holds nothing packed, its pool is free, and the request is prefilled by its decode node
    instead."""
    path, hf, tok = model
    first, answer, second = turns(hf)
    with _HolderFault("stall_pull_midway", holder_args=["--kv-pull-memory", str(4 * 8192)], prefill_nodes=1,
                      decode_nodes=1, kv_backend="tcp", kv_cache_memory="8MiB", model=str(path),
                      router_args=["--score-weights", "local_prefill_tokens=0"]) as c:
        client = first_turn(c, model, first)
        time.sleep(1.0)
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=_try(client, path, second)))
        t.start()
        deadline = time.monotonic() + 30
        while not _stalling(c, "decode-0"):
            assert time.monotonic() < deadline, "the pull never reached the holder"
            time.sleep(0.05)
        assert last_decision(c)["reuse"] == "pull"
        os.killpg(c.node("prefill-0").popen.pid, signal.SIGKILL)
        t.join(120)
        r = result["r"]
        assert not isinstance(r, Exception), r
        assert r.choices[0].logprobs.tokens == [tok.token_text(t) for t in greedy(hf, second, 8)]
        holder = c.node("decode-0").addr
        _until(lambda: get_json(f"{holder}/debug/state")["pull_budget"]["serving"] == 0)
        budget = get_json(f"{holder}/debug/state")["pull_budget"]
        assert budget["packed_bytes"] == 0 and 0 < budget["packed_bytes_peak"] <= 4 * 8192
        # the puller's hang-up cancels it (aborted), or its next send fails first (failed)
        assert sum(node_metric(c, "decode-0", names.KV_PULLS_SERVED, outcome=o) for o in ("aborted", "failed")) == 1
        assert node_metric(c, "decode-0", names.KV_PULLS_SERVED, outcome="sent") == 0
        pools_idle(c, ["decode-0"])


def _try(client, path, prompt: list[int]):
    """The completion of ``prompt`` (8 greedy tokens), or the exception it raised."""
    try:
        return client.completions.create(model=str(path), prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                         extra_body={"ignore_eos": True})
    except Exception as e:  # noqa: BLE001 - the caller checks which
        return e


def _until(pred, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


def _stalling(c: Cluster, member: str) -> bool:
    """Whether ``member`` holds a pull back (its /debug/state's ``pulls_stalled``)."""
    try:
        return get_json(f"{c.node(member).addr}/debug/state").get("pulls_stalled", 0) > 0
    except OSError:
        return False


def test_a_decode_node_pulls_from_either_role_before_prefilling_itself(model):
    """A GenerateRequest without a prefill node naming a pull source (what the router sends when
    a decode node prefills a prompt another node holds more of): the decode node pulls from the
    other decode node, or from the prefill node, then computes the rest."""
    import asyncio

    import aiohttp

    from splitserve.common.protocol import GenerateRequest, PullSource
    from splitserve.common.prompt_ref import WirePrompt
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.router.streams.node_client import NodeClient

    path, hf, tok = model
    first, answer, second = turns(hf)
    with Cluster(prefill_nodes=1, decode_nodes=2, kv_backend="tcp", kv_cache_memory="8MiB", model=str(path),
                 router_args=["--score-weights", "local_prefill_tokens=0"]) as c:
        first_turn(c, model, first)
        holder = last_decision(c)["decode"]
        puller = "decode-1" if holder == "decode-0" else "decode-0"

        async def generate(rid: str, prompt: list[int], source: str, tokens: int) -> list[int]:
            async with aiohttp.ClientSession() as session:
                req = GenerateRequest(request_id=rid, prompt=WirePrompt.of(prompt),
                                      sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                                      pull=PullSource(node_id=source, addr=c.node(source).addr, tokens=tokens))
                stream = await NodeClient(session).generate(c.node(puller).addr, req)
                out: list[int] = []
                async for delta in stream.deltas():
                    out += delta.token_ids
                return out

        held = (TURN1 + ANSWER - 1) // 16 * 16
        assert asyncio.run(generate("from-decode", second, holder, held)) == greedy(hf, second, 8)
        assert node_metric(c, puller, names.KV_PULL_TOKENS) == held
        assert node_metric(c, holder, names.KV_PULLS_SERVED, outcome="sent") == 1
        # the prefill node holds turn 1's prompt: another conversation starting with it pulls that
        other = first + [(61 * j + 3) % 30000 + 200 for j in range(40)]
        assert asyncio.run(generate("from-prefill", other, "prefill-0", (TURN1 - 1) // 16 * 16)) == greedy(hf, other, 8)
        # the puller already had those blocks (pulled with the conversation): nothing moved
        assert node_metric(c, "prefill-0", names.KV_PULLS_SERVED) == 0
        c2 = first[:16] + [(71 * j + 9) % 30000 + 200 for j in range(200)]  # unseen after one block
        assert asyncio.run(generate("from-prefill-2", c2, "prefill-0", 144)) == greedy(hf, c2, 8)
        assert node_metric(c, puller, names.KV_PULLS, outcome="held_none") + \
            node_metric(c, puller, names.KV_PULLS, outcome="pulled") >= 1
        pools_idle(c, ["prefill-0", "decode-0", "decode-1"])


def test_a_tensor_parallel_puller_keeps_no_record_of_its_pulls(model):
    """A decode node of two ranks pulls prefixes from a single-rank one: each pull's transfer,
    closed on every rank when it resolved, leaves no record behind once it ended
    (``closed_transfers_tracked`` in /debug/state), and every pool is free."""
    import asyncio

    import aiohttp

    from splitserve.benchmarks.harness import wait_pools_free
    from splitserve.common.prompt_ref import WirePrompt
    from splitserve.common.protocol import GenerateRequest, PullSource
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.router.streams.node_client import NodeClient

    path, hf, tok = model
    c = Cluster(prefill_nodes=0, decode_nodes=0, kv_backend="tcp", kv_cache_memory="8MiB", model=str(path))
    try:
        c.start_redis()
        procs = [c.start_node("decode", 0), c.start_node("decode", 1, ["--tensor-parallel-size", "2"])]
        for p in procs:
            c.wait_ready(p, 180)
        holder, puller = (c.node(f"decode-{i}").addr for i in (0, 1))

        async def generate(addr: str, rid: str, prompt: list[int], pull: PullSource | None) -> list[int]:
            async with aiohttp.ClientSession() as session:
                req = GenerateRequest(request_id=rid, prompt=WirePrompt.of(prompt), pull=pull,
                                      sampling_params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                stream = await NodeClient(session).generate(addr, req)
                return [t async for d in stream.deltas() for t in d.token_ids]

        for i in range(3):
            prompt = [(41 * j + 7 * i + 3) % 30000 + 200 for j in range(10 * 16 + 5)]
            want = asyncio.run(generate(holder, f"h{i}", prompt, None))
            source = PullSource(node_id="decode-0", addr=holder, tokens=10 * 16)
            assert asyncio.run(generate(puller, f"p{i}", prompt, source)) == want
        assert node_metric(c, "decode-1", names.KV_PULLS, outcome="pulled") == 3
        assert get_json(f"{puller}/debug/state")["closed_transfers_tracked"] == 0
        asyncio.run(wait_pools_free([holder, puller], {}, 10))
    finally:
        c.stop()
