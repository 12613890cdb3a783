"""The fused MoE expert computation: the torch reference against a per-token loop, and the
Triton grouped GEMM (engine/models/fused_moe_triton.py) against the reference, three ways:

- run by the Triton interpreter in one child process (TRITON_INTERPRET=1 must be set before
  triton decorates the kernels and must not leak into other tests), like test_triton_kernels.py;
- compiled to sm_80 and sm_90 cubins by triton's compiler and ptxas (no GPU needed);
- on CUDA (``gpu``-marked, skipped here).

The cases include experts with no token, a token routed to the last expert, and pairs marked
skipped (id E: another rank's expert under expert parallelism), which add nothing.

Tolerances against the reference: fp32 1e-5 (atol = rtol), not bit-exact: the kernel sums
each dot in BLOCK_K chunks and each token's k slots in slot order, the reference in the CPU
BLAS's order and expert order, so the last bits differ (~1e-7 seen). bf16 2e-2: the
reference rounds gate/up, silu and silu * up to bf16 one by one where the kernel rounds
gate/up and then the product, and each slot's output before the sum: a few bf16 ulps (2^-8).
"""

import os

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.models.fused_moe import fused_moe, fused_moe_torch
from splitserve.tests.triton_interpret import run_interpreted

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # atol = rtol, vs the torch reference

# name -> case: tokens, hidden, intermediate, experts, top-k, dtype. Hidden and intermediate
# are not multiples of the kernel's 32/64 tiles; 40 tokens span three 16-row blocks.
CASES = {
    "fp32-T1-k1": dict(T=1, H=32, I=48, E=4, k=1, dtype=torch.float32),
    "fp32-T40-k2": dict(T=40, H=40, I=24, E=5, k=2, dtype=torch.float32),
    "fp32-T3-k8": dict(T=3, H=64, I=32, E=8, k=8, dtype=torch.float32),
    "bf16-T1-k2": dict(T=1, H=64, I=96, E=6, k=2, dtype=torch.bfloat16),
    "bf16-T40-k8": dict(T=40, H=48, I=40, E=16, k=8, dtype=torch.bfloat16),
    # expert parallelism: a third of the pairs belong to another rank's experts (id E: skipped)
    "fp32-T40-k2-skip": dict(T=40, H=40, I=24, E=5, k=2, dtype=torch.float32, skip=True),
    "bf16-T40-k8-skip": dict(T=40, H=48, I=40, E=16, k=8, dtype=torch.bfloat16, skip=True),
}


def make_case(T: int, H: int, I: int, E: int, k: int, dtype: torch.dtype, seed: int = 0, skip: bool = False) -> dict:
    """Random weights scaled to unit outputs; expert 1 gets no token (k < E - 1 cases) and the
    last token's first slot is the last expert; with ``skip`` every third pair but the last
    token's first is marked skipped (id E), the first token's all of them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)  # [T, H]
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5).to(dtype)  # [E, 2I, H]
    w2 = (torch.randn(E, H, I, generator=gen) / I ** 0.5).to(dtype)  # [E, H, I]
    others = [e for e in range(E) if e != 1] if k < E - 1 else list(range(E))
    ids = torch.stack([torch.tensor(others)[torch.randperm(len(others), generator=gen)[:k]] for _ in range(T)])
    if E - 1 not in ids[-1]:
        ids[-1, 0] = E - 1  # [T, k]
    if skip:
        flat = ids.view(-1)
        flat[::3] = E
        ids[0] = E
        ids[-1, 0] = E - 1
    weights = torch.softmax(torch.randn(T, k, generator=gen), -1)  # [T, k]
    return dict(x=x, w13=w13, w2=w2, topk_ids=ids, topk_weights=weights)


def loop_reference(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """The contract token by token, in fp64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e == w13.shape[0]:  # skipped: another rank's expert
                continue
            gu = w13[e].double() @ x[t].double()
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def test_cases_cover_zero_token_experts_and_the_last_expert():
    for name, spec in CASES.items():
        c = make_case(**spec)
        counts = torch.bincount(c["topk_ids"].reshape(-1), minlength=spec["E"] + 1)[:spec["E"]]
        assert counts[-1] > 0, name
        assert (counts == 0).any() or spec["k"] >= spec["E"] - 1, name
    assert sum((torch.bincount(make_case(**s)["topk_ids"].reshape(-1), minlength=s["E"] + 1)[:s["E"]] == 0)
               .any().item() for s in CASES.values()) >= 3
    skipping = [make_case(**s) for s in CASES.values() if s.get("skip")]
    assert skipping and all((c["topk_ids"] == c["w13"].shape[0]).all(dim=1)[0] for c in skipping)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_the_per_token_loop(name):
    c = make_case(**CASES[name])
    out = fused_moe(**c)  # CPU tensors: the torch reference
    assert out.dtype == c["x"].dtype and out.shape == c["x"].shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out.double(), loop_reference(**c), atol=1e-5, rtol=1e-5)
    else:  # the loop is fp64 on bf16 inputs; the reference rounds each matmul to bf16
        torch.testing.assert_close(out.double(), loop_reference(**c), atol=5e-2, rtol=5e-2)


