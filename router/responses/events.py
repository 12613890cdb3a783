"""A streamed response: the chat chunks of one generation (bodies.py) -> the Responses
API's typed events, each with its ``sequence_number`` (0, 1, 2, ...)::

    response.created, response.in_progress                   (status "in_progress")
    for each output item, in order:
      text   response.output_item.added (message) -> response.content_part.added
             -> response.output_text.delta ... -> response.output_text.done
             -> response.content_part.done -> response.output_item.done
      call   response.output_item.added (function_call, arguments "")
             -> response.function_call_arguments.delta ... -> ...arguments.done
             -> response.output_item.done
    response.completed, or response.incomplete (max_output_tokens cut it)
    on failure: error, then response.failed

A message item opens with the first text; a tool call closes the item before it, so
each item's events end before the next item's begin.
The last event's response is the same object a non-streamed request returns.

Must not do I/O: it turns dicts into dicts.
"""

from __future__ import annotations

from typing import Any

from ..errors import ApiError
from .objects import (ResponseHead, function_call_item, item_status, message_item, new_id,
                                text_part)


class EventStream:
    def __init__(self, head: ResponseHead, logprobs: bool):
        self.head = head
        self._logprobs = logprobs  # output_text carries logprobs
        self._seq = 0
        self.items: list[dict[str, Any]] = []  # output items, in order, as last seen
        self._message: dict[str, Any] | None = None  # the message item being written
        self._text: list[str] = []  # its text so far
        self._message_logprobs: list[dict[str, Any]] = []
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its open item
        self.finish_reason: str | None = None

    def _event(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = {"type": type_, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.head.body("in_progress", [])
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat.completion.chunk -> its events."""
        out: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("content"):
                lps = (choice.get("logprobs") or {}).get("content") or [] if self._logprobs else []
                out += self._text_delta(delta["content"], lps)
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self, usage: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(the closing events, the final response)."""
        out = []
        if not self.items:  # nothing generated: one empty message, as a whole answer has
            out += self._open_message()
        out += self._close_message()
        for index in sorted(i for i, c in self._calls.items() if c["status"] == "in_progress"):
            out += self._close_call(index)
        status = item_status(self.finish_reason)
        response = self.head.body(status, self.items, usage)
        out.append(self._event(f"response.{status}", response=response))
        return out, response

    def fail(self, error: ApiError) -> list[dict[str, Any]]:
        code = ("server_error" if error.status >= 500 else "rate_limit_exceeded" if error.status == 429
                else "invalid_prompt")  # Response.error.code is one of OpenAI's few
        body = {"code": code, "message": error.message}
        return [self._event("error", code=error.code or error.type, message=error.message,
                            param=error.param),
                self._event("response.failed", response=self.head.body("failed", self.items,
                                                                       error=body))]

    # -- text ----------------------------------------------------------------------

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = message_item(new_id("msg"), "", "in_progress")
        self._message["content"] = []
        self.items.append(self._message)
        ids = self._ids(self._message)
        part = text_part("")
        return [self._event("response.output_item.added", output_index=ids["output_index"],
                            item=dict(self._message, content=[])),
                self._event("response.content_part.added", content_index=0, part=part, **ids)]

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = self._open_message() if self._message is None else []
        assert self._message is not None
        self._text.append(text)
        self._message_logprobs += logprobs
        return out + [self._event("response.output_text.delta", content_index=0, delta=text,
                                  logprobs=logprobs, **self._ids(self._message))]

    def _close_message(self) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        message, self._message = self._message, None
        text, logprobs = "".join(self._text), self._message_logprobs
        part = text_part(text, logprobs)
        message["content"] = [part]
        message["status"] = item_status(self.finish_reason)
        ids = self._ids(message)
        return [self._event("response.output_text.done", content_index=0, text=text,
                            logprobs=logprobs, **ids),
                self._event("response.content_part.done", content_index=0, part=part, **ids),
                self._event("response.output_item.done", output_index=ids["output_index"],
                            item=message)]

    # -- tool calls ------------------------------------------------------------------

    def _call_delta(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        index = call["index"]
        fn = call.get("function") or {}
        item = self._calls.get(index)
        if item is None:  # a new call: the ones before it are whole (each item ends before the next)
            out += self._close_message()
            for open_index in sorted(i for i, c in self._calls.items() if c["status"] == "in_progress"):
                out += self._close_call(open_index)
            item = function_call_item(new_id("fc"), call["id"], fn["name"], "", "in_progress")
            self._calls[index] = item
            self.items.append(item)
            out.append(self._event("response.output_item.added",
                                   output_index=self._ids(item)["output_index"], item=dict(item)))
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta",
                                   delta=fn["arguments"], **self._ids(item)))
        return out

    def _close_call(self, index: int) -> list[dict[str, Any]]:
        item = self._calls[index]
        item["status"] = "completed"
        ids = self._ids(item)
        return [self._event("response.function_call_arguments.done", arguments=item["arguments"],
                            name=item["name"], **ids),
                self._event("response.output_item.done", output_index=ids["output_index"],
                            item=dict(item))]

    def _ids(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}
