"""A decode node's --local-prefill-budget (issue 38): ``EngineConfig.prefill_step_budget``
bounds the prompt tokens one step computes over all its prefill rows (engine/scheduler.py).
Decodes never draw from it and get a row every step, the oldest prefill progresses every
step, no budget leaves the schedule as it was, and greedy tokens do not change."""

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.prompt_ref import PromptKeys, PromptRef
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.engine.request import Request
from splitserve.engine.scheduler import Row, Scheduler, SchedulerOutput

BS = 16


def make_scheduler(budget: int | None, max_num_batched_tokens: int = 2048, chunk: int = 512,
                   max_num_seqs: int = 64) -> Scheduler:
    """A scheduler over a pool that holds every test's requests (no preemption)."""
    return Scheduler(KVCacheManager(2048, BS), max_num_seqs, max_num_batched_tokens, chunk, 1 << 16, budget)


def make_request(rid: str, prompt_len: int, max_tokens: int, base: int) -> Request:
    """Prompts of distinct ``base`` share no block, so none is a prefix-cache hit."""
    return Request(rid, PromptRef(list(range(base, base + prompt_len)), PromptKeys(model="m"), BS),
                   SamplingParams(max_tokens=max_tokens, temperature=0), frozenset())


def prompt_tokens(row: Row) -> int:
    """What ``row`` drew from the prefill budget: all its tokens unless it is one token at the end."""
    return 0 if row.num_tokens == 1 and row.num_verify == 1 else row.num_tokens


def step(s: Scheduler) -> SchedulerOutput:
    """One engine step without a model: every verifying row samples a token; max_tokens ends it."""
    out = s.schedule()
    s.update_after_step(out)
    for row in out.rows:
        if row.num_verify:
            row.request.append_tokens([1], [None])
            if len(row.request.output_token_ids) >= row.request.sampling_params.max_tokens:
                s.finish(row.request.request_id, "length")
    return out


def test_long_prompts_beside_running_decodes_stay_within_the_budget():
    s = make_scheduler(budget=64)
    decodes = [make_request(f"d{i}", 8, 1000, 1000 * i) for i in range(4)]
    for r in decodes:
        s.add(r)
    step(s)  # their prompts (32 tokens) fit one step: from now on they decode
    long = [make_request("a", 300, 2, 10_000), make_request("b", 200, 2, 20_000)]
    for r in long:
        s.add(r)
    steps = 0
    while not all(r.finished for r in long):
        out = step(s)
        steps += 1
        assert sum(prompt_tokens(r) for r in out.rows) <= 64
        assert {r.request.request_id for r in out.rows} >= {"d0", "d1", "d2", "d3"}  # decodes every step
        assert steps < 20
    # 500 prompt tokens in chunks of 64 (b takes what a's last chunk leaves), then the last decode
    assert steps == -(-500 // 64) + 1


def test_the_oldest_prefill_progresses_every_step():
    s = make_scheduler(budget=48, chunk=32)
    reqs = [make_request(f"p{i}", 100 + 10 * i, 1, 1000 * i) for i in range(4)]
    for r in reqs:
        s.add(r)
    while s.has_unfinished():
        oldest = next(r for r in reqs if r.num_computed_tokens < len(r.prompt_token_ids))
        before = oldest.num_computed_tokens
        out = step(s)
        assert oldest.num_computed_tokens - before == min(32, len(oldest.prompt_token_ids) - before)
        assert sum(prompt_tokens(r) for r in out.rows) <= 48


def mixed_batch_rows(budget: int | None) -> list[list[tuple[str, int]]]:
    """Every step's (request, tokens) of two short requests and two long prompts, to the end."""
    s = make_scheduler(budget, max_num_batched_tokens=100, chunk=64)
    for i, (n, m) in enumerate([(8, 10), (8, 10), (150, 3), (90, 3)]):
        s.add(make_request(f"r{i}", n, m, 1000 * i))
    steps = []
    while s.has_unfinished():
        steps.append([(r.request_id, n) for r, n in step(s).scheduled])
    return steps


def test_no_budget_leaves_the_schedule_as_it_was():
    rows = mixed_batch_rows(None)
    # the old rule, min(uncomputed, step budget left, chunk), worked by hand for the first steps
    assert rows[:3] == [[("r0", 8), ("r1", 8), ("r2", 64), ("r3", 20)],
                        [("r0", 1), ("r1", 1), ("r2", 64), ("r3", 34)],
                        [("r0", 1), ("r1", 1), ("r2", 22), ("r3", 36)]]
    assert mixed_batch_rows(100) == rows  # a budget of the whole step binds nothing
    assert mixed_batch_rows(64)[0] == [("r0", 8), ("r1", 8), ("r2", 48)]  # r3 is not admitted yet


@settings(max_examples=150, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 12), st.integers(0, 8)),
                         min_size=1, max_size=10),
       budget=st.integers(1, 96), chunk=st.integers(1, 64))