CHILD = """
import sys
import torch
from splitserve.engine.models.fused_moe_triton import fused_moe_triton

cases = torch.load(sys.argv[1])
torch.save({name: fused_moe_triton(**c) for name, c in cases.items()}, sys.argv[2])
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """name -> (inputs, the interpreted kernel's output) for every case."""
    pytest.importorskip("triton", reason="triton is not installed (deploy/requirements.txt pins it)")
    cases = {name: make_case(**spec) for name, spec in CASES.items()}
    folder = tmp_path_factory.mktemp("fused_moe_interpret")
    return run_interpreted(CHILD, cases, folder)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_the_torch_reference(interpreted, name):
    c, out = interpreted[name]
    ref = fused_moe_torch(**c)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_alignment_pads_each_expert_to_whole_blocks():
    pytest.importorskip("triton", reason="triton is not installed")
    from splitserve.engine.models.fused_moe_triton import align_block_size

    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])  # pairs 0..5: expert 2 has none
    sorted_ids, expert_ids = align_block_size(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_ids.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert sorted_ids.numel() == 6 + 5 * 3 and (sorted_ids[12:] == pad).all()
    assert expert_ids.tolist() == [0, 1, 3, 4, 4, 4]  # 4: padding blocks past the last expert

    skipped = torch.tensor([[3, 4], [4, 1]])  # pairs 1 and 2 skipped (id 4 = E): they sort last, into block E
    sorted_ids, expert_ids = align_block_size(skipped, num_experts=4, block_m=4)
    pad = 4
    assert sorted_ids.tolist()[:12] == [3, pad, pad, pad, 0, pad, pad, pad, 1, 2, pad, pad]
    assert expert_ids.tolist()[:3] == [1, 3, 4] and (expert_ids[2:] == 4).all()


def _signature(kernel, dtype: str, constexprs: dict) -> dict[str, str]:
    """Triton argument types: weights and activations in the model dtype, fp32 outputs of
    the down GEMM and scores, int64 sorted ids and expert ids, int32 sizes and strides."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("y_ptr", "weights_ptr"):
            sig[name] = "*fp32"
        elif name in ("sorted_ids_ptr", "expert_ids_ptr"):
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*" + dtype
        else:
            sig[name] = "i32"
    return sig


@pytest.mark.parametrize("cc", [80, 90])
def test_kernels_compile_for_sm80_and_sm90(cc, tmp_path, monkeypatch):
    triton = pytest.importorskip("triton", reason="triton is not installed (deploy/requirements.txt pins it)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernels are interpreted, not compiled")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from splitserve.engine.models import fused_moe_triton as fm

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # really compile, every run
    target = GPUTarget("cuda", cc, 32)
    for kernel in (fm._gate_up, fm._down):
        for dtype in ("bf16", "fp16", "fp32"):
            constexprs = dict(BLOCK_M=fm.BLOCK_M, BLOCK_N=fm.BLOCK_N, BLOCK_K=fm.BLOCK_K, DOT_FP32=dtype != "fp16",
                              DOT_PRECISION="ieee" if dtype == "fp32" else "tf32")
            compiled = triton.compile(ASTSource(fn=kernel, signature=_signature(kernel, dtype, constexprs),
                                                constexprs=constexprs), target=target, options=dict(num_warps=4))
            assert compiled.asm["cubin"], f"{kernel.fn.__name__} {dtype}: no cubin for sm_{cc}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fp32-T40-k2", "bf16-T40-k8", "bf16-T40-k8-skip"])
def test_triton_fused_moe_on_cuda_matches_the_reference(name):
    c = make_case(**CASES[name])
    ref = fused_moe_torch(**c)
    out = fused_moe(**{key: value.cuda() for key, value in c.items()})  # CUDA tensors: the Triton path
    assert out.is_cuda and out.dtype == ref.dtype
    tol = TOLERANCE[ref.dtype]
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
