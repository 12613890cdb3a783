"""How long does the costliest constraint the limits accept take to compile?

    .venv/bin/python benchmarks/engine/bench_grammar_limits.py [--threads 1] [--only NAME]

Builds constraints that each fill common/grammar_limits.py's budget a different way
(distinct string bounds of every size, patterns, regexes, EBNF, properties, maxItems,
enums, and all of them mixed up to the 64 KiB cap), checks that the limits accept every
one (and refuse the same built one step further), then compiles each with xgrammar in
a fresh compiler (no cache, ``--threads`` compile threads: a node's compile worker uses
one; the node's own copy, another) against the bundled SmolLM2 tokenizer, and times the
compile and reports the compiled grammar's memory. The worst compile is the figure
common/grammar_limits.py states.

Writes ``benchmarks/results/grammar_limits.json``.
"""

import argparse
import json
import platform
import time
from typing import Any

from splitserve.benchmarks.harness import RESULTS
from splitserve.common.errors import InvalidRequest
from splitserve.common.grammar_limits import MAX_MASK_POSITIONS, MAX_OBJECT_PROPERTIES, REPEAT_PLATEAU
from splitserve.common.structured_outputs import MAX_SPEC_CHARS, StructuredOutputsParams

P = MAX_MASK_POSITIONS


def strings(bounds: list[dict]) -> dict:
    return {"type": "object", "required": [f"k{i}" for i in range(len(bounds))],
            "properties": {f"k{i}": {"type": "string", **b} for i, b in enumerate(bounds)}}


def distinct_max(size: int, extra: int = 0) -> dict:
    """Strings of distinct (minLength, maxLength) bounds, maxLength ``size`` or just below,
    as many as the budget (less ``-extra`` positions) takes."""
    bounds: list[dict] = []
    for hi in range(size, 0, -1):
        for lo in range(hi + 1):
            trial = bounds + [{"minLength": lo, "maxLength": hi}]
            if sum(b["maxLength"] for b in trial) > P + extra:
                return strings(bounds)
            bounds = trial
    return strings(bounds)


def filler(schema: dict) -> dict:
    """``schema`` plus constructs the limits count nothing for (enums, number ranges,
    anyOf), in objects of 16 properties, up to the 64 KiB cap or the first limit."""
    groups: list[dict] = []
    i = 0
    while True:
        if i % 16 == 0:
            groups.append({"type": "object", "properties": {}})
        groups[-1]["properties"][f"f{i}"] = {"anyOf": [
            {"type": "integer", "minimum": -7 * i, "maximum": 10 ** 9 + i},
            {"type": "number", "minimum": -1.5 * i, "maximum": 1e6 + i / 7},
            {"enum": [f"v{i}-{j}" for j in range(2)]}]}
        candidate = {**schema, "properties": {**schema["properties"], "filler": {"anyOf": groups}}}
        try:
            if len(json.dumps(candidate)) > MAX_SPEC_CHARS:
                raise InvalidRequest("", "")
            StructuredOutputsParams(json=candidate).validate()
        except InvalidRequest:
            del groups[-1]["properties"][f"f{i}"]
            return {**schema, "properties": {**schema["properties"], "filler": {"anyOf": groups}}}
        i += 1


