"""How a prefix-pull holder paces its copies (node/kv_pull.py ``pull_chunk_blocks``): by time,
so a pull from a busy decode node slows each of its steps by at most PULL_STEP_SHARE, an idle
holder lends up to a whole step per pass, and a device whose copies are cheap sends a large
prefix in one pass instead of one fixed-size chunk per step."""

from hypothesis import given
from hypothesis import strategies as st

from splitserve.node.kv_pull import PULL_PROBE_BLOCKS, PULL_STEP_SHARE, pull_chunk_blocks


def test_before_any_copy_was_measured_a_probe_chunk_goes_first():
    assert pull_chunk_blocks(800, True, 0.01, None) == PULL_PROBE_BLOCKS
    assert pull_chunk_blocks(5, False, 0.01, None) == 5
    assert pull_chunk_blocks(800, True, 0.0, 1e-4) == PULL_PROBE_BLOCKS  # no step measured yet


def test_a_busy_holder_spends_its_share_of_a_step_and_an_idle_one_a_whole_step():
    step, per_block = 0.150, 0.0002  # a CPU decode step; a 737 KB block copied at ~3.7 GB/s
    busy = pull_chunk_blocks(10_000, True, step, per_block)
    assert busy == int(PULL_STEP_SHARE * step / per_block) == 75
    assert pull_chunk_blocks(10_000, False, step, per_block) == 750


def test_cheap_copies_move_a_large_prefix_in_one_pass():
    # an H100 decode node: 10 ms steps, a 2 MiB block gathered in ~1 us on the device
    assert pull_chunk_blocks(839, True, 0.010, 1e-6) == 839
    assert pull_chunk_blocks(839, True, 0.010, 0.0) == 839  # too fast to measure


@given(left=st.integers(1, 10**6), busy=st.booleans(), step=st.floats(0, 10), per_block=st.floats(0, 10))
def test_a_chunk_is_at_least_one_block_and_never_more_than_wanted(left, busy, step, per_block):
    n = pull_chunk_blocks(left, busy, step, per_block)
    assert 1 <= n <= left
    if per_block > 0 and step > 0 and n > 1:  # the copy fits the budget
        assert n * per_block <= step * (PULL_STEP_SHARE if busy else 1.0) * (1 + 1e-9)
