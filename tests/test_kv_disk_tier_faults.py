"""Faults of the disk tier (engine/kv/disk_tier.py, engine/kv/disk_trust.py).

Every damaged, planted or unsafe block file is a miss and a counted ``TierFault``, dropped
from the index, and the tier serves on: a file cut after its magic, a header length beyond
the file, a payload of the wrong size, a file grown since it was indexed, a folder, a fifo
or a symlink where a block file should be, a file of another user, a file without a valid
MAC (planted, or written under another node's key). The start-up scan skips folders and
removes what is not a block file of ours. The folders are private to the node's user
(created 0700; another user's folder, or one others may access, is refused at start-up),
block files are written 0600, and the MAC key comes from the environment, a key file, or a
key file the tier makes once and reuses. Races of the writer thread and the engine thread
over one hash are no faults: a damaged file dropped while the writer stores the block again
leaves the new file, and a file the writer evicts while it is read is a plain miss.

And through the real engine: a prompt pushed to disk whose files are then cut short is
served again with the tokens of a run without tiers, and no request fails.
"""

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from splitserve.common.hashing import hash_blocks, salt_id
from splitserve.common.prompt_ref import PromptKeys
from splitserve.common.outcomes import TierFault
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv.disk_file import MAC_BYTES, DiskHeader, block_file_name, encode_block
from splitserve.engine.kv.disk_tier import MAGIC, DiskLayout, DiskTier
from splitserve.engine.kv.disk_trust import KEY_ENV, KEY_FILE_ENV, KEY_FILE_NAME, disk_key

LAYOUT = DiskLayout("m", "float32", (2, 2, 4, 1, 2))
BB = 2 * 2 * 4 * 1 * 2 * 4  # bytes of one block of LAYOUT
KEY, OTHER_KEY = bytes(range(32)), bytes(range(1, 33))
TOKENS = (1, 2, 3, 4)
SALT = salt_id(("m",))
PAYLOAD = bytes(range(BB))
FOREIGN_UID = 54321  # a user that is not this node's

BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # bytes of the tiny Llama's block: 2 layers, K and V, 16 tokens, 2 KV heads of 16, fp32
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Faults:
    """The tier observer's fault calls (node/metrics.py implements the same)."""

    def __init__(self):
        self.faults: list[TierFault] = []

    def moved(self, move): ...

    def looked_up(self, queried, hits): ...

    def evicted(self, tier, blocks): ...

    def fault(self, tier, fault):
        self.faults.append(fault)


@pytest.fixture
def make():
    """make(root, key=KEY) -> a DiskTier of LAYOUT over ``root``; all closed at the end."""
    made: list[DiskTier] = []

    def new(root, key=KEY):
        made.append(DiskTier(root, LAYOUT, BB, 1 << 20, key))
        return made[-1]
    yield new
    for t in made:
        t.close()


def stored(t: DiskTier, h: int = 1) -> Path:
    """Have ``t``'s writer store block ``h``; its file."""
    t.put(h, TOKENS, SALT, PAYLOAD)
    deadline = time.monotonic() + 10
    while not t.contains(h):
        assert time.monotonic() < deadline, "the writer did not store the block"
        time.sleep(0.005)
    return t.dir / block_file_name(h)


def forge(t: DiskTier, h: int, key: bytes, payload: bytes = PAYLOAD, salt: bytes = SALT) -> Path:
    """Write block ``h``'s file in ``t``'s folder by hand, its MAC made with ``key``."""
    header = DiskHeader(LAYOUT.model, LAYOUT.dtype, list(LAYOUT.block_shape), h, salt, list(TOKENS), len(payload))
    head, mac = encode_block(header, payload, key)
    path = t.dir / block_file_name(h)
    path.write_bytes(head + payload + mac)
    return path


def is_miss(t: DiskTier, h: int, fault: TierFault) -> None:
    """Reading block ``h`` is a miss that counts ``fault`` and drops it from the index, and
    the tier serves on."""
    assert t.read(h, TOKENS, SALT) is None
    dropped, faults = t.take_dropped()
    assert faults == [fault] and dropped == [h] and not t.contains(h)
    assert t.read(h, TOKENS, SALT) is None and t.take_dropped() == ([], [])  # no second fault
    stored(t, 99)
    assert bytes(t.read(99, TOKENS, SALT)) == PAYLOAD


def test_a_sound_file_is_read_back_and_a_restarted_tier_finds_it(make, tmp_path):
    t = make(tmp_path)
    stored(t)
    assert bytes(t.read(1, TOKENS, SALT)) == PAYLOAD
    t.close()
    again = make(tmp_path)
    assert bytes(again.read(1, TOKENS, SALT)) == PAYLOAD and again.take_dropped() == ([], [])


