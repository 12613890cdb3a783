"""The Responses API's objects: the response, its output items and its usage, in the
shapes of the openai client's ``types/responses`` (Response, ResponseOutputMessage,
ResponseFunctionToolCall, ResponseUsage).

A response is built from the chat completion body (bodies.py) of the same generation,
so its text and tool calls are the chat endpoint's::

    chat message.content       -> a "message" item with one "output_text" part
    chat message.tool_calls    -> one "function_call" item each (call_id: the call's id)
    finish_reason "length"     -> status "incomplete", incomplete_details
                                  {"reason": "max_output_tokens"}; the message item
                                  "incomplete" (complete tool calls stay "completed")
    otherwise                  -> status "completed"
    usage prompt / completion  -> input_tokens (+ input_tokens_details.cached_tokens),
                                  output_tokens

Must not do I/O or know about nodes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from .request import ResponsesRequest

INCOMPLETE = {"reason": "max_output_tokens"}


def new_id(prefix: str) -> str:
    """``resp_<hex>``, ``msg_<hex>``, ``fc_<hex>``, as OpenAI's ids look."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(slots=True)
class ResponseHead:
    """What every snapshot of one response shares: its ids and the request's settings,
    echoed as OpenAI echoes them."""

    id: str
    created_at: int  # unix seconds
    model: str
    request: ResponsesRequest

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        r = self.request
        reasoning = r.reasoning
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": INCOMPLETE if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None, "metadata": r.metadata or {}, "model": self.model,
            "output": output, "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": reasoning.effort if reasoning else None,
                          "summary": reasoning.summary if reasoning else None},
            "store": r.store is not False,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "text": {"format": (r.text.format if r.text and r.text.format else {"type": "text"})},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [], "top_logprobs": r.top_logprobs or 0,
            "top_p": 1.0 if r.top_p is None else r.top_p, "truncation": "disabled",
            "usage": usage, "user": r.user,
        }


def message_item(item_id: str, text: str, status: str,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_of(completion: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """A whole chat completion (one choice) -> (output items, the response's status)."""
    choice = completion["choices"][0]
    message, finish = choice["message"], choice["finish_reason"]
    calls = message.get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        logprobs = (choice.get("logprobs") or {}).get("content")
        items.append(message_item(new_id("msg"), message.get("content") or "", item_status(finish),
                                  logprobs))
    for call in calls:
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    return items, item_status(finish)


def usage_of(usage: dict[str, Any]) -> dict[str, Any]:
    """A chat usage -> the Responses usage (no reasoning tokens; cache writes not counted)."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}
