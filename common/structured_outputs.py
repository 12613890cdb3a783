"""What a structured-output request constrains its tokens to, as a wire type.

Owns `StructuredOutputsParams` (router -> prefill/decode nodes, inside `SamplingParams`,
named and shaped as vLLM's): exactly one of a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar. Its `validate()` checks the shape
(which one is set, types, sizes) and turns a schema given as a dict into its JSON text,
so every node compiles -- and caches -- the same string. It also refuses a constraint
too costly to compile (common/grammar_limits.py), naming the keyword's path, e.g.
``structured_outputs.json.properties.a.maxLength``; router and nodes both run it.
Whether the schema, regex or grammar compiles is the nodes' check (node/grammar_service.py,
engine/sampling/structured.py), which raises `InvalidRequest` naming the field.

Must not import xgrammar or torch.
"""

from __future__ import annotations

import enum
import json
from typing import Any, NamedTuple

import msgspec

from .errors import InvalidRequest
from .grammar_limits import check_grammar, check_regex, check_schema

FIELD = "structured_outputs"  # the parameter's name in errors
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar; far above any real one
MAX_CHOICES = 256


class GrammarKind(enum.Enum):
    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # one of a list of strings
    GRAMMAR = "grammar"  # EBNF (xgrammar's GBNF dialect)


class GrammarSpec(NamedTuple):
    """The one constraint of a request, hashable: the key of the compiled-grammar cache."""
    kind: GrammarKind
    source: str  # the schema's JSON text, the regex, the grammar, or the choices as a JSON list
    any_whitespace: bool  # JSON kinds: whitespace between tokens allowed (False: compact JSON)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Set exactly one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``.

    ``disable_any_whitespace``: JSON is generated compact (no whitespace between
    tokens). True by default, unlike vLLM: a small model allowed free whitespace can
    spend its whole budget on it and return truncated JSON."""

    json: str | dict[str, Any] | bool | None = None  # a JSON schema (dict or its JSON text)
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True
    # Tokens already generated under this grammar, the last ones of the prompt: the matcher
    # starts past them (a request migrated to another node mid-stream continues its grammar).
    resume_token_ids: list[int] = []

    def validate(self) -> StructuredOutputsParams:
        """Raise `InvalidRequest` naming ``structured_outputs.<field>``; a schema given as
        a dict becomes its JSON text. Returns self."""
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequest(FIELD, "set exactly one of json, json_object, regex, choice, grammar; "
                                 f"got {', '.join(given) or 'none'}")
        if type(self.disable_any_whitespace) is not bool:
            raise InvalidRequest(f"{FIELD}.disable_any_whitespace", "must be a boolean")
        if not isinstance(self.resume_token_ids, list) or not all(
                type(t) is int and t >= 0 for t in self.resume_token_ids):
            raise InvalidRequest(f"{FIELD}.resume_token_ids", "must be a list of token ids")
        if self.json is not None:
            self.json, schema = _schema_text(self.json)
            check_schema(schema, f"{FIELD}.json")
        for name, check in (("regex", check_regex), ("grammar", check_grammar)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(f"{FIELD}.{name}", "must be a non-empty string")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise InvalidRequest(f"{FIELD}.{name}", f"at most {MAX_SPEC_CHARS} characters")
            if value is not None:
                check(value, f"{FIELD}.{name}")
        if self.choice is not None:
            c = self.choice
            if not isinstance(c, list) or not c or not all(isinstance(s, str) and s for s in c):
                raise InvalidRequest(f"{FIELD}.choice", "must be a non-empty list of non-empty strings")
            if len(c) > MAX_CHOICES or sum(len(s) for s in c) > MAX_SPEC_CHARS:
                raise InvalidRequest(f"{FIELD}.choice", f"at most {MAX_CHOICES} choices of "
                                     f"{MAX_SPEC_CHARS} characters in all")
        return self

    def spec(self) -> GrammarSpec:
        """The constraint; call after `validate()`."""
        ws = not self.disable_any_whitespace
        if self.json is not None:
            assert isinstance(self.json, str), "validate() first: it turns a schema into its JSON text"
            return GrammarSpec(GrammarKind.JSON, self.json, ws)
        if self.json_object:
            return GrammarSpec(GrammarKind.JSON_OBJECT, "", ws)
        if self.regex is not None:
            return GrammarSpec(GrammarKind.REGEX, self.regex, False)
        if self.choice is not None:
            return GrammarSpec(GrammarKind.CHOICE, json.dumps(self.choice), False)
        assert self.grammar is not None  # validate(): exactly one is set
        return GrammarSpec(GrammarKind.GRAMMAR, self.grammar, False)


def _schema_text(schema: Any) -> tuple[str, Any]:
    """A schema as JSON text, and parsed: a dict or bool is serialized (key order kept: it
    is the order properties are generated in); a string must parse to an object or a bool."""
    field = f"{FIELD}.json"
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise InvalidRequest(field, f"at most {MAX_SPEC_CHARS} characters")
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(field, f"is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequest(field, "is nested too deep to read") from None
        if not isinstance(parsed, (dict, bool)):
            raise InvalidRequest(field, f"a JSON schema must be an object or a boolean, got "
                                 f"{type(parsed).__name__}")
        return schema, parsed
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(field, f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except (RecursionError, ValueError, TypeError) as e:  # nested too deep, a circular or odd value
        raise InvalidRequest(field, f"cannot be written as JSON: {type(e).__name__}") from None
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequest(field, f"at most {MAX_SPEC_CHARS} characters")
    return text, schema
