"""The Triton MLA decode kernel (engine/attention/mla_decode_triton.py) on a CPU-only machine,
as tests/test_triton_kernels.py does for the GQA one:

- run by the Triton interpreter in one child process (TRITON_INTERPRET=1 must be set before
  triton decorates the kernels and must not leak into other tests): the parent saves the
  inputs, the child runs the kernel, the parent compares with the torch reference,
  ``MLAttention.absorbed`` on the latents gathered through the block tables
  (``decode_latents``) under the additive decode mask, in fp32;
- compiled to sm_80 and sm_90 cubins by triton's compiler and ptxas (no GPU needed);
- on a CUDA GPU (``gpu``, benchmarks/gpu/gpu_tests.txt): MLAttention.forward's CUDA branch
  against its CPU (torch) path.

The kernel cases compare o_lat itself: the reference layer's W_UK and W_UV are identities
(qk_nope = v = kv_lora), so ``absorbed(q_abs[..., :kv_lora], q_abs[..., kv_lora:])`` is
exactly the kernel's contract. The ``layer-*`` cases run ``absorbed_paged`` (the kernel with
the layer's random W_UK and W_UV around it, what forward calls on CUDA) against ``absorbed``.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.models.mla import MLAttention, decode_latents
from splitserve.engine.models.mla_config import MLAConfig
from splitserve.tests.triton_interpret import run_interpreted

# name -> kernel case: decode rows of different lengths (1, 17 and 100 tokens: one partial
# tile, several tiles, several blocks), latent 48 (kv_lora 32 + rope 16: the compressed part
# crosses from the K half into the V half at 24) and 576 (DeepSeek-V3: 512 + 64, halves of
# 288), block sizes 16 and 4, 4 and 16 heads (20: two head tiles, the second partial),
# one partition or split-K (partition_size tokens each).
CASES = {
    "fp32-l48-bs16-h4": dict(seq_lens=[1, 17, 100], heads=4, kv_lora=32, rope=16, block_size=16,
                             dtype=torch.float32, partition_size=512),
    "fp32-l48-bs4-h16-split": dict(seq_lens=[100, 1, 17], heads=16, kv_lora=32, rope=16, block_size=4,
                                   dtype=torch.float32, partition_size=32),
    "fp32-l48-bs4-h20-split": dict(seq_lens=[17, 100], heads=20, kv_lora=32, rope=16, block_size=4,
                                   dtype=torch.float32, partition_size=16),
    "fp32-l576-bs16-h16-split": dict(seq_lens=[17, 100, 1], heads=16, kv_lora=512, rope=64, block_size=16,
                                     dtype=torch.float32, partition_size=48),
    "fp32-l576-bs4-h4": dict(seq_lens=[1, 100, 17], heads=4, kv_lora=512, rope=64, block_size=4,
                             dtype=torch.float32, partition_size=512),
    "bf16-l576-bs16-h16-split": dict(seq_lens=[100, 17, 1], heads=16, kv_lora=512, rope=64, block_size=16,
                                     dtype=torch.bfloat16, partition_size=32),
    "bf16-l48-bs4-h4": dict(seq_lens=[17, 1, 100], heads=4, kv_lora=32, rope=16, block_size=4,
                            dtype=torch.bfloat16, partition_size=512),
    "fp16-l576-bs4-h4-split": dict(seq_lens=[100, 1, 17], heads=4, kv_lora=512, rope=64, block_size=4,
                                   dtype=torch.float16, partition_size=64),
}
# name -> layer case: absorbed_paged with random W_UK, W_UV (nope, v) against absorbed
LAYERS = {
    "layer-fp32-l48": dict(seq_lens=[1, 17, 100], heads=4, kv_lora=32, rope=16, nope=32, v=24, block_size=4,
                           dtype=torch.float32),
    "layer-bf16-l576": dict(seq_lens=[100, 17], heads=16, kv_lora=512, rope=64, nope=128, v=128, block_size=16,
                            dtype=torch.bfloat16),
}
# atol = rtol against the fp32 reference on the same (rounded) inputs: fp32 within 1e-5; bf16 and
# fp16 outputs are rounded to their dtype (2^-8 and 2^-11 relative) after fp32 accumulation
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# a layer's output in bf16 also carries the bf16 rounding of q_abs and of both einsums
LAYER_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_layer(heads: int, kv_lora: int, rope: int, nope: int, v: int, identity: bool, seed: int = 0) -> MLAttention:
    """An MLAttention of random weights (q_proj, no q LoRA) in fp32; ``identity``: W_UK and W_UV
    are identities (needs nope == v == kv_lora), so ``absorbed`` computes o_lat itself."""
    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                    v_head_dim=v, rope_interleave=True, rope_inv_freq=tuple(1e-2 ** (i / (rope // 2))
                                                                            for i in range(rope // 2)),
                    rope_scaling=1.0, softmax_scale=(kv_lora + rope) ** -0.5)
    cfg = SimpleNamespace(mla=mla, num_heads=heads, hidden_size=64, o_bias=False)
    torch.manual_seed(seed)
    layer = MLAttention(cfg, None, SimpleNamespace(size=1))  # type: ignore[arg-type]  # a stand-in config
    with torch.no_grad():
        if identity:
            assert nope == v == kv_lora
            eye = torch.eye(kv_lora)
            layer.kv_b_proj.weight.copy_(torch.cat((eye, eye)).repeat(heads, 1))  # per head [W_UK; W_UV]
        else:
            layer.kv_b_proj.weight.normal_(0, kv_lora ** -0.5)
    return layer.eval()


def make_case(make_paged_decode, seq_lens, heads, kv_lora, rope, block_size, dtype, seed=0):
    """(q_abs [D, H, latent], kv_cache [2, blocks, block_size, 1, latent / 2], meta): random
    latents in shuffled blocks (make_paged_decode's tables, padded with block 0)."""
    latent = kv_lora + rope
    _, kv_cache, meta = make_paged_decode(seq_lens=seq_lens, num_heads=1, kv_heads=1, head_dim=latent // 2,
                                          block_size=block_size, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn((len(seq_lens), heads, latent), generator=g).to(dtype)
    return q, kv_cache, meta


CHILD = """
import sys
import torch
from splitserve.engine.attention.mla_decode_triton import mla_decode

cases = torch.load(sys.argv[1], weights_only=False)
outputs = {}
for name, c in cases.items():
    meta = c["meta"]
    if "layer" in c:
        with torch.no_grad():
            outputs[name] = c["layer"].absorbed_paged(c["q_nope"], c["q_rope"], c["kv_cache"], meta)
    else:
        outputs[name] = mla_decode(c["q"], c["kv_cache"][0], c["kv_cache"][1], meta.decode_block_tables,
                                   meta.decode_seq_lens, kv_lora_rank=c["kv_lora"], scale=c["scale"],
                                   partition_size=c["partition_size"])
torch.save(outputs, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory, make_paged_decode):
    """name -> (inputs, the child's output) for every kernel and layer case."""
    pytest.importorskip("triton", reason="triton is not installed (deploy/requirements.txt pins it)")
    cases = {}
    for name, spec in CASES.items():
        spec = dict(spec)
        partition_size = spec.pop("partition_size")
        q, kv_cache, meta = make_case(make_paged_decode, **spec)
        cases[name] = dict(q=q, kv_cache=kv_cache, meta=meta, kv_lora=spec["kv_lora"],
                           scale=(spec["kv_lora"] + spec["rope"]) ** -0.5, partition_size=partition_size)
    for name, spec in LAYERS.items():
        spec = dict(spec)
        nope, v, dtype = spec.pop("nope"), spec.pop("v"), spec["dtype"]
        layer = make_layer(spec["heads"], spec["kv_lora"], spec["rope"], nope, v, identity=False).to(dtype)
        _, kv_cache, meta = make_case(make_paged_decode, **spec)
        g = torch.Generator().manual_seed(3)
        q_nope = torch.randn((len(spec["seq_lens"]), spec["heads"], nope), generator=g).to(dtype)
        q_rope = torch.randn((len(spec["seq_lens"]), spec["heads"], spec["rope"]), generator=g).to(dtype)
        cases[name] = dict(layer=layer, q_nope=q_nope, q_rope=q_rope, kv_cache=kv_cache, meta=meta)
    folder = tmp_path_factory.mktemp("mla_interpret")
    return run_interpreted(CHILD, cases, folder, 600)


def reference(q: torch.Tensor, kv_cache: torch.Tensor, meta, kv_lora: int) -> torch.Tensor:
    """o_lat [D, H, kv_lora] in fp32: MLAttention.absorbed with identity W_UK, W_UV over the
    gathered latents (fp32 copies of the inputs), padded context masked."""
    layer = make_layer(q.shape[1], kv_lora, q.shape[2] - kv_lora, kv_lora, kv_lora, identity=True)
    q = q.float()
    with torch.no_grad():
        return layer.absorbed(q[..., :kv_lora], q[..., kv_lora:], decode_latents(kv_cache.float(), meta),
                              meta.decode_mask)


def test_cases_cover_the_issue_shapes():
    specs = CASES.values()
    assert {16, 4} <= {s["block_size"] for s in specs}
    assert {(32, 16), (512, 64)} <= {(s["kv_lora"], s["rope"]) for s in specs}
    assert {4, 16} <= {s["heads"] for s in specs}
    assert all({1, 17, 100} <= set(s["seq_lens"]) for s in specs if s["heads"] != 20)
    assert {torch.float32, torch.bfloat16, torch.float16} == {s["dtype"] for s in specs}
    split = [s for s in specs if s["partition_size"] < max(s["seq_lens"])]
    assert split and len(split) < len(CASES)  # split-K and single-partition launches both


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_absorbed(interpreted, name):
    c, out = interpreted[name]
    q = c["q"]
    assert out.dtype == q.dtype and out.shape == (q.shape[0], q.shape[1], c["kv_lora"])
    ref = reference(q, c["kv_cache"], c["meta"], c["kv_lora"])
    assert ref.abs().max() > 0.1
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(LAYERS))
def test_absorbed_paged_matches_absorbed(interpreted, name):
    """What forward runs on CUDA (W_UK into the query, the kernel, W_UV) == the CPU path."""
    c, out = interpreted[name]
    layer = c["layer"]
    with torch.no_grad():
        ref = layer.float().absorbed(c["q_nope"].float(), c["q_rope"].float(),
                                     decode_latents(c["kv_cache"].float(), c["meta"]), c["meta"].decode_mask)
    assert out.dtype == c["q_nope"].dtype and out.shape == ref.shape and ref.abs().max() > 0.1
    tol = LAYER_TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_bad_arguments_raise_value_errors():
    pytest.importorskip("triton", reason="triton is not installed")
    from splitserve.engine.attention.mla_decode_triton import mla_decode

    q, kv_cache = torch.zeros(2, 4, 48), torch.zeros(2, 3, 16, 1, 24)
    tables, lens = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(q, kv_cache[0], kv_cache[1], tables, lens, kv_lora_rank=48, scale=1.0)
    with pytest.raises(ValueError, match="^q: latent width"):
        mla_decode(q[..., :40], kv_cache[0], kv_cache[1], tables, lens, kv_lora_rank=32, scale=1.0)
    with pytest.raises(ValueError, match="^seq_lens"):
        mla_decode(q, kv_cache[0], kv_cache[1], tables, lens.int(), kv_lora_rank=32, scale=1.0)
    with pytest.raises(ValueError, match="^partition_size"):
        mla_decode(q, kv_cache[0], kv_cache[1], tables, lens, kv_lora_rank=32, scale=1.0, partition_size=24)
    with pytest.raises(ValueError, match="^q: "):
        mla_decode(q.half(), kv_cache[0], kv_cache[1], tables, lens, kv_lora_rank=32, scale=1.0)


def test_partition_size_fills_the_device_then_stays_long():
    from splitserve.engine.attention.mla_decode_triton import mla_partition_size

    assert mla_partition_size(1, 128, 32768, 132) == 512  # 8 head tiles x 64 partitions: 2 programs per SM
    assert mla_partition_size(16, 16, 8192, 132) == 256  # 16 x 16 < 264 at 512 tokens, 16 x 32 at 256
    assert mla_partition_size(1, 16, 1024, 132) == 128  # too few programs at any size: the shortest


def _signature(kernel, dtype: str, constexprs: dict) -> dict[str, str]:
    """Triton argument types: q, caches and out of the model dtype, fp32 split-K scratch,
    int64 tables and lengths, an fp32 scale, int32 sizes and strides."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name in ("block_tables_ptr", "seq_lens_ptr"):
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


@pytest.mark.parametrize("cc", [80, 90])
def test_kernel_compiles_for_sm80_and_sm90(cc, tmp_path, monkeypatch):
    triton = pytest.importorskip("triton", reason="triton is not installed (deploy/requirements.txt pins it)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels are interpreted, not compiled")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from splitserve.engine.attention import mla_decode_triton as mk

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # really compile, every run
    target = GPUTarget("cuda", cc, 32)
    # DeepSeek-V3's latent in bf16 (split) and fp16; the small latent in fp32, block size 4
    for dtype, kv_lora, rope, block_size, split in (("bf16", 512, 64, 16, True), ("fp16", 512, 64, 64, False),
                                                    ("fp32", 32, 16, 4, True)):
        constexprs = dict(HALF=(kv_lora + rope) // 2, KV_LORA=kv_lora, KV_LORA_PAD=kv_lora, LATENT=kv_lora + rope,
                          ROPE_PAD=max(16, rope), BLOCK_H=mk.BLOCK_H, BLOCK_N=mk.BLOCK_N, BLOCK_SIZE=block_size,
                          SPLIT=split, DOT_FP32=dtype != "fp16",
                          DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
        kernel = mk._mla_decode_partition
        compiled = triton.compile(ASTSource(fn=kernel, signature=_signature(kernel, dtype, constexprs),
                                            constexprs=constexprs), target=target,
                                  options=dict(num_warps=8 if kv_lora > 128 else 4))
        assert compiled.asm["cubin"], f"{dtype} latent {kv_lora}+{rope}: no cubin for sm_{cc}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mla_forward_on_cuda_uses_the_kernel_and_matches_the_cpu_path(dtype, make_paged_decode):
    """MLAttention.forward on CUDA (decode rows through the Triton kernel, read from the paged
    cache) against forward on CPU (the gathered latents through ``absorbed``): DeepSeek-V3's
    latent (512 + 64), 16 heads, block size 16, rows of 1, 17 and 1000 tokens (split-K), the
    new tokens' latents written by forward itself."""
    from splitserve.engine.attention.base import AttentionMetadata
    from splitserve.engine.attention.torch_backend import build_decode_mask

    seq_lens, heads, kv_lora, rope, block_size = [1, 17, 1000], 16, 512, 64, 16
    layer = make_layer(heads, kv_lora, rope, 128, 128, identity=False)
    _, kv_cache, meta = make_case(make_paged_decode, seq_lens, heads, kv_lora, rope, block_size, torch.float32)
    tables, lens = meta.decode_block_tables, meta.decode_seq_lens
    slots = tables.gather(1, ((lens - 1) // block_size)[:, None])[:, 0] * block_size + (lens - 1) % block_size
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=len(seq_lens), decode_block_tables=tables,
                             decode_seq_lens=lens, decode_mask=build_decode_mask(lens, tables.shape[1] * block_size,
                                                                                 torch.float32, lens.device),
                             prefills=[])
    g = torch.Generator().manual_seed(5)
    x = torch.randn((len(seq_lens), 64), generator=g)
    angles = torch.randn((len(seq_lens), 1, rope // 2), generator=g)
    rope_tables = (angles.cos(), angles.sin())
    with torch.no_grad():
        want = layer(x, rope_tables, kv_cache.clone(), meta, None)
        on_gpu = layer.to("cuda", dtype)
        cuda = lambda t: t.to("cuda", dtype) if t.is_floating_point() else t.cuda()  # noqa: E731
        gpu_meta = AttentionMetadata(slot_mapping=slots.cuda(), num_decodes=len(seq_lens),
                                     decode_block_tables=tables.cuda(), decode_seq_lens=lens.cuda(),
                                     decode_mask=None, prefills=[])  # the kernel reads seq_lens, not a mask
        got = on_gpu(cuda(x), tuple(cuda(t) for t in rope_tables), cuda(kv_cache), gpu_meta, None)
    assert got.is_cuda and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # fp32: cuBLAS's projections, not bitwise the CPU's
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
