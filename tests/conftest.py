"""Shared factories: the bundled model (converted once), its tokenizer, the
transformers reference, tiny random Llamas saved as safetensors, and a helper
that drives an EngineCore to completion.

On the GPU suite's machine (benchmarks/gpu/) the bundled model is not installed: tests
marked ``gpu`` use tiny random models and token-id prompts, and ``shaped_model`` /
``tokenizer_dir`` read $SPLITSERVE_GPU_MODEL_DIR there (the bundled model's config.json
and tokenizer files, no weights)."""

import os
import shutil
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SPLITSERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def bundled_dir():
    from splitserve.engine.models.convert import bundled_model_dir
    return bundled_model_dir()


@pytest.fixture(scope="session")
def tokenizer(bundled_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(bundled_dir)


@pytest.fixture(scope="session")
def hf_model(bundled_dir):
    """transformers' own Llama on the same weights: the correctness reference."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model, prompt_ids, n) -> transformers' greedy continuation (stops at EOS),
    computed on the model's device."""
    def run(model, prompt_ids, max_new_tokens):
        x = torch.tensor([prompt_ids], device=model.device)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=model.config.eos_token_id)
        return out[0, len(prompt_ids):].tolist()
    return run


@pytest.fixture(scope="session")
def shaped_model(request):
    """(folder, load_format) of the bundled model's shape: $SPLITSERVE_GPU_MODEL_DIR with
    random weights ("dummy") when set (the GPU suite's machine has the config, not the
    weights), else the bundled model itself ("auto")."""
    env = os.environ.get("SPLITSERVE_GPU_MODEL_DIR")
    if env:
        return Path(env), "dummy"
    return request.getfixturevalue("bundled_dir"), "auto"


@pytest.fixture(scope="session")
def tokenizer_dir(shaped_model):
    """A folder holding the bundled model's tokenizer files (and config.json)."""
    return shaped_model[0]


@pytest.fixture
def make_engine(request):
    """make_engine(**EngineConfig fields) -> EngineCore on the bundled model unless ``model``
    is given (the bundled model is resolved only then, so tests on tiny models run where
    it is not installed)."""
    from splitserve.common.config import EngineConfig
    from splitserve.engine.engine_core import EngineCore

    def make(**kwargs):
        if "model" not in kwargs:
            kwargs["model"] = str(request.getfixturevalue("bundled_dir"))
        kwargs.setdefault("kv_cache_memory", 64 << 20)
        return EngineCore(EngineConfig(**kwargs))
    return make


def _drive(engine, requests, join_at=None):
    """Yield every RequestDelta of running ``{req_id: (prompt_ids, params)}`` to the end;
    requests in ``join_at`` are added when the loop reaches that step (continuous batching)."""
    join_at = join_at or {}
    for rid, (ids, params) in requests.items():
        if rid not in join_at:
            engine.add_request(rid, engine.prompt_ref(ids), params)
    step = 0
    while engine.has_unfinished() or any(s >= step for s in join_at.values()):
        for rid, s in join_at.items():
            if s == step:
                ids, params = requests[rid]
                engine.add_request(rid, engine.prompt_ref(ids), params)
        yield from engine.step()
        step += 1


@pytest.fixture(scope="session")
def drive_engine():
    """drive_engine(engine, {req_id: (prompt_ids, params)}, join_at={req_id: step}) -> every delta, in order."""
    return _drive


@pytest.fixture(scope="session")
def run_engine():
    """run_engine(engine, {req_id: (prompt_ids, params)}, join_at={req_id: step}) -> {req_id: tokens}.
    Requests in ``join_at`` are added when the loop reaches that step (continuous batching)."""
    def run(engine, requests, join_at=None):
        out = {rid: [] for rid in requests}
        for d in _drive(engine, requests, join_at):
            out[d.request_id].extend(d.new_token_ids)
        return out
    return run


