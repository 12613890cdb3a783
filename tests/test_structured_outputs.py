"""Structured outputs in the engine, without a cluster: `StructuredOutputsParams`
checks, the offline LLM under json / choice / regex / grammar constraints, the
hand-over of the first token (sampled under the grammar by one engine, as the prefill
node does, then admitted by another with ``add_prefilled``, as the decode node does),
the compiled-grammar cache, and the mask leaving unconstrained rows alone."""

import json

import jsonschema
import pytest
import torch

from splitserve import LLM, SamplingParams, StructuredOutputsParams
from splitserve.common.errors import InvalidRequest
from splitserve.engine.sampling.structured import GrammarMasker

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0,
                                                                                "maximum": 120}}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def llm(bundled_dir):
    return LLM(model=str(bundled_dir), kv_cache_memory=64 << 20)


@pytest.mark.parametrize("kwargs, field", [
    (dict(), "structured_outputs"),
    (dict(json={"type": "object"}, regex="a"), "structured_outputs"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json=[1, 2]), "structured_outputs.json"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
])
def test_params_shape_errors_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(structured_outputs=StructuredOutputsParams(**kwargs)).validate()
    assert err.value.field == field


def test_json_schema_sampled_batch_is_valid(llm):
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate([ASK] * 4, [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=so)
                                    for i in range(4)])
    for o in outs:
        assert o.finish_reason == "stop", o
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.token_ids[-1] == 2  # the grammar completed, then allowed only EOS
    assert llm.engine.grammars.compiles == 1  # one schema, compiled once for four requests


def test_choice_regex_grammar_and_json_object(llm):
    greedy = dict(temperature=0, max_tokens=24)
    choice = llm.generate(ASK, SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no", "it depends"])))[0]
    assert choice.text in ("yes", "no", "it depends") and choice.finish_reason == "stop"
    regex = llm.generate(ASK, SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(
        regex=r"[A-Z][a-z]{2,5} [0-9]{2}")))[0]
    assert regex.finish_reason == "stop" and regex.text[0].isupper() and regex.text[-2:].isdigit()
    grammar = llm.generate(ASK, SamplingParams(**greedy, structured_outputs=StructuredOutputsParams(
        grammar='root ::= "x=" [0-9] [0-9]? ";"')))[0]
    assert grammar.text.startswith("x=") and grammar.text.endswith(";")
    obj = llm.generate([{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
                       SamplingParams(temperature=0, max_tokens=32,
                                      structured_outputs=StructuredOutputsParams(json_object=True)))[0]
    assert isinstance(json.loads(obj.text), dict), obj.text


def test_grammar_end_stops_even_with_ignore_eos(llm):
    out = llm.generate(ASK, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                           structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, field", [
    (dict(json={"type": "foo"}), "structured_outputs.json"),
    (dict(json={"$ref": "#/nowhere"}), "structured_outputs.json"),
    (dict(regex="(("), "structured_outputs.regex"),
    (dict(grammar="root ::= "), "structured_outputs.grammar"),
])
def test_uncompilable_constraints_are_invalid_requests(llm, kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        llm.generate(ASK, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**kwargs)))
    assert err.value.field == field and "cannot be compiled" in err.value.message
    assert not llm.engine.has_unfinished()


def test_first_token_handover_continues_the_grammar(llm):
    """One engine samples the first token under the grammar (a prefill node: max_tokens 1,
    EOS ignored); the request is admitted elsewhere with that token (a decode node's
    add_prefilled), whose matcher must start past it: the whole answer is valid."""
    engine = llm.engine
    prompt = llm.tokenize(ASK)
    so = StructuredOutputsParams(json=SCHEMA)
    engine.add_request("p", engine.prompt_ref(prompt), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                   structured_outputs=so))
    first = [d for d in _run(engine) if d.request_id == "p"][0].new_token_ids[0]
    assert llm.tokenizer.decode([first]).startswith("{")
    assert engine.reserve("d", engine.prompt_ref(prompt)) is not None
    engine.add_prefilled("d", engine.prompt_ref(prompt),
                         SamplingParams(temperature=0, max_tokens=40, structured_outputs=so), first_token=first, logprobs=None, num_cached_tokens=0)
    tokens = [first] + [t for d in _run(engine) for t in d.new_token_ids]
    jsonschema.validate(json.loads(llm.tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)

    # a first token the grammar refuses fails the request rather than returning broken JSON
    assert engine.reserve("bad", engine.prompt_ref(prompt)) is not None
    refused = llm.tokenizer("hello", add_special_tokens=False)["input_ids"][0]
    delta = engine.add_prefilled("bad", engine.prompt_ref(prompt), SamplingParams(max_tokens=40, structured_outputs=so),
                                 first_token=refused, logprobs=None, num_cached_tokens=0)
    assert delta.finish_reason == "error" and not engine.has_unfinished()


def test_mask_leaves_unconstrained_rows_alone(llm):
    engine = llm.engine
    state = engine.grammars.new_state(StructuredOutputsParams(choice=["yes", "no"]).validate())
    vocab = engine.model_config.vocab_size
    logits = torch.randn(3, vocab)
    before = logits.clone()
    out = GrammarMasker(vocab, torch.device("cpu"))(logits, [None, state, None])
    assert torch.equal(out[0], before[0]) and torch.equal(out[2], before[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    texts = {llm.tokenizer.decode([t]) for t in allowed}
    assert 0 < len(allowed) < 10 and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts


def _run(engine):
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    return deltas


def test_model_without_tokenizer_refuses_structured_outputs(tiny_llama_dir):
    path, _ = tiny_llama_dir()
    llm = LLM(model=str(path), kv_cache_memory=4 << 20)
    with pytest.raises(InvalidRequest) as err:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(
            choice=["a"])))
    assert err.value.field == "structured_outputs" and "tokenizer" in err.value.message


def test_limits_without_grammars_refuse_structured_outputs():
    from splitserve.engine.limits import RequestLimits
    limits = RequestLimits(vocab_size=100, max_model_len=64, kv_capacity_tokens=256)  # a simulated engine's
    with pytest.raises(InvalidRequest) as err:
        limits.check([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    assert err.value.field == "structured_outputs"


def test_resume_token_ids_continue_the_grammar(llm):
    """A migrated request (router/streams/migration.py): prompt + the tokens already streamed,
    with the grammar resumed past them, ends the same JSON document."""
    so = StructuredOutputsParams(json=SCHEMA)
    prompt = llm.tokenize(ASK)
    head = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, structured_outputs=so))[0]
    assert head.finish_reason == "length"
    resumed = StructuredOutputsParams(json=SCHEMA, resume_token_ids=head.token_ids)
    tail = llm.generate([prompt + head.token_ids], SamplingParams(temperature=0, max_tokens=40,
                                                                  structured_outputs=resumed))[0]
    jsonschema.validate(json.loads(head.text + tail.text), SCHEMA)
    with pytest.raises(InvalidRequest) as err:  # tokens the grammar refuses
        bad = StructuredOutputsParams(json=SCHEMA, resume_token_ids=llm.tokenizer("hi")["input_ids"])
        llm.generate([prompt], SamplingParams(max_tokens=4, structured_outputs=bad))
    assert err.value.field == "structured_outputs.resume_token_ids"
