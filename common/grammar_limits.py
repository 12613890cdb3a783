"""Complexity limits of a structured-output constraint, checked before anything compiles it.

xgrammar's compile time is spent on *mask positions*: for each place in the grammar that
a character class or ``.`` may fill, it works out which tokens of the whole vocabulary
may come next. A bounded repetition of such a class (a string's ``maxLength``, a regex's
``{n,m}``) is one position per count, up to a plateau near 256, and a grammar's distinct
ones add up; a group repeated {n,m} times around a variable-length part multiplies
them. Literal characters, enums, number ranges and property lists cost little. Measured
with xgrammar 0.2.8 on SmolLM2's 49k-token vocabulary, one compile thread of the 2-core
CI machine, while other work ran (benchmarks/engine/bench_grammar_limits.py,
benchmarks/results/grammar_limits.json; a 128k vocabulary takes about 2.6x as long):

    construct                                  compile             counted here as
    one string, maxLength 16 / 64 / >= 256     0.2 / 0.9 / 1.9-4.5 s   16 / 64 / 256
    one string, minLength 16 / >= 64           0.4 / 0.7 s             16 / 64
    four strings of distinct maxLength ~1e5    9-18 s (6.6 s on 4 threads)   1024: refused
    twenty strings of one maxLength 100        as one (xgrammar shares the rule)   100
    a format (email, uri, date-time, ...)      ~8 ms each, never shared            1 each
    pattern [^a] x 1000 / .{0,64}              4.1 / 0.6 s             1000: refused / 64
    pattern (.{0,4}){16} / (.?){128}           15 / 96 s               refused: nested
    an object of 256 / 1000 properties         0.14 / 1.3 s            refused over 256

A constraint is refused (`InvalidRequest` naming the keyword's path, e.g.
``structured_outputs.json.properties.a.maxLength``) when any of these is over its limit:

    minLength, maxLength              MAX_LENGTH_BOUND each
    minItems, maxItems                MAX_ITEMS_BOUND
    minProperties, maxProperties      MAX_PROPERTIES_BOUND
    properties of one object          MAX_OBJECT_PROPERTIES
    enum values and consts, in all    MAX_ENUM_VALUES
    schema nesting                    MAX_SCHEMA_DEPTH
    a {n,m} count (pattern, regex, EBNF)   MAX_REPEAT
    mask positions, in all            MAX_MASK_POSITIONS: each distinct string bound
        min(maxLength, 256) (or min(minLength, 64)), each format 1, each pattern / regex /
        grammar the character classes it spells times their repetition counts (256 at
        most per count; a group under * or + four times its own)
    a group repeated {n,m} (n or m >= 2) around a variable-length part (?, {n,m} or |
        over character classes): refused outright

Worst case accepted, the same bench (24 constraints built to fill the limits each way,
two of them the 64 KiB cap of spec text): 3.2-3.4 s (256 formats, a (.{0,64})+ pattern;
4.8 s in a busier run), most 1.5-3 s; the compiled grammars at most 23 MB. A node's compile timeout
(--grammar-compile-timeout, 10 CPU seconds; node/grammar_service.py) backs these
estimates up for what they miss: EBNF rule references hide their structure here.

Must not import xgrammar or torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequest

MAX_LENGTH_BOUND = 100_000  # minLength / maxLength: longer than any context
MAX_ITEMS_BOUND = 1_000  # minItems / maxItems
MAX_PROPERTIES_BOUND = 1_000  # minProperties / maxProperties
MAX_OBJECT_PROPERTIES = 256  # in one object's properties
MAX_ENUM_VALUES = 1_000  # enum values and consts of the whole schema (OpenAI's limit)
MAX_SCHEMA_DEPTH = 32  # nested schemas
MAX_REPEAT = 1_000  # n and m of a {n,m} repetition
MAX_MASK_POSITIONS = 256  # the budget: 2-5 s of compile on the machine above
REPEAT_PLATEAU = 256  # xgrammar compiles a longer repetition as a loop: it costs no more
MIN_LENGTH_PLATEAU = 64  # a minLength-only string costs no more past this
MAX_CACHED_GRAMMARS = 256  # compiled grammars a node (or an offline engine) keeps; the router's memory of them

# keyword -> (limit, what it counts)
_BOUNDS = {"minLength": MAX_LENGTH_BOUND, "maxLength": MAX_LENGTH_BOUND, "minItems": MAX_ITEMS_BOUND,
           "maxItems": MAX_ITEMS_BOUND, "minProperties": MAX_PROPERTIES_BOUND,
           "maxProperties": MAX_PROPERTIES_BOUND}
_NAMED_SCHEMAS = ("properties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")
_CLASS_ESCAPES = frozenset("dDwWsSpP")


@dataclass(slots=True)
class _Budget:
    """What a constraint has spent so far."""
    positions: int = 0
    enum_values: int = 0
    seen: set[Any] = field(default_factory=set)  # string bounds and patterns counted already

    def spend(self, cost: int, path: str, what: str) -> None:
        self.positions += cost
        if self.positions > MAX_MASK_POSITIONS:
            raise InvalidRequest(path, f"{what} brings this constraint to {self.positions} grammar positions to "
                                 f"compile, at most {MAX_MASK_POSITIONS} (each distinct string length bound counts "
                                 f"its maxLength up to {REPEAT_PLATEAU}, a pattern its character classes times "
                                 "their repetition counts); use fewer distinct bounds, or smaller ones")


def check_schema(schema: Any, path: str) -> None:
    """Raise `InvalidRequest` naming ``path.<keyword path>`` if compiling ``schema`` (parsed
    JSON) would cost more than these limits allow."""
    _walk(schema, path, 0, _Budget())


def check_regex(pattern: str, path: str) -> None:
    _Budget().spend(_positions(pattern, path, ebnf=False), path, "this regex")


def check_grammar(ebnf: str, path: str) -> None:
    _Budget().spend(_positions(ebnf, path, ebnf=True), path, "this grammar")


def _walk(node: Any, path: str, depth: int, budget: _Budget) -> None:
    if not isinstance(node, dict):
        return  # true / false, or not a schema: xgrammar says what is wrong with it
    if depth >= MAX_SCHEMA_DEPTH:
        raise InvalidRequest(path, f"schemas nested too deep: at most {MAX_SCHEMA_DEPTH} levels")
    _check_keywords(node, path, budget)
    for key, value in node.items():
        sub = f"{path}.{key}"
        if key in _NAMED_SCHEMAS and isinstance(value, dict):
            for name, schema in value.items():
                _walk(schema, f"{sub}.{name}", depth + 1, budget)
        elif key == "patternProperties" and isinstance(value, dict):
            for pattern, schema in value.items():
                _spend_pattern(pattern, sub, budget)
                _walk(schema, f"{sub}.{pattern}", depth + 1, budget)
        elif (key in _SCHEMA_LISTS or key == "items") and isinstance(value, list):
            for i, schema in enumerate(value):
                _walk(schema, f"{sub}[{i}]", depth + 1, budget)
        elif key in _ONE_SCHEMA:
            _walk(value, sub, depth + 1, budget)


def _check_keywords(node: dict, path: str, budget: _Budget) -> None:
    for key, limit in _BOUNDS.items():
        value = node.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 0:
            raise InvalidRequest(f"{path}.{key}", "must be a non-negative integer")
        if value > limit:
            raise InvalidRequest(f"{path}.{key}", f"{value} is over the limit: at most {limit}")
    props = node.get("properties")
    if isinstance(props, dict) and len(props) > MAX_OBJECT_PROPERTIES:
        raise InvalidRequest(f"{path}.properties", f"{len(props)} properties, at most {MAX_OBJECT_PROPERTIES} "
                             "in one object")
    enum = node.get("enum")
    budget.enum_values += (len(enum) if isinstance(enum, list) else 0) + ("const" in node)
    if budget.enum_values > MAX_ENUM_VALUES:
        where = f"{path}.enum" if isinstance(enum, list) else f"{path}.const"
        raise InvalidRequest(where, f"{budget.enum_values} enum and const values in the schema, at most "
                             f"{MAX_ENUM_VALUES}")
    if isinstance(node.get("format"), str):  # each one compiles apart (~8 ms: email, uri, date-time)
        budget.spend(1, f"{path}.format", f"format {node['format'][:40]!r}")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        _spend_pattern(pattern, f"{path}.pattern", budget)
    lo: int = node.get("minLength") or 0  # both checked above: non-negative integers
    hi: int | None = node.get("maxLength")
    if hi is not None or lo:
        bound = (lo, hi, pattern, node.get("format"))  # xgrammar compiles each distinct one once
        if bound not in budget.seen:
            budget.seen.add(bound)
            cost = min(hi, REPEAT_PLATEAU) if hi is not None else min(lo, MIN_LENGTH_PLATEAU)
            where = "maxLength" if hi is not None else "minLength"
            budget.spend(cost, f"{path}.{where}", f"{where} {node[where]}")


def _spend_pattern(pattern: str, path: str, budget: _Budget) -> None:
    if ("pattern", pattern) not in budget.seen:
        budget.seen.add(("pattern", pattern))
        budget.spend(_positions(pattern, path, ebnf=False), path, "this pattern")


@dataclass(slots=True)
class _Group:
    """An open group of a pattern being scanned: its closed atoms and its last one."""
    total: int = 0  # positions of the atoms before the last
    variable: bool = False  # one of them has a variable length (?, {n,m}) over character classes
    alternated: bool = False  # it has a | (branches of classes: a variable length too)
    last: int = 0  # positions of the last atom (a quantifier multiplies these)
    last_variable: bool = False
    last_group: bool = False  # the last atom is a (group)

    def push(self, positions: int, variable: bool = False, group: bool = False) -> None:
        self.total += self.last
        self.variable |= self.last_variable
        self.last, self.last_variable, self.last_group = positions, variable, group


def _positions(text: str, path: str, ebnf: bool) -> int:
    """The mask positions a regex (or an EBNF grammar, ``ebnf``) spells: each character
    class, ``.`` or class escape is one, a repeated atom or group counts its own times its
    count (capped at REPEAT_PLATEAU), a group under * or + four times its own; alternatives
    add up. Refuses a count over MAX_REPEAT, and a group repeated {n,m} times that holds a
    bounded variable repetition: xgrammar's compile explodes on those ((.{0,4}){16}: 15 s).
    Syntax errors are xgrammar's to report. EBNF rule references count nothing here (their
    rules count once, where defined): the compile timeout covers what they hide."""
    frames = [_Group()]
    i, n = 0, len(text)
    while i < n:
        c, f = text[i], frames[-1]
        if c == "\\":
            atom = 1 if text[i + 1:i + 2] in _CLASS_ESCAPES and not ebnf else 0
            i += 2
            if atom and text[i:i + 1] == "{":  # \p{Letter}
                i = text.find("}", i) + 1 or n
            f.push(atom)
        elif c == "[":
            j = i + 1 + (text[i + 1:i + 2] == "^")
            j += text[j:j + 1] == "]"  # a leading ] is a member
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            f.push(1)
            i = j + 1
        elif ebnf and c == '"':  # a literal: free
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            f.push(0)
            i = j + 1
        elif ebnf and c == "#":  # a comment
            i = text.find("\n", i) + 1 or n
        elif c == "(":
            frames.append(_Group())
            i += 1
        elif c == ")":
            if len(frames) > 1:
                _close(frames)
            i += 1
        elif c == "|":
            f.push(0)
            f.alternated = True
            i += 1
        elif c == "{" and (m := _REPEAT.match(text, i)):
            low, high = int(m[1]), int(m[3]) if m[3] else None
            if max(low, high or 0) > MAX_REPEAT:
                raise InvalidRequest(path, f"the repetition {m[0]} is over the limit: counts of at most "
                                     f"{MAX_REPEAT}")
            count = high if high is not None else low + (m[2] is not None)
            if f.last_group and f.last_variable and count >= 2:
                raise InvalidRequest(path, f"a group repeated {m[0]} matches a variable length (?, {{n,m}} or | "
                                     "over character classes): xgrammar's compile time explodes on it; repeat "
                                     "fixed-length groups only")
            f.last_variable |= f.last > 0 and high is not None and high > low
            f.last *= min(max(count, 1), REPEAT_PLATEAU)
            i = m.end()
        elif c in "*+":
            if f.last_group and f.last_variable:
                f.last *= 4
            i += 1
        elif c == "?":
            if text[i - 1:i] not in "*+?}":  # not a lazy quantifier's ?
                f.last_variable |= f.last > 0
            i += 1
        else:  # a literal character, a rule name, ::=
            f.push(1 if c == "." and not ebnf else 0)
            i += 1
    while len(frames) > 1:  # unclosed: xgrammar will say so
        _close(frames)
    return frames[0].total + frames[0].last


def _close(frames: list[_Group]) -> None:
    g = frames.pop()
    positions = g.total + g.last
    frames[-1].push(positions, g.variable or g.last_variable or (g.alternated and positions > 0), group=True)
