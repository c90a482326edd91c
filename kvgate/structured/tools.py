"""Tool calling: the tools in the prompt, the grammar of a call, and calls read back out.

The wire format inside the model's output is the one most open chat models are trained on
(Hermes, Qwen): each call is a JSON object with the function's name and arguments between
``<tool_call>`` tags, one per line::

    <tool_call>
    {"name":"get_weather","arguments":{"city":"Paris"}}
    </tool_call>

``tool_grammar`` constrains it: the object must name one of the tools and its arguments must
validate against that tool's parameters, their objects closed where the schema does not
say otherwise (``closed_objects``) (``required`` / a named function: a call is the only
output; ``auto``: text, or calls from the first token on; ``none``: text only). The arguments
are kept exactly as generated, so a streamed call's argument fragments add up to the same
string as the whole response's.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance

from kvgate.structured.spec import Grammar, bounded_numbers, check_size

OPEN, CLOSE = "<tool_call>", "</tool_call>"

#: What the prompt says when the chat template cannot render tools itself.
_INSTRUCTIONS = (
    "You can call functions to help with the user's request. The functions, as JSON "
    "schemas, are:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments between "
    'tags, one call per block:\n<tool_call>\n{{"name": "NAME", "arguments": {{...}}}}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def as_json(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            spec["description"] = self.description
        return {"type": "function", "function": spec}


#: Keywords whose value is one schema, or a list or map of schemas (JSON Schema 2020-12 and
#: draft 7), that ``closed_objects`` walks into.
_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else")
_MANY = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of
    ``additionalProperties`` (nor has ``patternProperties``) closed: no keys beyond those
    it lists, as vLLM's strict mode and OpenAI's strict tools read such a schema. Tools
    are sent that way by LangChain and the plain SDK, and an open object let the model add
    keys until ``max_tokens``. An object without ``properties`` stays open (a free-form
    map); a schema that sets ``additionalProperties`` keeps what it says."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE or (key == "additionalProperties" and isinstance(value, Mapping)):
            out[key] = closed_objects(value)
        elif key in _MANY:
            out[key] = closed_objects(value)  # a list: each schema in it
        elif key in _MAP and isinstance(value, Mapping):
            out[key] = {name: closed_objects(s) for name, s in value.items()}
        else:
            out[key] = value
    if (
        "properties" in out
        and "additionalProperties" not in out
        and "patternProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def tool_grammar(
    functions: Sequence[Function],
    mode: str,
    parallel: bool,
    name: str | None = None,
    param: str = "tools",
    answer: Mapping[str, Any] | bool | None = None,
) -> Grammar:
    """``mode``: "auto" (text, or calls), "none" (text only), "required" (calls only) or
    "named" (exactly one call, of the function ``name``). ``answer``: with "auto", the
    text is not free but JSON valid against this schema (``response_format`` or
    ``text.format`` beside tools: the model calls tools or answers in the format; a JSON
    answer begins with ``{`` or ``[``, never with the call's tag, so the first character
    still decides)."""
    # Text: anything that does not open a call. It may not begin with whitespace either:
    # llguidance lexes greedily, so " <tool_call>" would be taken as text and then fail.
    text = r"TEXT: /(?s:.*)/ & ~/(?s:[ \t\r\n].*)/ & ~/(?s:<tool_call>.*)/"
    if mode == "none":
        lark = f"start: TEXT\n{text}"
        return Grammar("tools", llguidance.LLMatcher.grammar_from_lark(lark), param)
    chosen = [f for f in functions if mode != "named" or f.name == name]
    rules = []
    for i, f in enumerate(chosen):
        schema = {
            "type": "object",
            "properties": {
                "name": {"const": f.name},
                "arguments": bounded_numbers(closed_objects(f.parameters)),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False},
        }
        rules.append(f"fn{i}: %json {json.dumps(schema)}")
    if mode == "auto" and answer is not None:
        shape = bounded_numbers(answer) if isinstance(answer, Mapping) else answer
        if isinstance(shape, Mapping):
            shape = {**shape, "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"answer: %json {json.dumps(shape)}")
    calls = 'call ("\\n" call)*' if parallel and mode != "named" else "call"
    # Whitespace may come before the first call when only calls may come (the reader drops
    # it), a few characters of it: unbounded, a sampled model could write whitespace until
    # max_tokens and never call (seen in 6 of 48 seeds on a random model); with "auto" the
    # first character decides, and whitespace is not one.
    start = "start: WS? calls"
    if mode == "auto":
        start = "start: answer | calls" if answer is not None else "start: TEXT | calls"
    lark = "\n".join(
        [
            start,
            f"calls: {calls}",
            f'call: "{OPEN}\\n" ({" | ".join(f"fn{i}" for i in range(len(chosen)))}) "\\n{CLOSE}"',
            r"WS: /[ \t\r\n]{1,4}/",
            *rules,
            *([text] if mode == "auto" and answer is None else []),
        ]
    )
    check_size(lark, param)
    return Grammar("tools", llguidance.LLMatcher.grammar_from_lark(lark), param)


def tools_system_text(functions: Sequence[Function]) -> str:
    return _INSTRUCTIONS.format(tools="\n".join(json.dumps(f.as_json()) for f in functions))


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (history turns are rendered the same way)."""
    return f'{OPEN}\n{{"name":{json.dumps(name)},"arguments":{arguments}}}\n{CLOSE}'


def render_history(
    messages: Sequence[Mapping[str, Any]], functions: Sequence[Function]
) -> list[dict[str, Any]]:
    """Messages for a chat template that knows nothing of tools: the tools described in the
    system turn, assistant calls written as the model writes them, tool results as user
    turns between ``<tool_response>`` tags."""
    out: list[dict[str, Any]] = []
    for m in messages:
        message = dict(m)
        message["content"] = _text(message.get("content"))
        calls = message.pop("tool_calls", None)
        if calls:
            written = [
                call_text(c["function"]["name"], c["function"].get("arguments") or "{}")
                for c in calls
            ]
            text = message.get("content") or ""
            message["content"] = "\n".join([text, *written] if text else written)
        if message.get("role") == "tool":
            message = {
                "role": "user",
                "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>",
            }
        message.pop("tool_call_id", None)
        out.append(message)
    if functions:
        system = tools_system_text(functions)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _text(content: Any) -> Any:
    """A message's content as one string when it is text parts (joined as the tokenizer
    joins them); anything else is left for the tokenizer to refuse."""
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "\n".join(p["text"] for p in content)
    return content if content is not None else ""


def template_history(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a chat template that renders calls itself: each call's arguments as a
    dict (what such templates expect, as in transformers; a string would be JSON-encoded
    twice by their ``tojson``)."""
    out = []
    for m in messages:
        message = dict(m)
        if message.get("tool_calls"):
            message["tool_calls"] = [_parsed_arguments(c) for c in message["tool_calls"]]
        out.append(message)
    return out


def _parsed_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = None
    if isinstance(arguments, dict):
        function["arguments"] = arguments
    return {**call, "function": function}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_message(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class Delta:
    """A piece of a choice's output: ``content`` text, or (``index``) a call's start (its
    ``call_id`` and ``name``) or a fragment of its ``arguments``."""

    content: str = ""
    index: int | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str = ""


_HEAD = re.compile(
    r'[ \t\r\n]*<tool_call>[ \t\r\n]*\{[ \t\r\n]*"name"[ \t\r\n]*:[ \t\r\n]*'
    r'"((?:[^"\\]|\\.)*)"[ \t\r\n]*,[ \t\r\n]*"arguments"[ \t\r\n]*:[ \t\r\n]*'
)
_TAIL = re.compile(r"[ \t\r\n]*\}[ \t\r\n]*</tool_call>")


@dataclass
class ToolCallReader:
    """Reads one choice's output as it streams (``feed``), and at its end (``finish``).

    ``may_call``: calls are possible. The first characters decide: output that begins with
    ``<tool_call>`` is calls, anything else is content (held back only while it could
    still be the start of a call).
    """

    may_call: bool
    calls: list[ToolCall] = field(default_factory=list)
    _mode: str = "undecided"  # -> "text" | "head" | "args" | "tail"
    _buffer: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def __post_init__(self) -> None:
        if not self.may_call:
            self._mode = "text"

    @property
    def called(self) -> bool:
        return bool(self.calls)

    @property
    def cut(self) -> bool:
        """The output ended inside a call's arguments (``max_tokens``): the last call's
        arguments are not whole JSON."""
        return self._mode == "args"

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        out: list[Delta] = []
        while self._buffer:
            before = (self._mode, len(self._buffer))
            out += self._advance()
            if (self._mode, len(self._buffer)) == before:
                break  # needs more text
        return out

    def finish(self) -> list[Delta]:
        """The output ended: what is left over is content (a truncated call stays as far as
        it got)."""
        out = self.feed("")
        if self._buffer and self._mode in ("undecided", "text"):
            out.append(Delta(content=self._buffer))
            self._buffer = ""
        return out

    def _advance(self) -> list[Delta]:
        if self._mode == "undecided":
            stripped = self._buffer.lstrip(" \t\r\n")
            if stripped.startswith(OPEN):
                self._mode = "head"
            elif stripped and not OPEN.startswith(stripped):
                self._mode = "text"
            return []
        if self._mode == "text":
            content, self._buffer = self._buffer, ""
            return [Delta(content=content)]
        if self._mode == "head":
            m = _HEAD.match(self._buffer)
            if m is None:
                return []
            call = ToolCall(new_call_id(), json.loads(f'"{m.group(1)}"'))
            self.calls.append(call)
            self._buffer = self._buffer[m.end() :]
            self._mode, self._depth = "args", 0
            self._in_string = self._escaped = False
            return [Delta(index=len(self.calls) - 1, call_id=call.id, name=call.name)]
        if self._mode == "args":
            return self._scan_arguments()
        m = _TAIL.match(self._buffer)  # tail
        if m is not None:
            self._buffer = self._buffer[m.end() :]
            self._mode = "head"
        return []

    def _scan_arguments(self) -> list[Delta]:
        """Up to the end of the arguments' JSON value (braces counted outside strings)."""
        end = None
        for i, ch in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        taken = self._buffer if end is None else self._buffer[:end]
        self._buffer = "" if end is None else self._buffer[end:]
        if end is not None:
            self._mode = "tail"
        call = self.calls[-1]
        call.arguments += taken
        return [Delta(index=len(self.calls) - 1, arguments=taken)] if taken else []
