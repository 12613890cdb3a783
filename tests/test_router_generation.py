"""A generation and its legs, on the real Dispatcher with scripted decode nodes (no
network): a decode node that breaks the stream is left for another through
`Generation.new_leg`, the generation's leg history records every leg in order, and
the dispatcher's books (in-flight counts per node, the decision log, aborts,
the migrations counter) close exactly once per leg."""

from collections import Counter

import pytest

from splitserve.common.kv_index import KVIndex
from splitserve.common.load import NodeLoad
from splitserve.common.outcomes import PredictionOutcome
from splitserve.common.protocol import GenerateRequest, TokenDelta
from splitserve.common.node_registry import NodeInfo, NodeRegistry
from splitserve.common.sampling_params import SamplingParams
from splitserve.router.streams.background import BackgroundTasks
from splitserve.router.routing.decisions import DecisionLog
from splitserve.router.routing.discovery import NodeDirectory
from splitserve.router.streams.dispatch import Dispatcher
from splitserve.router.errors import ApiError
from splitserve.router.routing.load_policies import LeastLoad
from splitserve.router.metrics import RouterMetrics
from splitserve.router.streams.node_client import NodeUnavailable
from splitserve.router.routing.mirror_follower import MirrorFollower
from splitserve.router.routing.prefix_mirror import PrefixMirror
from splitserve.router.prompt import Prompt
from splitserve.router.tokenizer import RouterTokenizer

pytestmark = pytest.mark.anyio

NOWHERE = "redis://127.0.0.1:1/0"  # never connected: these tests route from a fixed node list
MODEL = "m"


def node(node_id: str, role: str = "decode", running: int = 0) -> NodeInfo:
    return NodeInfo(node_id=node_id, role=role, http_addr=f"http://{node_id}:1", model=MODEL,
                    epoch="e", load=NodeLoad(running=running))


class ScriptedStream:
    """A decode node's token stream: ``frames`` deltas, then, unless the last one
    finishes, the stream breaks (NodeUnavailable)."""

    def __init__(self, request_id: str, frames: list[TokenDelta]):
        self.request_id, self.frames, self.closed = request_id, frames, False

    async def deltas(self):
        for f in self.frames:
            yield f
        if not self.frames or self.frames[-1].finish_reason is None:
            raise NodeUnavailable(f"decode node of {self.request_id} closed the token stream")

    def close(self) -> None:
        self.closed = True


class ScriptedNodes:
    """The NodeClient: the n-th request sent gets the n-th script, a list of
    (token ids, finish_reason, num_cached_tokens) frames; every request and abort is kept."""

    def __init__(self, scripts: list[list[tuple[list[int], str | None, int]]]):
        self.scripts = list(scripts)
        self.sent: list[tuple[str, GenerateRequest]] = []  # (decode node addr, request)
        self.streams: list[ScriptedStream] = []
        self.aborts: list[tuple[str, str]] = []  # (addr, request_id)

    async def generate(self, addr: str, req: GenerateRequest) -> ScriptedStream:
        self.sent.append((addr, req))
        frames = [TokenDelta(request_id=req.request_id, token_ids=ids, finish_reason=finish,
                             num_cached_tokens=cached) for ids, finish, cached in self.scripts.pop(0)]
        self.streams.append(ScriptedStream(req.request_id, frames))
        return self.streams[-1]

    async def abort(self, addr: str, request_id: str) -> bool:
        self.aborts.append((addr, request_id))
        return True


@pytest.fixture(scope="module")
def tok(bundled_dir):
    return RouterTokenizer(bundled_dir)


@pytest.fixture
def make_dispatcher(tok):
    def make(scripts, migration_limit: int, nodes: list[NodeInfo]) -> tuple[Dispatcher, ScriptedNodes]:
        metrics = RouterMetrics.create(MODEL)
        directory = NodeDirectory(NodeRegistry(NOWHERE), MODEL, metrics, nodes=nodes)
        client = ScriptedNodes(scripts)
        d = Dispatcher(directory, LeastLoad(), client, tok, metrics, BackgroundTasks(),
                       PrefixMirror(metrics, MODEL, 16), DecisionLog(metrics),
                       migration_limit=migration_limit)
        return d, client
    return make


# d0 idle, d1 busier, d2 busiest: least_load picks d0 first, and only the exclusion of
# the nodes that failed this generation moves it on to d1, then d2.
FLEET = [node("p0", "prefill"), node("d0"), node("d1", running=1), node("d2", running=2)]


def prompt_of(tok, text: str) -> Prompt:
    return Prompt.of(tok.encode(text), tok.vocab_size)


async def run(gen) -> str:
    text = ""
    try:
        async for piece in gen.pieces():
            text += piece.text
    finally:
        gen.close()
    return text


