"""A request body's constraints: the grammar its output must match, and whether (and how)
its output is read back as tool calls. Shapes are checked here; whether a grammar compiles
is checked by the engine's ``GrammarCompiler`` at the door, before admission."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.errors import InvalidRequest
from kvgate.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from kvgate.structured import spec
from kvgate.structured.spec import Grammar
from kvgate.structured.tools import Function, tool_grammar


@dataclass(frozen=True)
class Constraints:
    grammar: Grammar | None = None
    #: The tools the prompt describes (chat with ``tools``).
    functions: tuple[Function, ...] = ()
    #: The output may hold tool calls, to be read back into ``tool_calls``.
    may_call: bool = False


def response_grammar(fmt: ResponseFormat | None) -> Grammar | None:
    """The grammar of ``response_format``; None for none or ``text``."""
    if fmt is None or fmt.type == "text":
        return None
    param = "response_format"
    if fmt.type == "json_object":
        return spec.json_object_grammar(param)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise InvalidRequest(
                "response_format of type json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        return spec.json_schema_grammar(
            fmt.json_schema.json_schema, "response_format.json_schema.schema"
        )
    if fmt.type == "regex":
        return spec.regex_grammar(fmt.regex, "response_format.regex")
    if fmt.type == "choice":
        return spec.choice_grammar(fmt.choice, "response_format.choice")
    return spec.lark_grammar(fmt.grammar, "response_format.grammar")


def completion_constraints(body: CompletionRequest) -> Constraints:
    return Constraints(grammar=response_grammar(body.response_format))


def chat_constraints(body: ChatCompletionRequest) -> Constraints:
    functions = tuple(
        Function(
            t.function.name,
            t.function.description,
            t.function.parameters or {"type": "object", "properties": {}},
        )
        for t in body.tools or ()
    )
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools must have distinct function names", param="tools")
    choice = body.tool_choice
    name: str | None = None
    if choice is None:
        mode = "auto" if functions else "none"
    elif isinstance(choice, str):
        mode = choice
    else:
        mode, name = "named", choice.function.name
        if name not in names:
            raise InvalidRequest(
                f"tool_choice names function {name!r}, which is not among the tools",
                param="tool_choice",
            )
    if mode != "none" and not functions:
        raise InvalidRequest(f"tool_choice {mode!r} needs tools", param="tool_choice")
    text_format = response_grammar(body.response_format)
    if not functions:
        return Constraints(grammar=text_format)
    if mode == "none":
        # The tools stay described (the history may refer to them); no call may be made.
        grammar = text_format or tool_grammar(functions, "none", False)
        return Constraints(grammar=grammar, functions=functions)
    parallel = body.parallel_tool_calls is not False
    answer = _answer_schema(body.response_format) if text_format is not None else None
    grammar = tool_grammar(functions, mode, parallel, name, answer=answer)
    return Constraints(grammar=grammar, functions=functions, may_call=True)


def _answer_schema(fmt: ResponseFormat | None) -> dict[str, Any] | bool:
    """The JSON schema an answer beside tools must match (tools with ``response_format``:
    a tool call, or text in the format). OpenAI's formats only: kvgate's regex, choice and
    grammar formats do not nest in the tool grammar."""
    assert fmt is not None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.type == "json_schema" and fmt.json_schema is not None:
        schema = fmt.json_schema.json_schema
        if schema is not None:
            return schema
    raise InvalidRequest(
        f"response_format of type {fmt.type!r} cannot be combined with tools (json_schema "
        "and json_object can) unless tool_choice is 'none'",
        param="response_format",
    )
