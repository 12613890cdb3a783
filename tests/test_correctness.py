"""The engine's greedy output is token-identical to transformers' generate, alone,
batched, with chunked prefill and requests joining mid-way."""

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.llm import render_chat

NEW_TOKENS = 40
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
]
COMPLETIONS = [
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the mountains, there lived",
]


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [render_chat(tokenizer, c) for c in CHATS]
    return chats + [tokenizer(t)["input_ids"] for t in COMPLETIONS]


@pytest.fixture(scope="module")
def reference(prompts, hf_model, hf_greedy):
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


def greedy():
    return SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def test_each_prompt_alone_matches_transformers(make_engine, run_engine, prompts, reference):
    engine = make_engine()
    for i, p in enumerate(prompts):
        out = run_engine(engine, {f"r{i}": (p, greedy())})
        assert out[f"r{i}"] == reference[i], f"prompt {i}"
    assert all(len(r) >= 32 or r[-1] == 2 for r in reference)


def test_batched_matches_transformers(make_engine, run_engine, prompts, reference):
    engine = make_engine()
    out = run_engine(engine, {f"r{i}": (p, greedy()) for i, p in enumerate(prompts)})
    for i in range(len(prompts)):
        assert out[f"r{i}"] == reference[i], f"prompt {i}"


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_and_joining_midway(make_engine, run_engine, prompts, reference, chunk):
    """Small chunks and a small budget force prompts to split across steps and
    interleave with other requests' decodes; later requests join mid-way."""
    engine = make_engine(prefill_chunk_size=chunk, max_num_batched_tokens=chunk + 8)
    requests = {f"r{i}": (p, greedy()) for i, p in enumerate(prompts)}
    out = run_engine(engine, requests, join_at={"r2": 3, "r4": 7, "r6": 20})
    for i in range(len(prompts)):
        assert out[f"r{i}"] == reference[i], f"prompt {i} (chunk {chunk})"
    assert engine.kv.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 2.0},
                                          {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_tiny_sharded_llama_loads_and_matches(tiny_llama_dir, make_engine, run_engine, hf_greedy, rope_scaling):
    path, hf = tiny_llama_dir(rope_scaling=rope_scaling)
    assert len(list(path.glob("model-*.safetensors"))) > 1, "expected a sharded checkpoint"
    engine = make_engine(model=str(path), kv_cache_memory=1 << 20, block_size=4)
    prompts = [[5, 17, 42, 99, 3, 8, 200, 13, 77], [1, 2, 3], list(range(10, 90))]
    out = run_engine(engine, {f"r{i}": (p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                              for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        ref = hf_greedy(hf, p, 24)
        assert out[f"r{i}"][:len(ref)] == ref, f"prompt {i}"
