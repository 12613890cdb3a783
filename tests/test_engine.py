"""Prefix caching, eviction, preemption and request validation of the engine."""

import msgspec
import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.hashing import hash_blocks
from splitserve.common.kv_events import BlockRemoved, BlockStored
from splitserve.common.sampling_params import SamplingParams

BS = 16


def greedy(n=24, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def assert_pool_idle(engine):
    assert not engine.has_unfinished()
    assert engine.kv.num_free_blocks == engine.num_blocks
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


@pytest.fixture(scope="module")
def long_prefix(tokenizer):
    text = ("You are a meticulous assistant for a shipping company. Always answer with the tracking "
            "status, the expected delivery date, and a polite closing line. Never invent data. ") * 2
    ids = tokenizer(text)["input_ids"]
    assert len(ids) >= 3 * BS
    return ids


def test_shared_prefix_computes_only_new_tokens(make_engine, run_engine, long_prefix, tokenizer):
    engine = make_engine(block_size=BS)
    a = long_prefix + tokenizer(" Where is parcel 17?")["input_ids"]
    b = long_prefix + tokenizer(" Cancel order 99, please.")["input_ids"]
    run_engine(engine, {"a": (a, greedy())})

    before = engine.num_computed_tokens_total
    engine.add_request("b", engine.prompt_ref(b), greedy())
    tokens, cached = [], None
    while engine.has_unfinished():
        for d in engine.step():
            tokens += d.new_token_ids
            cached = d.num_cached_tokens
    shared_blocks = len(long_prefix) // BS
    assert cached == shared_blocks * BS
    # prompt tokens after the cached prefix, then one token per decode step
    assert engine.num_computed_tokens_total - before == (len(b) - cached) + (len(tokens) - 1)

    fresh = make_engine(block_size=BS, enable_prefix_caching=False)
    assert run_engine(fresh, {"b": (b, greedy())})["b"] == tokens
    assert_pool_idle(engine)


def test_fully_cached_prompt_still_computes_last_token(make_engine, run_engine, long_prefix):
    engine = make_engine(block_size=BS)
    prompt = long_prefix[: 3 * BS]  # exactly three full blocks
    first = run_engine(engine, {"a": (prompt, greedy(8))})["a"]
    engine.add_request("b", engine.prompt_ref(prompt), greedy(8))
    out = []
    while engine.has_unfinished():
        for d in engine.step():
            out += d.new_token_ids
            assert d.num_cached_tokens == 2 * BS
    assert out == first
    assert_pool_idle(engine)


def test_eviction_under_small_pool(make_engine, run_engine, tokenizer):
    engine = make_engine(block_size=BS, kv_cache_memory=24 * 737280)  # 24 blocks
    assert engine.num_blocks == 24
    topics = ["apples", "rivers", "engines", "poetry", "volcanoes", "chess", "bees", "glaciers"]
    prompts = {t: tokenizer(f"Write a detailed paragraph about {t}, covering their history, the science "
                            f"behind {t}, and the culture around {t}, with examples from many countries "
                            f"and centuries, quoting at least two experts on {t}.")["input_ids"]
               for t in topics}
    assert all(len(p) > 2 * BS for p in prompts.values())  # 8 x 3+ blocks > 24
    outs = {}
    for t, ids in prompts.items():
        outs[t] = run_engine(engine, {t: (ids, greedy(20, ignore_eos=True))})[t]
    events = engine.kv.take_events()
    removed = sum(len(e.block_hashes) for e in events if isinstance(e, BlockRemoved))
    stored = sum(len(e.block_hashes) for e in events if isinstance(e, BlockStored))
    assert removed > 0 and stored >= removed
    # the oldest prompt was evicted: running it again computes it anew, with the same output
    again = run_engine(engine, {"again": (prompts["apples"], greedy(20, ignore_eos=True))})["again"]
    assert again == outs["apples"]
    assert_pool_idle(engine)


def test_preemption_when_pool_too_small(make_engine, run_engine, tokenizer):
    prompts = [tokenizer(f"Count from {i} to {i + 30}, one number per line:")["input_ids"] for i in range(6)]
    big = make_engine(block_size=BS)
    expected = run_engine(big, {f"r{i}": (p, greedy(48, ignore_eos=True)) for i, p in enumerate(prompts)})
    # each request needs ~5 blocks at the end; 6 of them need ~30, the pool has 14
    small = make_engine(block_size=BS, kv_cache_memory=14 * 737280)
    got = run_engine(small, {f"r{i}": (p, greedy(48, ignore_eos=True)) for i, p in enumerate(prompts)})
    assert small.num_preemptions_total > 0
    assert got == expected
    assert_pool_idle(small)


@pytest.mark.parametrize("prompt, params, field", [
    ([], greedy(), "prompt"),
    ([1] * 9000, greedy(), "prompt"),
    ([1, 2, 3], greedy(8190), "max_tokens"),
    ([1, 2, 3], SamplingParams(max_tokens=0), "max_tokens"),
    ([1, 2, 3], SamplingParams(temperature=-0.5), "temperature"),
    ([1, 2, 3], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2, 3], SamplingParams(top_p=1.5), "top_p"),
    ([1, 99999999], greedy(), "prompt"),
])
def test_bad_requests_raise_naming_the_field(make_engine, prompt, params, field):
    engine = make_engine()
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("x", engine.prompt_ref(prompt), params)
    assert err.value.field == field and isinstance(err.value, ValueError)
    assert not engine.has_unfinished()


