"""benchmarks/serving/bench_multiturn.py's arithmetic: shares of prompt tokens by where they
came from (the router's decisions and the nodes' pulled tokens), turn-2.. TTFT, TPOT and the
rounds' spread."""

import pytest

from splitserve.benchmarks.serving.bench_multiturn import summarize


def _turn(turn, ttft, tpot):
    return dict(conversation=0, turn=turn, ttft_s=ttft, tpot_s=tpot, prompt_tokens=100, cached_tokens=0)


def _decision(prefill, prompt, cached, reuse="own"):
    return dict(prefill=prefill, decode="decode-0", prompt_tokens=prompt, delivered_cached_tokens=cached,
                reuse=reuse)


def test_summary_splits_prompt_tokens_by_where_they_came_from():
    rounds = [{"turns": [_turn(1, 1.0, 0.05), _turn(2, 0.2, 0.04)],
               "decisions": [_decision("prefill-0", 100, 0), _decision(None, 300, 240)], "pulled_tokens": 0},
              {"turns": [_turn(1, 1.2, None), _turn(2, 0.3, 0.06)],
               "decisions": [_decision("prefill-1", 200, 150, "pull"), _decision("prefill-0", 400, None)],
               "pulled_tokens": 96}]
    s = summarize(rounds)
    assert s["requests"] == 4 and s["prompt_tokens"] == 1000
    assert s["share_decode_side_reuse"] == pytest.approx(0.24)
    assert s["share_pulled"] == pytest.approx(0.096)
    assert s["share_local_hits"] == pytest.approx(0.054)
    assert s["share_computed"] == pytest.approx(0.61)
    assert s["requests_prefilled_by_decode_node"] == 1 and s["requests_that_pulled"] == 1
    assert s["later_turns_ttft_p50_ms"] == pytest.approx(250.0)
    assert s["tpot_p99_ms"] == pytest.approx(60.0)
    assert s["round_ttft_p50_spread"] == pytest.approx(1.5)
