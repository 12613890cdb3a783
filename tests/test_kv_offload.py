"""The lower tiers of the prefix cache (engine/kv/tier_store.py, engine/kv/disk_tier.py):

- the block bookkeeping on a real KVCacheManager over a CPU tensor: an evicted block's KV
  lands in host memory, comes back into a fresh device block with its bytes intact, the
  events say which tier holds each hash (a move is a store with the new tier, removal only
  when no tier holds it), host evictions spill to disk and back, the protection of a
  lookup's hits while their blocks are allocated;
- the engine on a tiny random Llama: greedy tokens of prompts served from host memory and
  from disk equal a run that recomputes them, a node restarted on the same folder finds
  its blocks, a corrupted or truncated file and a temporary left by a kill are misses
  (deleted, counted; more faults in test_kv_disk_tier_faults.py), a full disk is a counted
  failure; nothing raises, the device pool is all free afterwards and the tiers stay
  within their sizes.
"""

import subprocess

import pytest
import torch

from splitserve.common.hashing import salt_id
from splitserve.common.kv_events import BlockRemoved, BlockStored, Tier
from splitserve.common.outcomes import TierFault
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv.cache_manager import KVCacheManager
from splitserve.engine.kv.disk_file import MAC_BYTES
from splitserve.engine.kv.disk_tier import SUFFIX, DiskLayout, DiskTier
from splitserve.engine.kv.tier_spec import Move, TierSpec

BS = 4
SALT = salt_id(("m",))
KEY = bytes(range(32))  # the disk tier's MAC key


class Observer:
    """Counts what the tiers report (the node's metrics implement the same calls)."""

    def __init__(self):
        self.hits = {Tier.HOST: 0, Tier.DISK: 0}
        self.queried = 0
        self.faults: list[TierFault] = []
        self.moves: list[Move] = []
        self.evictions = {Tier.HOST: 0, Tier.DISK: 0}

    def moved(self, move):
        self.moves.append(move)

    def looked_up(self, queried, hits):
        self.queried += queried
        for t, n in hits.items():
            self.hits[t] += n

    def evicted(self, tier, blocks):
        self.evictions[tier] += blocks

    def fault(self, tier, fault):
        self.faults.append(fault)


def manager(num_blocks=4, host_blocks=4, disk=None):
    kv = torch.zeros((2, 2, num_blocks, BS, 1, 2))
    mgr = KVCacheManager(num_blocks, BS, True, TierSpec(kv, host_blocks, disk))
    return kv, mgr.tiers, mgr


def land(off):
    """What the next forward does with the loads queued since the last one: all its layers."""
    loads = off.take_loads()
    if loads is not None:
        loads.wait_all()


def fill(kv, mgr, rid, tokens, value):
    """Allocate ``tokens`` for ``rid``, write ``value + block index`` into its blocks, cache
    them, free them: a finished request whose blocks stay cached."""
    hashes = [hash((rid, i)) & (2**64 - 1) for i in range(len(tokens) // BS)]
    hit = mgr.get_computed_blocks(hashes, tokens, SALT)
    assert mgr.allocate_slots(rid, len(tokens), hit.blocks, hit.lower) is not None
    land(mgr.tiers)
    for i, b in enumerate(mgr.block_ids(rid)):
        kv[:, :, b] = value + i
    mgr.cache_blocks(rid, hashes, tokens, len(tokens), SALT)
    mgr.free(rid)
    return hashes


def test_evicted_blocks_come_back_from_host_with_their_bytes_and_the_events_name_the_tier():
    kv, off, mgr = manager(num_blocks=4, host_blocks=8)
    a = list(range(8)) + [99]  # 2 full blocks (+1 token: the last is never a hit)
    ha = fill(kv, mgr, "a", a, 10.0)
    assert mgr.take_events() == [BlockStored(ha)]
    b = list(range(100, 112)) + [99]  # 4 blocks: evicts a's two
    fill(kv, mgr, "b", b, 20.0)
    events = mgr.take_events()
    moved = [h for e in events if isinstance(e, BlockStored) and e.tier is Tier.HOST for h in e.block_hashes]
    assert sorted(moved) == sorted(ha) and not any(isinstance(e, BlockRemoved) for e in events)
    assert mgr.held_blocks()[ha[0]] is Tier.HOST
    hit = mgr.get_computed_blocks(ha, a, SALT)
    assert hit.blocks == [] and [h.block_hash for h in hit.lower] == ha and hit.num_tokens == 8
    new = mgr.allocate_slots("a2", len(a), hit.blocks, hit.lower)
    assert new is not None
    land(off)
    for i, b_id in enumerate(mgr.block_ids("a2")[:2]):  # the bytes came back
        assert torch.all(kv[:, :, b_id] == 10.0 + i)
    assert mgr.held_blocks()[ha[0]] is Tier.DEVICE  # loaded back: device again, still on host too
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored) and e.tier is Tier.DEVICE]
    assert [h for e in stored for h in e.block_hashes][:2] == ha
    mgr.free("a2")
    assert mgr.num_free_blocks == 4


