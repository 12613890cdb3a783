"""A holder's pull budget (node/pull_budget.py), in virtual time: the chunks of every pull it
serves, together, take at most PULL_STEP_SHARE of a busy holder's time (its steps' share), a
chunk that cost more than it was sized for is a debt the next ones wait out, an idle holder
lends a whole step per chunk, the bytes packed and not yet sent never exceed the cap, and the
pulls take turns. The real holder under 8 concurrent pulls: tests/test_pull_budget.py."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.common.load import NodeLoad
from splitserve.engine.engine_thread import EngineStats
from splitserve.node.pull_budget import PULL_PROBE_BLOCKS, PULL_STEP_SHARE, PULLS_SERVED_MAX, PullBudget, \
    pull_chunk_blocks

BLOCK = 1000  # packed bytes of a block
STEP_S = 0.150  # a CPU decode step


class Holder:
    """A holder in virtual time: its steps run back to back, ``STEP_S`` each; a pull's chunk is
    copied between two of them and moves the clock by what it costs. Only copies and the
    budget's waits move the clock."""

    def __init__(self, busy: bool = True, step_s: float = STEP_S):
        self.start = self.now = 10 * step_s  # ten steps ran before the pulls came
        self.copied_s = 0.0
        self.busy, self.step_s = busy, step_s

    @property
    def computed_s(self) -> float:
        """The holder's time in steps since the pulls came."""
        return self.now - self.start - self.copied_s

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)

    def stats(self) -> EngineStats:
        steps = int((self.now - self.copied_s) / self.step_s)
        return EngineStats(NodeLoad(running=int(self.busy)), steps, 1000, 1000, steps * self.step_s, 0, 0)

    def budget(self, max_bytes: int = 10**9) -> PullBudget:
        return PullBudget(max_bytes, self.stats, self.clock, self.sleep)

    def copy(self, seconds: float) -> None:
        self.now += seconds
        self.copied_s += seconds


async def pull(holder: Holder, budget: PullBudget, blocks: int, block_s, chunks: list | None = None,
               name: str = "") -> None:
    """One pull of ``blocks`` through ``budget``: each chunk copied at ``block_s(i)`` seconds for
    block ``i`` of the pull, its bytes held until the send (a yield to the other pulls)."""
    done = 0
    while done < blocks:
        async with budget.turn():
            n = await budget.grant(blocks - done, BLOCK)
            cost = sum(block_s(done + i) for i in range(n))
            holder.copy(cost)
            budget.charge(cost)
            budget.measured(n, cost)
            assert budget.packed_bytes <= budget.max_bytes
        if chunks is not None:
            chunks.append(name)
        await asyncio.sleep(0)  # the send: the other pulls copy meanwhile
        budget.release(n * BLOCK)
        done += n


def test_before_any_copy_was_measured_a_probe_chunk_goes_first():
    assert pull_chunk_blocks(800, 0.015, None) == PULL_PROBE_BLOCKS
    assert pull_chunk_blocks(5, 0.15, None) == 5
    assert pull_chunk_blocks(800, 0.0, 1e-4) == PULL_PROBE_BLOCKS  # no step measured yet


def test_a_chunk_fits_its_time_and_cheap_copies_move_a_large_prefix_at_once():
    per_block = 0.0002  # a 737 KB block copied at ~3.7 GB/s
    assert pull_chunk_blocks(10_000, PULL_STEP_SHARE * STEP_S, per_block) == 75
    assert pull_chunk_blocks(10_000, STEP_S, per_block) == 750
    # an H100 decode node: 10 ms steps, a 2 MiB block gathered in ~1 us on the device
    assert pull_chunk_blocks(839, PULL_STEP_SHARE * 0.010, 1e-6) == 839
    assert pull_chunk_blocks(839, 0.001, 0.0) == 839  # too fast to measure


@given(left=st.integers(1, 10**6), budget_s=st.floats(0, 10), per_block=st.floats(0, 10))
def test_a_chunk_is_at_least_one_block_and_never_more_than_wanted(left, budget_s, per_block):
    n = pull_chunk_blocks(left, budget_s, per_block)
    assert 1 <= n <= left
    if per_block > 0 and budget_s > 0 and n > 1:  # the copy fits the budget
        assert n * per_block <= budget_s * (1 + 1e-9)


@pytest.mark.anyio
@pytest.mark.parametrize("pullers", [1, 8])
async def test_every_pull_together_takes_the_share_of_a_busy_holder(pullers):
    """N pulls of 600 blocks at 0.2 ms each: their copies take PULL_STEP_SHARE of the holder's
    time whatever N (a budget per pull would give N times that), so N pulls last N times one."""
    holder = Holder()
    budget = holder.budget()
    await asyncio.gather(*(pull(holder, budget, 600, lambda i: 0.0002) for _ in range(pullers)))
    compute = holder.computed_s
    one_chunk = PULL_STEP_SHARE * STEP_S + 0.0002
    assert holder.copied_s <= PULL_STEP_SHARE * compute + one_chunk
    assert holder.copied_s >= 0.8 * PULL_STEP_SHARE * compute  # and it uses it
    assert compute == pytest.approx(pullers * 600 * 0.0002 / PULL_STEP_SHARE, rel=0.1)


@pytest.mark.anyio
async def test_a_chunk_that_cost_more_than_its_share_is_a_debt_the_next_ones_wait_out():
    """Blocks 100.. sit on disk and cost 20x the first ones (a lower tier's read and check): the
    chunk sized at the device's rate overshoots its share once, and the share still holds."""
    holder = Holder()
    budget = holder.budget()
    await pull(holder, budget, 400, lambda i: 0.0002 if i < 100 else 0.004)
    compute = holder.computed_s
    assert holder.copied_s <= PULL_STEP_SHARE * compute + PULL_STEP_SHARE * STEP_S + 75 * 0.004


@pytest.mark.anyio
async def test_an_idle_holder_lends_a_whole_step_per_chunk_without_waiting():
    holder = Holder(busy=False)
    budget = holder.budget()
    chunks: list[str] = []
    await pull(holder, budget, 3000, lambda i: 0.0002, chunks)
    assert holder.now - holder.start == pytest.approx(3000 * 0.0002)  # nothing but copies
    assert len(chunks) == 1 + (3000 - PULL_PROBE_BLOCKS) // int(STEP_S / 0.0002) + 1


@pytest.mark.anyio
async def test_the_bytes_packed_for_every_pull_together_stay_under_the_cap_and_the_pulls_take_turns():
    holder = Holder()
    budget = holder.budget(max_bytes=5 * BLOCK)
    chunks: list[str] = []
    await asyncio.gather(*(pull(holder, budget, 200, lambda i: 0.0002, chunks, name) for name in "abc"))
    assert budget.peak_bytes <= 5 * BLOCK and budget.packed_bytes == 0
    assert set(chunks[:3]) == set("abc") and all(chunks[i] != chunks[i + 1] for i in range(len(chunks) - 3))


def test_a_holder_serves_at_most_its_pulls_at_once():
    budget = Holder().budget()
    assert all(budget.admit() for _ in range(PULLS_SERVED_MAX))
    assert not budget.admit() and budget.refused == 1
    budget.leave()
    assert budget.admit()
