"""The ``file_search`` tool: the input's last user turn is the query; the caller's vector
stores' best chunks go into the system turn position-aware and labelled
(``retrieval/prompt.py``), as many as the context holds beside the answer (the rest are
dropped, from the lowest rank, and the response says how many under
``metadata.kvgate_dropped_sources``).

``answer_mode: "extract"`` (kvgate's) is locate → extract → answer: the best chunk's clause
is quoted verbatim as the evidence, with its citation, even when the model is too small to
phrase a good answer; the model answers from that clause alone.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from kvgate.errors import InvalidRequest
from kvgate.retrieval import filters as attribute_filters
from kvgate.retrieval.prompt import arrange, fit, sources_block
from kvgate.retrieval.service import DocsService, SearchResult
from kvgate.server.rerank import RANKER, rerank
from kvgate.server.responses.answer import Answer, Search
from kvgate.server.responses.protocol import FileSearchTool, RankingOptions, ResponsesRequest
from kvgate.server.serving import ServingContext


def file_search_tool(body: ResponsesRequest) -> FileSearchTool | None:
    """The request's ``file_search`` tool (its filters checked), if it has one."""
    found = None
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "file_search":
            continue
        if found is not None:
            raise InvalidRequest("at most one file_search tool", param=f"tools[{i}]")
        try:
            found = FileSearchTool.model_validate(tool)
        except ValueError as exc:
            raise InvalidRequest(f"invalid file_search tool: {exc}", param=f"tools[{i}]") from None
        if found.filters is not None:
            attribute_filters.check(found.filters, f"tools[{i}].filters")
    return found


def extract(result: SearchResult, question: str) -> str:
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


async def retrieve(
    ctx: ServingContext,
    http: Request,
    docs: DocsService,
    tenant: str,
    tool: FileSearchTool,
    answer: Answer,
    question: str,
) -> None:
    """Search the caller's stores for ``question``: the answer's ``search`` record."""
    search = Search(
        f"fs_{answer.id.removeprefix('resp_')}",
        "file_search_call.results" in (answer.body.include or []),
        queries=[question],
    )
    answer.search = search
    results = await run_in_threadpool(
        docs.search, tenant, tool.vector_store_ids, question, tool.max_num_results, tool.filters
    )
    ranking = tool.ranking_options or RankingOptions()
    if ranking.score_threshold is not None:
        results = [r for r in results if r.score >= ranking.score_threshold]
    if ranking.ranker == RANKER:
        results = await rerank(ctx, http, results, question, answer.id)
    search.results = results
    body = answer.body

    def expanded() -> list[SearchResult]:
        return [
            docs.expand(r, body.expand_neighbours) if i < body.expand_top else r
            for i, r in enumerate(search.results)
        ]

    search.sources = await run_in_threadpool(expanded) if body.expand_neighbours else results


def sources_system(
    answer: Answer, question: str, room: int, tokens: Callable[[str], int]
) -> str | None:
    """The system turn's sources: as many as fit in ``room`` tokens (None: no sources).
    Sets what the answer's citations are matched against."""
    search = answer.search
    if search is None or not search.sources:
        return None
    choices = [
        [s, r] if s is not r else [r] for s, r in zip(search.sources, search.results, strict=True)
    ]
    if answer.body.answer_mode == "extract":
        best = search.results[0]  # the clause itself, not its neighbours
        evidence = extract(best, question)
        section = best.attributes.get("section") or best.filename
        answer.prefix = f"{section}：「{evidence}」[1]\n\n"
        choices = [[SearchResult(best.file_id, best.filename, best.score, evidence,
                                 best.attributes)]]  # fmt: skip
    kept, search.dropped = fit(choices, tokens, max(room, 0))
    search.results = (
        search.results[: len(kept)] if answer.body.answer_mode != "extract" else search.results[:1]
    )
    search.shown = [r.text for r in kept]  # a rank's chunk with its neighbours, or alone
    return sources_block(arrange(kept)) if kept else None
