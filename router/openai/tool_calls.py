"""Tool calling on /v1/chat/completions: ``tools``, ``tool_choice``, and the
``message.tool_calls`` of the answer.

    tool_choice   prompt                        output constrained to         parsed as
    -----------   ---------------------------   ---------------------------   ----------------------
    "none"        tools left out                nothing                       content
    "auto"        tools rendered                nothing                       <tool_call>{json}</tool_call>
    (default with tools)                                                      blocks -> tool_calls, the
                                                                              rest -> content
    "required"    tools rendered                a JSON array of {"name",      each item -> a tool call
                                                "arguments"} (one item with
                                                parallel_tool_calls=false)
    {"type": "function", "function": {"name"}}  that function's parameters    the arguments of one call
                                                schema

Tools reach the model through its chat template (``tools=``, as transformers'
``apply_chat_template``). A template that does not use ``tools`` (the bundled SmolLM2
does not) gets them in a system message, with the Hermes ``<tool_call>`` convention
that "auto" parses; earlier assistant tool calls are written back in that form.
A constrained answer ends with finish_reason "tool_calls". One cut by max_tokens keeps
finish_reason "length": "required" and "auto" answers return the calls complete so far
as tool_calls (the call being written when the budget ran out is dropped), or their
text as content when no call was complete; a "named" one keeps its text as content.
Call ids are ``call_<24 hex>``.

Must not tokenize or talk to nodes.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ...common.errors import InvalidRequest
from ...common.structured_outputs import StructuredOutputsParams
from ..errors import ApiError
from .structs import ChatCompletionRequest
from .structured import rename

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: ToolMode
    tools: list[dict]  # OpenAI tool dicts, as templates take them; [] when not rendered
    named: str | None = None  # NAMED: the function's name
    constraint: StructuredOutputsParams | None = None  # REQUIRED, NAMED (validated)
    field: str | None = None  # the parameter the constraint comes from, named in its errors


class ToolCall(NamedTuple):
    name: str
    arguments: str  # JSON text


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """Check ``tools`` and ``tool_choice``; None when the request uses no tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice is None or choice == "none":
            return None
        raise ApiError(400, "tool_choice: needs tools; send tools or leave tool_choice out",
                       param="tool_choice")
    names: dict[str, dict] = {}
    for i, tool in enumerate(req.tools):
        if tool.type != "function":
            raise ApiError(400, f"tools[{i}].type: only \"function\" is supported, got {tool.type!r}",
                           param=f"tools[{i}].type")
        fn = tool.function
        if fn.name in names:
            raise ApiError(400, f"tools[{i}].function.name: {fn.name!r} is given twice",
                           param=f"tools[{i}].function.name")
        params = fn.parameters if fn.parameters is not None else _EMPTY_PARAMETERS
        names[fn.name] = {"type": "function", "function": {
            "name": fn.name, "description": fn.description or "", "parameters": params}}
    tools = list(names.values())
    if choice is None or choice == "auto":
        return ToolPlan(ToolMode.AUTO, tools)
    if choice == "none":
        return ToolPlan(ToolMode.NONE, [])
    if choice == "required":
        for i, t in enumerate(tools):  # each one's own limits first, an error naming the tool's field
            _constraint(t["function"]["parameters"], f"tools[{i}].function.parameters")
        items = [{"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": t["function"]["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, t in names.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolPlan(ToolMode.REQUIRED, tools, constraint=_constraint(schema, "tools", inside=False),
                        field="tools")
    if isinstance(choice, str):
        raise ApiError(400, "tool_choice: must be none, auto, required or {\"type\": \"function\", "
                       f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")
    if choice.type != "function":
        raise ApiError(400, f"tool_choice.type: only \"function\" is supported, got {choice.type!r}",
                       param="tool_choice.type")
    name = choice.function.name
    if name not in names:
        raise ApiError(400, f"tool_choice.function.name: {name!r} is not one of the tools",
                       param="tool_choice.function.name")
    field = f"tools[{list(names).index(name)}].function.parameters"
    return ToolPlan(ToolMode.NAMED, tools, named=name,
                    constraint=_constraint(names[name]["function"]["parameters"], field), field=field)


def _constraint(schema: dict, field: str, inside: bool = True) -> StructuredOutputsParams:
    """``schema`` (the user's ``field``) validated; an error names the keyword's path inside
    it unless not ``inside`` (a schema built here: its paths are not the user's)."""
    try:
        return StructuredOutputsParams(json=schema).validate()
    except InvalidRequest as e:  # e.g. a schema too large or too costly to compile
        where = rename(e.field, field) if inside else field
        raise ApiError(400, f"{where}: {e.message}", param=where) from None


def system_prompt(tools: list[dict]) -> str:
    """The tools for a chat template that does not render ``tools`` itself."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You are a function calling AI model. You may call one or more functions to assist with "
            f"the user query. The functions are listed in <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "For each function call, return a JSON object with the function name and arguments within "
            f"{OPEN}{CLOSE} tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": "
            f"<args-json-object>}}\n{CLOSE}")


def inline_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Messages for a template without tool support: the tools in the system message,
    earlier tool calls written as ``<tool_call>`` text."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            text = "\n".join(_tagged(c["function"]) for c in calls)
            m["content"] = (m["content"] + "\n" if m["content"] else "") + text
        out.append(m)
    if tools:
        prompt = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _tagged(function: dict) -> str:
    """An earlier call as the model would have written it."""
    call = {"name": function["name"], "arguments": _loads(function["arguments"])}
    return f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}"


def parse(plan: ToolPlan, text: str, finish_reason: str = "stop") -> tuple[str | None, list[ToolCall]]:
    """A finished answer's text -> (content, tool calls). Text that does not parse as
    the mode's format stays content, with no calls. With ``finish_reason`` "length" (cut
    by max_tokens), the complete calls before the cut (see the module's docstring)."""
    if finish_reason == "length":
        return _parse_truncated(plan, text)
    if plan.mode is ToolMode.NAMED:
        args = _loads(text)
        assert plan.named is not None  # NAMED plans name their function
        return (text, []) if args is None else (None, [ToolCall(plan.named, json.dumps(args, ensure_ascii=False))])
    if plan.mode is ToolMode.REQUIRED:
        items = _loads(text)
        parsed = [_call(item) for item in items] if isinstance(items, list) else []
        calls = [c for c in parsed if c is not None]
        return (text, []) if not calls or len(calls) < len(parsed) else (None, calls)
    if plan.mode is ToolMode.AUTO:
        return _parse_tagged(text)
    return text, []


def _parse_truncated(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """An answer cut by max_tokens -> (content, the complete calls); (text, []) without one."""
    if plan.mode is ToolMode.REQUIRED:
        parsed = [_call(item) for item in _complete_items(text)]
        calls = [c for c in parsed if c is not None]
        return (text, []) if not calls or len(calls) < len(parsed) else (None, calls)
    if plan.mode is ToolMode.AUTO:
        return _parse_tagged(text, truncated=True)
    return text, []


def _complete_items(text: str) -> list:
    """The items of a JSON array cut anywhere (``[{...}, {...}, {"na``) that are complete."""
    decoder, items = json.JSONDecoder(), list[Any]()
    at = len(text) - len(text.lstrip())
    if not text.startswith("[", at):
        return []
    at += 1
    while True:
        at += len(text[at:]) - len(text[at:].lstrip())
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:  # cut inside this item (or the array is malformed)
            return items
        items.append(item)
        at += len(text[at:]) - len(text[at:].lstrip())
        if not text.startswith(",", at):
            return items
        at += 1


def _parse_tagged(text: str, truncated: bool = False) -> tuple[str | None, list[ToolCall]]:
    """``truncated``: a last block that is not a whole call was cut by max_tokens: dropped."""
    content, calls, rest = [], [], text
    while (start := rest.find(OPEN)) >= 0:
        end = rest.find(CLOSE, start)
        call = _call(_loads(rest[start + len(OPEN):end if end >= 0 else len(rest)]))
        if call is None and truncated and end < 0:
            content.append(rest[:start])
            rest = ""
            break
        if call is None:
            return text, []  # not a well-formed call: the model wrote text
        content.append(rest[:start])
        calls.append(call)
        rest = rest[end + len(CLOSE):] if end >= 0 else ""
    content.append(rest)
    joined = "".join(content).strip()
    return (joined or None) if calls else text, calls


def _call(item) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(item["name"], json.dumps(args, ensure_ascii=False))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_calls(calls: list[ToolCall]) -> list[dict]:
    """OpenAI ``message.tool_calls``."""
    return [{"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice's deltas. NAMED streams the arguments as they come; AUTO
    streams content until a ``<tool_call>`` may start, then holds the rest back;
    REQUIRED holds everything back. `finish` emits what was held."""

    plan: ToolPlan
    held: list[str] = field(default_factory=list)
    holding: bool = False
    named_id: str | None = None

    def feed(self, text: str) -> list[dict]:
        """New text -> the deltas to send now (may be none)."""
        mode = self.plan.mode
        if mode is ToolMode.NAMED:
            if self.named_id is None:
                self.named_id = call_id()
                return [{"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                         "function": {"name": self.plan.named, "arguments": text}}]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []
        if mode is ToolMode.REQUIRED or self.holding:
            self.held.append(text)
            return []
        self.held.append(text)
        pending = "".join(self.held)
        at = pending.find(OPEN)
        if at >= 0:
            self.holding = True
            self.held = [pending[at:]]
            return [{"content": pending[:at]}] if pending[:at] else []
        keep = _partial_tag(pending)  # a suffix that may begin <tool_call>
        self.held = [pending[len(pending) - keep:]] if keep else []
        send = pending[:len(pending) - keep]
        return [{"content": send}] if send else []

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """(the last deltas, the choice's finish_reason)."""
        held = "".join(self.held)
        self.held = []
        if self.plan.mode is ToolMode.NAMED:
            return [], "tool_calls" if finish_reason == "stop" and self.named_id else finish_reason
        content, calls = (parse(self.plan, held, finish_reason) if finish_reason in ("stop", "length")
                          else (held or None, []))
        deltas: list[dict[str, Any]] = [{"content": content}] if content else []
        if calls:
            deltas.append({"tool_calls": [
                {"index": i, **c} for i, c in enumerate(message_calls(calls))]})
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return deltas, finish_reason


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