def test_cached_blocks_are_written_through_and_an_eviction_copies_only_what_the_host_lacks():
    kv, off, mgr = manager(num_blocks=6, host_blocks=8)
    obs = off.observer = Observer()
    tail = [1]  # a ninth token: each request has 3 blocks, 2 of them cached
    a = list(range(8)) + tail
    ha = fill(kv, mgr, "a", a, 10.0)
    off.flush()  # the engine flushes after each step: a's 2 blocks reach the host, still on the device
    assert [(m.blocks, m.batch, m.load) for m in obs.moves] == [(2, 1, False)]
    assert all(mgr.held_blocks()[h] is Tier.DEVICE for h in ha) and off.stats()[0].used_blocks == 2
    kv[:, :, :3] = -1.0  # a's device blocks change: the host keeps what was flushed
    hb = fill(kv, mgr, "b", list(range(20, 28)) + tail, 20.0)  # 3 free blocks: no eviction
    assert not off.before_forward()
    obs.moves.clear()
    fill(kv, mgr, "c", list(range(40, 48)) + tail, 30.0)  # evicts a's: the host has them
    assert obs.moves == [] and off.before_forward() == 1 and off.before_forward() == 0  # for a's batch, once
    assert all(mgr.held_blocks()[h] is Tier.HOST for h in ha)
    fill(kv, mgr, "d", list(range(60, 68)) + tail, 40.0)  # evicts b's, still queued: flushed first
    stores = [m for m in obs.moves if not m.load]
    assert [m.blocks for m in stores] == [4]  # b's and c's, one batch
    assert all(mgr.held_blocks()[h] is Tier.HOST for h in hb)
    hit = mgr.get_computed_blocks(ha, a, SALT)
    assert [h.tier for h in hit.lower] == [Tier.HOST, Tier.HOST]
    assert mgr.allocate_slots("a2", 9, hit.blocks, hit.lower) is not None
    land(off)
    assert [float(kv[0, 0, b, 0, 0, 0]) for b in mgr.block_ids("a2")[:2]] == [10.0, 11.0]
    mgr.free("a2")
    assert mgr.num_free_blocks == 6


