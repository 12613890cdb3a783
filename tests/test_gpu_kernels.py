"""On a GPU: every kernel (CUDA and Triton) against the torch reference across dtypes
(fp16, bf16, fp32), block sizes 16 and 32, head dims 64 and 128, grouped-query layouts,
contexts long enough for split-K, and slot -1; block pack/unpack against index_select
and the CPU store's wire bytes; and the engine's greedy output on the GPU against
transformers on the same GPU, on a tiny random Llama built here. Marked gpu; skipped
without CUDA. benchmarks/gpu/gpu_tests.txt picks the few cases the GPU suite runs."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEADS = [(8, 8), (9, 3), (32, 8), (16, 2), (7, 1)]  # MHA, SmolLM2 (group 3), Llama-3 (4), group 8, group 7
SEQ_LENS = [1, 15, 16, 17, 200, 511, 512, 513, 1000, 2049]  # block edges, partition edges
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol, vs fp32


@pytest.fixture(scope="module")
def cuda_kernels():
    """csrc/ops.py, built here: on a GPU machine a build failure is a test failure."""
    from splitserve.csrc import ops
    from splitserve.csrc.build import load_ops

    load_ops()
    return ops


@pytest.fixture(scope="module")
def triton_kernels():
    pytest.importorskip("triton", reason="triton is not installed (deploy/requirements.txt pins it)")
    from splitserve.engine.attention import triton_kernels

    return triton_kernels


@pytest.fixture
def kernels(request):
    return request.getfixturevalue(f"{request.param}_kernels")


@pytest.fixture
def reference(decode_reference):
    """The torch backend's decode in fp32 through SDPA's math path (no TF32, no fused kernel)."""
    def run(q, kv, meta):
        with sdpa_kernel(SDPBackend.MATH):
            return decode_reference(q, kv, meta)
    return run


def _decode(kernels, q, kv, meta, partition_size=None):
    from splitserve.engine.attention.partition import decode_partition_size

    block_size, kv_heads = kv.shape[2:4]
    if partition_size is None:  # what the backends pick
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        partition_size = decode_partition_size(q.shape[0], kv_heads, meta.decode_block_tables.shape[1] * block_size,
                                               block_size, sms)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    kernels.paged_decode_attention(out, q, kv[0], kv[1], meta.decode_block_tables, meta.decode_seq_lens,
                                   scale=q.shape[-1] ** -0.5, partition_size=partition_size)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("kernels", ["cuda", "triton"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("partition_size", [None, 128], ids=["auto", "p128"])
def test_paged_decode_matches_reference(kernels, reference, make_paged_decode, dtype, block_size, head_dim, heads,
                                        partition_size):
    q, kv, meta = make_paged_decode(SEQ_LENS, *heads, head_dim, block_size, dtype, device="cuda")
    out = _decode(kernels, q, kv, meta, partition_size)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), reference(q, kv, meta), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernels", ["cuda", "triton"], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_long_contexts_split_k(kernels, reference, make_paged_decode, dtype, block_size):
    """32k tokens: 64 partitions of 512 (or more), merged by the second kernel."""
    q, kv, meta = make_paged_decode([32768, 4097, 1], 32, 8, 128, block_size, dtype, device="cuda")
    tol = TOLERANCE[dtype]
    ref = reference(q, kv, meta)
    for partition_size in (None, 512):
        torch.testing.assert_close(_decode(kernels, q, kv, meta, partition_size).float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("kernels", ["cuda", "triton"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cache_write_matches_reference(kernels, make_kv_write, dtype, block_size, head_dim):
    from splitserve.engine.attention.torch_backend import TorchAttention

    k, v, kv, slots = make_kv_write(37, 3, head_dim, block_size, 4, dtype, device="cuda")
    got = kv.clone()
    kernels.write_kv_cache(k, v, got[0], got[1], slots)
    keep = slots >= 0
    TorchAttention().write_cache(k[keep], v[keep], kv, slots[keep])
    assert torch.equal(got, kv)  # slot -1 rows written nowhere, every other slot untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(16, 2, 64), (32, 8, 128), (1, 1, 3)], ids=["16B", "16B-big", "unaligned"])
def test_pack_unpack_blocks(cuda_kernels, dtype, shape):
    """pack == the CPU store's pack (the wire bytes), unpack inverts it; (1, 1, 3) runs are
    6 or 12 bytes, so the copy falls back to narrower words."""
    from splitserve.kvtransfer.block_store import KVBlockStore
    from splitserve.kvtransfer.layout import KVLayout

    g = torch.Generator().manual_seed(0)
    kv = torch.randn((3, 2, 10, *shape), generator=g).to(dtype)
    ids = [7, 0, 3, 9]
    packed = cuda_kernels.pack_blocks(kv.cuda(), ids)
    assert torch.equal(packed.cpu(), kv.permute(2, 0, 1, 3, 4, 5)[ids])
    store_bytes = bytes(KVBlockStore(kv, KVLayout.of_cache(kv.shape, kv.dtype)).pack(ids))
    assert packed.cpu().contiguous().view(torch.uint8).numpy().tobytes() == store_bytes

    dst = torch.zeros_like(kv).cuda()
    cuda_kernels.unpack_blocks(packed, dst, [1, 4, 5, 8])
    for i, b in enumerate([1, 4, 5, 8]):
        assert torch.equal(dst[:, :, b].cpu(), kv[:, :, ids[i]])
    untouched = [b for b in range(10) if b not in (1, 4, 5, 8)]
    assert not dst[:, :, untouched].any()

    out = torch.empty_like(packed)
    assert cuda_kernels.pack_blocks(kv.cuda(), ids, out=out) is out and torch.equal(out, packed)


# The engine on the GPU against transformers on the same GPU and weights: a tiny random
# Llama (conftest's KERNEL_SHAPED: head_dim 64, so "auto" picks the CUDA kernels) built here,
# prompts as token ids (the GPU machine has no bundled model or tokenizer).

NEW_TOKENS = 32
# 5, 17 and 40 tokens, and 200 (13 blocks of 16: its decode splits into 128-token partitions)
PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 47)), [(7 * i) % 250 + 1 for i in range(40)],
           [(13 * i + 5) % 250 + 1 for i in range(200)]]
# The reference's top-2 logit gap must exceed this at every step it takes: then fp32 rounding
# (~1e-5 here) cannot flip a token, and any difference from transformers is the engine's.
MIN_REFERENCE_GAP = 1e-3


def _hf_greedy(hf_model, dtype):
    """transformers' greedy tokens, each step's top-5 token ids and top-2 logit gap, on cuda."""
    model = hf_model.to("cuda", dtype)
    results = []
    with torch.no_grad():
        for ids in PROMPTS:
            x = torch.tensor([ids], device="cuda")
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=model.config.eos_token_id, output_logits=True,
                                 return_dict_in_generate=True)
            tokens = out.sequences[0, len(ids):].tolist()
            top = [step[0].float().topk(5) for step in out.logits]
            results.append((tokens, [set(t.indices.tolist()) for t in top],
                            min(float(t.values[0] - t.values[1]) for t in top)))
    return results


def _ours(make_engine, model_dir, **config):
    """Our greedy tokens and each step's top-5 token ids, all prompts batched (so decode
    rows of different lengths share steps and padded block tables)."""
    from splitserve.common.sampling_params import SamplingParams

    engine = make_engine(model=str(model_dir), device="cuda", kv_cache_memory=32 << 20, max_num_seqs=8, **config)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=5)
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"r{i}", engine.prompt_ref(ids), params)
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    top = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for d in engine.step():
            tokens[d.request_id].extend(d.new_token_ids)
            top[d.request_id].extend({t for t, _ in lp.top} for lp in d.new_logprobs)
    want = config["attention_backend"].replace("auto", "cuda")  # auto on a GPU: the CUDA kernels
    assert engine.runner.backend.name == want
    assert engine.kv.num_free_blocks == engine.num_blocks
    return [(tokens[f"r{i}"], top[f"r{i}"]) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("backend", ["cuda", "triton", "torch"])
def test_engine_fp32_greedy_equals_transformers_on_gpu(make_engine, tiny_kernel_llama, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    path, hf = tiny_kernel_llama()
    ref = _hf_greedy(hf, torch.float32)
    assert all(gap > MIN_REFERENCE_GAP for _, _, gap in ref), [gap for _, _, gap in ref]
    assert len(ref[3][0]) > 8, "the long prompt should decode for a while before any EOS"
    ours = _ours(make_engine, path, dtype="float32", attention_backend=backend)
    for i, ((got, _), (want, _, _)) in enumerate(zip(ours, ref)):
        assert got == want, f"prompt {i} ({backend})"


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_engine_bf16_greedy_close_to_transformers_on_gpu(make_engine, tiny_kernel_llama, backend):
    """bf16 rounding differs between any two implementations, so the sequences may part:
    up to the first difference they agree, and there each side's token is in the other's
    top 5 (after that they continue from different text and are not compared). The
    engine's prefill runs torch's varlen flash attention here (bf16 on CUDA)."""
    if backend == "triton":
        pytest.importorskip("triton")
    path, hf = tiny_kernel_llama()
    ref = _hf_greedy(hf, torch.bfloat16)
    ours = _ours(make_engine, path, attention_backend=backend)  # dtype auto: bf16 on cuda
    for i, ((got, got_top), (want, want_top, _)) in enumerate(zip(ours, ref)):
        assert got and want, f"prompt {i}: no tokens"
        for step, (a, b) in enumerate(zip(got, want)):
            if a != b:
                assert b in got_top[step] and a in want_top[step], \
                    f"prompt {i}: step {step} picked {a} vs transformers' {b}, outside each other's top 5"
                break
