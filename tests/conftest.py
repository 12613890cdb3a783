"""Shared factories: the bundled model (converted once), its tokenizer, the
transformers reference, tiny random Llamas saved as safetensors, and a helper
that drives an EngineCore to completion."""

import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SPLITSERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def bundled_dir():
    from splitserve.engine.convert import bundled_model_dir
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
    """hf_greedy(model, prompt_ids, n) -> transformers' greedy continuation (stops at EOS)."""
    def run(model, prompt_ids, max_new_tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                 dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=model.config.eos_token_id)
        return out[0, len(prompt_ids):].tolist()
    return run


@pytest.fixture
def make_engine(bundled_dir):
    """make_engine(**EngineConfig fields) -> EngineCore on the bundled model by default."""
    from splitserve.common.config import EngineConfig
    from splitserve.engine.engine_core import EngineCore

    def make(**kwargs):
        kwargs.setdefault("model", str(bundled_dir))
        kwargs.setdefault("kv_cache_memory", 64 << 20)
        return EngineCore(EngineConfig(**kwargs))
    return make


@pytest.fixture(scope="session")
def run_engine():
    """run_engine(engine, {req_id: (prompt_ids, params)}, join_at={req_id: step}) -> {req_id: tokens}.
    Requests in ``join_at`` are added when the loop reaches that step (continuous batching)."""
    def run(engine, requests, join_at=None):
        join_at = join_at or {}
        out = {rid: [] for rid in requests}
        for rid, (ids, params) in requests.items():
            if rid not in join_at:
                engine.add_request(rid, ids, params)
        step = 0
        while engine.has_unfinished() or any(s >= step for s in join_at.values()):
            for rid, s in join_at.items():
                if s == step:
                    engine.add_request(rid, *requests[rid])
            for d in engine.step():
                out[d.request_id].extend(d.new_token_ids)
            step += 1
        return out
    return run


@pytest.fixture
def tiny_llama_dir(tmp_path_factory):
    """tiny_llama_dir(**LlamaConfig overrides) -> folder of a random Llama saved as sharded safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(**overrides):
        cfg = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   tie_word_embeddings=False, eos_token_id=256, bos_token_id=0)
        cfg.update(overrides)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
        path = tmp_path_factory.mktemp("tiny_llama")
        model.save_pretrained(path, max_shard_size="60KB", safe_serialization=True)
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
