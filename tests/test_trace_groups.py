"""The prefix-group trace (``make-trace --preset prefix-groups``, issue 26's workload): its
statistics, computed from the generated trace alone, are the ones stated (15k-token
prompts, groups of 2 to 24 sharing 97%, a median reuse gap of ~55 s, a working set ~3x
16 H100s' KV pools, an unlimited cache serving ~65% and a pool-sized LRU ~50%), and the
LRU cache that measures the last behaves like one."""

import json
import subprocess
import sys

import pytest

from splitserve.benchmarks.loadgen.replay.generate import PRESETS, generate
from splitserve.benchmarks.loadgen.replay.groups import GroupSpec, generate_groups, group_stats
from splitserve.deploy.planner.sim_profiles import get_profile
from splitserve.common.trace import TraceRequest, load_trace, lru_hits, oracle_hits

FLEET = 16 * get_profile("llama3-8b-h100").kv_pool_tokens  # 6.9M tokens of KV in 16 H100s


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_groups_preset_has_the_stated_statistics(seed):
    spec = PRESETS["prefix-groups"]
    assert isinstance(spec, GroupSpec)
    trace = generate(GroupSpec(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "seed": seed}))
    st = group_stats(trace, FLEET)
    assert 14000 <= st["mean_prompt_tokens"] <= 16500
    assert st["group_size_min"] == 2 and 18 <= st["group_size_max"] <= 24 and 2.7 <= st["group_size_mean"] <= 3.3
    assert 0.96 <= st["shared_fraction_mean"] <= 0.98
    assert 45 <= st["reuse_gap_p50_s"] <= 65 and st["reuse_gap_p90_s"] > 300  # minutes: returns after a break
    assert 2.7 <= st["working_set_over_capacity"] <= 3.3 and st["capacity_tokens"] == FLEET
    assert 0.60 <= st["unlimited_hit_rate"] <= 0.70
    assert 0.45 <= st["capacity_lru_hit_rate"] <= 0.55
    assert 3500 <= st["requests"] <= 4500 and st["groups"] == spec.groups
    assert trace == generate_groups(GroupSpec(seed=seed))  # deterministic in the seed
    for r in trace:
        assert len(r.hash_ids) == -(-r.input_length // 512) and r.input_length <= spec.max_prompt_tokens


def test_lru_cache_evicts_the_least_recent_blocks_tails_first():
    def req(t, ids, n):
        return TraceRequest(timestamp=t, input_length=n, output_length=1, hash_ids=ids)

    a1, a2 = req(0, [1, 2, 3], 1500), req(1, [1, 2, 4], 1100)  # share 2 blocks (1024 tokens)
    b = req(2, [7, 8], 1024)
    # room for 2048 tokens: b evicts a1's and a2's tails (least recent: tails before prefixes);
    # the 4th prompt's 6 new tokens then push out b's tail, and b's prefix alone hits again
    trace = [a1, a2, b, req(3, [1, 2, 5], 1030), req(4, [7, 8], 1024)]
    assert lru_hits(trace, 4 * 512) == [0, 1024, 0, 1024, 512]
    # room for 1024: a1's tail goes at once, its prefix serves a2; b pushes out a's blocks, then back
    assert lru_hits(trace, 2 * 512) == [0, 1024, 0, 0, 0]
    assert lru_hits(trace, 10 ** 9) == oracle_hits(trace)  # never full: the oracle


def test_make_trace_writes_the_preset(tmp_path):
    out = tmp_path / "groups.jsonl"
    line = subprocess.run([sys.executable, "-m", "splitserve.cli", "make-trace", str(out), "--preset",
                           "prefix-groups", "--seed", "1"], capture_output=True, text=True, check=True).stdout
    info = json.loads(line)
    trace = load_trace(out)
    assert info["preset"] == "prefix-groups" and info["requests"] == len(trace) > 3000
    assert trace == generate_groups(GroupSpec(seed=1))
