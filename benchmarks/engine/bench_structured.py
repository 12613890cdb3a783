"""What do structured outputs cost per decode step, and do the answers hold to the schema?

    .venv/bin/python benchmarks/engine/bench_structured.py [--runs 3] [--steps 24] [--batch 16] [--check 100]
    .venv/bin/python benchmarks/engine/bench_structured.py --device cuda   (skips with a message without CUDA)

TPOT: the engine (bundled SmolLM2) decodes ``--batch`` sampled requests on the same
prompts, once unconstrained and once under a JSON schema (xgrammar mask + matcher
advance every step), alternating, ``--runs`` times each. TPOT is the wall time of a
decode step while every request of the batch is running (prefill excluded), so both
sides decode at exactly the batch size. Reported: the median TPOT of each side and
their ratio (target: structured within 10% of unconstrained).

``--check N``: N chat requests with ``response_format`` json_schema through a real
router + prefill node + decode node (16 in flight), each answer parsed and validated
against the schema with ``jsonschema``: the count that are valid.

Writes ``benchmarks/results/structured.json`` (``structured_cuda.json`` on a GPU).
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any, NamedTuple

import torch

from splitserve.benchmarks.harness import RESULTS
from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_outputs import StructuredOutputsParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.llm import render_chat
from splitserve.engine.model_runner import ModelRunner

# Long enough that no request completes its grammar within the measured steps. Strings
# without maxLength: xgrammar 0.2.8 fills the mask of a position inside a string with a
# maxLength in ~3 ms per request on this CPU (every token needs a runtime check), against
# ~0.1 ms without; `--max-length` measures that case.
LONG_SCHEMA: dict[str, Any] = {"type": "array", "minItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}}}
CHECK_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
                "properties": {"city": {"type": "string", "maxLength": 20},
                               "population": {"type": "integer", "minimum": 0, "maximum": 99999999}}}


def long_schema(max_length: int | None) -> dict:
    if max_length is None:
        return LONG_SCHEMA
    props = {k: dict(v, maxLength=max_length) if v["type"] == "string" else v
             for k, v in LONG_SCHEMA["items"]["properties"].items()}
    return {**LONG_SCHEMA, "items": {**LONG_SCHEMA["items"], "properties": props}}


class Timing(NamedTuple):
    tpot_s: float  # seconds per decode step with every request of the batch running
    mask_s: float  # of which filling and applying grammar masks


def tpot(engine: EngineCore, prompts: list[list[int]], steps: int, schema: dict | None) -> Timing:
    so = StructuredOutputsParams(json=schema) if schema is not None else None
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 8, ignore_eos=True,
                                structured_outputs=so)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", engine.prompt_ref(p), params)
    first = 0
    while first < len(prompts):  # prefill: until every request has its first token
        first += len(engine.step())
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "structured outputs need the real model, not a simulated one"
    masker = runner.grammar_masker  # None until the first structured request
    busy = masker.busy_s if masker is not None else 0.0
    start = time.perf_counter()
    for _ in range(steps):
        deltas = engine.step()
        assert len(deltas) == len(prompts) and not any(d.finish_reason for d in deltas), deltas
    elapsed = time.perf_counter() - start
    mask = 0.0
    if schema is not None:
        masker = runner.grammar_masker
        assert masker is not None, "the structured requests' steps made the grammar masker"
        mask = masker.busy_s - busy
    for rid in list(engine.scheduler.requests):
        engine.abort(rid)
    return Timing(elapsed / steps, mask / steps)


def measure_tpot(args) -> dict:
    engine = EngineCore(EngineConfig(device=args.device, num_threads=args.threads, max_num_seqs=args.batch,
                                     kv_cache_memory=256 << 20))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(engine.model_dir)
    prompts = [render_chat(tok, [{"role": "user", "content": f"List {40 + i} people as JSON with name, age "
                                  "and city."}]) for i in range(args.batch)]
    schema = long_schema(args.max_length)
    assert engine.grammars is not None, "a real (not simulated) engine has a grammar cache"
    engine.grammars.compile(StructuredOutputsParams(json=schema).validate())  # compile outside the timing
    tpot(engine, prompts, 2, schema)  # warm-up: first-use allocations on both paths
    tpot(engine, prompts, 2, None)
    plain, structured, mask_s = [], [], []
    for run in range(args.runs):  # adjacent pairs, so a shift in the machine's load hits both sides,
        timings = {}  # side -> Timing; the sides take turns going first
        for side in ("plain", "schema") if run % 2 == 0 else ("schema", "plain"):
            timings[side] = tpot(engine, prompts, args.steps, schema if side == "schema" else None)
        plain.append(timings["plain"].tpot_s)
        structured.append(timings["schema"].tpot_s)
        mask_s.append(timings["schema"].mask_s)
        print(f"run {run}: TPOT unconstrained {plain[-1] * 1e3:.1f} ms, json_schema {structured[-1] * 1e3:.1f} ms "
              f"(mask {mask_s[-1] * 1e3:.2f} ms of it)", flush=True)
    p, s = statistics.median(plain), statistics.median(structured)
    ratio = statistics.median(b / a for a, b in zip(plain, structured))
    mask = statistics.median(mask_s)
    print(f"batch {args.batch}: TPOT median unconstrained {p * 1e3:.1f} ms, json_schema {s * 1e3:.1f} ms; "
          f"median ratio of adjacent runs {ratio:.3f}; mask fill + apply {mask * 1e3:.2f} ms per step "
          f"({mask / p:.1%} of the unconstrained TPOT)")
    return {"batch": args.batch, "steps": args.steps, "schema": schema, "runs": args.runs,
            "tpot_unconstrained_s": plain, "tpot_structured_s": structured, "mask_s_per_step": mask_s,
            "median_unconstrained_s": p, "median_structured_s": s, "median_ratio": ratio,
            "median_mask_s_per_step": mask, "mask_share_of_tpot": mask / p}


def check_validity(n: int) -> dict:
    """``n`` json_schema chat requests through a real cluster; how many validate."""
    import jsonschema
    import openai

    from splitserve.deploy.launcher import Cluster

    async def run(url: str) -> list:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        gate = asyncio.Semaphore(16)

        async def one(i):
            async with gate:
                return await client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", max_tokens=48, temperature=1.0, seed=i,
                    messages=[{"role": "user", "content": f"Name city number {i} and its population, as JSON."}],
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "city", "schema": CHECK_SCHEMA, "strict": True}})
        try:
            return await asyncio.gather(*(one(i) for i in range(n)))
        finally:
            await client.close()

    with Cluster(prefill_nodes=1, decode_nodes=1, kv_backend="tcp", kv_cache_memory="128MiB") as c:
        t0 = time.perf_counter()
        answers = asyncio.run(run(c.url))
        elapsed = time.perf_counter() - t0
    valid = 0
    reasons: dict[str, int] = {}  # finish_reason -> answers
    for a in answers:
        reasons[a.choices[0].finish_reason] = reasons.get(a.choices[0].finish_reason, 0) + 1
        try:
            jsonschema.validate(json.loads(a.choices[0].message.content), CHECK_SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            print("invalid:", a.choices[0].message.content)
    print(f"json_schema through router + prefill + decode: {valid}/{n} valid ({elapsed:.0f} s); "
          f"finish reasons {reasons}")
    return {"requests": n, "valid": valid, "finish_reasons": reasons, "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-length", type=int, default=None, help="give the schema's strings this maxLength")
    ap.add_argument("--check", type=int, default=0, help="also validate N answers through a real cluster")
    args = ap.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA here; nothing measured")
        return
    out = {"device": args.device, "command": " ".join(sys.argv), "tpot": measure_tpot(args)}
    if args.check:
        out["validity"] = check_validity(args.check)
    RESULTS.mkdir(exist_ok=True)
    name = "structured" + ("_cuda" if args.device.startswith("cuda") else "") + (
        "_maxlength" if args.max_length else "") + ".json"
    (RESULTS / name).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
