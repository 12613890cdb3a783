"""TransferTable: the decode node's per-transfer state machine (transitions, idempotent
fail/abort, leases on an injected clock, stray and late reports counted, never raised),
and each transfer's one ``done`` future, resolved once on every path; with tensor
parallelism, reports counted per (block, decode rank) and the worker ranks' messages
(kvtransfer/rank_report.py)."""

import asyncio

import pytest

from splitserve.common.protocol import PrefillResult
from splitserve.kvtransfer import rank_report
from splitserve.kvtransfer.rank_report import (ClosedApplied, ClosedTransfers, RankBlocks, RankReporter,
                                               TransfersClosed)
from splitserve.kvtransfer.state import TransferFailure, TransferState, TransferTable

RESULT = PrefillResult(transfer_id="t", first_token=7)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()  # the done futures live here; resolving one needs no running loop
    yield loop
    loop.close()


@pytest.fixture
def make_table(loop):
    def make():
        clock = Clock()
        return TransferTable(clock=clock, loop=loop), clock
    return make


def test_happy_path_reserved_to_owned(make_table):
    table, _ = make_table()
    t = table.reserve("t1", "req-1", [4, 5, 6], lease_s=10)
    assert t.state is TransferState.RESERVED and not table.all_landed("t1")
    table.on_block("t1", 5, True, None)
    assert t.state is TransferState.TRANSFERRING and t.landed == {5}
    table.on_block("t1", 4, True, None)
    table.on_block("t1", 4, True, None)  # a duplicate report changes nothing
    assert not table.all_landed("t1")
    table.on_block("t1", 6, True, None)
    assert table.all_landed("t1") and not t.done.done()  # the prefill node has not answered
    assert table.prefilled("t1", RESULT).state is TransferState.COMPLETE
    assert t.done.result() is RESULT
    assert table.own("t1").state is TransferState.OWNED
    assert table.counts()["owned"] == 1
    assert table.remove("t1") is t and "t1" not in table and len(table) == 0


def test_no_blocks_to_send_completes_from_reserved(make_table):
    table, _ = make_table()
    table.reserve("t", "r", [], lease_s=1)  # every block was a local prefix hit
    assert table.all_landed("t")
    assert table.prefilled("t", RESULT).state is TransferState.COMPLETE


def test_bad_block_fails_and_later_reports_are_ignored(make_table):
    table, _ = make_table()
    table.reserve("t", "r", [1, 2], lease_s=5)
    table.on_block("t", 1, False, "checksum mismatch on block 1")
    t = table.get("t")
    assert t.state is TransferState.FAILED and "checksum mismatch" in t.reason
    assert t.done.result() == TransferFailure(TransferState.FAILED, t.reason)
    assert table.on_block("t", 2, True, None) is None  # too late: ignored, counted
    assert table.ignored_reports == 1 and t.landed == set()
    assert not table.all_landed("t")


def test_stray_block_fails_the_transfer(make_table):
    table, _ = make_table()
    table.reserve("t", "r", [1, 2], lease_s=5)
    table.on_block("t", 9, True, None)
    assert table.get("t").state is TransferState.FAILED and table.stray_blocks == 1
    assert "9" in table.get("t").reason


def test_unknown_transfer_reports_are_counted_not_raised(make_table):
    table, _ = make_table()
    assert table.on_block("nope", 0, True, None) is None
    assert table.on_block("nope", 1, False, "x") is None
    assert table.prefilled("nope", RESULT) is None
    assert table.ignored_reports == 3
    assert table.abort("nope") is None and table.fail("nope", "x") is None
    assert table.remove("nope") is None


