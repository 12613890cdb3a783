"""Backend selection, its config and flags, the kernel wrappers' argument checks, the
split-K partition choice, and the torch reference itself, all on CPU."""

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.engine.attention.partition import decode_partition_size
from splitserve.engine.attention.selector import select_backend
from splitserve.engine.attention.torch_backend import TorchAttention, build_decode_mask

CPU = torch.device("cpu")


def test_dtype_auto_resolves_by_device():
    assert EngineConfig().dtype == "float32"
    assert EngineConfig(device="cuda").dtype == "bfloat16"
    assert EngineConfig(device="cuda:1", dtype="float16").dtype == "float16"
    assert EngineConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype="int8")


def test_attention_backend_is_validated():
    assert EngineConfig().attention_backend == "auto"
    with pytest.raises(ValueError, match="attention_backend: must be auto, cuda, triton or torch"):
        EngineConfig(attention_backend="flash")
    for name in ("cuda", "triton"):
        with pytest.raises(ValueError, match="attention_backend.*needs a CUDA device"):
            EngineConfig(attention_backend=name)
        assert EngineConfig(device="cuda", attention_backend=name).attention_backend == name


def test_cpu_always_gets_the_torch_reference():
    for name in ("auto", "torch"):
        backend = select_backend(EngineConfig(attention_backend=name), CPU, head_dim=64)
        assert type(backend) is TorchAttention and backend.needs_decode_mask
    for name in ("cuda", "triton"):  # a config meant for a GPU, handed a CPU device
        with pytest.raises(ValueError, match="attention_backend.*needs a CUDA device.*cpu"):
            select_backend(EngineConfig(device="cuda", attention_backend=name), CPU, head_dim=64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallbacks are forced by a machine without CUDA")
def test_auto_falls_back_to_torch_and_explicit_choices_say_why(caplog):
    """A config for a GPU on a machine without one: auto tries the CUDA kernels (cannot
    build), then Triton (no GPU), then takes the reference, logging each reason."""
    from splitserve.csrc.build import CsrcBuildError

    cuda = torch.device("cuda")
    with caplog.at_level("WARNING"):
        backend = select_backend(EngineConfig(device="cuda"), cuda, head_dim=64)
    assert type(backend) is TorchAttention
    reasons = [r.getMessage() for r in caplog.records if "fallback" in r.getMessage()]
    assert len(reasons) == 2 and "CUDA" in reasons[0] and "Triton" in reasons[1], reasons
    with pytest.raises(CsrcBuildError, match="attention-backend"):
        select_backend(EngineConfig(device="cuda", attention_backend="cuda"), cuda, head_dim=64)
    with pytest.raises(ValueError, match="attention_backend: the CUDA kernels support head_dim"):
        select_backend(EngineConfig(device="cuda", attention_backend="cuda"), cuda, head_dim=96)
    with pytest.raises(ValueError, match="attention_backend: the Triton kernels need a visible CUDA GPU"):
        select_backend(EngineConfig(device="cuda", attention_backend="triton"), cuda, head_dim=64)
    assert type(select_backend(EngineConfig(device="cuda", attention_backend="torch"), cuda, 64)) is TorchAttention


def test_engine_on_cpu_uses_torch(make_engine, tiny_llama_dir):
    path, _ = tiny_llama_dir()
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20)
    assert engine.runner.backend.name == "torch"
    assert engine.runner.kv_caches.dtype == torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engine_runs_on_cpu(make_engine, run_engine, tiny_llama_dir, dtype):
    """The GPU default dtype through the whole model (RoPE tables follow the activations'
    dtype, so q and k reach the cache in its dtype)."""
    from splitserve.common.sampling_params import SamplingParams

    path, _ = tiny_llama_dir()
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20, block_size=4, dtype=dtype)
    assert engine.runner.kv_caches.dtype == getattr(torch, dtype)
    out = run_engine(engine, {"a": ([5, 17, 42, 99, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
                              "b": ([1, 2, 3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))})
    assert all(len(t) == 6 and all(0 <= x < 257 for x in t) for t in out.values())


def test_cli_engine_flags():
    from splitserve.cli import _add_engine_args, engine_config
    import argparse

    p = argparse.ArgumentParser()
    _add_engine_args(p)
    cfg = engine_config(p.parse_args([]))
    assert (cfg.device, cfg.dtype, cfg.attention_backend) == ("cpu", "float32", "auto")
    cfg = engine_config(p.parse_args(["--device", "cuda", "--attention-backend", "triton"]))
    assert (cfg.device, cfg.dtype, cfg.attention_backend) == ("cuda", "bfloat16", "triton")
    cfg = engine_config(p.parse_args(["--device", "cuda:0", "--dtype", "float16", "--attention-backend", "cuda"]))
    assert (cfg.dtype, cfg.attention_backend) == ("float16", "cuda")
    with pytest.raises(SystemExit):
        p.parse_args(["--attention-backend", "flash"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_cuda_kernels_without_cuda_raise_a_clear_error():
    from splitserve.csrc.build import CsrcBuildError, load_ops

    with pytest.raises(CsrcBuildError, match="--attention-backend triton .* or torch"):
        load_ops()


def test_kernel_wrappers_check_arguments(make_paged_decode, make_kv_write):
    from splitserve.csrc import ops

    q, kv, meta = make_paged_decode([5, 20], num_heads=4, kv_heads=2, head_dim=64, block_size=16,
                                    dtype=torch.float16)
    args = (kv[0], kv[1], meta.decode_block_tables, meta.decode_seq_lens)
    out = torch.empty(q.shape, dtype=q.dtype)
    with pytest.raises(ValueError, match="k_cache: must be a CUDA tensor"):  # all checks pass but the device
        ops.paged_decode_attention(out, q, *args, scale=0.125, partition_size=32)
    with pytest.raises(ValueError, match="^out: must be torch.float16"):
        ops.paged_decode_attention(out.float(), q, *args, scale=0.125, partition_size=32)
    with pytest.raises(ValueError, match="^q: last dim must be contiguous"):
        ops.paged_decode_attention(out, q.transpose(1, 2).contiguous().transpose(1, 2), *args, scale=0.125,
                                   partition_size=32)
    with pytest.raises(ValueError, match="^partition_size: must be a multiple of block_size 16"):
        ops.paged_decode_attention(out, q, *args, scale=0.125, partition_size=40)
    with pytest.raises(ValueError, match="^seq_lens: must be int64"):
        ops.paged_decode_attention(out, q, *args[:3], meta.decode_seq_lens.int(), scale=0.125, partition_size=32)
    with pytest.raises(ValueError, match="^v_cache: must have the shape, strides"):
        ops.paged_decode_attention(out, q, kv[0], kv[1][:, :8], *args[2:], scale=0.125, partition_size=32)
    with pytest.raises(ValueError, match="^k_cache: head_dim 32 is not supported"):
        ops.paged_decode_attention(out[..., :32], q[..., :32], kv[0][..., :32], kv[1][..., :32], *args[2:],
                                   scale=0.125, partition_size=32)

    k, v, kv, slots = make_kv_write(num_tokens=4, kv_heads=2, head_dim=64, block_size=16, num_blocks=2,
                                    dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k_cache: must be a CUDA tensor"):
        ops.write_kv_cache(k, v, kv[0], kv[1], slots)
    with pytest.raises(ValueError, match="^slot_mapping: must be int64 \\[4\\]"):
        ops.write_kv_cache(k, v, kv[0], kv[1], slots[:3])
    with pytest.raises(ValueError, match="^kv_caches: must be a CUDA tensor"):
        ops.pack_blocks(torch.zeros(2, 2, 3, 16, 2, 64), [0, 2])
    with pytest.raises(ValueError, match="^block_ids: must be in \\[0, 3\\)"):
        ops.pack_blocks(torch.zeros(2, 2, 3, 16, 2, 64), [0, 3])


def test_partition_size():
    # many sequences fill the GPU: the longest partition
    assert decode_partition_size(64, 8, 32768, 16, num_sms=132) == 512
    # one sequence, one KV head: split finer, down to 128 tokens
    assert decode_partition_size(1, 1, 4096, 16, num_sms=132) == 128
    assert decode_partition_size(1, 8, 4096, 32, num_sms=48) == 256  # 8 * 16 partitions >= 2 per SM
    for bs in (16, 32):
        for seqs in (1, 7, 64):
            size = decode_partition_size(seqs, 2, 1000, bs, num_sms=108)
            assert size % bs == 0 and 128 <= size <= 512


def test_decode_mask_only_when_padded():
    assert build_decode_mask(torch.tensor([32, 32]), 32, torch.float32, CPU) is None
    mask = build_decode_mask(torch.tensor([32, 3]), 32, torch.float32, CPU)
    assert mask.shape == (2, 1, 1, 32)
    assert (mask[0] == 0).all() and (mask[1, 0, 0, :3] == 0).all() and (mask[1, 0, 0, 3:] == float("-inf")).all()


def test_torch_reference_decode_equals_a_plain_loop(make_paged_decode, decode_reference):
    """The reference every kernel is compared with, against softmax(q k^T / sqrt(d)) v
    written out per sequence and head in float64."""
    seq_lens = [1, 16, 37]
    q, kv, meta = make_paged_decode(seq_lens, num_heads=6, kv_heads=2, head_dim=64, block_size=16,
                                    dtype=torch.float32)
    got = decode_reference(q, kv, meta)
    for s, n in enumerate(seq_lens):
        table = meta.decode_block_tables[s]
        k = kv[0][table].reshape(-1, 2, 64)[:n].double()  # [n, kv_heads, hd]
        v = kv[1][table].reshape(-1, 2, 64)[:n].double()
        for h in range(6):
            p = torch.softmax(k[:, h // 3] @ q[s, h].double() / 8.0, dim=0)
            torch.testing.assert_close(got[s, h].double(), p @ v[:, h // 3], atol=1e-5, rtol=1e-5)
