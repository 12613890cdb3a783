"""benchmarks/router/bench_multiturn_sim.py's split of the router's decisions by path: which
node computed the prompt and where its prefix came from, with TTFT in trace seconds."""

from splitserve.benchmarks.router.bench_multiturn_sim import ttft_by_path


def _decision(prefill, reuse, ttft):
    return dict(prefill=prefill, reuse=reuse, delivered_ttft_s=ttft)


def test_decisions_split_by_the_node_that_computed_and_where_the_prefix_came_from():
    decisions = [_decision(None, "own", 0.028), _decision(None, "own", 0.030), _decision(None, "own", 0.040),
                 _decision("prefill-0", "pull", 0.200), _decision("prefill-1", "own", 0.042),
                 _decision("prefill-1", "none", None)]  # still running at the end: no TTFT
    paths = ttft_by_path(decisions, 0.5)
    assert list(paths) == ["decode node, own", "prefill node, own", "prefill node, pull"]
    assert paths["decode node, own"] == {"requests": 3, "ttft_p50": 0.015, "ttft_p90": 0.019}
    assert paths["prefill node, pull"] == {"requests": 1, "ttft_p50": 0.1, "ttft_p90": 0.1}
    assert paths["prefill node, own"]["ttft_p50"] == 0.021


def test_no_decisions_no_paths():
    assert ttft_by_path([], 1.0) == {}