def test_a_file_cut_after_its_magic_is_a_miss_and_the_tier_serves_on(make, tmp_path):
    t = make(tmp_path)
    path = stored(t)
    path.write_bytes(path.read_bytes()[:len(MAGIC) + 2])
    is_miss(t, 1, TierFault.CORRUPT)
    assert not path.exists()
    stored(t, 2).write_bytes(PAYLOAD[:len(MAGIC) + 2])  # and one found so at the next start
    t.close()
    again = make(tmp_path)
    assert not again.contains(2) and again.take_dropped() == ([], [TierFault.CORRUPT])


def test_a_header_length_beyond_the_file_is_a_miss(make, tmp_path):
    t = make(tmp_path)
    path = stored(t)
    data = bytearray(path.read_bytes())
    data[len(MAGIC):len(MAGIC) + 4] = (len(data)).to_bytes(4, "little")  # the same size: the index agrees
    path.write_bytes(bytes(data))
    is_miss(t, 1, TierFault.CORRUPT)


def test_a_payload_of_the_wrong_size_is_a_miss_even_under_the_right_key(make, tmp_path):
    t = make(tmp_path)
    path = forge(t, 1, KEY, PAYLOAD[:-1])
    t.close()
    t = make(tmp_path)  # indexed at its size
    assert t.contains(1)
    is_miss(t, 1, TierFault.CORRUPT)
    assert not path.exists()


def test_a_file_grown_since_it_was_indexed_is_a_miss(make, tmp_path):
    t = make(tmp_path)
    path = stored(t)
    with open(path, "ab") as f:
        f.write(b"\0" * 4096)
    is_miss(t, 1, TierFault.CORRUPT)


def test_a_folder_where_a_block_file_should_be_is_a_miss(make, tmp_path):
    t = make(tmp_path)
    path = stored(t)
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")
    is_miss(t, 1, TierFault.UNSAFE)
    assert (path / "inside").exists()  # never entered


def test_a_fifo_where_a_block_file_should_be_is_a_miss_not_a_hang(make, tmp_path):
    t = make(tmp_path)
    path = stored(t)
    path.unlink()
    os.mkfifo(path)
    done = threading.Event()
    threading.Thread(target=lambda: (t.read(1, TOKENS, SALT), done.set()), daemon=True).start()
    assert done.wait(5), "reading a fifo blocked"
    assert t.take_dropped() == ([1], [TierFault.UNSAFE]) and not path.exists()


def test_a_symlink_to_a_sound_block_file_is_not_followed(make, tmp_path):
    t = make(tmp_path / "kv")
    path = stored(t)
    target = tmp_path / "elsewhere.kvb"
    path.rename(target)
    path.symlink_to(target)
    is_miss(t, 1, TierFault.UNSAFE)
    assert not path.is_symlink() and target.read_bytes()  # the link went, the target stays


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_of_another_user_is_a_miss(make, tmp_path):
    t = make(tmp_path)
    path = stored(t)
    os.chown(path, FOREIGN_UID, FOREIGN_UID)
    is_miss(t, 1, TierFault.UNSAFE)
    assert not path.exists()


def test_a_file_written_under_another_key_is_a_miss_and_removed(make, tmp_path):
    other = make(tmp_path / "other", OTHER_KEY)
    t = make(tmp_path / "kv")
    (t.dir / block_file_name(1)).write_bytes(stored(other).read_bytes())  # another node's, or a copied one
    t.close()
    t = make(tmp_path / "kv")
    assert t.contains(1)
    is_miss(t, 1, TierFault.UNAUTHENTICATED)
    assert not (t.dir / block_file_name(1)).exists()


def test_a_planted_file_without_a_valid_mac_is_a_miss(make, tmp_path):
    t = make(tmp_path)
    planted = forge(t, 1, KEY)
    data = bytearray(planted.read_bytes())
    data[-MAC_BYTES:] = bytes(MAC_BYTES)  # well formed, but no key made its MAC
    planted.write_bytes(bytes(data))
    t.close()
    t = make(tmp_path)
    is_miss(t, 1, TierFault.UNAUTHENTICATED)


def test_a_sound_file_of_another_salt_or_tokens_is_a_miss_that_stays(make, tmp_path):
    t = make(tmp_path)
    stored(t)
    assert t.read(1, TOKENS, salt_id(("m", "cache_salt", "b"))) is None
    assert t.read(1, (1, 2, 3, 5), SALT) is None
    assert t.contains(1) and t.take_dropped() == ([], [])  # not damaged: another block's (a collision)
    assert bytes(t.read(1, TOKENS, SALT)) == PAYLOAD


