"""One response in the making: its output items (a ``file_search_call``, then the
assistant's message or its function calls), the response object at each status, and the
stream's events in OpenAI's order.

The model's text is read by the chat endpoint's ``ToolCallReader``: output that begins with
a call is calls (one ``function_call`` item each), anything else is the message. The
message's item opens with its first text, so a stream never announces a message that turns
out to be calls.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from kvgate.retrieval.prompt import citations
from kvgate.retrieval.service import SearchResult
from kvgate.server.responses.items import new_id
from kvgate.server.responses.protocol import ResponsesRequest
from kvgate.server.tracker import Tracker
from kvgate.structured.tools import Delta, ToolCallReader


@dataclass
class Search:
    """The ``file_search_call``: its queries, its results as searched, and the texts the
    prompt showed for them (a rank's chunk with its neighbours, fitted)."""

    id: str
    include_results: bool
    queries: list[str] = field(default_factory=list)
    results: list[SearchResult] = field(default_factory=list)
    sources: list[SearchResult] = field(default_factory=list)  # as they go into the prompt
    shown: list[str] = field(default_factory=list)
    dropped: int = 0

    def item(self, status: str = "completed") -> dict[str, Any]:
        results = None
        if self.include_results and status == "completed":
            results = [
                {"file_id": r.file_id, "filename": r.filename, "score": round(r.score, 6),
                 "text": r.text, "attributes": r.attributes}
                for r in self.results
            ]  # fmt: skip
        return {"id": self.id, "type": "file_search_call", "status": status,
                "queries": self.queries, "results": results}  # fmt: skip


@dataclass
class Call:
    item_id: str
    call_id: str
    name: str
    arguments: str = ""
    #: Cut by ``max_output_tokens`` inside its arguments.
    cut: bool = False

    def item(self, status: str = "completed") -> dict[str, Any]:
        done = status != "in_progress"
        if done and self.cut:
            status = "incomplete"
        return {"id": self.item_id, "type": "function_call", "status": status,
                "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments if done else ""}  # fmt: skip


def usage_of(tracker: Tracker) -> dict[str, Any]:
    u = tracker.usage()
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,
        },
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


class Answer:
    """The response ``id`` and what it has produced; ``feed`` / ``finish`` read the model's
    text and give the stream's events for it."""

    def __init__(self, body: ResponsesRequest, model: str, may_call: bool):
        self.body = body
        self.model = model
        # Ids of the server's own making, never the client's x-request-id (which names the
        # request in the logs): a stored response's id must not be claimable by a client.
        token = secrets.token_hex(16)
        self.id = f"resp_{token}"
        self.created = int(time.time())
        self.message_id = f"msg_{token}"
        self.search: Search | None = None
        self.prefix = ""  # extract mode: the quoted evidence before the model's text
        self.text = ""  # the message's text as the reader gave it
        self.calls: list[Call] = []
        self.reader = ToolCallReader(may_call)
        self.message_open = False
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.seq = 0
        self._cited: tuple[str, list[dict[str, Any]]] | None = None

    def reading(self, may_call: bool) -> None:
        """How the model's text is to be read: calls may come (the request has tools)."""
        self.reader = ToolCallReader(may_call)

    # ------------------------------------------------------------------ items

    def annotations(self, text: str) -> list[dict[str, Any]]:
        """``text``'s citations, matched against the sources as the prompt showed them;
        computed once per text (a stream asks for them in three events)."""
        search = self.search
        if search is None or not search.results:
            return []
        if self._cited is None or self._cited[0] != text:
            shown = search.shown if len(search.shown) == len(search.results) else None
            self._cited = (text, citations(text, search.results, shown))
        return self._cited[1]

    def part(self) -> dict[str, Any]:
        text = self.prefix + self.text
        return {"type": "output_text", "text": text, "annotations": self.annotations(text)}

    @property
    def cut(self) -> bool:
        """The output was cut (``max_output_tokens``, or a cancel): its items are
        ``incomplete``."""
        return self.finish_reason not in (None, "stop")

    def message_item(self, status: str | None = None) -> dict[str, Any]:
        """The message item (``status`` None: as it ended, ``incomplete`` when cut)."""
        if status is None:
            status = "incomplete" if self.cut else "completed"
        content = [self.part()] if status != "in_progress" else []
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}  # fmt: skip

    @property
    def has_message(self) -> bool:
        return not self.calls or bool(self.prefix + self.text)

    def output(self, status: str) -> list[dict[str, Any]]:
        items = [self.search.item()] if self.search is not None and self.search.queries else []
        if status in ("completed", "incomplete", "cancelled"):
            if self.has_message:
                items.append(self.message_item())
            items += [c.item() for c in self.calls]
        return items

    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object; a ``completed`` one cut by ``max_output_tokens`` is
        ``incomplete``, as OpenAI's."""
        body = self.body
        incomplete = None
        if status == "completed" and self.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        metadata = dict(body.metadata or {})
        if self.search is not None and self.search.dropped:
            metadata["kvgate_dropped_sources"] = str(self.search.dropped)
        fmt = body.text.format if body.text is not None else None
        text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        if text_format["type"] == "json_schema":
            text_format.setdefault("name", "response")
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "background": bool(body.background), "model": self.model,
            "output": self.output(status), "usage": self.usage if status not in (
                "queued", "in_progress") else None,
            "error": error, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": metadata, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": body.stored,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": choice.model_dump() if choice is not None and not isinstance(
                choice, str) else choice or "auto",
            "tools": body.tools or [], "text": {"format": text_format},
            "truncation": body.truncation or "disabled", "user": body.user,
        }  # fmt: skip

    # ------------------------------------------------------------------ reading

    def collect(self, text: str) -> None:
        """A whole response's text, read at once."""
        self._take(self.reader.feed(text) + self.reader.finish())
        self._mark_cut()

    def _mark_cut(self) -> None:
        if self.calls and self.reader.cut:
            self.calls[-1].cut = True

    def _take(self, deltas: list[Delta]) -> None:
        for d in deltas:
            if d.index is None:
                self.text += d.content
            elif d.call_id is not None:
                self.calls.append(Call(new_id("fc"), d.call_id, d.name or ""))
            else:
                self.calls[d.index].arguments += d.arguments

    # ------------------------------------------------------------------ events

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def opening(self) -> list[str]:
        """``response.created``, ``in_progress``, and the search's events when it searched."""
        events = [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]
        search = self.search
        if search is not None and search.queries:
            events.append(self.event("response.output_item.added", output_index=0,
                                     item=search.item("in_progress")))  # fmt: skip
            for phase in ("in_progress", "searching", "completed"):
                events.append(self.event(f"response.file_search_call.{phase}", output_index=0,
                                         item_id=search.id))  # fmt: skip
            events.append(self.event("response.output_item.done", output_index=0,
                                     item=search.item()))  # fmt: skip
        if self.prefix:
            events += self._open_message() + self._text_delta(self.prefix)
        return events

    @property
    def _base(self) -> int:
        """The output index of the first item after the search."""
        return 1 if self.search is not None and self.search.queries else 0

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": self._base, "content_index": 0}

    def _open_message(self) -> list[str]:
        self.message_open = True
        return [
            self.event("response.output_item.added", output_index=self._base,
                       item=self.message_item("in_progress")),
            self.event("response.content_part.added", **self._at(),
                       part={"type": "output_text", "text": "", "annotations": []}),
        ]  # fmt: skip

    def _text_delta(self, text: str) -> list[str]:
        return [self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[])]

    def _call_index(self, n: int) -> int:
        return self._base + (1 if self.message_open else 0) + n

    def feed(self, text: str) -> list[str]:
        """Events for the next piece of the model's text."""
        return self._events(self.reader.feed(text))

    def finish(self) -> list[str]:
        """The events that close the output items (the response's own last event is the
        caller's: it needs the usage)."""
        events = self._events(self.reader.finish())
        self._mark_cut()
        if not self.calls and not self.message_open:
            events += self._open_message()  # an empty answer is still a message
        if self.message_open:
            part, at = self.part(), self._at()
            for n, annotation in enumerate(part["annotations"]):
                events.append(self.event("response.output_text.annotation.added", **at,
                                         annotation_index=n, annotation=annotation))  # fmt: skip
            events += [
                self.event("response.output_text.done", **at, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **at, part=part),
                self.event("response.output_item.done", output_index=self._base,
                           item=self.message_item()),
            ]  # fmt: skip
        if self.calls:
            events += self._close_call(len(self.calls) - 1)
        return events

    def _close_call(self, n: int) -> list[str]:
        call, index = self.calls[n], self._call_index(n)
        return [
            self.event("response.function_call_arguments.done", item_id=call.item_id,
                       output_index=index, name=call.name, arguments=call.arguments),
            self.event("response.output_item.done", output_index=index, item=call.item()),
        ]  # fmt: skip

    def _events(self, deltas: list[Delta]) -> list[str]:
        events: list[str] = []
        for d in deltas:
            if d.index is None:
                if not d.content:
                    continue
                if not self.message_open:
                    events += self._open_message()
                self.text += d.content
                events += self._text_delta(d.content)
            elif d.call_id is not None:
                if self.calls:
                    events += self._close_call(len(self.calls) - 1)
                self.calls.append(Call(new_id("fc"), d.call_id, d.name or ""))
                n = len(self.calls) - 1
                events.append(self.event("response.output_item.added",
                                         output_index=self._call_index(n),
                                         item=self.calls[n].item("in_progress")))  # fmt: skip
            elif d.arguments:
                call = self.calls[d.index]
                call.arguments += d.arguments
                events.append(self.event("response.function_call_arguments.delta",
                                         item_id=call.item_id,
                                         output_index=self._call_index(d.index),
                                         delta=d.arguments))  # fmt: skip
        return events
