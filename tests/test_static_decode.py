"""Static-shape decode (engine/decode_graphs.py) on CPU: padded batch-size buckets give
the same tokens as the eager path (greedy and seeded sampling, requests joining and
leaving mid-run), padding rows write only the scratch block, and the config/CLI flags.
On a GPU the greedy check runs with CUDA graphs captured, on a tiny random Llama."""

import argparse

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.attention.torch_backend import TorchAttention
from splitserve.engine.decode_graphs import StaticDecode, default_graph_sizes


def test_default_buckets_follow_vllm_and_cover_max_num_seqs():
    assert default_graph_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_graph_sizes(10) == (1, 2, 4, 8, 10)
    assert default_graph_sizes(1) == (1,)


def test_config_and_cli_flags():
    from splitserve.cli import _add_engine_args, engine_config

    assert EngineConfig(cuda_graph_sizes=(8, 1, 2, 2)).cuda_graph_sizes == (1, 2, 8)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=(0, 4))
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=())
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    cfg = engine_config(p.parse_args([]))
    assert (cfg.enforce_eager, cfg.cuda_graph_sizes) == (False, None)
    cfg = engine_config(p.parse_args(["--enforce-eager", "--cuda-graph-sizes", "4", "1", "2"]))
    assert (cfg.enforce_eager, cfg.cuda_graph_sizes) == (True, (1, 2, 4))


def test_padding_rows_write_only_the_scratch_block(tiny_llama_dir):
    from splitserve.engine.models.loader import load_model

    path, _ = tiny_llama_dir()
    model = load_model(path, torch.float32, torch.device("cpu"))
    cfg, bs, num_blocks = model.cfg, 4, 12
    kv = torch.randn(cfg.num_layers, 2, num_blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim)
    before = kv.clone()
    static = StaticDecode(model, kv, TorchAttention(), (1, 4, 8), max_blocks_per_seq=8, scratch_block=num_blocks,
                          use_graphs=False)
    tables = [[3, 5], [7], [0, 1, 2]]
    positions = [5, 2, 9]  # slots 5*4+1, 7*4+2, 2*4+1
    logits = static.run([11, 12, 13], positions, tables)  # 3 rows -> bucket 4: one padding row
    assert logits.shape == (3, cfg.vocab_size)
    written = {(5, 1), (7, 2), (2, 1)}
    for b in range(num_blocks):
        for o in range(bs):
            same = torch.equal(kv[:, :, b, o], before[:, :, b, o])
            assert same != ((b, o) in written), (b, o)
    assert not torch.equal(kv[:, :, num_blocks, 0], before[:, :, num_blocks, 0])  # the padding row's write
    # the real rows' logits do not depend on the padding: bucket 4 vs the exact batch of 3
    exact = StaticDecode(model, before.clone(), TorchAttention(), (3,), 8, num_blocks, use_graphs=False)
    torch.testing.assert_close(logits, exact.run([11, 12, 13], positions, tables), rtol=1e-5, atol=1e-5)


def continuous_batch(tokenizer, params_for):
    """11 requests of different lengths: 8 start, 3 join mid-run, all finish at different
    steps, so decode batches shrink and grow through several buckets."""
    topics = ["tea", "maps", "owls", "clocks", "rain", "salt", "ships", "glass", "bread", "wolves", "kites"]
    requests = {t: (tokenizer(f"Tell me one fact about {t}.")["input_ids"], params_for(i))
                for i, t in enumerate(topics)}
    return requests, {"bread": 1, "wolves": 2, "kites": 9}


def run_both(make_engine, run_engine, requests, join_at, monkeypatch, replays=None, **engine_args):
    """(eager tokens, static tokens, buckets the static runs used); ``replays`` (a list) gets, per
    static step, (whether a captured graph ran it, the attention backend's name)."""
    buckets = []
    real_run = StaticDecode.run

    def spy(self, ids, positions, tables, from_last=None):
        buckets.append(self.bucket(len(ids)))
        if replays is not None:
            replays.append((self.bucket(len(ids)) in self.graphs, self.backend.name))
        return real_run(self, ids, positions, tables, from_last)

    monkeypatch.setattr(StaticDecode, "run", spy)
    eager = run_engine(make_engine(enforce_eager=True, **engine_args), requests, join_at)
    assert not buckets
    static = run_engine(make_engine(**engine_args), requests, join_at)
    return eager, static, set(buckets)