CASES: dict[str, tuple[str, Any]] = {
    "maxLength plateau (one of 100000)": ("json", strings([{"maxLength": 100_000}])),
    "maxLength 256": ("json", strings([{"maxLength": REPEAT_PLATEAU}])),
    "maxLength 128 distinct x2": ("json", distinct_max(128)),
    "maxLength 64 distinct x4": ("json", distinct_max(64)),
    "maxLength 16 distinct x16": ("json", distinct_max(16)),
    "maxLength <= 4, every distinct bound": ("json", distinct_max(4)),
    "minLength 64 x4 distinct": ("json", strings([{"minLength": 64 + i} for i in range(P // 64)])),
    "pattern .{0,256}": ("json", {"type": "string", "pattern": f".{{0,{P}}}"}),
    "pattern .{256} fixed": ("json", {"type": "string", "pattern": f".{{{P}}}"}),
    "pattern [^a] x256": ("json", {"type": "string", "pattern": "[^a]" * P}),
    "pattern (.{16}){16} nested": ("json", {"type": "string", "pattern": "(.{16}){16}"}),
    "pattern (.{0,64})+ nested": ("json", {"type": "string", "pattern": "(.{0,64})+"}),
    "pattern (ab|c){1000} nested, literal": ("json", {"type": "string", "pattern": "(ab|c){1000}"}),
    "pattern (.*x){256} nested": ("json", {"type": "string", "pattern": "(.*x){256}"}),
    "pattern (.+)+ x8 distinct, nested": ("json", strings([{"pattern": "(.+)+" * (i + 1)} for i in range(8)])),
    "patterns .{0,64} x4 distinct": ("json", strings([{"pattern": f"^{i}.{{0,64}}$"} for i in range(4)])),
    "regex .{0,256}": ("regex", f"x.{{0,{P}}}"),
    "regex [^\"] x256": ("regex", "[^\"]" * P),
    "ebnf 16 rules [^a]{0,16}": ("grammar", "root ::= " + " ".join(f"r{i}" for i in range(16)) + "\n"
                                 + "\n".join(f"r{i} ::= \"{i}\" [^a]{{0,16}}" for i in range(16))),
    "formats x256 (email, uri, date-time, ipv6)": ("json", {"anyOf": [
        {"properties": {f"q{i}": {"type": "string", "format": ("email", "uri", "date-time", "ipv6")[i % 4]}}}
        for i in range(P)]}),
    "properties 256 optional": ("json", {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(MAX_OBJECT_PROPERTIES)}}),
    "maxItems 1000 x4": ("json", strings([])
                         | {"properties": {f"a{i}": {"type": "array", "items": {"type": "string"},
                                                     "maxItems": 1000 - i} for i in range(4)}}),
    "mixed: maxLength 64 distinct x3 + enums, number ranges to 64 KiB": ("json", filler(distinct_max(64, -64))),
    "mixed: maxLength 16 distinct x12 + filler to 64 KiB": ("json", filler(distinct_max(16, -64))),
}


def params(kind: str, spec: Any) -> StructuredOutputsParams:
    if kind == "json":
        return StructuredOutputsParams(json=spec)
    return StructuredOutputsParams(regex=spec) if kind == "regex" else StructuredOutputsParams(grammar=spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from splitserve.engine.models.convert import bundled_model_dir
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[tok.eos_token_id])
    rows: list[dict[str, Any]] = []
    for name, (kind, spec) in CASES.items():
        if args.only and args.only not in name:
            continue
        p = params(kind, spec).validate()  # the limits accept it
        text = p.spec().source
        compiler = xgr.GrammarCompiler(info, max_threads=args.threads, cache_enabled=False)
        t0 = time.perf_counter()
        g = (compiler.compile_json_schema(text, any_whitespace=False) if kind == "json"
             else compiler.compile_regex(text) if kind == "regex" else compiler.compile_grammar(text))
        row = {"case": name, "spec_chars": len(text), "compile_s": round(time.perf_counter() - t0, 3),
               "compiled_mb": round(g.memory_size_bytes / 1e6, 1)}
        rows.append(row)
        print(f"{name:60s} {len(text):6d} chars  compile {row['compile_s']:6.2f} s  ({row['compiled_mb']:5.1f} MB)",
              flush=True)
    worst = max(rows, key=lambda r: r["compile_s"])
    print(f"worst: {worst['case']}: {worst['compile_s']:.2f} s")
    out = RESULTS / "grammar_limits.json"
    out.write_text(json.dumps({"threads": args.threads, "machine": platform.processor() or platform.machine(),
                               "budget_positions": P, "cases": rows, "worst": worst}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
