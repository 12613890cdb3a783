"""Conversations in the replay (benchmarks/loadgen/replay/conversation.py): the generator
marks them, a later turn's prompt is the turn before it + the ids the node generated + the
new tokens, the pooled bound counts generated blocks, and end to end the decode node that
served turn 1 reports turn 2's prompt cached through turn 1's answer."""

import dataclasses

import msgspec
import pytest

from splitserve.benchmarks.loadgen.replay import run
from splitserve.benchmarks.loadgen.replay.conversation import Conversations
from splitserve.benchmarks.loadgen.replay.generate import PRESETS, TraceSpec, generate
from splitserve.common.sim_tokens import sim_answer
from splitserve.common.trace import TraceRequest, dump_trace, load_trace, prompt_tokens

BS = 16


def two_turns(conversation: int, at: float, first: int, ids: list[int], answer: int, new: int) -> list[TraceRequest]:
    """One conversation of two turns: ``first`` prompt tokens, an ``answer``, ``new`` more."""
    return [TraceRequest(at, first, answer, ids, conversation=conversation),
            TraceRequest(at + 1000, first + answer + new, answer, ids, conversation=conversation, think_ms=200)]


def test_generator_marks_conversations_only_when_closed_loop(tmp_path):
    spec = TraceSpec(tenants=2, users_per_tenant=2, rate=0.2, duration_s=60, mean_turns=3, seed=3)
    plain, closed = generate(spec), generate(dataclasses.replace(spec, closed_loop=True))
    # the same lines; only the marks differ
    assert [msgspec.structs.replace(r, conversation=None, think_ms=0.0) for r in closed] == plain
    assert all(r.conversation is None and r.think_ms == 0 for r in plain)
    dump_trace(plain, tmp_path / "plain.jsonl")  # a trace without conversations is written as before
    assert "conversation" not in (tmp_path / "plain.jsonl").read_text()
    dump_trace(closed, tmp_path / "closed.jsonl")
    assert load_trace(tmp_path / "closed.jsonl") == closed
    chain = Conversations(closed, BS, "m")
    assert chain.count == len({r.conversation for r in closed}) and chain.previous
    for later, before in chain.previous.items():  # a later turn: the same conversation, after a think time
        assert closed[later].conversation == closed[before].conversation and closed[later].think_ms > 0
    assert PRESETS["chat"].closed_loop


def test_a_later_turn_holds_the_turn_before_and_its_generated_tokens():
    trace = two_turns(0, 0.0, 700, [1, 2], 24, 100)
    chain = Conversations(trace, BS, "m")
    assert chain.previous == {1: 0} and chain.next_turn == {0: 1}
    first = chain.prompt(0)
    assert first == prompt_tokens(trace[0])
    answer = sim_answer(len(first), 24)
    chain.answered(0, first, 24, chain._text(answer))
    second = chain.prompt(1)
    assert second[:724] == first + answer
    assert second[724:] == prompt_tokens(trace[1])[724:] and len(second) == 824
    assert chain.not_reproduced == 0
    # the pooled bound: turn 2 finds turn 1's prompt and answer (all but its last token), whole blocks
    assert chain.pooled_hits == [0, (724 - 1) // BS * BS] and chain.prompt_lengths == [700, 824]
    assert chain.pooled_hit_rate() == pytest.approx(chain.pooled_hits[1] / (700 + 824))


def test_an_answer_whose_text_differs_is_counted_and_a_short_turn_refused():
    trace = two_turns(0, 0.0, 700, [1, 2], 8, 10)
    chain = Conversations(trace, BS, "m")
    chain.answered(0, chain.prompt(0), 8, "not what the node said")
    assert chain.not_reproduced == 1
    bad = [trace[0], msgspec.structs.replace(trace[1], input_length=708)]
    with pytest.raises(ValueError, match="conversation 0"):
        Conversations(bad, BS, "m")
    assert Conversations.of([TraceRequest(0, 10, 1, [1])], BS, "m") is None


def test_decode_node_reuses_the_turn_it_served_end_to_end(tmp_path, monkeypatch):
    trace = two_turns(0, 0.0, 700, [1, 2], 24, 100) + two_turns(1, 100.0, 600, [3, 4], 24, 50)
    path = tmp_path / "t.jsonl"
    dump_trace(trace, path)
    sent: list[tuple[list[int], run.Outcome]] = []
    real_send = run.send

    async def recording_send(session, url, model, prompt, max_tokens):
        o = await real_send(session, url, model, prompt, max_tokens)
        sent.append((prompt, o))
        return o

    monkeypatch.setattr(run, "send", recording_send)
    r = run.run_replay(run.ReplayConfig(trace=str(path), prefill_nodes=1, decode_nodes=2, speedup=5,
                                        max_output_tokens=24, fleet_procs=1, profile="llama3-8b-h100",
                                        score_weights=(("local_prefill_tokens", 512.0),)))
    assert r["failed"] == 0 and r["requests"] == 4, r["errors"]
    assert r["conversations"] == {"conversations": 2, "later_turns": 2, "answers_not_reproduced": 0}
    by_prompt = {len(p): (p, o) for p, o in sent}
    for first_len, new in ((700, 100), (600, 50)):
        first, o1 = by_prompt[first_len]
        second, o2 = by_prompt[first_len + 24 + new]
        assert o1.output_tokens == 24
        assert second[:first_len + 24] == first + sim_answer(first_len, 24)  # the ids the node generated
        # the decode node that generated them holds them: cached through the answer's whole blocks
        assert o2.cached_tokens >= (first_len + 24 - 1) // BS * BS > (first_len - 1) // BS * BS
    assert r["prompt_tokens_by_source"]["decode_node_hits"] > 0
    assert r["hit_rate"] <= r["oracle_hit_rate"]
