"""The hot-prefix benchmark's trace (benchmarks/router/bench_hot_prefix.py): HOT_SHARE of the
requests open with the one shared prefix, the rest share nothing, and it is a valid trace."""

import pytest

from splitserve.benchmarks.router.bench_hot_prefix import HOT_SHARE, hot_trace
from splitserve.common.trace import dump_trace, load_trace, oracle_hits


def test_hot_trace_shares_one_prefix_and_nothing_else(tmp_path):
    trace = hot_trace(rate=20, duration_s=30, prefix_tokens=4096, suffix_tokens=128, seed=1)
    dump_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace  # every line checks out
    hot = [r for r in trace if r.hash_ids[:8] == list(range(8))]
    assert len(hot) / len(trace) == pytest.approx(HOT_SHARE, abs=0.05) and 400 < len(trace) < 800
    assert all(r.input_length > 4096 for r in hot)
    others = [i for r in trace for i in (r.hash_ids[8:] if r in hot else r.hash_ids)]
    assert len(others) == len(set(others)) and not set(others) & set(range(8))  # nothing else is shared
    # the pooled oracle hits exactly the prefix of every hot request after the first
    assert sum(oracle_hits(trace)) == 4096 * (len(hot) - 1)
    with pytest.raises(ValueError, match="multiple of 512"):
        hot_trace(rate=1, duration_s=1, prefix_tokens=1000, suffix_tokens=10, seed=0)
