"""The rest of the OpenAI request surface, end to end through the official openai client:
router -> prefill node (samples the first token) -> decode node (the rest), and a
colocated node. A tiny random Llama with the bundled tokenizer keeps it fast; the
values are checked against transformers (prompt logprobs) or against requests that
must agree (choice j of a seeded n equals a single request with seed + j).

n (whole and streamed, several prompts, all choices routed to one prefill node), echo
(with logprobs, and scoring with max_tokens 0), prompt_logprobs (vLLM's shape),
logit_bias forcing a token, min_tokens holding EOS back (the prefill node's first token
included), include_stop_str_in_output; every node's KV pool is empty afterwards."""

import json
import os
import shutil
import time
import urllib.request

import openai
import pytest
import torch

from splitserve.common import metric_names as names
from splitserve.deploy.launcher import Cluster
from splitserve.tests.metrics_text import sample_sum

pytestmark = pytest.mark.slow
os.environ.setdefault("SPLITSERVE_QUIET", "1")
NAME = "tiny"
EOS = 2
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model(tmp_path_factory, bundled_dir):
    """(folder, transformers model): a tiny random Llama with the bundled tokenizer."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True, eos_token_id=EOS, bos_token_id=1,
                                   initializer_range=0.2)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_openai")
    hf.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(bundled_dir / name, path / name)
    return path, hf


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, model):
    colocated = request.param == "colocated"
    with Cluster(prefill_nodes=0 if colocated else 2, decode_nodes=1, colocated=colocated, kv_backend="tcp",
                 kv_cache_memory="16MiB", model=str(model[0]), served_model_names=[NAME]) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none", max_retries=0, timeout=120)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def tokenize(cluster, text: str) -> list[int]:
    return post_json(f"{cluster.url}/tokenize", {"model": NAME, "prompt": text})["tokens"]


def prefill_counts(cluster) -> list[float]:
    """Prefill tasks each prefill node has served."""
    counts = []
    for p in cluster.procs:
        if p.role == "prefill":
            with urllib.request.urlopen(f"{p.addr}/metrics", timeout=10) as r:
                counts.append(sample_sum(r.read().decode(), names.PREFILL_REQUESTS))
    return counts


def test_n_samples_are_seeded_choices_with_summed_usage(client, cluster):
    before = prefill_counts(cluster)
    out = client.completions.create(model=NAME, prompt=PROMPT, n=3, max_tokens=6, seed=7, temperature=1.0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) == 3  # independent samples
    if before:  # every choice went to the same prefill node (so its prefix cache serves them)
        assert sorted(b - a for a, b in zip(before, prefill_counts(cluster))) == [0, 3]
    # choice j is sampled with seed + j, as vLLM: the same as one request with that seed
    for j in (0, 2):
        single = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, seed=7 + j, temperature=1.0)
        assert single.choices[0].text == texts[j]
    prompt_len = single.usage.prompt_tokens
    assert out.usage.prompt_tokens == prompt_len  # the prompt counts once
    assert out.usage.completion_tokens == 18 and out.usage.total_tokens == prompt_len + 18
    # several prompts: prompt i's choices are i*n .. i*n + n - 1
    two = client.completions.create(model=NAME, prompt=[PROMPT, "Hello"], n=2, max_tokens=3, seed=1)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    hello = client.completions.create(model=NAME, prompt="Hello", max_tokens=3, seed=2)
    assert two.choices[3].text == hello.choices[0].text


def test_n_streamed_chat_and_completions(client):
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], n=2,
                                            max_tokens=5, temperature=0.8, seed=3, stream=True,
                                            stream_options={"include_usage": True})
    text, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1} and usage.completion_tokens == 10
    whole = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], n=2,
                                           max_tokens=5, temperature=0.8, seed=3)
    assert [c.message.content for c in whole.choices] == [text[0], text[1]]
    assert whole.usage.prompt_tokens == usage.prompt_tokens

    pieces = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(model=NAME, prompt=PROMPT, n=3, max_tokens=4, seed=5, stream=True):
        for c in chunk.choices:
            pieces[c.index] += c.text
    whole = client.completions.create(model=NAME, prompt=PROMPT, n=3, max_tokens=4, seed=5)
    assert [pieces[i] for i in range(3)] == [c.text for c in whole.choices]


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()  # [n, V]
    return torch.log_softmax(logits, dim=-1)[:-1]  # row p predicts ids[p + 1]


def test_echo_and_scoring_the_prompt_match_transformers(client, cluster, model):
    _, hf = model
    gen = client.completions.create(model=NAME, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    plain = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert gen.choices[0].text == PROMPT + plain.choices[0].text

    scored = client.completions.create(model=NAME, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    ids = tokenize(cluster, PROMPT)
    ref = hf_prompt_logprobs(hf, ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([ref[p, ids[p + 1]].item() for p in range(len(ids) - 1)],
                                                  abs=1e-3)
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]

    streamed = list(client.completions.create(model=NAME, prompt=[PROMPT, "Hello"], echo=True, max_tokens=4,
                                              temperature=0, stream=True))
    first = {}
    for chunk in streamed:
        for c in chunk.choices:
            first.setdefault(c.index, c.text)
    assert first[0].startswith(PROMPT) and first[1].startswith("Hello")
    assert "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == 0) == \
        gen.choices[0].text
    ids_only = client.completions.create(model=NAME, prompt=ids, echo=True, max_tokens=0)
    assert ids_only.choices[0].text == PROMPT  # token ids are echoed as their text

    # echo + logprobs with generation: the prompt's entries, then the completion's
    both = client.completions.create(model=NAME, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                     temperature=0)
    assert len(both.choices[0].logprobs.tokens) == len(ids) + 3
    assert both.choices[0].text == PROMPT + plain.choices[0].text[:len(both.choices[0].text) - len(PROMPT)]


def test_prompt_logprobs_in_vllm_shape(client, cluster, model):
    _, hf = model
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=0, extra_body={"prompt_logprobs": 1})
    ids = tokenize(cluster, PROMPT)
    ref = hf_prompt_logprobs(hf, ids)
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert out.choices[0].text == "" and len(plp) == len(ids) and plp[0] is None
    for p, entry in enumerate(plp[1:]):
        row, token = ref[p], ids[p + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=1e-3)
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        best = int(row.argmax())
        assert entry[str(best)]["rank"] == 1 and len(entry) <= 2

    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat.usage.prompt_tokens and all(len(e) == 1 for e in plp[1:])


def test_logit_bias_and_min_tokens(client, cluster):
    forced = 1234
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0,
                                    logit_bias={str(forced): 100}, logprobs=0)
    tokens = out.choices[0].logprobs.tokens
    text = post_json(f"{cluster.url}/detokenize", {"model": NAME, "tokens": [forced]})["prompt"]
    assert tokens == [text] * 5
    # EOS pushed to the top: one token and done, unless min_tokens holds it back (the first
    # token comes from the prefill node, so its mask must hold there too)
    eager = {str(EOS): 100}
    stopped = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=eager)
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logit_bias=eager,
                                     extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0.7, logit_bias=eager, extra_body={"min_tokens": 2}, n=2)
    assert [c.finish_reason for c in chat.choices] == ["stop", "stop"] and chat.usage.completion_tokens == 6


def test_include_stop_str_in_output(client, cluster):
    full = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    at = next(i for i in range(len(full) // 2, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    stop = full[at:at + 3]
    cut = full.index(stop)
    without = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert without.choices[0].text == full[:cut] and without.choices[0].finish_reason == "stop"
    kept = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:cut] + stop and kept.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True,
        extra_body={"include_stop_str_in_output": True}))
    assert streamed == kept.choices[0].text

    # nothing leaked on any node
    deadline = time.monotonic() + 20
    for p in cluster.procs:
        if p.role == "router":
            continue
        while True:
            state = get_json(f"{p.addr}/debug/state")
            if state["kv_blocks_free"] == state["kv_blocks_total"]:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
