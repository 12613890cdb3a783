"""The routing trace (format, expansion, oracle), its generator, the greedy
balancer's reference load, and ``splitserve replay`` end to end on a small trace,
also with a heterogeneous deployment (prefill TP4 / decode TP8)."""

import json
import os
import subprocess
import sys

import pytest

from splitserve.deploy.planner.sim_profiles import get_profile
from splitserve.benchmarks.loadgen.replay.balance import greedy_max_mean
from splitserve.benchmarks.loadgen.replay.generate import TraceSpec, generate
from splitserve.common.trace import (HASH_BLOCK, TraceRequest, dump_trace, load_trace, oracle_hits, prompt_tokens,
                                     summarize)


def write(tmp_path, lines) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_load_sorts_and_names_the_bad_line_and_field(tmp_path):
    ok = ['{"timestamp": 20, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
          '{"timestamp": 10, "input_length": 100, "output_length": 5, "hash_ids": [1]}']
    assert [r.timestamp for r in load_trace(write(tmp_path, ok))] == [10, 20]
    bad = {'{"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1]}': "needs 2",
           '{"timestamp": 1, "input_length": 6, "output_length": 5}': "hash_ids",
           '{"timestamp": 1, "input_length": "x", "output_length": 5, "hash_ids": [1]}': "input_length",
           '{"timestamp": -1, "input_length": 6, "output_length": 5, "hash_ids": [1]}': "timestamp",
           'not json': "not JSON"}
    for line, word in bad.items():
        with pytest.raises(ValueError, match=f"line 2: .*{word}"):
            load_trace(write(tmp_path, [ok[0], line]))
    with pytest.raises(ValueError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_hash_ids_expand_to_fixed_blocks_cut_to_input_length():
    a = TraceRequest(0, 700, 1, [5, 9])
    b = TraceRequest(1, 1024, 1, [5, 9])
    c = TraceRequest(2, 512, 1, [6])
    ta, tb, tc = prompt_tokens(a), prompt_tokens(b), prompt_tokens(c)
    assert len(ta) == 700 and len(tb) == 1024 and tb[:700] == ta  # same ids, same tokens
    assert tc != tb[:512]
    assert all(100 <= t < 49000 for t in tb)
    # the expansion is fixed across processes (no hash randomisation, no global state)
    out = subprocess.run([sys.executable, "-c", "from splitserve.common.trace import "
                          "TraceRequest, prompt_tokens; print(prompt_tokens(TraceRequest(0, 8, 1, [5])))"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONHASHSEED="7"), check=True)
    assert json.loads(out.stdout) == ta[:8]


def test_oracle_counts_blocks_an_earlier_request_listed_after_the_same_prefix():
    trace = [TraceRequest(0, 1000, 1, [1, 2]), TraceRequest(1, 1200, 1, [1, 2, 3]),
             TraceRequest(2, 300, 1, [3]), TraceRequest(3, 1100, 1, [1, 2, 3]),
             TraceRequest(4, 1024, 1, [7, 2])]
    # second: blocks 1 and 2 after the same prefix (512 + 512); third: block 3 was listed,
    # but after [1, 2], so a cache cannot reuse it; fourth: all three, the last cut to 76;
    # fifth: block 2 after another first block is new KV
    assert oracle_hits(trace) == [0, 1024, 0, 1100, 0]


def test_greedy_balancer_spreads_work_and_keeps_a_conversation_where_it_is_cached():
    p = get_profile("llama3-8b-h100")
    equal = [TraceRequest(i, 2048, 1, [10 * i + k for k in range(4)]) for i in range(4)]
    assert greedy_max_mean(equal, 2, p) == 1.0  # two each
    # A long first turn, its next turn (cached but for one block) and a short stranger:
    # the next turn stays with the long one (its cached time is the least end), the
    # stranger goes to the idle node.
    first = TraceRequest(0, 32 * 512, 1, list(range(32)))
    turn = TraceRequest(1, 33 * 512, 1, list(range(33)))
    stranger = TraceRequest(2, 4 * 512, 1, [100, 101, 102, 103])
    busy = [p.prefill_seconds(32 * 512) + p.prefill_seconds(33 * 512, 32 * 512), p.prefill_seconds(4 * 512)]
    assert greedy_max_mean([first, turn, stranger], 2, p) == round(max(busy) / (sum(busy) / 2), 3)
    # one request longer than all the rest together: max/mean stays far from 1
    big = TraceRequest(3, 200 * 512, 1, list(range(1000, 1200)))
    assert greedy_max_mean(equal + [big], 4, p) > 2


def test_generator_is_deterministic_and_builds_conversations():
    spec = TraceSpec(tenants=3, users_per_tenant=4, rate=0.5, duration_s=120, mean_turns=3, seed=5)
    trace = generate(spec)
    assert trace == generate(spec) and trace != generate(TraceSpec(**{**spec_dict(spec), "seed": 6}))
    assert [r.timestamp for r in trace] == sorted(r.timestamp for r in trace)
    for r in trace:
        assert len(r.hash_ids) == -(-r.input_length // HASH_BLOCK)
        assert r.input_length + r.output_length <= spec.max_context
    # a later turn lists every id of the turn before it (the history), then new ones
    follow_ups = sum(any(o is not r and r.hash_ids[:len(o.hash_ids)] == o.hash_ids and r.timestamp > o.timestamp
                         for o in trace) for r in trace)
    assert follow_ups > len(trace) / 3
    info = summarize(trace)
    assert 0.3 < info["oracle_hit_rate"] < 1 and info["requests"] == len(trace)


def spec_dict(spec):
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


def test_replay_command_end_to_end(tmp_path):
    trace = generate(TraceSpec(tenants=2, users_per_tenant=2, rate=0.2, duration_s=40, mean_turns=3,
                               mean_user_tokens=200, mean_think_s=5, seed=1))[:10]
    path = tmp_path / "t.jsonl"
    dump_trace(trace, path)
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "replay", str(path), "--prefill-nodes", "2",
                           "--decode-nodes", "1", "--speedup", "20", "--max-output-tokens", "4",
                           "--fleet-procs", "1", "--kv-cache-memory", "512MiB", "--result-json", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, SPLITSERVE_QUIET="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["failed"] == 0 and r["requests"] == 10
    for key in ("hit_rate", "oracle_hit_rate", "ttft_p50", "ttft_p99", "max_mean_load"):
        assert r[key] is not None, key
    assert 0 < r["hit_rate"] <= r["oracle_hit_rate"] <= 1
    assert 0 < r["ttft_p50"] <= r["ttft_p99"]
    assert r["max_mean_load"] >= 1
    assert sum(r["prefill_requests_per_node"].values()) + r["local_prefills"] == 10
    assert r["prefill_nodes_not_idle_at_end"] == {}  # nothing leaked on the nodes
    # where the mean TTFT went: each role's queue and prompt time, the rest is the path between
    prefill = r["at_nodes"]["prefill"]
    assert prefill["prefill_s"] > 0 and prefill["queue_s"] >= 0 and set(r["at_nodes"]) == {"prefill", "decode"}
    assert prefill["queue_s"] + prefill["prefill_s"] + r["ttft_path_s"] == pytest.approx(r["ttft_mean"], abs=2e-3)
    stages = r["at_nodes"]["decode"]["transfer_s"]  # the decode nodes' side of it
    assert set(stages) == {"reserve", "transfer", "admit"} and stages["transfer"] > 0
    # (over the transferred requests only: those a decode node prefilled itself have no stages)
    assert all(s >= 0 for s in stages.values()) and sum(stages.values()) < r["ttft_p99"]
    assert "hit rate" in proc.stdout


def test_replay_of_a_heterogeneous_deployment_end_to_end(tmp_path):
    """``replay --profile DEPLOYMENT``: prefill nodes on the TP4 profile, decode nodes on
    the TP8 one (a fleet process per role), every request answered, nothing leaked."""
    from splitserve.benchmarks.loadgen.replay.run import ReplayConfig, run_replay

    trace = generate(TraceSpec(tenants=2, users_per_tenant=2, rate=0.2, duration_s=40, mean_turns=3,
                               mean_user_tokens=200, mean_think_s=5, seed=1))[:8]
    path = tmp_path / "t.jsonl"
    dump_trace(trace, path)
    r = run_replay(ReplayConfig(trace=str(path), prefill_nodes=2, decode_nodes=1, speedup=20, max_output_tokens=4,
                                fleet_procs=1, profile="llama3-70b-p-tp4-d-tp8-h100"))
    assert r["failed"] == 0 and r["requests"] == 8, r["errors"]
    assert (r["prefill_profile"], r["decode_profile"]) == ("llama3-70b-tp4-h100", "llama3-70b-tp8-h100")
    assert sum(r["prefill_requests_per_node"].values()) + r["local_prefills"] == 8
    assert r["prefill_nodes_not_idle_at_end"] == {}
    with pytest.raises(ValueError, match="unknown simulated-node profile or deployment 'tp4-tp9'"):
        ReplayConfig(trace=str(path), profile="tp4-tp9")


def test_trace_block_size_maps_any_hash_block_onto_the_node_blocks(tmp_path):
    lines = ['{"timestamp": 0, "input_length": 300, "output_length": 5, "hash_ids": [1, 2, 3]}',
             '{"timestamp": 5, "input_length": 290, "output_length": 5, "hash_ids": [1, 2, 4]}']
    with pytest.raises(ValueError, match="one per 512 tokens; --trace-block-size"):
        load_trace(write(tmp_path, lines))
    trace = load_trace(write(tmp_path, lines), hash_block=128)
    a, b = (prompt_tokens(r, hash_block=128) for r in trace)
    assert len(a) == 300 and len(b) == 290 and a[:256] == b[:256] and a[256:] != b[256:]
    assert oracle_hits(trace, 128) == [0, 256]
    with pytest.raises(ValueError, match="trace_block_size"):
        load_trace(write(tmp_path, lines), hash_block=0)


def test_long_context_preset_has_the_published_length_distribution():
    from splitserve.benchmarks.loadgen.replay.generate import PRESETS

    info = summarize(generate(PRESETS["long-context"]))
    assert 7000 <= info["input_p50"] <= 12000 and 27000 <= info["input_p90"] <= 39000
    assert info["input_max"] > 80000 and info["requests"] > 500