def test_every_step_stays_within_the_budget_and_every_request_finishes(requests, budget, chunk):
    max_num_batched_tokens, max_num_seqs = 128, 16
    s = make_scheduler(budget, max_num_batched_tokens, chunk, max_num_seqs)
    reqs = [(make_request(f"r{i}", n, m, 1000 * i), arrival) for i, (n, m, arrival) in enumerate(requests)]
    # the oldest pending prefill gets at least this much of its prompt every step
    least = min(budget, chunk, max_num_batched_tokens - max_num_seqs)
    bound = 8 + sum(-(-r.num_tokens // least) for r, _ in reqs) + max(r.sampling_params.max_tokens for r, _ in reqs)
    steps = 0
    while steps <= 8 or s.has_unfinished():
        for r, arrival in reqs:
            if arrival == steps:
                s.add(r)
        out = step(s)
        steps += 1
        assert sum(prompt_tokens(r) for r in out.rows) <= budget
        assert not out.preempted
        assert steps <= bound
    assert all(r.finished and len(r.output_token_ids) == r.sampling_params.max_tokens for r, _ in reqs)


def test_greedy_tokens_do_not_change_with_a_budget(make_engine, run_engine):
    prompts = {f"p{i}": (list(range(100 + 40 * i, 100 + 40 * i + n)), SamplingParams(max_tokens=8, temperature=0))
               for i, n in enumerate([5, 37, 70, 23])}
    outputs, most = [], []
    for budget in (None, 16):
        engine = make_engine(dtype="float32", kv_cache_memory=16 << 20, prefill_chunk_size=64,
                             max_num_batched_tokens=128, prefill_step_budget=budget)
        assert engine.scheduler.prefill_step_budget == budget
        steps: list[int] = []
        engine.on_launch = lambda out: steps.append(sum(prompt_tokens(r) for r in out.rows))
        outputs.append(run_engine(engine, prompts, join_at={"p3": 3}))
        most.append(max(steps))
        engine.close()
    assert outputs[0] == outputs[1]
    assert most == [64 + 37 + 5, 16]


def test_only_decode_nodes_get_the_flag_default_512():
    from splitserve.cli import build_parser, node_config
    from splitserve.common.config import SimConfig
    from splitserve.deploy.launcher import Cluster
    from splitserve.node.sim_fleet import fleet_configs

    budget = lambda argv, role: node_config(build_parser().parse_args(argv), role).engine.prefill_step_budget
    assert budget(["decode"], "decode") == 512
    assert budget(["decode", "--local-prefill-budget", "96"], "decode") == 96
    assert budget(["decode", "--local-prefill-budget", "0"], "decode") is None
    assert budget(["decode", "--colocated"], "colocated") is None
    assert budget(["prefill", "--local-prefill-budget", "96"], "prefill") is None
    template = node_config(build_parser().parse_args(["sim-nodes"]), "decode", SimConfig.load(None, 1.0))
    assert [(c.role, c.engine.prefill_step_budget) for c in fleet_configs(template, 1, 1)] == [
        ("prefill", None), ("decode", 512)]
    # splitserve up: the decode nodes' flag (deploy/local.toml's 512 unless given)
    c = Cluster(prefill_nodes=1, decode_nodes=1, local_prefill_budget=128)
    decode_args = c.node_args("decode", 0)
    assert decode_args[decode_args.index("--local-prefill-budget") + 1] == "128"
    assert "--local-prefill-budget" not in c.node_args("prefill", 0)


def test_a_budget_that_leaves_no_room_for_the_decodes_is_refused_at_start_up():
    """prefill_step_budget + max_num_seqs must fit max_num_batched_tokens: running rows come
    first in admission order, so a prefill chunk of the whole budget ahead of max_num_seqs
    decodes would leave them no tokens, and a decode node's step would skip decodes rather
    than stay within "its decodes plus N"."""
    import subprocess
    import sys

    import pytest

    from splitserve.cli import build_parser, node_config
    from splitserve.common.config import EngineConfig

    with pytest.raises(ValueError) as err:
        EngineConfig(prefill_step_budget=100, max_num_seqs=64, max_num_batched_tokens=128)
    for name in ("prefill_step_budget", "max_num_seqs", "max_num_batched_tokens", "--local-prefill-budget"):
        assert name in str(err.value), err.value
    EngineConfig(prefill_step_budget=64, max_num_seqs=64, max_num_batched_tokens=128)  # exactly fits
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="--local-prefill-budget"):  # an explicit budget too big for the step
        node_config(parse(["decode", "--max-num-batched-tokens", "256", "--local-prefill-budget", "512"]), "decode")
    # the default fits the step: 512, or what the step leaves beside max_num_seqs decodes
    assert node_config(parse(["decode", "--max-num-batched-tokens", "256"]), "decode").engine.prefill_step_budget == 192
    assert node_config(parse(["decode", "--max-num-batched-tokens", "64"]), "decode").engine.prefill_step_budget is None
    assert node_config(parse(["decode", "--max-num-batched-tokens", "256", "--local-prefill-budget", "192"]),
                       "decode").engine.prefill_step_budget == 192
    # the flag is the decode nodes': a prefill or colocated node with a small step is fine
    assert node_config(parse(["prefill", "--max-num-batched-tokens", "256"]), "prefill").engine.prefill_step_budget is None
    assert node_config(parse(["decode", "--colocated", "--max-num-batched-tokens", "256"]),
                       "colocated").engine.prefill_step_budget is None
    # the process refuses to start, saying which flags to change (no traceback)
    proc = subprocess.run([sys.executable, "-m", "splitserve.cli", "decode", "--max-num-batched-tokens", "256",
                           "--max-num-seqs", "32", "--local-prefill-budget", "512"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--local-prefill-budget" in proc.stderr and "--max-num-batched-tokens" in proc.stderr
    assert "Traceback" not in proc.stderr