def test_abort_and_fail_are_idempotent(make_table):
    table, _ = make_table()
    table.reserve("a", "r", [1], lease_s=5)
    t = table.abort("a", "client disconnected")
    assert t.state is TransferState.ABORTED and t.reason == "client disconnected"
    assert table.abort("a", "again") is t and t.reason == "client disconnected"
    assert table.fail("a", "late failure") is t and t.state is TransferState.ABORTED
    assert table.on_block("a", 1, True, None) is None and table.ignored_reports == 1
    assert t.done.result() == TransferFailure(TransferState.ABORTED, "client disconnected")
    table.reserve("f", "r", [1], lease_s=5)
    table.fail("f", "peer died")
    table.fail("f", "again")
    table.abort("f")
    assert table.get("f").state is TransferState.FAILED and table.get("f").reason == "peer died"


def test_complete_transfer_can_still_fail_or_abort_but_owned_cannot_fail(make_table):
    table, _ = make_table()
    for tid in ("x", "y", "z"):
        table.reserve(tid, "r", [1], lease_s=5)
        table.prefilled(tid, RESULT)
        table.on_block(tid, 1, True, None)
    assert table.fail("x", "admission failed").state is TransferState.FAILED
    assert table.get("x").done.result() is RESULT  # resolved once, when it completed
    assert table.abort("y").state is TransferState.ABORTED
    table.own("z")
    assert table.abort("z").state is TransferState.OWNED  # the scheduler cancels owned requests
    with pytest.raises(AssertionError):
        table.fail("z", "too late")


def test_illegal_transitions_assert(make_table):
    table, _ = make_table()
    t = table.reserve("t", "r", [1, 2], lease_s=5)
    with pytest.raises(AssertionError):
        table.own("t")  # not complete
    table.prefilled("t", RESULT)  # blocks missing: it does not complete
    assert t.state is TransferState.RESERVED and not t.done.done()
    with pytest.raises(AssertionError):
        table.remove("t")  # live: its blocks would leak
    with pytest.raises(AssertionError):
        table.reserve("t", "r2", [3], lease_s=5)  # transfer ids are unique
    table.abort("t")
    table.on_block("t", 1, True, None)
    table.on_block("t", 2, True, None)  # every block, too late: an aborted transfer never completes
    assert t.state is TransferState.ABORTED and t.done.result().state is TransferState.ABORTED
    with pytest.raises(AssertionError):
        table.own("t")


def test_lease_expiry(make_table):
    table, clock = make_table()
    table.reserve("slow", "r1", [1, 2], lease_s=5)
    table.reserve("done", "r2", [3], lease_s=5)
    table.reserve("long", "r3", [4], lease_s=60)
    table.on_block("slow", 1, True, None)
    table.on_block("done", 3, True, None)
    table.prefilled("done", RESULT)
    assert table.expired() == []
    clock.now += 5
    assert [t.transfer_id for t in table.expired()] == ["slow"]  # complete ones never expire
    assert [t.transfer_id for t in table.expired(now=clock.now + 60)] == ["slow", "long"]
    assert [t.transfer_id for t in table.expire_leases()] == ["slow"]
    assert table.expired() == [] and table.get("slow").reason.startswith("lease expired")
    assert table.get("slow").done.result().state is TransferState.FAILED


def test_counts_and_snapshot(make_table):
    table, clock = make_table()
    table.reserve("a", "r1", [1, 2], lease_s=10)
    clock.now += 1
    table.reserve("b", "r2", [3], lease_s=10)
    table.on_block("a", 1, True, None)
    table.abort("b", "cancelled")
    counts = table.counts()
    assert counts == {"reserved": 0, "transferring": 1, "complete": 0, "owned": 0,
                      "failed": 0, "aborted": 1}
    clock.now += 2
    snap = table.snapshot()
    assert [s["transfer_id"] for s in snap] == ["a", "b"]
    assert snap[0] == {"transfer_id": "a", "request_id": "r1", "state": "transferring", "blocks": 2,
                       "landed": 1, "prefilled": False, "reason": None, "age_s": 3.0,
                       "lease_left_s": 8.0}  # renewed by the block that landed at age 1
    assert snap[1]["state"] == "aborted" and snap[1]["reason"] == "cancelled"


