"""Requests that share a prompt prefix and arrive together (the n choices of one
prompt) compute it once: a waiting request whose next block a running request is
computing waits for it and then takes it from the prefix cache. Outputs are unchanged,
and a request asking for prompt logprobs (which skips the cache) never waits."""

import pytest

from splitserve.common.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(10, 35))  # 25 tokens: 6 full blocks + 1


@pytest.fixture
def engine(make_engine, tiny_llama_dir):
    path, _ = tiny_llama_dir()
    return make_engine(model=str(path), block_size=BS, prefill_chunk_size=8, max_num_batched_tokens=64,
                       kv_cache_memory=4 << 20)


def test_identical_prompts_arriving_together_prefill_once(engine, run_engine):
    params = SamplingParams(max_tokens=3, temperature=0)
    out = run_engine(engine, {f"r{i}": (PROMPT, params) for i in range(3)})
    assert out["r0"] == out["r1"] == out["r2"]
    # the first computes all 25 prompt tokens; the others only the last, uncached one (6 blocks hit)
    prompt_tokens = engine.num_computed_tokens_total - 3 * 2  # each request's 2 decode steps
    assert prompt_tokens == 25 + 1 + 1


def test_prompt_logprobs_requests_do_not_wait(engine):
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request("a", engine.prompt_ref(PROMPT), params)
    engine.add_request("b", engine.prompt_ref(PROMPT), SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))
    engine.add_request("c", engine.prompt_ref(PROMPT), params)
    out = engine.scheduler.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]  # c waits for a's blocks; b never does
