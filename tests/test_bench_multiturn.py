"""benchmarks/serving/bench_multiturn.py's arithmetic: shares of prompt tokens by where they
came from (the router's decisions), turn-2.. TTFT, TPOT and the rounds' spread."""

import pytest

from splitserve.benchmarks.serving.bench_multiturn import summarize


def _turn(turn, ttft, tpot):
    return dict(conversation=0, turn=turn, ttft_s=ttft, tpot_s=tpot, prompt_tokens=100, cached_tokens=0)


def _decision(prefill, prompt, cached):
    return dict(prefill=prefill, decode="decode-0", prompt_tokens=prompt, delivered_cached_tokens=cached)


def test_summary_splits_prompt_tokens_by_where_they_came_from():
    rounds = [{"turns": [_turn(1, 1.0, 0.05), _turn(2, 0.2, 0.04)],
               "decisions": [_decision("prefill-0", 100, 0), _decision(None, 300, 240)]},
              {"turns": [_turn(1, 1.2, None), _turn(2, 0.3, 0.06)],
               "decisions": [_decision("prefill-1", 200, 150), _decision("prefill-0", 400, None)]}]
    s = summarize(rounds)
    assert s["requests"] == 4 and s["prompt_tokens"] == 1000
    assert s["share_decode_side_reuse"] == pytest.approx(0.24)
    assert s["share_prefill_node_hits"] == pytest.approx(0.15)
    assert s["share_computed"] == pytest.approx(0.61)
    assert s["requests_prefilled_by_decode_node"] == 1
    assert s["later_turns_ttft_p50_ms"] == pytest.approx(250.0)
    assert s["tpot_p99_ms"] == pytest.approx(60.0)
    assert s["round_ttft_p50_spread"] == pytest.approx(1.5)