def test_lease_renews_while_blocks_arrive_and_expires_after_the_last(make_table):
    table, clock = make_table()
    table.reserve("t", "r", [1, 2, 3, 4], lease_s=5)
    for block in (1, 2, 3):  # a slow prefill: one block every 4 s, 12 s in all > one lease
        clock.now += 4
        table.on_block("t", block, True, None)
        assert table.expired() == []
    clock.now += 5  # the sender went silent for one lease
    assert [t.transfer_id for t in table.expired()] == ["t"]


def test_done_needs_every_block_and_the_prefill_answer(make_table):
    table, _ = make_table()
    t = table.reserve("t", "r", [1, 2], lease_s=5)
    table.on_block("t", 1, True, None)
    table.prefilled("t", RESULT)
    assert not t.done.done()
    table.on_block("t", 2, True, None)
    assert t.done.result() is RESULT and t.state is TransferState.COMPLETE
    table.fail("t", "x")
    assert t.state is TransferState.FAILED and t.done.result() is RESULT  # not resolved again
    assert table.prefilled("t", RESULT) is None  # no longer live: ignored


@pytest.mark.parametrize("path", ["last block", "result last", "bad block", "stray block", "prefill failed",
                                  "lease", "abort", "abort after fail"])
def test_every_path_resolves_the_future_exactly_once(make_table, path):
    table, clock = make_table()
    t = table.reserve("t", "r", [1, 2], lease_s=5)
    table.on_block("t", 1, True, None)
    match path:
        case "last block":
            table.prefilled("t", RESULT)
            table.on_block("t", 2, True, None)
        case "result last":
            table.on_block("t", 2, True, None)
            table.prefilled("t", RESULT)
        case "bad block":
            table.on_block("t", 2, False, "checksum")
        case "stray block":
            table.on_block("t", 9, True, None)
        case "prefill failed":
            table.fail("t", "connection refused")
        case "lease":
            clock.now += 5
            table.expire_leases()
        case "abort":
            table.abort("t", "client gone")
        case "abort after fail":
            table.fail("t", "peer died")
            table.abort("t", "client gone")
    assert t.done.done() and t.state is not TransferState.TRANSFERRING
    # whatever comes later changes nothing
    table.on_block("t", 2, True, None)
    table.prefilled("t", RESULT)
    table.fail("t", "late")
    table.abort("t", "late")
    clock.now += 60
    table.expire_leases()
    assert table.reserved == sum(table.totals()["resolutions"].values()) == 1
    assert (t.done.result() is RESULT) == (path in ("last block", "result last"))
    if t.state is TransferState.COMPLETE:
        table.own("t")
    table.remove("t")


# -- tensor parallelism: every decode rank must land every block ------------------------------

@pytest.fixture
def make_tp_table(loop):
    def make(ranks):
        clock, closed = Clock(), []
        return TransferTable(clock=clock, loop=loop, ranks=ranks, on_closed=closed.append), clock, closed
    return make


def test_a_block_lands_when_every_rank_reported_it(make_tp_table):
    table, clock, closed = make_tp_table(3)
    t = table.reserve("t", "r", [4, 5], lease_s=5)
    table.on_block("t", 4, True, None)  # rank 0, the receiver in rank 0's process
    table.on_rank_blocks(RankBlocks(rank=2, transfer_id="t", landed=[4, 5]))
    table.prefilled("t", RESULT)
    assert t.landed == set() and t.ranks_landed == {4: 0b101, 5: 0b100} and not t.done.done()
    table.on_rank_blocks(RankBlocks(rank=1, transfer_id="t", landed=[4, 5]))
    table.on_rank_blocks(RankBlocks(rank=2, transfer_id="t", landed=[5]))  # a repeat changes nothing
    assert t.landed == {4} and not t.done.done()
    clock.now += 4
    table.on_block("t", 5, True, None, rank=0)  # the last (block, rank) completes it
    assert t.done.result() is RESULT and t.state is TransferState.COMPLETE and t.ranks_landed == {}
    assert closed == ["t"] and t.lease_deadline == clock.now + 5