def test_loads_land_layer_by_layer_as_the_forward_reaches_each_and_their_slots_are_held_until_then():
    kv, off, mgr = manager(num_blocks=5, host_blocks=2)
    obs = off.observer = Observer()
    a = list(range(8)) + [1]
    ha = fill(kv, mgr, "a", a, 10.0)
    fill(kv, mgr, "b", list(range(20, 36)) + [1], 20.0)  # 5 blocks: a's 2 -> host (its 2 slots)
    hit = mgr.get_computed_blocks(ha, a, SALT)
    assert len(hit.lower) == 2
    assert mgr.allocate_slots("a2", 9, hit.blocks, hit.lower) is not None
    ids = mgr.block_ids("a2")[:2]
    kv[:, :, ids] = -1.0  # whatever the new blocks held
    # before the forward: another request's eviction needs host slots, but both are a2's to load
    c = list(range(40, 44)) + [1]
    hc = [hash(("c", 0)) & (2**64 - 1)]
    hit_c = mgr.get_computed_blocks(hc, c, SALT)
    assert mgr.allocate_slots("c", 5, hit_c.blocks, hit_c.lower) is not None  # evicts b's: no slot for them
    assert all(mgr.held_blocks().get(h) is Tier.DEVICE for h in ha)  # a2's, and their host copies kept
    assert off.stats()[0].used_blocks == 2 and off.host.loading == set(ha)
    obs.moves.clear()
    loads = off.take_loads()
    assert loads is not None and off.take_loads() is None  # taken once
    assert torch.all(kv[:, :, ids] == -1.0)  # nothing copied before the forward reaches a layer
    loads.wait(0)
    assert [float(kv[0, 0, b, 0, 0, 0]) for b in ids] == [10.0, 11.0]
    assert torch.all(kv[1, :, ids] == -1.0) and obs.moves == []  # layer 1 not yet: no move yet
    loads.wait_all()
    loads.wait(1)  # once per layer
    assert [float(kv[1, 1, b, 3, 0, 1]) for b in ids] == [10.0, 11.0]
    assert [(m.load, m.blocks) for m in obs.moves] == [(True, 2)] and off.stats()[0].load_bytes_per_s > 0
    mgr.free("a2")
    mgr.free("c")


def test_a_block_the_host_dropped_while_on_the_device_is_copied_at_its_eviction():
    kv, off, mgr = manager(num_blocks=3, host_blocks=2)
    obs = off.observer = Observer()
    ha = fill(kv, mgr, "a", list(range(8)) + [1], 1.0)
    off.flush()
    off.clear()  # the host forgot a's copies (as an LRU that gave their slots away would)
    obs.moves.clear()
    fill(kv, mgr, "b", list(range(20, 28)) + [1], 2.0)  # evicts a's: copied now, on the step's path
    stores = [m for m in obs.moves if not m.load]
    assert [m.blocks for m in stores] == [1, 1] and off.before_forward() == stores[-1].batch  # the forward waits
    assert all(mgr.held_blocks()[h] is Tier.HOST for h in ha)


def test_a_full_host_tier_drops_least_recent_and_a_lookup_protects_its_hits():
    kv, off, mgr = manager(num_blocks=3, host_blocks=2)
    tail = [1]  # a ninth token: the 2 full blocks can be hits
    ha = fill(kv, mgr, "a", list(range(8)) + tail, 1.0)  # 2 cached blocks on the device
    hb = fill(kv, mgr, "b", list(range(20, 28)) + tail, 2.0)  # a's 2 -> host
    mgr.take_events()
    hc = fill(kv, mgr, "c", list(range(40, 48)) + tail, 3.0)  # b's 2 -> host; a's dropped
    events = mgr.take_events()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(ha)  # no tier holds them any more
    held = mgr.held_blocks()
    assert all(held[h] is Tier.HOST for h in hb) and all(held[h] is Tier.DEVICE for h in hc)
    assert all(h not in held for h in ha)
    b = list(range(20, 28)) + tail
    hit = mgr.get_computed_blocks(hb, b, SALT)
    assert len(hit.lower) == 2
    assert mgr.allocate_slots("b2", 13, hit.blocks, hit.lower) is None  # 4 blocks of 3: nothing changes
    # allocating b's 3 blocks evicts c's 2 into a host tier full of b's, which the lookup
    # protects: c's are dropped, b's bytes stay
    hit = mgr.get_computed_blocks(hb, b, SALT)
    assert mgr.allocate_slots("b2", 9, hit.blocks, hit.lower) is not None
    land(off)
    assert [float(kv[0, 0, blk, 0, 0, 0]) for blk in mgr.block_ids("b2")[:2]] == [2.0, 3.0]
    mgr.free("b2")
    held = mgr.held_blocks()
    assert all(held[h] is Tier.DEVICE for h in hb) and all(h not in held for h in hc)


