"""Tensor parallelism without processes: the config checks, which heads and columns a rank
holds, each rank's slices of a checkpoint (read with safetensors slices) against the cut
of the whole model, dummy weights, the vocab-parallel embedding and LM head at the edges
of each rank's rows, the step message, and the group's failures (two real ranks)."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import msgspec
import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.deploy.ports import free_port
from splitserve.common.kv_heads import rank_heads
from splitserve.engine.llm import LLM
from splitserve.engine.models.loader import hf_to_ours, load_model
from splitserve.engine.models.llama import CausalLM, ParallelLMHead, VocabParallelEmbedding
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.families import model_config, read_model_config
from splitserve.engine.parallel.group import TPGroup
from splitserve.engine.models.sharding import model_tp_problems, shard_full, shard_of
from splitserve.engine.step_inputs import ForwardInputs, PrefillChunk
from splitserve.engine.parallel.step_channel import Control, Stop, ToWorker
from splitserve.tests.tp_ranks import fake_group, gloo_peer


def _cfg(heads=4, kv=2, inter=128, vocab=257) -> ModelConfig:
    return model_config(dict(architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=64,
                                      intermediate_size=inter, num_hidden_layers=1, num_attention_heads=heads,
                                      num_key_value_heads=kv))


def test_config_field_is_checked():
    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
    assert EngineConfig().tensor_parallel_size == 1


@pytest.mark.parametrize("heads, kv, inter, tp, expected", [
    (4, 2, 128, 3, ["tensor_parallel_size: 3 does not divide the model's 4 attention heads (num_attention_heads)",
                    "tensor_parallel_size: 3 is not a multiple of the model's 2 KV heads",
                    "tensor_parallel_size: 3 does not divide the model's intermediate_size 128"]),
    (8, 2, 128, 8, []),  # fewer KV heads than ranks: each replicated on 4 ranks
    (12, 4, 96, 6, ["tensor_parallel_size: 6 is not a multiple of the model's 4 KV heads"]),
    (4, 2, 130, 4, ["tensor_parallel_size: 4 does not divide the model's intermediate_size 130"]),
    (4, 4, 128, 2, []),
])
def test_model_checks_name_the_field_and_the_numbers(heads, kv, inter, tp, expected):
    problems = model_tp_problems(_cfg(heads, kv, inter), tp)
    assert len(problems) == len(expected)
    for got, want in zip(problems, expected):
        assert got.startswith(want), got


def test_llm_refuses_an_impossible_split_before_starting_a_worker(tiny_model_dir):
    path, _ = tiny_model_dir("llama")  # 4 heads, 2 KV heads
    before = set(mp.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's 4 attention heads"):
        LLM(str(path), tensor_parallel_size=3)
    assert set(mp.active_children()) == before


@pytest.mark.parametrize("heads, kv, tp", [(4, 2, 2), (4, 2, 4), (8, 8, 4), (8, 2, 8), (32, 8, 8), (4, 1, 4),
                                          (64, 8, 4)])
def test_a_ranks_query_heads_use_only_its_kv_heads(heads, kv, tp):
    cfg = _cfg(heads, kv, inter=64 * tp)
    for r in range(tp):
        shard = shard_of(cfg, r, tp)
        assert shard.kv_heads == rank_heads(r, tp, kv)  # the one rule the KV transfer applies too
        assert shard.num_heads == heads // tp
        used = {h // (heads // kv) for h in range(shard.q_heads.start, shard.q_heads.stop)}
        assert used <= set(range(shard.kv_heads.start, shard.kv_heads.stop)), (r, used, shard.kv_heads)
    covered = set().union(*(range(shard_of(cfg, r, tp).q_heads.start, shard_of(cfg, r, tp).q_heads.stop)
                            for r in range(tp)))
    assert covered == set(range(heads))


def test_vocab_rows_are_padded_to_a_multiple_of_tp():
    cfg = _cfg(vocab=257)
    shards = [shard_of(cfg, r, 4) for r in range(4)]
    assert [s.vocab for s in shards] == [(0, 65), (65, 130), (130, 195), (195, 260)]
    assert [s.vocab_real_rows for s in shards] == [65, 65, 65, 62]


@pytest.mark.parametrize("family, kv, tp", [("llama", 2, 2), ("llama", 2, 4), ("qwen2", 2, 2), ("qwen2", 1, 4),
                                             ("qwen3", 2, 2), ("qwen3", 1, 2), ("mistral", 4, 4)])
def test_checkpoint_slices_equal_the_cut_of_the_whole_model(tiny_model_dir, family, kv, tp):
    """What a rank reads from the safetensors files (its slices only) is exactly the cut
    (sharding.shard_full, the dummy loader's rule) of the TP=1 weights, biases included;
    a tied embedding is tied in the shard too."""
    path, _ = tiny_model_dir(family, num_key_value_heads=kv, tie_word_embeddings=(family == "qwen3"))
    cfg = read_model_config(path)
    with torch.device("meta"):
        whole_model = CausalLM(cfg)
    whole = hf_to_ours(whole_model, path)
    for r in range(tp):
        with torch.device("meta"):
            rank_model = CausalLM(cfg, fake_group(r, tp))
        mine = hf_to_ours(rank_model, path)
        assert mine.keys() == whole.keys()
        for name, t in mine.items():
            assert torch.equal(t, shard_full(name, whole[name], rank_model.shard, cfg)), (r, name)
    model = load_model(path, group=fake_group(1, tp))
    assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tie_word_embeddings


def test_dummy_weights_of_a_rank_are_its_cut_of_the_tp1_dummy_model(tiny_model_dir):
    path, _ = tiny_model_dir("qwen2", num_key_value_heads=1)
    whole = load_model(path, load_format="dummy")
    cfg = whole.cfg
    full = dict(whole.named_parameters())
    for r in range(2):
        shard = load_model(path, load_format="dummy", group=fake_group(r, 2))
        for name, p in shard.named_parameters():
            assert torch.equal(p, shard_full(name, full[name], shard.shard, cfg)), (r, name)


class _Partial(TPGroup):
    """A rank whose collectives return its own part: the test adds the parts up."""

    def all_reduce(self, t, op="sum", timeout_s=None):
        return t

    def all_gather(self, t, dim=-1, timeout_s=None):
        return t


def test_vocab_parallel_embedding_and_head_cover_every_token_once():
    cfg = _cfg(vocab=257)
    torch.manual_seed(0)
    table = torch.randn(cfg.vocab_size, cfg.hidden_size)
    ids = torch.arange(cfg.vocab_size)  # every token, the rank boundaries included
    x = torch.randn(3, cfg.hidden_size)
    for tp in (2, 4):
        summed, logits = torch.zeros(len(ids), cfg.hidden_size), []
        for r in range(tp):
            shard = shard_of(cfg, r, tp)
            group = _Partial(r, tp, torch.device("cpu"), pg=object())
            emb, head = VocabParallelEmbedding(shard, cfg.hidden_size, group), ParallelLMHead(shard, cfg.hidden_size, group)
            with torch.no_grad():
                rows = shard_full("embed_tokens.weight", table, shard, cfg)
                emb.weight.copy_(rows)
                head.weight.copy_(rows)
                summed += emb(ids)
                logits.append(torch.nn.functional.linear(x, head.weight))
        assert torch.equal(summed, table)
        torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :cfg.vocab_size], x @ table.T)


def test_step_messages_round_trip():
    inputs = ForwardInputs(False, [1, 2, 3, 0], [5, 0, 1, 2], [[4, 7]], [PrefillChunk(1, 3, 0, [2])], [0, 3],
                           [0], 2)
    decoder = msgspec.msgpack.Decoder(ToWorker)
    for msg in (inputs, Control("kv_export", b"\x00\x01"), Stop()):
        assert decoder.decode(msgspec.msgpack.encode(msg)) == msg
    assert inputs.decode_slots(block_size=4) == [7 * 4 + 1]
    assert PrefillChunk(0, 3, 5, [9, 2]).key_slots(4).tolist() == [36, 37, 38, 39, 8, 9, 10, 11]


@pytest.mark.parametrize("fault, bound_s", [("kill", 1.5), ("hang", 6.0)])
def test_group_collectives_and_a_dead_or_hung_peer(fault, bound_s):
    """Two real ranks: the collectives' results, then the peer dies (sockets closed: the next
    all_reduce fails at once) or hangs (SIGSTOP: it fails after the 2 s timeout)."""
    import time

    from splitserve.engine.parallel.group import CollectiveError, init_tp_group

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    peer = ctx.Process(target=gloo_peer, args=(port, fault, q), daemon=True)
    peer.start()
    try:
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30))
        group = init_tp_group(0, 2, torch.device("cpu"), store, timeout_s=2)
        t = torch.full((4,), 1.0)
        assert group.all_reduce(t).tolist() == [3.0] * 4
        assert group.all_gather(torch.tensor([[0]]), dim=-1).tolist() == [[0, 1]]
        assert group.min_int(7) == 6
        assert q.get(timeout=10) == ("sum", [3.0] * 4, [[0, 1]], 6)
        time.sleep(0.5)  # the peer is dead or stopped by now
        t0 = time.monotonic()
        with pytest.raises(CollectiveError, match="all_reduce failed on rank 0 of 2"):
            group.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < bound_s
    finally:
        peer.kill()
        peer.join()
