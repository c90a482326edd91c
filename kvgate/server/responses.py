"""``POST /v1/responses`` with the ``file_search`` tool: OpenAI's Responses shape, whole or
streamed, over the caller's own vector stores.

The input's last user turn is the query; the stores' best chunks go into the prompt
position-aware and labelled (``docs/prompt.py``), as many as the context holds beside the
answer (the rest are dropped, from the lowest rank, and the response says how many under
``metadata.kvgate_dropped_sources``). The output is a ``file_search_call`` item, then the
assistant message with ``file_citation`` annotations for the sources it cites.

``answer_mode: "extract"`` (kvgate's) is locate → extract → answer: the best chunk's clause
is quoted verbatim as the evidence, with its citation, even when the model is too small to
phrase a good answer; the model answers from that clause alone.

The generation runs under the caller's tenant like any chat request (its limits, priority,
usage record and prefix-cache salt): one tenant's chunks never reach another's prompt or
cache.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response

from kvgate.errors import InvalidRequest, KVGateError, RequestTooLarge
from kvgate.governance.tenants import DEFAULT_TENANT, TenantSpec
from kvgate.retrieval import filters as attribute_filters
from kvgate.retrieval.extra import missing_modules, unavailable
from kvgate.retrieval.prompt import arrange, citations, fit, sources_block
from kvgate.retrieval.service import DocsService, SearchResult
from kvgate.server.access_log import access_record
from kvgate.server.chat import chat_prompt_ids
from kvgate.server.choices import admit_choices
from kvgate.server.constraints import chat_constraints
from kvgate.server.door import Prompt, charge, off_loop
from kvgate.server.errors import error_body, status_of
from kvgate.server.files import docs_caller
from kvgate.server.protocol import ChatCompletionRequest
from kvgate.server.rerank import RANKER, rerank
from kvgate.server.respond import run_merged
from kvgate.server.routing import Route
from kvgate.server.serving import ServingContext
from kvgate.server.streaming import ClientDisconnected, EventStream, unless_disconnected
from kvgate.server.tracing import CHAT
from kvgate.server.tracker import Tracker

#: Tokens kept free for the answer when the request sets no max_output_tokens.
DEFAULT_ANSWER_TOKENS = 512


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class RankingOptions(_Body):
    #: OpenAI's rankers are the retriever's own order here; ``kvgate-llm``: reranked by
    #: the served model (server/rerank.py).
    ranker: Literal["auto", "default-2024-11-15", "none", "kvgate-llm"] | None = None
    score_threshold: Annotated[float, Field(ge=0, le=1)] | None = None


class FileSearchTool(_Body):
    type: Literal["file_search"]
    vector_store_ids: Annotated[list[str], Field(min_length=1, max_length=16)]
    #: 5, not 8 with neighbours: measured with Qwen2.5-1.5B on the 30 development questions
    #: (docs/user/documents.md), the same answers from half the prompt, sooner, better cited.
    max_num_results: Annotated[int, Field(ge=1, le=50)] = 5
    filters: dict[str, Any] | None = None
    ranking_options: RankingOptions | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | Annotated[list[InputMessage], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    #: kvgate's: ``extract`` quotes the best clause verbatim before the model's answer.
    answer_mode: Literal["generate", "extract"] = "generate"
    #: kvgate's: the best ``expand_top`` sources go into the prompt with up to
    #: ``expand_neighbours`` chunks on each side under the same heading (context expansion);
    #: off by default: a small model quotes the neighbours under the hit's label.
    expand_neighbours: Annotated[int, Field(ge=0, le=3)] = 0
    expand_top: Annotated[int, Field(ge=0, le=50)] = 3


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _messages(body: ResponsesRequest) -> list[dict[str, str]]:
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    return [{"role": m.role, "content": _text(m.content)} for m in body.input]


def _file_search(body: ResponsesRequest) -> FileSearchTool | None:
    found = None
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "file_search":
            raise InvalidRequest(
                f"tool type {tool.get('type')!r} is not supported on /v1/responses (only "
                "file_search; use /v1/chat/completions for function tools)",
                param=f"tools[{i}].type",
            )
        try:
            found = FileSearchTool.model_validate(tool)
        except ValueError as exc:
            raise InvalidRequest(f"invalid file_search tool: {exc}", param=f"tools[{i}]") from None
        if found.filters is not None:
            attribute_filters.check(found.filters, f"tools[{i}].filters")
    return found


class _Answer:
    """One response in the making: its ids, the search call, the message's text."""

    def __init__(self, body: ResponsesRequest, model: str, request_id: str) -> None:
        self.body = body
        self.model = model
        self.id = f"resp_{request_id}"
        self.created = int(time.time())
        self.message_id = f"msg_{request_id}"
        self.search_id = f"fs_{request_id}"
        self.queries: list[str] = []
        self.results: list[SearchResult] = []  # as searched: the file_search_call's
        self.sources: list[SearchResult] = []  # as they go into the prompt (expanded)
        self.shown: list[str] = []  # the texts the prompt showed, by rank (fitted)
        self.dropped = 0
        self.prefix = ""  # extract mode: the quoted evidence before the model's text
        self.text = ""
        self.seq = 0
        self._cited: tuple[str, list[dict[str, Any]]] | None = None  # (text, annotations)

    def search_item(self, status: str = "completed") -> dict[str, Any]:
        include = "file_search_call.results" in (self.body.include or [])
        return {
            "id": self.search_id,
            "type": "file_search_call",
            "status": status,
            "queries": self.queries,
            "results": [
                {
                    "file_id": r.file_id, "filename": r.filename, "score": round(r.score, 6),
                    "text": r.text, "attributes": r.attributes,
                }
                for r in self.results
            ]
            if include and status == "completed"
            else None,
        }  # fmt: skip

    def annotations(self, text: str) -> list[dict[str, Any]]:
        """``text``'s citations, matched against the sources as the prompt showed them;
        computed once per text (a stream asks for them in three events)."""
        if self._cited is None or self._cited[0] != text:
            shown = self.shown if len(self.shown) == len(self.results) else None
            found = citations(text, self.results, shown) if self.results else []
            self._cited = (text, found)
        return self._cited[1]

    def part(self) -> dict[str, Any]:
        text = self.prefix + self.text
        return {"type": "output_text", "text": text, "annotations": self.annotations(text)}

    def message_item(self, status: str = "completed") -> dict[str, Any]:
        content = [self.part()] if status == "completed" else []
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status, "content": content}  # fmt: skip

    def response(
        self, status: str, tracker: Tracker | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        output = []
        if self.queries:
            output.append(self.search_item())
        if status in ("completed", "incomplete"):
            output.append(self.message_item())
        usage = None
        if tracker is not None and status != "in_progress":
            u = tracker.usage()
            cached = u["prompt_tokens_details"]["cached_tokens"]
            usage = {
                "input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": u["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"],
            }  # fmt: skip
        finish = tracker.results[0].finish_reason if tracker is not None else None
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        metadata = dict(self.body.metadata or {})
        if self.dropped:
            metadata["kvgate_dropped_sources"] = str(self.dropped)
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "model": self.model, "output": output, "usage": usage, "error": error,
            "incomplete_details": incomplete, "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens, "metadata": metadata,
            "parallel_tool_calls": True, "temperature": self.body.temperature,
            "top_p": self.body.top_p, "tool_choice": "auto", "tools": self.body.tools or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
        }  # fmt: skip

    def event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _extract(result: SearchResult, question: str) -> str:
    """The clause of ``result`` that shares most words with the question: its first
    sentence-group when nothing stands out."""
    from kvgate.retrieval.retrieval import words

    wanted = set(words(question))
    parts = [p for p in result.text.replace("\r", "").split("\n") if p.strip()]
    if not parts:
        return result.text
    best = max(parts, key=lambda p: (len(wanted & set(words(p))), -parts.index(p)))
    head = parts[0]
    return best if best == head or len(head) > 120 else f"{head}\n……\n{best}"


