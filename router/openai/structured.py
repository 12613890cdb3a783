"""The structured-output parameters of an OpenAI request -> `StructuredOutputsParams`.

Accepted, at most one per request (two -> 400 naming the second):

    response_format  {"type": "text"}                          no constraint
                     {"type": "json_object"}                   any JSON object
                     {"type": "json_schema", "json_schema":
                        {"name", "schema", "strict", "description"}}   that schema
    structured_outputs {"json" | "json_object" | "regex" | "choice" | "grammar",
                        "disable_any_whitespace"}              vLLM's current field
    guided_json / guided_regex / guided_choice / guided_grammar     vLLM's older fields

`Constraint.field` is the parameter the user wrote, so an error the nodes report
while compiling the grammar (``structured_outputs.json: ...``) is answered naming it.

Must not compile grammars (the nodes do, with the model's tokenizer) or import xgrammar.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from ...common.errors import InvalidRequest
from ...common.structured_outputs import FIELD, StructuredOutputsParams
from ..errors import ApiError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")


class Constraint(NamedTuple):
    params: StructuredOutputsParams  # validated
    field: str  # the request parameter it came from, for error messages


def request_constraint(req) -> Constraint | None:
    """The request's one structured-output constraint, validated; None without one."""
    found: list[Constraint] = []
    if req.response_format is not None:
        params = _response_format(req.response_format)
        if params is not None:
            found.append(Constraint(params, _response_format_field(req.response_format)))
    if req.structured_outputs is not None:
        try:
            params = msgspec.convert(req.structured_outputs, StructuredOutputsParams)
        except msgspec.ValidationError as e:
            raise ApiError(400, f"{FIELD}: {e}", param=FIELD) from None
        found.append(Constraint(params, FIELD))
    for name, key in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append(Constraint(StructuredOutputsParams(**{key: value}), name))
    if len(found) > 1:
        raise ApiError(400, f"{found[1].field}: only one structured-output constraint per request, "
                       f"and {found[0].field} is given too", param=found[1].field)
    if not found:
        return None
    c = found[0]
    try:
        c.params.validate()
    except InvalidRequest as e:
        field = rename(e.field, c.field)
        raise ApiError(400, f"{field}: {e.message}", param=field) from None
    return c


def rename(node_field: str, user_field: str) -> str:
    """``structured_outputs.json`` (what nodes and validation name) -> the user's parameter;
    a path inside the schema is kept: ``structured_outputs.json.properties.a.maxLength`` ->
    ``response_format.json_schema.schema.properties.a.maxLength``."""
    if user_field == FIELD or not node_field.startswith(FIELD):
        return node_field
    inside = f"{FIELD}.json."
    return user_field + node_field[len(inside) - 1:] if node_field.startswith(inside) else user_field


def renamed_constraint_error(e: ApiError, user_field: str | None) -> ApiError:
    """A node's 400 naming ``structured_outputs.<x>`` -> the same error naming ``user_field``."""
    if user_field is None or e.param is None or not e.param.startswith(FIELD):
        return e
    field = rename(e.param, user_field)
    message = e.message.removeprefix(f"{e.param}: ")
    return ApiError(e.status, f"{field}: {message}", param=field)


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ApiError(400, "response_format.type: must be one of text, json_object, json_schema, "
                       f"got {str(kind)[:100]!r}", param="response_format.type")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema: required with type json_schema: an object "
                       "with name and schema", param="response_format.json_schema")
    unknown = sorted(set(spec) - set(_JSON_SCHEMA_KEYS))
    if unknown:
        raise ApiError(400, f"response_format.json_schema.{unknown[0][:100]}: unknown field; allowed: "
                       + ", ".join(_JSON_SCHEMA_KEYS), param=f"response_format.json_schema.{unknown[0][:100]}")
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, "response_format.json_schema.schema: required: a JSON schema object",
                       param="response_format.json_schema.schema")
    for key, type_ in (("name", str), ("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], type_):
            raise ApiError(400, f"response_format.json_schema.{key}: must be a {type_.__name__}",
                           param=f"response_format.json_schema.{key}")
    return StructuredOutputsParams(json=schema)


def _response_format_field(rf: dict[str, Any]) -> str:
    return "response_format.json_schema.schema" if rf.get("type") == "json_schema" else "response_format"
