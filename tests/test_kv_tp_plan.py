"""The KV head rule (common/kv_heads.py), the compatibility key (common/kv_compat.py) and
the transfer plan between two TP degrees (kvtransfer/tp_plan.py): every (decode rank,
head) covered exactly once by a prefill rank that holds it, the fewest heads moved,
replicas chosen deterministically and spread, impossible layouts refused by name."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.kv_compat import KVCompat, can_exchange
from splitserve.common.kv_heads import HeadRange, check_tp, heads_per_rank, rank_heads, ranks_holding, replicas
from splitserve.kvtransfer import KVLayout, KVShard
from splitserve.kvtransfer.tp_plan import transfer_plan

TPS = st.sampled_from([1, 2, 4, 8])
HEADS = st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 32])


def possible(tp: int, heads: int) -> bool:
    return heads % tp == 0 if heads >= tp else tp % heads == 0


def test_vllm_rule_examples():
    assert [rank_heads(r, 2, 8) for r in range(2)] == [HeadRange(0, 4), HeadRange(4, 8)]
    assert [rank_heads(r, 4, 2) for r in range(4)] == [HeadRange(0, 1)] * 2 + [HeadRange(1, 2)] * 2
    assert [rank_heads(r, 8, 1) for r in range(8)] == [HeadRange(0, 1)] * 8
    assert ranks_holding(1, 4, 2) == range(2, 4) and ranks_holding(5, 2, 8) == range(1, 2)
    assert heads_per_rank(8, 2) == 1 and replicas(8, 2) == 4 and heads_per_rank(2, 8) == 4


@pytest.mark.parametrize("tp, heads, words", [
    (2, 3, "does not divide the model's 3 KV heads"),
    (4, 6, "does not divide"),
    (8, 3, "not a multiple of the model's 3 KV heads"),
    (0, 4, "must be >= 1"),
])
def test_impossible_splits_are_named(tp, heads, words):
    with pytest.raises(ValueError, match=words):
        check_tp(tp, heads)


@given(tp=TPS, heads=HEADS)
def test_every_head_is_held_and_ranks_agree(tp, heads):
    if not possible(tp, heads):
        with pytest.raises(ValueError):
            rank_heads(0, tp, heads)
        return
    held = [rank_heads(r, tp, heads) for r in range(tp)]
    assert all(h.size == heads_per_rank(tp, heads) for h in held)
    assert {h for r in held for h in range(r.start, r.stop)} == set(range(heads))
    for h in range(heads):  # ranks_holding is the inverse of rank_heads
        assert list(ranks_holding(h, tp, heads)) == [r for r in range(tp) if held[r].start <= h < held[r].stop]
        assert len(ranks_holding(h, tp, heads)) == replicas(tp, heads)


@settings(max_examples=300)
@given(p_tp=TPS, d_tp=TPS, heads=HEADS)
def test_plan_covers_each_decode_head_exactly_once_with_minimal_bytes(p_tp, d_tp, heads):
    if not (possible(p_tp, heads) and possible(d_tp, heads)):
        with pytest.raises(ValueError, match="no KV transfer plan") as err:
            transfer_plan(p_tp, d_tp, heads)
        side = "prefill" if not possible(p_tp, heads) else "decode"
        assert f"{side} side" in str(err.value)
        return
    plan = transfer_plan(p_tp, d_tp, heads)
    assert len(plan.parts) == d_tp
    for d, parts in enumerate(plan.parts):
        mine = rank_heads(d, d_tp, heads)
        covered = []
        for part in parts:
            assert part.heads.size >= 1
            p_held = rank_heads(part.prefill_rank, p_tp, heads)
            assert p_held.contains(part.heads)  # a prefill rank sends only heads it holds
            assert mine.contains(part.heads)  # a decode rank receives only heads it holds
            assert part.prefill_local == part.heads.shift(p_held.start)
            assert part.decode_local == part.heads.shift(mine.start)
            covered += range(part.heads.start, part.heads.stop)
        assert covered == list(range(mine.start, mine.stop))  # exactly once, in order
        # one part per prefill rank: consecutive heads of one sender travel as one slice
        assert len({part.prefill_rank for part in parts}) == len(parts)
    # the minimum: each decode rank gets its own heads once, however the prefill side replicates
    assert plan.heads_sent() == d_tp * heads_per_rank(d_tp, heads)
    sends = [s for r in range(p_tp) for s in plan.sends_of(r)]
    assert sum(s.part.heads.size for s in sends) == plan.heads_sent()
    assert transfer_plan(p_tp, d_tp, heads) is plan  # deterministic (and cached)


@given(p_tp=TPS, d_tp=TPS, heads=st.sampled_from([1, 2, 4]))
def test_replicated_heads_spread_over_their_replicas(p_tp, d_tp, heads):
    if not (possible(p_tp, heads) and possible(d_tp, heads)):
        return
    plan = transfer_plan(p_tp, d_tp, heads)
    k = replicas(p_tp, heads)
    for h in range(heads):
        needing = [d for d in range(d_tp) if rank_heads(d, d_tp, heads).start <= h < rank_heads(d, d_tp, heads).stop]
        senders = [p.prefill_rank for d in needing for p in plan.parts[d] if p.heads.start <= h < p.heads.stop]
        assert len(senders) == len(needing)  # sent once per decode rank that needs it
        assert len(set(senders)) == min(k, len(needing))  # as many replicas as useful share the work


def test_documented_plans():
    p = transfer_plan(2, 4, 8)
    assert [[(x.prefill_rank, tuple(x.heads)) for x in parts] for parts in p.parts] == \
        [[(0, (0, 2))], [(0, (2, 4))], [(1, (4, 6))], [(1, (6, 8))]]
    p = transfer_plan(4, 2, 8)
    assert [[(x.prefill_rank, tuple(x.heads)) for x in parts] for parts in p.parts] == \
        [[(0, (0, 2)), (1, (2, 4))], [(2, (4, 6)), (3, (6, 8))]]
    p = transfer_plan(4, 1, 2)
    assert [[(x.prefill_rank, tuple(x.heads)) for x in parts] for parts in p.parts] == [[(0, (0, 1)), (2, (1, 2))]]
    assert p.sends_of(1) == [] and p.sends_of(3) == []  # idle replicas


def compat(**changes) -> KVCompat:
    base = dict(model="m", dtype="float16", block_size=16, num_layers=4, num_kv_heads=8, head_dim=64, tp=1)
    return KVCompat(**{**base, **changes})


def test_compat_key_names_each_mismatch_and_allows_other_tp():
    assert compat().exchange_problem(compat(tp=8)) is None and can_exchange(compat(tp=2), compat(tp=4))
    why = compat().exchange_problem(compat(dtype="bfloat16", head_dim=128, tp=2))
    assert "dtype: 'float16' != 'bfloat16'" in why and "head_dim: 64 != 128" in why and "tp" not in why
    assert "model: 'm' != 'n'" in compat().exchange_problem(compat(model="n"))
    assert "does not divide" in compat().exchange_problem(compat(tp=3))
    assert not can_exchange(compat(num_layers=5), compat())
    assert can_exchange(None, compat()) and not can_exchange(None, compat(tp=3))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(compat(tp=4)), type=KVCompat) == compat(tp=4)


def test_shard_layout_is_its_heads():
    shard = KVShard(compat(num_kv_heads=2, tp=4), rank=3)
    assert shard.heads == HeadRange(1, 2) and shard.layout.num_kv_heads == 1 and shard.problem() is None
    assert KVShard(compat(tp=2), rank=2).problem() == "rank 2 of a node with tensor_parallel_size 2"
    layout = KVLayout(dtype="float32", block_size=4, num_layers=2, num_kv_heads=3, head_dim=8)
    single = KVShard.of_layout(layout, model="x")
    assert single.layout == layout and single.heads == HeadRange(0, 3) and single.compat.tp == 1