@pytest.mark.parametrize("path", ["worker fails", "rank 0 fails", "abort", "lease", "fail then abort"])
def test_every_tp_path_resolves_once_and_closes_once(make_tp_table, path):
    table, clock, closed = make_tp_table(2)
    t = table.reserve("t", "r", [1, 2], lease_s=5)
    table.on_block("t", 1, True, None)
    match path:
        case "worker fails":  # a frame with a bad slice: its failures count before its landed blocks
            table.on_rank_blocks(RankBlocks(rank=1, transfer_id="t", landed=[1, 2], failed=[2],
                                            reason="checksum mismatch on block 2"))
            assert "block 2 on decode rank 1: checksum mismatch" in t.reason
        case "rank 0 fails":
            table.on_block("t", 2, False, "frame cut short")
        case "abort":
            table.abort("t", "client gone")
        case "lease":
            clock.now += 5
            table.expire_leases()
        case "fail then abort":
            table.fail("t", "prefill node died")
            table.abort("t", "client gone")
    assert t.done.done() and isinstance(t.done.result(), TransferFailure)
    table.on_rank_blocks(RankBlocks(rank=1, transfer_id="t", landed=[1, 2]))  # late: ignored
    table.on_block("t", 2, True, None)
    table.prefilled("t", RESULT)
    assert closed == ["t"] and table.reserved == sum(table.totals()["resolutions"].values()) == 1
    assert t.landed == set()


def test_worker_reports_renew_the_lease(make_tp_table):
    table, clock, _ = make_tp_table(2)
    table.reserve("t", "r", [1, 2, 3], lease_s=5)
    for block in (1, 2, 3):
        clock.now += 4
        table.on_rank_blocks(RankBlocks(rank=1, transfer_id="t", landed=[block]))
        assert table.expired() == []
    assert table.totals()["ranks"] == 2


def test_a_report_of_a_rank_the_node_does_not_have_is_a_bug(make_tp_table):
    table, _, _ = make_tp_table(2)
    table.reserve("t", "r", [1], lease_s=5)
    with pytest.raises(AssertionError, match="rank 2 on a 2-rank node"):
        table.on_block("t", 1, True, None, rank=2)


def test_rank_reporter_sends_one_message_per_transfer_per_loop_turn():
    sent = []

    async def body():
        reporter = RankReporter(3, lambda msg: sent.append(rank_report.decode(rank_report.encode(msg))))
        for dest in (7, 8, 9):
            reporter.on_block("a", dest, dest != 8, None if dest != 8 else "checksum mismatch")
        reporter.on_block("b", 1, True, None)
        assert sent == []  # gathered until the loop turns
        await asyncio.sleep(0)
        reporter.on_block("a", 10, True, None)
        await asyncio.sleep(0)

    asyncio.run(body())
    assert sent == [RankBlocks(rank=3, transfer_id="a", landed=[7, 9], failed=[8], reason="checksum mismatch"),
                    RankBlocks(rank=3, transfer_id="b", landed=[1]),
                    RankBlocks(rank=3, transfer_id="a", landed=[10])]


def test_closed_transfers_gate_a_worker_receiver():
    gate = ClosedTransfers(rank=1, keep=2)
    assert gate.accepts("a")
    ack = gate.apply(rank_report.decode(rank_report.encode(TransfersClosed(seq=5, transfer_ids=["a", "b"]))))
    assert ack == ClosedApplied(rank=1, seq=5) and not gate.accepts("a") and not gate.accepts("b")
    gate.apply(TransfersClosed(seq=6, transfer_ids=["c"]))
    assert gate.accepts("a") and not gate.accepts("c")  # only the last `keep` are remembered
