"""Triton kernels on a CPU-only machine, two ways:

- run by the Triton interpreter and compared with the torch reference. TRITON_INTERPRET=1
  must be set before triton decorates the kernels and must not leak into other tests, so
  one child process runs every case: the parent saves the inputs, the child runs the
  kernels, the parent compares;
- compiled to sm_80 and sm_90 cubins by triton's own compiler and ptxas (no GPU needed),
  which the interpreter does not exercise.
"""

import os

import pytest
import torch

from splitserve.tests.triton_interpret import run_interpreted

triton = pytest.importorskip("triton", reason="triton is not installed (deploy/requirements.txt pins it)")

# name -> paged decode case. Split-K needs more tokens than partition_size; tiny partitions
# make short contexts split (5 partitions at 100 tokens, 69 at 1100: two merge chunks of 64).
DECODE = {
    "fp32-gqa3-split": dict(seq_lens=[1, 37, 100], num_heads=6, kv_heads=2, head_dim=64, block_size=16,
                            dtype=torch.float32, partition_size=32),
    "fp16-gqa8-hd128-bs32-split": dict(seq_lens=[5, 64, 70], num_heads=8, kv_heads=1, head_dim=128, block_size=32,
                                       dtype=torch.float16, partition_size=64),
    "bf16-mha-single": dict(seq_lens=[16, 3], num_heads=4, kv_heads=4, head_dim=64, block_size=16,
                            dtype=torch.bfloat16, partition_size=512),
    "bf16-gqa2-split": dict(seq_lens=[48, 33], num_heads=4, kv_heads=2, head_dim=64, block_size=16,
                            dtype=torch.bfloat16, partition_size=16),
    "fp32-69-partitions": dict(seq_lens=[1100], num_heads=1, kv_heads=1, head_dim=64, block_size=16,
                               dtype=torch.float32, partition_size=16),
}
WRITE = {
    "fp32-bs16": dict(num_tokens=7, kv_heads=2, head_dim=64, block_size=16, num_blocks=3, dtype=torch.float32),
    "fp16-bs32": dict(num_tokens=5, kv_heads=3, head_dim=128, block_size=32, num_blocks=2, dtype=torch.float16),
    "bf16-bs16": dict(num_tokens=6, kv_heads=1, head_dim=64, block_size=16, num_blocks=2, dtype=torch.bfloat16),
}
# name -> host-tier load case: slots of a slot-major host pool into scattered cache blocks
HOST_LOAD = {
    "host-fp32-bs16": dict(layers=3, kv_heads=2, head_dim=64, block_size=16, slots=7, blocks=9, dtype=torch.float32),
    "host-bf16-bs32": dict(layers=2, kv_heads=1, head_dim=128, block_size=32, slots=4, blocks=9, dtype=torch.bfloat16),
}
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol, vs fp32