# family -> (transformers config class name, model class name)
TINY_FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                 "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
                 "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                 "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
                 "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
                 "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def _save_tiny_model(tmp_path_factory, family, **overrides):
    """(folder, transformers model): see ``tiny_model_dir``."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in TINY_FAMILIES[family])
    cfg = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               tie_word_embeddings=False, eos_token_id=256, bos_token_id=0,
               initializer_range=0.2)  # sharp attention: RoPE and masking errors change the tokens
    cfg.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        for name, b in model.named_buffers():  # DeepSeek-V3's router score bias: steers the choice
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp(f"tiny_{family}")
    model.save_pretrained(path, max_shard_size="60KB", safe_serialization=True)
    return path, model


@pytest.fixture
def tiny_model_dir(tmp_path_factory):
    """tiny_model_dir(family, **config overrides) -> (folder, transformers model): a random
    2-layer, hidden-64 GQA model of ``family`` (a TINY_FAMILIES key) saved as sharded
    safetensors. Weights are 10x transformers' default scale and biases and norm weights are random too (transformers starts them at 0 and
    1), so a mixed-up bias or q/k norm changes the output."""
    return lambda family, **overrides: _save_tiny_model(tmp_path_factory, family, **overrides)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def served_tiny_model(shared_tiny_model, bundled_dir):
    """served_tiny_model(family, **overrides) -> folder: ``shared_tiny_model``'s model over the
    bundled vocabulary, with the bundled tokenizer beside it, so real nodes and the router
    serve it like any model folder."""
    import json
    import shutil
    ref = json.loads((bundled_dir / "config.json").read_text())

    def get(family, **overrides):
        path = shared_tiny_model(family, vocab_size=ref["vocab_size"], bos_token_id=ref["bos_token_id"],
                                 eos_token_id=ref["eos_token_id"], **overrides)
        for f in TOKENIZER_FILES:
            if (bundled_dir / f).is_file() and not (path / f).is_file():
                shutil.copy(bundled_dir / f, path / f)
        return path
    return get


@pytest.fixture(scope="session")
def shared_tiny_model(tmp_path_factory):
    """shared_tiny_model(family, **overrides) -> folder: ``tiny_model_dir``'s model, saved once
    per session for each set of arguments (for module-scoped engines)."""
    made: dict[tuple, object] = {}

    def make(family, **overrides):
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in made:
            made[key] = _save_tiny_model(tmp_path_factory, family, **overrides)[0]
        return made[key]
    return make


@pytest.fixture
def tiny_llama_dir(tiny_model_dir):
    """tiny_llama_dir(**LlamaConfig overrides) -> (folder, transformers model) of a tiny random Llama."""
    return lambda **overrides: tiny_model_dir("llama", **overrides)


# A tiny Llama whose head_dim (64) the CUDA kernels take (conftest's default, 16, makes a GPU
# engine fall back to Triton), with grouped queries (6 heads over 2 KV heads, as SmolLM2's 3)
# and room for contexts that split-K partitions (decode_partition_size's floor is 128 tokens).
KERNEL_SHAPED = dict(hidden_size=384, intermediate_size=512, num_attention_heads=6, num_key_value_heads=2,
                     max_position_embeddings=512)


@pytest.fixture
def tiny_kernel_llama(tiny_llama_dir):
    """tiny_kernel_llama(**overrides) -> (folder, transformers model): KERNEL_SHAPED, random."""
    return lambda **overrides: tiny_llama_dir(**{**KERNEL_SHAPED, **overrides})


# files of a model folder that are its tokenizer (and chat template), not its config or weights
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


@pytest.fixture
def tiny_llama_with_tokenizer(tiny_llama_dir, tokenizer_dir):
    """tiny_llama_with_tokenizer(**overrides) -> (folder, transformers model): a tiny random Llama
    over the bundled model's vocabulary, with its tokenizer files copied in (what structured
    outputs need), the same weights on every device."""
    import json

    def make(**overrides):
        ref = json.loads((tokenizer_dir / "config.json").read_text())
        vocab = {k: ref[k] for k in ("vocab_size", "bos_token_id", "eos_token_id") if k in ref}
        path, model = tiny_llama_dir(**{**vocab, **overrides})
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, path / name)
        return path, model
    return make


@pytest.fixture(scope="module")
def redis_url():
    """A real redis-server on a free port for the module, killed afterwards."""
    from splitserve.deploy.launcher import start_redis
    proc, url = start_redis()
    yield url
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
async def http():
    """One aiohttp client session for the module's raw HTTP requests (30 s per request)."""
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