def test_host_evictions_spill_to_disk_and_come_back(tmp_path):
    layout = DiskLayout("m", "float32", (2, 2, BS, 1, 2))
    block_bytes = 2 * 2 * BS * 1 * 2 * 4
    disk = DiskTier(tmp_path, layout, block_bytes, 64 << 10, KEY)
    kv, off, mgr = manager(num_blocks=3, host_blocks=1, disk=disk)
    obs = off.observer = Observer()
    ha = fill(kv, mgr, "a", list(range(8)) + [1], 5.0)
    fill(kv, mgr, "b", list(range(20, 28)) + [1], 6.0)  # a's blocks: host (1 slot), then disk
    fill(kv, mgr, "c", list(range(40, 48)) + [1], 7.0)
    disk.close()  # the writer finished its queue
    disk = off.disk = DiskTier(tmp_path, layout, block_bytes, 64 << 10, KEY)  # the tier restarted on its folder
    assert all(disk.contains(h) for h in ha)
    hit = mgr.get_computed_blocks(ha, list(range(8)) + [1], SALT)
    assert [h.tier for h in hit.lower] == [Tier.DISK, Tier.DISK]
    assert mgr.allocate_slots("a2", 8, hit.blocks, hit.lower) is not None
    land(off)
    assert [float(kv[1, 1, b, 3, 0, 1]) for b in mgr.block_ids("a2")] == [5.0, 6.0]
    assert obs.hits[Tier.DISK] == 2 and any(m.tier is Tier.DISK and m.load for m in obs.moves)
    disk.close()


BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # bytes of a tiny Llama's block: 2 layers, K and V, 16 tokens, 2 KV heads of 16, fp32


def tiny_llm(model_dir, blocks, **kw):
    from splitserve.engine.llm import LLM
    return LLM(str(model_dir), kv_cache_memory=blocks * BLOCK, max_num_seqs=4, **kw)


PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompts():
    """Three unrelated prompts of 6 full blocks each: each evicts the one before from 8 blocks."""
    return [[(7 * i + 13 * j + 1) % 250 + 1 for j in range(100)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny(shared_tiny_model):
    return shared_tiny_model("llama", max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = tiny_llm(tiny, 64, enable_prefix_caching=False)
    with llm:
        return [o.token_ids for o in llm.generate(prompts(), PARAMS)]


def run_turns(llm, order):
    """Generate ``prompts()[i]`` for each i of ``order``, one at a time; (tokens, cached tokens)."""
    ps = prompts()
    out = []
    for i in order:
        o = llm.generate([ps[i]], PARAMS)[0]
        out.append((i, o.token_ids, o.num_cached_tokens))
    return out


def test_engine_tokens_from_host_equal_recompute(tiny, reference):
    ps = prompts()
    llm = tiny_llm(tiny, 8, kv_offload_memory=32 * BLOCK)
    with llm:
        obs = llm.engine.kv.tiers.observer = Observer()
        turns = run_turns(llm, [0, 1, 2, 0, 1])
        for i, tokens, _ in turns:
            assert tokens == reference[i], f"prompt {i}"
        assert [c for _, _, c in turns[3:]] == [96, 96]  # 6 blocks each, from host memory
        assert obs.hits[Tier.HOST] == 12 and obs.hits[Tier.DISK] == 0
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
        host = llm.engine.tier_stats()[1]
        assert host.tier is Tier.HOST and host.used_blocks <= host.capacity_blocks == 32
        assert host.load_bytes_per_s > 0 and host.store_bytes_per_s > 0
        # a decode node's reservation loads its host hits at once (no forward follows it) ...
        res = llm.engine.reserve("r", llm.engine.prompt_ref(ps[2]))
        assert res is not None and res.num_cached_tokens == 96 and llm.engine.kv.tiers.take_loads() is None
        llm.engine.release("r")
        # ... so the blocks it leaves cached hold the right KV
        again = llm.generate([ps[2]], PARAMS)[0]
        assert again.token_ids == reference[2] and again.num_cached_tokens == 96
        assert obs.hits[Tier.HOST] == 18


def test_a_prompt_from_host_but_its_last_token_loads_before_a_static_decode_step(tiny):
    """Its one uncached token runs as a decode-shaped step (padded, no per-layer waits):
    the loads land in full before it."""
    ps = [p[:97] for p in prompts()[:2]]  # 6 full blocks and one token
    with tiny_llm(tiny, 64, enable_prefix_caching=False) as llm:
        want = [o.token_ids for o in llm.generate(ps, PARAMS)]
    with tiny_llm(tiny, 8, kv_offload_memory=32 * BLOCK) as llm:
        assert llm.engine.runner.static_decode is not None
        got = [llm.generate([ps[i]], PARAMS)[0] for i in (0, 1, 0)]
        assert [o.token_ids for o in got] == [want[0], want[1], want[0]] and got[2].num_cached_tokens == 96


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_tokens_from_host_equal_recompute_on_cuda(tiny):
    cuda = dict(device="cuda", dtype="float32")
    with tiny_llm(tiny, 64, enable_prefix_caching=False, **cuda) as llm:
        want = [o.token_ids for o in llm.generate(prompts(), PARAMS)]
    with tiny_llm(tiny, 8, kv_offload_memory=32 * BLOCK, **cuda) as llm:
        off = llm.engine.kv.tiers
        streams = off.streams
        assert llm.engine.config.async_scheduling and streams.copy_stream is not None and streams.load_stream is not None
        turns = run_turns(llm, [0, 1, 2, 0, 1, 2])  # each evicts the one before, written through
        for i, tokens, _ in turns:
            assert tokens == want[i], f"prompt {i}"
        assert [c for _, _, c in turns[3:]] == [96, 96, 96]  # from pinned host memory
        both = llm.generate(prompts()[:2], PARAMS)  # a batch: loads and stores in the same steps
        assert [o.token_ids for o in both] == want[:2]
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
        assert llm.engine.tier_stats()[1].load_bytes_per_s > 0  # timed by CUDA events
        # a decode node's reservation: it evicts cached blocks, waits for their stores only
        res = llm.engine.reserve("r", llm.engine.prompt_ref(prompts()[2]))  # and loads its host hits at once
        assert res is not None and len(res.block_ids) == 7 and res.num_cached_tokens == 96
        llm.engine.release("r")
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
        again = llm.generate([prompts()[2]], PARAMS)[0]  # from the blocks the reservation loaded
        assert again.token_ids == want[2] and again.num_cached_tokens == 96


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_host_load_kernel_reads_pinned_slots_into_scattered_blocks_on_cuda():
    from splitserve.engine.kv.host_load_kernel import load_layer

    layers, block = 32, (16, 8, 128)  # Llama-3-8B's blocks, bf16: 2 MiB each
    host = torch.randn((300, layers, 2, *block)).to(torch.bfloat16).pin_memory()
    kv = torch.zeros((layers, 2, 1024, *block), dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(300)[:256]
    blocks = torch.randperm(1024)[:256]
    dev_slots, dev_blocks = slots.cuda(), blocks.cuda()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for layer in range(layers):
        load_layer(host, kv, dev_slots, dev_blocks, layer)
    end.record()
    end.synchronize()
    got = kv.cpu()
    for s, b in zip(slots.tolist(), blocks.tolist()):
        assert torch.equal(got[:, :, b], host[s])
    assert int((got != 0).movedim(2, 0).flatten(1).any(1).sum()) == 256  # no other block written
    gbps = 256 * host[0].numel() * 2 / (start.elapsed_time(end) / 1e3) / 1e9
    print(f"host-tier load kernel: 256 scattered 2 MiB blocks at {gbps:.1f} GB/s")


def test_engine_tokens_from_disk_equal_recompute_and_survive_a_restart(tiny, reference, tmp_path):
    args = dict(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    llm = tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, **args)
    with llm:
        obs = llm.engine.kv.tiers.observer = Observer()
        turns = run_turns(llm, [0, 1, 2, 0])
        assert all(tokens == reference[i] for i, tokens, _ in turns)
        assert turns[3][2] == 96 and obs.hits[Tier.DISK] >= 4  # most of prompt 0 came from disk
    files = sorted(p for p in next(d for d in tmp_path.iterdir() if d.is_dir()).iterdir())
    assert files and all(p.suffix == SUFFIX for p in files)
    llm = tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, **args)  # a restarted node
    with llm:
        obs = llm.engine.kv.tiers.observer = Observer()
        (i, tokens, cached), = run_turns(llm, [1])
        assert tokens == reference[1] and cached == 96 and obs.hits[Tier.DISK] == 6


def test_bad_files_are_misses_never_wrong_tokens(tiny, reference, tmp_path):
    args = dict(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)
    llm = tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, **args)
    with llm:
        run_turns(llm, [0, 1, 2])
    folder = next(d for d in tmp_path.iterdir() if d.is_dir())
    files = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime)
    assert len(files) >= 6
    flipped, truncated = files[0], files[1]  # prompt 0's leading blocks (written first)
    data = bytearray(flipped.read_bytes())
    data[-MAC_BYTES - 5] ^= 0xFF  # one payload byte: only the MAC notices
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:100])
    (folder / "deadbeef.tmp123").write_bytes(b"half a block")  # a node killed while storing
    llm = tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, **args)
    with llm:
        obs = llm.engine.kv.tiers.observer = Observer()
        turns = run_turns(llm, [0])
        assert turns[0][1] == reference[0]
        assert TierFault.CORRUPT in obs.faults and TierFault.UNAUTHENTICATED in obs.faults
        # the damaged files are gone: the flipped one deleted when it was read (it may be written
        # whole again since: its block, recomputed, left the host for the disk), the cut one at start
        assert (not flipped.exists() or flipped.read_bytes() != bytes(data)) and not truncated.exists()
        assert not (folder / "deadbeef.tmp123").exists()
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks


def test_a_full_disk_is_a_counted_failure(tiny, reference, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k,mode=0700", "tmpfs", str(mount)],
                          capture_output=True)  # 0700: the tier refuses a folder others may access
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        llm = tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, kv_offload_dir=str(mount),
                                    kv_offload_disk_bytes=1 << 20)  # the tier allows more than the disk has
        with llm:
            obs = llm.engine.kv.tiers.observer = Observer()
            turns = run_turns(llm, [0, 1, 2, 0])
            assert all(tokens == reference[i] for i, tokens, _ in turns)
        assert TierFault.WRITE_FAILED in obs.faults
        folder = next(d for d in mount.iterdir() if d.is_dir())
        assert not [p for p in folder.iterdir() if p.suffix != SUFFIX]  # no temporaries left
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_tier_settings_are_checked():
    from splitserve.common.config import EngineConfig
    for kw, field in ((dict(kv_offload_dir="/tmp/x"), "kv_offload_dir"),
                      (dict(kv_offload_disk_bytes=10), "kv_offload_disk_bytes"),
                      (dict(kv_offload_memory=-1), "kv_offload_memory"),
                      (dict(kv_offload_memory=1 << 20, enable_prefix_caching=False), "kv_offload_memory"),
                      (dict(kv_offload_memory=1 << 20, tensor_parallel_size=2), "kv_offload_memory")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kw)
