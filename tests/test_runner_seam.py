"""The runner seam (engine/runner.py): the scheduler says how many tokens each row computes,
verifies and proposes; the runner samples at the last ``num_verify`` tokens of each row, and a
request takes several tokens and rolls back rejected drafts."""

import pytest
import torch

from splitserve.common.hashing import hash_blocks
from splitserve.common.prompt_ref import PromptKeys, PromptRef
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.request import Request
from splitserve.engine.runner import split
from splitserve.engine.scheduler import Row, SchedulerOutput

BS = 4
PROMPT = list(range(10, 30))  # 20 tokens: chunks of 8, 8, 4


@pytest.fixture
def tiny(make_engine, tiny_llama_dir):
    path, model = tiny_llama_dir()
    return make_engine(model=str(path), block_size=BS, prefill_chunk_size=8, max_num_batched_tokens=64,
                       kv_cache_memory=4 << 20), model


def test_scheduler_rows_verify_one_token_at_the_end_of_a_sequence(tiny):
    engine, _ = tiny
    outs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput:
        outs.append(schedule())
        return outs[-1]
    engine.scheduler.schedule = recorded
    engine.add_request("a", engine.prompt_ref(PROMPT), SamplingParams(max_tokens=3, temperature=0))
    while engine.has_unfinished():
        engine.step()
    rows = [(r.num_tokens, r.num_verify, r.num_proposed) for out in outs for r in out.rows]
    # mid-prompt chunks sample nothing, the last chunk and each decode verify one, nothing proposes
    assert rows == [(8, 0, 0), (8, 0, 0), (4, 1, 0), (1, 1, 0), (1, 1, 0)]


def test_runner_samples_the_last_num_verify_tokens_of_a_row(tiny):
    engine, hf = tiny
    k = 3
    req = engine._new_request("v", engine.prompt_ref(PROMPT), SamplingParams(max_tokens=8, temperature=0))
    assert engine.kv.allocate_slots("v", len(PROMPT)) is not None
    row = Row(req, len(PROMPT), k, 0)
    out = SchedulerOutput([row], [])
    assert split(out).chunks == [row] and split(out).decodes == []
    launched = engine.runner.launch(out, engine.kv)
    assert launched.rows == [row]
    [(landed_row, tokens, logprobs)] = launched.result().sampled
    assert landed_row is row and len(tokens) == len(logprobs) == k
    with torch.no_grad():  # teacher-forced greedy tokens after each of the prompt's last k positions
        want = hf(torch.tensor([PROMPT])).logits[0, -k:].argmax(-1).tolist()
    assert tokens == want


def test_request_appends_several_tokens_and_rolls_back_rejected_drafts():
    prompt = PromptRef(list(PROMPT), PromptKeys(model="m"), BS)
    keys = prompt.hash_keys
    req = Request("r", prompt, SamplingParams(max_tokens=16), frozenset())
    req.num_computed_tokens = len(PROMPT) - 1  # a decode row next: its last token's KV is not computed
    proposed, accepted = 4, 2
    req.num_computed_tokens += 1 + proposed  # the verifying row computed its last token and 4 drafts
    req.rollback(proposed - accepted)  # 2 drafts rejected
    new = [101, 102, 103]  # the 2 accepted drafts, then the token sampled after them
    req.append_tokens(new, [None] * len(new))
    assert req.output_token_ids == new and req.all_token_ids == PROMPT + new
    assert req.num_computed_tokens == req.num_tokens - 1  # a decode row again: the next step starts right
    assert req.block_hashes == hash_blocks(PROMPT + new, BS, keys)
    with pytest.raises(AssertionError):
        req.rollback(req.num_computed_tokens + 1)