CHILD = """
import sys
import torch
from splitserve.engine.attention import triton_kernels

cases = torch.load(sys.argv[1])
outputs = {}
for name, c in cases.items():
    if c["kind"] == "decode":
        out = torch.empty(c["q"].shape, dtype=c["q"].dtype)
        triton_kernels.paged_decode_attention(out, c["q"], c["kv_cache"][0], c["kv_cache"][1], c["block_tables"],
                                              c["seq_lens"], scale=c["scale"], partition_size=c["partition_size"])
        outputs[name] = out
    elif c["kind"] == "write":
        kv_cache = c["kv_cache"].clone()
        triton_kernels.write_kv_cache(c["k"], c["v"], kv_cache[0], kv_cache[1], c["slot_mapping"])
        outputs[name] = kv_cache
    else:
        from splitserve.engine.kv.host_load_kernel import load_layer
        kv = c["kv"].clone()
        for layer in range(kv.shape[0]):
            load_layer(c["host"], kv, c["slots"], c["blocks"], layer)
        outputs[name] = kv
torch.save(outputs, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory, make_paged_decode, make_kv_write):
    """name -> (inputs, the child's output) for every case."""
    cases = {}
    for name, spec in DECODE.items():
        spec = dict(spec)
        partition_size = spec.pop("partition_size")
        q, kv_cache, meta = make_paged_decode(**spec)
        cases[name] = dict(kind="decode", q=q, kv_cache=kv_cache, block_tables=meta.decode_block_tables,
                           seq_lens=meta.decode_seq_lens, scale=q.shape[-1] ** -0.5, partition_size=partition_size,
                           meta_mask=meta.decode_mask)
    for name, spec in WRITE.items():
        k, v, kv_cache, slots = make_kv_write(**spec)
        cases[name] = dict(kind="write", k=k, v=v, kv_cache=kv_cache, slot_mapping=slots)
    gen = torch.Generator().manual_seed(7)
    for name, spec in HOST_LOAD.items():
        block = (spec["block_size"], spec["kv_heads"], spec["head_dim"])
        host = torch.randn((spec["slots"], spec["layers"], 2, *block), generator=gen).to(spec["dtype"])
        kv = torch.zeros((spec["layers"], 2, spec["blocks"], *block), dtype=spec["dtype"])
        slots = torch.tensor([5, 0, 3, 6][:spec["slots"] - 1]) % spec["slots"]  # scattered, one slot unused
        blocks = torch.tensor([8, 2, 4, 1][:len(slots)]) % spec["blocks"]
        cases[name] = dict(kind="host_load", host=host, kv=kv, slots=slots, blocks=blocks)
    assert len(cases) == len(DECODE) + len(WRITE) + len(HOST_LOAD), "case names must differ across kinds"
    folder = tmp_path_factory.mktemp("triton_interpret")
    return run_interpreted(CHILD, cases, folder)


@pytest.mark.parametrize("name", list(DECODE))
def test_paged_decode_matches_torch_reference(interpreted, decode_reference, name):
    from splitserve.engine.attention.base import AttentionMetadata

    c, out = interpreted[name]
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decodes=len(c["seq_lens"]),
                             decode_block_tables=c["block_tables"], decode_seq_lens=c["seq_lens"],
                             decode_mask=c["meta_mask"], prefills=[])
    ref = decode_reference(c["q"], c["kv_cache"], meta)
    assert out.dtype == c["q"].dtype
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", list(HOST_LOAD))
def test_host_load_copies_every_layer_of_each_slot_into_its_block_and_nothing_else(interpreted, name):
    c, got = interpreted[name]
    want = c["kv"].clone()
    for slot, block in zip(c["slots"].tolist(), c["blocks"].tolist()):
        want[:, :, block] = c["host"][slot]
    assert torch.equal(got, want)  # a copy: bit-exact, the other blocks untouched (zero)


@pytest.mark.parametrize("name", list(WRITE))
def test_cache_write_matches_torch_reference_and_skips_slot_minus_one(interpreted, name):
    from splitserve.engine.attention.torch_backend import TorchAttention

    c, got = interpreted[name]
    keep = c["slot_mapping"] >= 0
    assert not keep.all(), "the case must skip some tokens"
    ref = c["kv_cache"].clone()
    TorchAttention().write_cache(c["k"][keep], c["v"][keep], ref, c["slot_mapping"][keep])
    assert torch.equal(got, ref)  # a copy: bit-exact, untouched slots still zero


def _signature(kernel, dtype: str, constexprs: dict) -> dict[str, str]:
    """Triton argument types of our kernels, by name: tensors of the cache dtype, fp32
    split-K scratch, int64 tables and slots, an fp32 scale, int32 sizes and strides."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.startswith("part_"):
            sig[name] = "*fp32"
        elif name in ("block_tables_ptr", "seq_lens_ptr", "slot_mapping_ptr", "slots_ptr", "blocks_ptr"):
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


@pytest.mark.parametrize("cc", [80, 90])
def test_kernels_compile_for_sm80_and_sm90(cc, tmp_path, monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels are interpreted, not compiled")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from splitserve.engine.kv import host_load_kernel
    from splitserve.engine.attention import triton_kernels as tk

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # really compile, every run
    target = GPUTarget("cuda", cc, 32)
    builds = []
    for dtype, head_dim, block_size, group in (("fp16", 128, 16, 8), ("bf16", 64, 32, 3), ("fp32", 64, 16, 1)):
        builds.append((tk._decode_partition, dtype, dict(
            GROUP=group, GROUP_PAD=16, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, BLOCK_SIZE=block_size,
            SPLIT=dtype != "fp32", DOT_FP32=dtype != "fp16", DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")))
    builds.append((tk._decode_reduce, "bf16", dict(HEAD_DIM=128, HEAD_DIM_PAD=128, CHUNK=64)))
    builds.append((tk._write_kv_cache, "fp16", dict(KV_HEADS=3, KV_HEADS_PAD=4, HEAD_DIM=64, HEAD_DIM_PAD=64)))
    builds.append((host_load_kernel._load_layer, "bf16", dict(SPAN=host_load_kernel.SPAN)))
    for kernel, dtype, constexprs in builds:
        compiled = triton.compile(ASTSource(fn=kernel, signature=_signature(kernel, dtype, constexprs),
                                            constexprs=constexprs), target=target, options=dict(num_warps=4))
        assert compiled.asm["cubin"], f"{kernel.fn.__name__} {dtype}: no cubin for sm_{cc}"