def test_a_bad_file_dropped_while_the_writer_rewrites_its_hash_leaves_the_new_file(make, tmp_path):
    """Issue 53 (9b): the engine thread drops a damaged file while the writer rewrites the same
    hash. The drop's unlink is held back until the writer could have replaced the file (it
    cannot while the drop holds the tier's lock): the rewritten file must survive, and reading
    it back is no fault."""
    t = make(tmp_path)
    path = stored(t, 7)
    data = bytearray(path.read_bytes())
    data[-MAC_BYTES - 1] ^= 0xFF  # a flipped payload byte: its MAC fails
    path.write_bytes(bytes(data))
    old = path.stat().st_ino
    unlink = t._unlink

    def unlink_once_rewritten(name: str) -> None:
        if name == path.name and threading.current_thread() is threading.main_thread():
            t.put(7, TOKENS, SALT, PAYLOAD)  # the same block stored again, racing this drop
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                try:
                    if path.stat().st_ino != old:
                        break  # the writer replaced the file: the drop now unlinks the new one
                except FileNotFoundError:
                    pass
                time.sleep(0.005)
        unlink(name)

    t._unlink = unlink_once_rewritten  # the real unlink, held back
    assert t.read(7, TOKENS, SALT) is None  # the damaged file: a miss
    deadline = time.monotonic() + 10
    while not t.contains(7):
        assert time.monotonic() < deadline, "the writer did not store the block again"
        time.sleep(0.005)
    assert t.read(7, TOKENS, SALT) is not None, "the rewritten file was deleted by the drop of the old one"
    dropped, faults = t.take_dropped()
    assert faults == [TierFault.UNAUTHENTICATED] and dropped == [7]  # the damaged file's, no other


def test_a_read_racing_the_writers_eviction_of_its_file_is_a_plain_miss(make, tmp_path, monkeypatch):
    """Issue 53 (9b): a file the writer evicts (for room) while the engine thread reads it is a
    miss, not a corrupt file: no fault, and nothing else deleted."""
    from splitserve.engine.kv import disk_tier

    header = DiskHeader(LAYOUT.model, LAYOUT.dtype, list(LAYOUT.block_shape), 7, SALT, list(TOKENS), BB)
    head, mac = encode_block(header, PAYLOAD, KEY)
    t = DiskTier(tmp_path, LAYOUT, BB, len(head) + BB + len(mac), KEY)  # room for one file
    try:
        stored(t, 7)
        read = disk_tier.read_block_file

        def read_after_eviction(path, size):
            stored(t, 8)  # the writer evicts 7 to make room for 8
            return read(path, size)

        monkeypatch.setattr(disk_tier, "read_block_file", read_after_eviction)
        assert t.read(7, TOKENS, SALT) is None
        monkeypatch.setattr(disk_tier, "read_block_file", read)
        assert t.take_dropped() == ([7], [])  # 7 evicted for room; not a corrupt file
        assert bytes(t.read(8, TOKENS, SALT)) == PAYLOAD and t.take_dropped() == ([], [])
    finally:
        t.close()


def test_the_start_up_scan_skips_folders_and_removes_what_is_no_block_file_of_ours(make, tmp_path):
    t = make(tmp_path / "kv")
    good = stored(t, 0xAB)
    t.close()
    folder = t.dir
    (folder / "sub").mkdir()
    (folder / "sub" / "1.kvb").write_bytes(good.read_bytes())
    (folder / "c.kvb").mkdir()  # a folder under a block file's name
    outside = tmp_path / "outside"
    outside.write_bytes(good.read_bytes())
    (folder / "d.kvb").symlink_to(outside)
    (folder / "0ab.kvb").write_bytes(good.read_bytes())  # another name of block ab
    (folder / ".tmp-1234").write_bytes(b"half a block")  # a node killed while storing
    (folder / "e.kvb").write_bytes(b"short")
    again = make(tmp_path / "kv")
    assert again.hashes() == [0xAB] and bytes(again.read(0xAB, TOKENS, SALT)) == PAYLOAD
    assert sorted(p.name for p in folder.iterdir()) == ["ab.kvb", "c.kvb", "sub"]
    assert outside.exists() and (folder / "sub" / "1.kvb").exists()
    assert sorted(again.take_dropped()[1]) == sorted([TierFault.UNSAFE, TierFault.CORRUPT])