def test_unknown_model_path_raises(make_engine):
    with pytest.raises(ValueError, match="model"):
        make_engine(model="/no/such/model")


def test_prefilled_request_continues_like_a_local_one(make_engine, run_engine, long_prefix):
    """The decode-node path (reserve blocks, KV computed by another engine, admit with that
    engine's first token) gives the same tokens as a local request, seeded sampling included."""
    prompt = long_prefix[: 2 * BS]  # block-aligned: both blocks land in the prefill engine's cache
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    want = run_engine(make_engine(block_size=BS), {"a": (prompt, params)})["a"]

    prefill = make_engine(block_size=BS)
    first = run_engine(prefill, {"p": (prompt, msgspec.structs.replace(params, max_tokens=1))})["p"]
    assert first == want[:1]
    src = [prefill.kv.pool.cached[h].block_id for h in hash_blocks(prompt, BS, (prefill.config.model_id,))]

    decode = make_engine(block_size=BS)
    res = decode.reserve("d", decode.prompt_ref(prompt))
    assert len(res.block_ids) == len(src) == 2 and res.num_cached_tokens == 0
    for dst, s in zip(res.block_ids, src):  # what a KV transfer does
        decode.runner.kv_caches[:, :, dst] = prefill.runner.kv_caches[:, :, s]
    delta = decode.add_prefilled("d", decode.prompt_ref(prompt), params, first_token=first[0], logprobs=None,
                                 num_cached_tokens=0)
    got = list(delta.new_token_ids)
    while decode.has_unfinished():
        for d in decode.step():
            got += d.new_token_ids
    assert got == want
    assert_pool_idle(decode)


def test_load_counts_the_tokens_the_running_requests_generated(make_engine, long_prefix):
    """NodeLoad.generated_tokens: what the planner reads the mix of answers from."""
    engine = make_engine(block_size=BS)
    engine.add_request("a", engine.prompt_ref(long_prefix), greedy(30))
    engine.add_request("b", engine.prompt_ref(long_prefix[:20]), greedy(30))
    out = {"a": 0, "b": 0}
    assert engine.load().generated_tokens == 0
    for _ in range(6):
        for d in engine.step():
            out[d.request_id] += len(d.new_token_ids)
    assert engine.load().running == 2 and engine.load().generated_tokens == sum(out.values()) > 2
    while engine.has_unfinished():
        engine.step()
    assert engine.load().generated_tokens == 0