@pytest.mark.slow
def test_greedy_tokens_equal_eager_across_buckets(make_engine, run_engine, tokenizer, monkeypatch):
    requests, join_at = continuous_batch(
        tokenizer, lambda i: SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True))
    eager, static, buckets = run_both(make_engine, run_engine, requests, join_at, monkeypatch,
                                      max_num_seqs=16, num_threads=1)
    assert static == eager
    assert {1, 2, 4, 8, 16} <= buckets  # every bucket ran, padded most of the time
    assert all(len(static[r]) == requests[r][1].max_tokens for r in requests)


@pytest.mark.slow
def test_seeded_and_unseeded_sampling_equal_eager(make_engine, run_engine, tokenizer, monkeypatch):
    requests, join_at = continuous_batch(
        tokenizer, lambda i: SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=3 + i,
                                            seed=100 + i if i % 2 else None, ignore_eos=True))
    eager, static, buckets = run_both(make_engine, run_engine, requests, join_at, monkeypatch,
                                      max_num_seqs=16, cuda_graph_sizes=(2, 4, 8), num_threads=1)
    assert static == eager
    assert buckets == {2, 4, 8}  # 9+ decodes exceed the largest bucket and run eagerly


def continuous_batch_ids(params_for):
    """continuous_batch's schedule with token-id prompts (3 to 40 tokens) for a tiny random model."""
    lengths = [5, 9, 3, 14, 7, 11, 4, 17, 40, 6, 21]
    requests = {f"r{i}": ([(11 * i + 7 * j) % 250 + 1 for j in range(n)], params_for(i))
                for i, n in enumerate(lengths)}
    return requests, {"r8": 1, "r9": 2, "r10": 9}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_equal_eager_on_gpu(make_engine, run_engine, tiny_kernel_llama, monkeypatch):
    """A tiny random Llama with head_dim 64: the captured graphs run the CUDA kernels."""
    path, _ = tiny_kernel_llama()
    requests, join_at = continuous_batch_ids(
        lambda i: SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True))
    replays = []
    eager, static, buckets = run_both(make_engine, run_engine, requests, join_at, monkeypatch, replays,
                                      model=str(path), kv_cache_memory=32 << 20, max_num_seqs=16, device="cuda",
                                      dtype="float32")
    assert static == eager and {1, 2, 4, 8, 16} <= buckets
    assert all(len(static[r]) == requests[r][1].max_tokens for r in requests)
    assert replays and set(replays) == {(True, "cuda")}  # every static step replayed a graph of the CUDA kernels


def test_full_width_tables_with_stale_columns_equal_cut_tables(tiny_llama_dir):
    """What a CUDA graph reads: all W table columns, where columns past a row's blocks hold
    stale ids from earlier steps. On CPU the same layout (masked by seq_len) gives the
    logits and cache writes of the tables cut to the step's widest row."""
    from splitserve.engine.models.loader import load_model

    path, _ = tiny_llama_dir()
    model = load_model(path, torch.float32, torch.device("cpu"))
    cfg, bs, num_blocks = model.cfg, 4, 16
    kv = torch.randn(cfg.num_layers, 2, num_blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim)
    full = StaticDecode(model, kv.clone(), TorchAttention(), (2, 4), 8, num_blocks, use_graphs=False)
    full.full_width = True
    cut = StaticDecode(model, kv.clone(), TorchAttention(), (2, 4), 8, num_blocks, use_graphs=False)
    steps = [  # (ids, positions, tables): rows leave, shrink and reorder between steps
        ([1, 2, 3], [13, 6, 9], [[0, 1, 2, 3], [4, 5], [6, 7, 8]]),
        ([4, 5], [3, 14], [[9], [0, 1, 2, 3]]),
        ([6], [4], [[10, 11]]),
    ]
    for ids, positions, tables in steps:
        torch.testing.assert_close(full.run(ids, positions, tables), cut.run(ids, positions, tables),
                                   rtol=1e-5, atol=1e-5)
    assert full.h_tables[1, 3] == 3  # a stale column from the first step was there all along
    torch.testing.assert_close(full.kv_caches[:, :, :num_blocks], cut.kv_caches[:, :, :num_blocks])