async def _retrieve(
    ctx: ServingContext,
    http: Request,
    docs: DocsService,
    tenant: str,
    tool: FileSearchTool,
    answer: _Answer,
    question: str,
) -> None:
    answer.queries = [question]
    results = await run_in_threadpool(
        docs.search, tenant, tool.vector_store_ids, question, tool.max_num_results, tool.filters
    )
    ranking = tool.ranking_options or RankingOptions()
    if ranking.score_threshold is not None:
        results = [r for r in results if r.score >= ranking.score_threshold]
    if ranking.ranker == RANKER:
        results = await rerank(ctx, http, results, question, answer.id)
    answer.results = results
    body = answer.body

    def expanded() -> list[SearchResult]:
        return [
            docs.expand(r, body.expand_neighbours) if i < body.expand_top else r
            for i, r in enumerate(answer.results)
        ]

    answer.sources = await run_in_threadpool(expanded) if body.expand_neighbours else answer.results


def _check_input(ctx: ServingContext, count: int, prompts: list[Prompt], spec: TenantSpec) -> None:
    """The door's limits on the input's messages and prompt, before any search."""
    if count > ctx.door.limits.max_messages:
        raise RequestTooLarge(
            f"{count} input messages; at most {ctx.door.limits.max_messages} per request",
            param="input",
        )
    ctx.door.check_prompts(prompts, spec, "input")