@pytest.fixture(scope="session")
def make_paged_decode():
    """make_paged_decode(seq_lens, num_heads, kv_heads, head_dim, block_size, dtype, device="cpu", seed=0)
    -> (q, kv_cache, meta): random decode rows as the model hands them to a backend (q a strided
    view of a wider qkv tensor), one layer's cache [2, num_blocks, block_size, kv_heads, head_dim]
    and decode-only metadata whose block tables pick shuffled blocks (padded with 0)."""
    from splitserve.engine.attention.base import AttentionMetadata
    from splitserve.engine.attention.torch_backend import build_decode_mask

    def make(seq_lens, num_heads, kv_heads, head_dim, block_size, dtype, device="cpu", seed=0):
        g = torch.Generator().manual_seed(seed)
        widths = [-(-n // block_size) for n in seq_lens]
        num_blocks = sum(widths) + 3  # a few blocks no table uses
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables, at = [], 0
        for w in widths:
            tables.append(order[at:at + w] + [0] * (max(widths) - w))
            at += w
        kv_cache = torch.randn((2, num_blocks, block_size, kv_heads, head_dim), generator=g).to(dtype)
        qkv = torch.randn((len(seq_lens), (num_heads + 2 * kv_heads) * head_dim), generator=g).to(dtype)
        q = qkv[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
        seq = torch.tensor(seq_lens, dtype=torch.long)
        dev = torch.device(device)
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long, device=dev), num_decodes=len(seq_lens),
            decode_block_tables=torch.tensor(tables, dtype=torch.long, device=dev), decode_seq_lens=seq.to(dev),
            decode_mask=build_decode_mask(seq, max(widths) * block_size, torch.float32, dev), prefills=[])
        return q.to(dev), kv_cache.to(dev), meta
    return make


@pytest.fixture(scope="session")
def decode_reference():
    """decode_reference(q, kv_cache, meta) -> [D, H, hd] float32: the torch backend's decode
    on float32 copies of the inputs (meta from make_paged_decode)."""
    from splitserve.engine.attention.torch_backend import TorchAttention

    def run(q, kv_cache, meta):
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        TorchAttention().decode(q.float(), kv_cache.float(), meta, out)
        return out
    return run


@pytest.fixture(scope="session")
def make_kv_write():
    """make_kv_write(num_tokens, kv_heads, head_dim, block_size, num_blocks, dtype, device="cpu", seed=0)
    -> (k, v, kv_cache, slot_mapping): new K/V rows as strided views of one qkv-like tensor, a zeroed
    layer cache and distinct random slots, every third token's slot -1 (skipped)."""
    def make(num_tokens, kv_heads, head_dim, block_size, num_blocks, dtype, device="cpu", seed=0):
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn((num_tokens, 3 * kv_heads * head_dim), generator=g).to(dtype)  # [T, 3 * kv_heads * hd]: a q stand-in, k, v
        k = kv[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(num_tokens, kv_heads, head_dim)
        v = kv[:, 2 * kv_heads * head_dim:].view(num_tokens, kv_heads, head_dim)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
        slots[::3] = -1
        kv_cache = torch.zeros((2, num_blocks, block_size, kv_heads, head_dim), dtype=dtype)
        return k.to(device), v.to(device), kv_cache.to(device), slots.to(device)
    return make
