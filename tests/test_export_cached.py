"""The engine's two halves of a prefix pull (node/kv_pull.py), on a tiny random Llama: a holder
copies out the cached blocks of a prefix (``export_cached``), a puller lands them in a
reservation and commits them to its prefix cache (``commit_pulled``), and the puller's greedy
tokens then equal the holder's while it computes only the rest. A pull that races an eviction
on the holder gets the blocks still held and never a block under another block's hash."""

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.kvtransfer.block_store import KVBlockStore
from splitserve.kvtransfer.layout import KVLayout

BS = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def store_of(engine) -> KVBlockStore:
    kv = engine.runner.kv_caches
    return KVBlockStore(kv, KVLayout.of_cache(kv.shape, kv.dtype))


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * j) % 240 + 10 for j in range(n)]


@pytest.fixture
def engines(tiny_llama_dir, make_engine):
    path, _ = tiny_llama_dir()
    return lambda **kw: make_engine(model=str(path), block_size=BS, **kw)


def test_pulled_blocks_serve_the_puller_as_its_own(engines, run_engine):
    holder, puller = engines(), engines()
    p = prompt(1, 10 * BS + 5)
    want = run_engine(holder, {"a": (p, GREEDY)})["a"]
    hs = store_of(holder)
    prefix = p[:10 * BS]
    n, packed = holder.export_cached("x", holder.prompt_ref(prefix), start_block=0, max_blocks=64,
                                     pack=lambda ids: bytes(hs.pack(ids)))
    assert n == 10 and "x" not in holder.kv  # held only while it was copied
    res = puller.reserve("b:pull", puller.prompt_ref(p[:10 * BS + 1]))
    assert res.num_cached_tokens == 0 and len(res.block_ids) == 11
    ps = store_of(puller)
    ps.write_many(res.block_ids[:10], packed)
    puller.commit_pulled("b:pull", puller.prompt_ref(p[:10 * BS + 1]), num_tokens=10 * BS)
    assert "b:pull" not in puller.kv and puller.kv.num_free_blocks == puller.num_blocks
    deltas = []
    puller.add_request("b", puller.prompt_ref(p), GREEDY)
    while puller.has_unfinished():
        deltas += puller.step()
    assert [t for d in deltas for t in d.new_token_ids] == want
    assert deltas[0].num_cached_tokens == 10 * BS  # only the 5 tokens after the prefix were computed


def test_export_from_a_later_block_and_a_bounded_chunk(engines, run_engine):
    holder = engines()
    p = prompt(2, 8 * BS)
    run_engine(holder, {"a": (p + [5], GREEDY)})
    hs = store_of(holder)
    full = holder.export_cached("x", holder.prompt_ref(p), start_block=0, max_blocks=64, pack=lambda ids: list(ids))[1]
    n, ids = holder.export_cached("x", holder.prompt_ref(p), start_block=3, max_blocks=2, pack=lambda ids: list(ids))
    assert (n, ids) == (2, full[3:5])
    assert holder.export_cached("x", holder.prompt_ref(prompt(3, 4 * BS)), start_block=0, max_blocks=64,
                                pack=lambda ids: ids) == (0, None)
    assert hs.read(full[0]) != hs.read(full[1])


def test_a_pull_racing_an_eviction_gets_only_blocks_still_held(engines, run_engine):
    """Chunk 1 is copied, then the holder's pool is filled by other prompts (evicting the
    prefix); chunk 2 finds nothing under those hashes and ends the run: what was sent is the
    prefix's own KV, checked against a copy taken before."""
    block = store_of(engines()).layout.block_nbytes
    holder = engines(kv_cache_memory=24 * block)
    p = prompt(4, 8 * BS)
    run_engine(holder, {"a": (p + [5], GREEDY)})
    hs = store_of(holder)
    read = lambda ids: [hs.read(i) for i in ids]  # noqa: E731
    before = holder.export_cached("x", holder.prompt_ref(p), start_block=0, max_blocks=64, pack=read)[1]
    n1, chunk1 = holder.export_cached("x", holder.prompt_ref(p), start_block=0, max_blocks=4, pack=read)
    assert n1 == 4 and chunk1 == before[:4]
    others = {f"o{i}": (prompt(100 + i, 8 * BS), GREEDY) for i in range(holder.num_blocks // 8 + 2)}
    run_engine(holder, others)  # the pool turns over: the prefix's blocks are reused
    n2, chunk2 = holder.export_cached("x", holder.prompt_ref(p), start_block=4, max_blocks=4, pack=read)
    assert n2 == 0 and chunk2 is None
    # and whatever a later pull finds from the start is the prefix's KV again, recomputed
    run_engine(holder, {"again": (p + [5], GREEDY)})
    n3, chunk3 = holder.export_cached("x", holder.prompt_ref(p), start_block=0, max_blocks=64, pack=read)
    assert n3 == 8 and [torch.frombuffer(bytearray(a), dtype=torch.float32).allclose(
        torch.frombuffer(bytearray(b), dtype=torch.float32), atol=1e-5) for a, b in zip(chunk3, before)] == [True] * 8