def test_folders_are_made_private_and_files_written_owner_only(make, tmp_path):
    t = make(tmp_path / "a" / "kv")
    path = stored(t)
    for folder in (tmp_path / "a", tmp_path / "a" / "kv", t.dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_folder_others_may_access_or_of_another_user_is_refused_with_what_to_do(make, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ValueError, match=f"other users may access {shared} .*chmod 700"):
        make(shared)
    shared.chmod(0o700)
    (shared / LAYOUT.digest).symlink_to(tmp_path)  # the layout's folder must be a folder of its own
    with pytest.raises(ValueError, match="not a folder"):
        make(shared)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, FOREIGN_UID, FOREIGN_UID)
        with pytest.raises(ValueError, match=f"{theirs} belongs to uid {FOREIGN_UID}"):
            make(theirs)


def test_the_key_comes_from_the_environment_a_key_file_or_one_made_once(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    assert disk_key(root, {KEY_ENV: KEY.hex()}) == KEY
    with pytest.raises(ValueError, match=KEY_ENV):
        disk_key(root, {KEY_ENV: "not hex"})
    with pytest.raises(ValueError, match=KEY_ENV):
        disk_key(root, {KEY_ENV: "abcd"})  # too short
    file = tmp_path / "key"
    file.write_text(OTHER_KEY.hex() + "\n")
    file.chmod(0o644)
    with pytest.raises(ValueError, match="mode 600"):
        disk_key(root, {KEY_FILE_ENV: str(file)})
    file.chmod(0o600)
    assert disk_key(root, {KEY_FILE_ENV: str(file)}) == OTHER_KEY
    assert not (root / KEY_FILE_NAME).exists()
    made = disk_key(root, {})
    assert len(made) == 32 and stat.S_IMODE((root / KEY_FILE_NAME).stat().st_mode) == 0o600
    assert disk_key(root, {}) == made  # reused: a restarted node reads its own files
    (root / KEY_FILE_NAME).write_text("garbled")
    with pytest.raises(ValueError, match="delete it for a new key"):
        disk_key(root, {})


def test_an_engine_refuses_a_disk_tier_folder_others_may_read(tiny, tmp_path):
    tmp_path.chmod(0o755)
    with pytest.raises(ValueError, match=f"kv_offload_dir: other users may access {tmp_path}"):
        tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=1 << 20)


@pytest.fixture(scope="module")
def tiny(shared_tiny_model):
    return shared_tiny_model("llama", max_position_embeddings=512)


def tiny_llm(model_dir, blocks, **kw):
    from splitserve.engine.llm import LLM
    return LLM(str(model_dir), kv_cache_memory=blocks * BLOCK, max_num_seqs=4, **kw)


def prompts():
    """Three unrelated prompts of 6 full blocks each: each evicts the one before from 8 blocks."""
    return [[(7 * i + 13 * j + 1) % 250 + 1 for j in range(100)] for i in range(3)]


def test_the_engine_serves_a_prompt_whose_disk_files_were_cut_short_with_the_right_tokens(tiny, tmp_path):
    with tiny_llm(tiny, 64, enable_prefix_caching=False) as llm:
        want = [o.token_ids for o in llm.generate(prompts(), PARAMS)]
    with tiny_llm(tiny, 8, kv_offload_memory=2 * BLOCK, kv_offload_dir=str(tmp_path),
                  kv_offload_disk_bytes=1 << 20) as llm:
        engine = llm.engine
        disk = engine.kv.tiers.disk
        obs = engine.kv.tiers.observer = Faults()
        for p in prompts():
            llm.generate([p], PARAMS)
        hashes = hash_blocks(prompts()[0], 16, PromptKeys(model=engine.config.model_id).hash_keys())
        deadline = time.monotonic() + 10
        while not all(disk.contains(h) for h in hashes[:4]) and time.monotonic() < deadline:
            time.sleep(0.02)  # the writer stores prompt 0's blocks
        cut = [disk.dir / f"{h:x}.kvb" for h in hashes[:4]]
        for path in cut:
            path.write_bytes(path.read_bytes()[:len(MAGIC) + 2])
        again = llm.generate(prompts(), PARAMS)  # prompt 0 finds its blocks on disk, cut short
        assert [o.token_ids for o in again] == want
        assert all(o.finish_reason == "length" for o in again)
        assert TierFault.CORRUPT in obs.faults
        # the one the lookup read (its run ended there) is gone, or written whole again since
        assert any(not p.exists() or p.stat().st_size > len(MAGIC) + 2 for p in cut)
        for _ in range(2):  # the node serves on, whichever cut file a lookup reaches next
            assert [o.token_ids for o in llm.generate(prompts(), PARAMS)] == want
        assert engine.kv.num_free_blocks == engine.num_blocks