def _tokens(ctx: ServingContext, text: str) -> int:
    return len(ctx.tokenizer.encode(text, add_special_tokens=False))


def _chat_body(
    body: ResponsesRequest, answer: _Answer, ctx: ServingContext, question: str, context: int
) -> ChatCompletionRequest:
    """The chat request that answers: the sources in the system turn, as many as fit in
    ``context`` tokens (the model's, or the tenant's max_context) beside the conversation,
    the chat template's own tokens and the answer."""
    messages = _messages(body)
    system = body.instructions or ""
    if answer.sources:
        room = context - (body.max_output_tokens or DEFAULT_ANSWER_TOKENS)
        conversation = "".join(m["content"] for m in messages) + system
        room -= _tokens(ctx, conversation) + 16 * (len(messages) + 1) + 64
        choices = [
            [s, r] if s is not r else [r]
            for s, r in zip(answer.sources, answer.results, strict=True)
        ]
        if body.answer_mode == "extract":
            best = answer.results[0]  # the clause itself, not its neighbours
            evidence = _extract(best, question)
            section = best.attributes.get("section") or best.filename
            answer.prefix = f"{section}：「{evidence}」[1]\n\n"
            choices = [[SearchResult(best.file_id, best.filename, best.score, evidence,
                                     best.attributes)]]  # fmt: skip
        kept, answer.dropped = fit(choices, lambda t: _tokens(ctx, t), max(room, 0))
        answer.results = (
            answer.results[: len(kept)] if body.answer_mode != "extract" else [answer.results[0]]
        )
        answer.shown = [r.text for r in kept]  # a rank's chunk with its neighbours, or alone
        if kept:
            system = (system + "\n\n" if system else "") + sources_block(arrange(kept))
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": messages,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stream": bool(body.stream),
        },
        strict=False,
    )


async def create_response(
    ctx: ServingContext,
    docs: DocsService | None,
    tenant: str,
    body: ResponsesRequest,
    http: Request,
) -> JSONResponse | EventStream:

    if body.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id is not supported: kvgate stores no responses; send the "
            "conversation in 'input'",
            param="previous_response_id",
        )
    tool = _file_search(body)
    if tool is not None and docs is None:
        raise unavailable(missing_modules())
    messages = _messages(body)
    question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    if not question.strip():
        raise InvalidRequest("input needs a user message with text", param="input")
    record = access_record(http)
    record.model = ctx.served_model_name
    answer = _Answer(body, ctx.served_model_name, record.request_id)
    # The tenant's request rate first, then the input's size: the search, the embedding
    # and the answer are work (a 4 MB input took 88 s of search and tokenizing before its
    # size was checked).
    who = record.tenant or DEFAULT_TENANT
    charge(ctx.governance, who)
    spec = ctx.governance.spec(who)
    texts = [m["content"] for m in messages] + [body.instructions or ""]
    ctx.door.counted(who, _check_input, ctx, len(messages), [(texts, 0)], spec)
    if tool is not None and docs is not None:
        for store_id in tool.vector_store_ids:  # each is the caller's, before any work
            docs.vector_store(tenant, store_id)
        await _retrieve(ctx, http, docs, tenant, tool, answer, question)
    context = min(ctx.max_model_len, spec.max_context or ctx.max_model_len)
    chat = await off_loop(_chat_body, body, answer, ctx, question, context)  # it tokenizes
    ctx.door.enter(who, chat, charged=True)
    constraints = chat_constraints(chat)
    prompt = await off_loop(chat_prompt_ids, ctx, chat, constraints)
    record.prompt_tokens = len(prompt)
    requests, tracker = admit_choices(
        ctx, http, [prompt], chat, max_tokens=chat.max_tokens, logprobs=None, operation=CHAT,
        response_id=answer.id,
    )  # fmt: skip
    if body.stream:
        events = _stream(ctx, requests, tracker, answer)
        return EventStream(
            events, on_close=tracker.close, stalled_timeout=ctx.door.limits.stalled_client_timeout
        )
    try:
        await unless_disconnected(http, _collect(ctx, requests, tracker, answer))
        await tracker.settle_whole()
    finally:
        tracker.close()
    return JSONResponse(answer.response("completed", tracker))