def counter_value(metrics: RouterMetrics, name: str) -> float:
    return getattr(metrics, name)._value.get()


async def test_two_migrations_leave_a_leg_history_and_clean_books(make_dispatcher, tok):
    ids = tok.encode(" one two three four five six")
    assert len(ids) >= 6
    out = ids[:6]
    scripts = [[(out[0:1], None, 16), (out[1:2], None, 16)],  # d0 breaks after 2 tokens
               [(out[2:4], None, 32)],  # d1 breaks after 2 more
               [(out[4:5], None, 48), (out[5:6], "length", 48)]]  # d2 finishes
    d, nodes = make_dispatcher(scripts, migration_limit=2, nodes=FLEET)
    prompt = prompt_of(tok, "Count:")
    gen = await d.start(0, "r", prompt, SamplingParams(max_tokens=6), t_start=0.0)
    assert d.inflight == Counter({"p0": 1, "d0": 1})

    text = await run(gen)
    await d.background.drain(1.0)

    assert text == tok.decode(out) and gen.finish_reason == "length"
    assert gen.output_ids == out and gen.completion_tokens == 6
    # the history: every leg, in order; the broken ones recorded, the last one current
    assert [leg.request_id for leg in gen.legs] == ["r", "r~m1", "r~m2"]
    assert [leg.decision.decode.node_id for leg in gen.legs] == ["d0", "d1", "d2"]
    assert [leg.broken for leg in gen.legs] == [True, True, False]
    assert gen.leg is gen.legs[-1] and gen.migrations == 2
    assert gen.failed_nodes == {"d0", "d1"}
    assert all(leg.ended for leg in gen.legs) and all(s.closed for s in nodes.streams)
    assert gen.cached_tokens == 16  # usage: the first leg's, the client's prompt
    # each continuation: the prompt + every token received, max_tokens less them
    sent = [(addr, req.request_id, len(req.prompt.token_ids) // 4, req.sampling_params.max_tokens)
            for addr, req in nodes.sent]
    assert sent == [("http://d0:1", "r", len(prompt), 6),
                    ("http://d1:1", "r~m1", len(prompt) + 2, 4),
                    ("http://d2:1", "r~m2", len(prompt) + 4, 2)]
    # the books: aborts for the two broken legs only (d2 finished the request itself),
    # nothing left in flight, each decision settled once, the migrations counted
    assert nodes.aborts == [("http://d0:1", "r"), ("http://d1:1", "r~m1")]
    assert d.inflight == {} and d.inflight_tokens == {}
    outcomes = [rec.outcome for rec in d.decisions.records]
    assert outcomes == [PredictionOutcome.FAILED, PredictionOutcome.FAILED, None]
    assert d.decisions.records[2].delivered_cached_tokens == 48
    assert counter_value(d.metrics, "migrations") == 2
    assert d.metrics.inflight._value.get() == 0


async def test_past_the_limit_the_generation_fails_and_keeps_its_legs(make_dispatcher, tok):
    out = tok.encode(" a b c d")
    d, nodes = make_dispatcher([[(out[0:1], None, 0)], [(out[1:2], None, 0)]], migration_limit=1,
                               nodes=FLEET)
    gen = await d.start(0, "r", prompt_of(tok, "Go:"), SamplingParams(max_tokens=4), t_start=0.0)
    with pytest.raises(ApiError) as e:
        await run(gen)
    await d.background.drain(1.0)
    assert e.value.status == 502
    assert [leg.decision.decode.node_id for leg in gen.legs] == ["d0", "d1"]
    assert [leg.broken for leg in gen.legs] == [True, False]  # the last was not left for another
    assert gen.failed_nodes == {"d0"} and gen.migrations == 1
    assert nodes.aborts == [("http://d0:1", "r"), ("http://d1:1", "r~m1")]
    assert d.inflight == {} and d.inflight_tokens == {}
    assert [rec.outcome for rec in d.decisions.records] == [PredictionOutcome.FAILED] * 2
    assert counter_value(d.metrics, "migrations") == 1


async def test_no_node_for_the_new_leg_fails_with_the_broken_leg_ended(make_dispatcher, tok):
    out = tok.encode(" a b")
    d, nodes = make_dispatcher([[(out[0:1], None, 0)]], migration_limit=3,
                               nodes=[node("d0"), node("p0", "prefill")])
    gen = await d.start(0, "r", prompt_of(tok, "Go:"), SamplingParams(max_tokens=4), t_start=0.0)
    with pytest.raises(ApiError):
        await run(gen)
    await d.background.drain(1.0)
    assert len(gen.legs) == 1 and gen.legs[0].broken and gen.legs[0].ended
    assert gen.failed_nodes == {"d0"} and gen.migrations == 0
    assert nodes.aborts == [("http://d0:1", "r")]  # once, though close() ended it again
    assert d.inflight == {} and d.inflight_tokens == {}
    assert counter_value(d.metrics, "migrations") == 0


async def test_migration_off_a_broken_stream_fails_on_its_one_leg(make_dispatcher, tok):
    out = tok.encode(" a b")
    d, nodes = make_dispatcher([[(out[0:1], None, 0)]], migration_limit=0, nodes=FLEET)
    gen = await d.start(0, "r", prompt_of(tok, "Go:"), SamplingParams(max_tokens=4), t_start=0.0)
    with pytest.raises(ApiError):
        await run(gen)
    await d.background.drain(1.0)
    assert len(gen.legs) == 1 and not gen.legs[0].broken and gen.legs[0].ended
    assert len(nodes.sent) == 1 and nodes.aborts == [("http://d0:1", "r")]
    assert d.inflight == {} and d.inflight_tokens == {}


async def test_first_token_releases_the_prefill_slot_and_close_the_rest(make_dispatcher, tok):
    """The dispatcher's in-flight counts follow what the generation saw: the prefill
    node's slot until the first token, the decode node's until the end."""
    out = tok.encode(" a b")
    d, _ = make_dispatcher([[(out[0:1], None, 0), (out[1:2], "length", 0)]], migration_limit=0,
                           nodes=FLEET)
    gen = await d.start(0, "r", prompt_of(tok, "Go:"), SamplingParams(max_tokens=2), t_start=0.0)
    pieces = gen.pieces()
    await pieces.__anext__()
    assert d.inflight == Counter({"d0": 1}) and d.inflight_tokens == {}
    async for _ in pieces:
        pass
    assert d.inflight == Counter({"d0": 1})
    gen.close()
    gen.close()  # idempotent
    assert d.inflight == {} and d.metrics.inflight._value.get() == 0


async def test_a_pull_counts_on_its_holder_until_the_first_token(tok, redis_url):
    """Cache-aware routing over a real prefix index (Redis): a prompt only d1 holds is pulled
    from d1 (busy, so not routed there), and the pull counts on d1 in ``Dispatcher.pulls``
    until the generation's first token, then no more; the next decision prices it."""
    import asyncio
    import time as clock

    from splitserve.common.hashing import hash_blocks
    from splitserve.common.prompt_ref import PromptKeys
    from splitserve.common.kv_index import IndexDelta
    from splitserve.router.routing.cache_aware import CacheAware

    ids = [(37 * j + 11) % 30000 + 200 for j in range(1000)]
    holder = NodeInfo(node_id="d1", role="decode", http_addr="http://d1:1", model=MODEL, epoch="e1",
                      load=NodeLoad(running=40, kv_usage=0.9))
    nodes = [node("p0", "prefill"), node("d0"), holder]
    writer = KVIndex(redis_url)
    metrics = RouterMetrics.create(MODEL)
    mirror = PrefixMirror(metrics, MODEL, 16)
    follower = MirrorFollower(mirror, KVIndex(redis_url, timeout_s=0.5), check_interval_s=0.2, retry_s=0.2)
    follower.start()
    try:
        await writer.apply("d1", "e1", IndexDelta.full(hash_blocks(ids, 16, PromptKeys(model=MODEL).hash_keys())[:60]), seq=1)
        deadline = clock.monotonic() + 10
        while not (mirror.connected and mirror.nodes_mirrored()):
            assert clock.monotonic() < deadline, "the mirror never caught up"
            await asyncio.sleep(0.02)
        out = tok.encode(" a b")
        client = ScriptedNodes([[(out[0:1], None, 960), (out[1:2], "length", 960)]] * 2)
        d = Dispatcher(NodeDirectory(NodeRegistry(NOWHERE), MODEL, metrics, nodes=nodes), CacheAware(), client, tok,
                       metrics, BackgroundTasks(), mirror, DecisionLog(metrics))
        prompt = Prompt.of(ids, tok.vocab_size)
        first = await d.start(0, "r0", prompt, SamplingParams(max_tokens=2), t_start=0.0)
        assert first.leg.decision.pull is not None and first.leg.decision.pull.share == 1
        assert client.sent[0][1].pull.node_id == "d1" and d.pulls == Counter({"d1": 1})
        second = await d.start(1, "r1", prompt, SamplingParams(max_tokens=2), t_start=0.0)
        assert second.leg.decision.pull.share == 2  # the first pull still in flight shares d1 with it
        pieces = first.pieces()
        await pieces.__anext__()  # r0's first token: its pull is over
        assert d.pulls == Counter({"d1": 1})
        first.close()
        second.close()
        assert d.pulls == {}
    finally:
        await follower.stop()
        await follower.index.close()
        await writer.close()