async def _collect(ctx: ServingContext, requests: Any, tracker: Tracker, answer: _Answer) -> None:
    async for i, out in run_merged(ctx.engine, requests):
        tracker.on_output(i, out)
        answer.text += out.text


async def _stream(
    ctx: ServingContext, requests: Any, tracker: Tracker, answer: _Answer
) -> AsyncGenerator[str, None]:
    yield answer.event("response.created", response=answer.response("in_progress"))
    yield answer.event("response.in_progress", response=answer.response("in_progress"))
    index = 0
    if answer.queries:
        sid = answer.search_id
        yield answer.event("response.output_item.added", output_index=0,
                           item=answer.search_item("in_progress"))  # fmt: skip
        for phase in ("in_progress", "searching", "completed"):
            yield answer.event(f"response.file_search_call.{phase}", output_index=0, item_id=sid)
        yield answer.event("response.output_item.done", output_index=0, item=answer.search_item())
        index = 1
    mid = answer.message_id
    at = {"item_id": mid, "output_index": index, "content_index": 0}
    yield answer.event("response.output_item.added", output_index=index,
                       item=answer.message_item("in_progress"))  # fmt: skip
    yield answer.event("response.content_part.added", **at,
                       part={"type": "output_text", "text": "", "annotations": []})  # fmt: skip
    try:
        if answer.prefix:
            await tracker.deliver()
            yield answer.event("response.output_text.delta", **at, delta=answer.prefix)
        async for i, out in run_merged(ctx.engine, requests, tracker.watch):
            tracker.on_output(i, out)
            if out.text:
                answer.text += out.text
                await tracker.deliver()
                yield answer.event("response.output_text.delta", **at, delta=out.text)
    except KVGateError as exc:
        tracker.record.error_code = exc.code
        tracker.error = exc.code
        error = error_body(exc.message, status_of(exc)[1], exc.code, exc.param)["error"]
        yield answer.event("error", code=exc.code, message=exc.message, param=exc.param)
        yield answer.event("response.failed", response=answer.response("failed", tracker, error))
        return
    part = answer.part()
    for n, annotation in enumerate(part["annotations"]):
        yield answer.event("response.output_text.annotation.added", **at,
                           annotation_index=n, annotation=annotation)  # fmt: skip
    yield answer.event("response.output_text.done", **at, text=part["text"])
    yield answer.event("response.content_part.done", **at, part=part)
    yield answer.event("response.output_item.done", output_index=index,
                       item=answer.message_item())  # fmt: skip
    final = answer.response("completed", tracker)
    yield answer.event(f"response.{final['status']}", response=final)


def install_response_routes(app: FastAPI) -> None:
    @app.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest, request: Request, route: Route) -> Any:
        ctx = route(body.model)
        docs: DocsService | None = request.app.state.kvgate.docs
        owner = docs_caller(request).tenant  # whose vector stores it may search
        try:
            return await create_response(ctx, docs, owner, body, request)
        except ClientDisconnected:
            return Response(status_code=499)
