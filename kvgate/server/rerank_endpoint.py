"""``POST /v1/rerank`` (also ``/rerank`` and ``/v2/rerank``): the Cohere / Jina rerank shape
that vLLM serves, scored by a served chat model's yes/no judgement (``rerank.py``).

Each document is put to the model with the query (``retrieval/rerank.py``'s question, the
document whole); its ``relevance_score`` is the sigmoid of the log-odds of ``Yes`` against
``No`` as the model's first token, ``P(yes) / (P(yes) + P(no))``, in (0, 1). Results are
sorted by it, best first (ties keep the documents' order), ``top_n`` of them.

The documents run as the caller's requests under its tenant: one request against its
``requests_per_minute``, every document's prompt and token against its
``tokens_per_minute``, and each document one engine request against ``max_concurrent``, its
KV quota and queue share; the usage ledger and access log have the request's tokens. Before
any work: the query must have text, at most ``MAX_DOCUMENTS`` documents, each (with the
query and the template) within the context.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from kvgate.errors import InvalidRequest, KVGateError, PromptTooLong, RequestTooLarge
from kvgate.governance.tenants import DEFAULT_TENANT
from kvgate.retrieval.rerank import relevance, reorder
from kvgate.server.access_log import access_record
from kvgate.server.door import charge, off_loop
from kvgate.server.rerank import judge, judge_prompts
from kvgate.server.routing import Route
from kvgate.server.serving import ServingContext
from kvgate.server.streaming import ClientDisconnected, unless_disconnected

#: Most documents one request may rerank: each is a prefill (Cohere's API allows 1,000 and
#: recommends far fewer; a CPU server's queue and its tenants' shares are in hundreds).
MAX_DOCUMENTS = 100


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    model: str | None = None
    query: str
    documents: Annotated[list[str | RerankDocument], Field(min_length=1)]
    #: How many results, best first; None or 0 (vLLM's default): all.
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool = True


def _refused(ctx: ServingContext, tenant: str, exc: KVGateError) -> KVGateError:
    ctx.governance.count_refusal(tenant, exc.code)
    return exc


def _checked_texts(ctx: ServingContext, tenant: str, body: RerankRequest) -> list[str]:
    """The documents' texts once the query and their number pass (400s, counted)."""
    if not body.query.strip():
        raise _refused(ctx, tenant, InvalidRequest("query must have text", param="query"))
    if len(body.documents) > MAX_DOCUMENTS:
        raise _refused(
            ctx,
            tenant,
            RequestTooLarge(
                f"{len(body.documents)} documents; at most {MAX_DOCUMENTS} per request",
                param="documents",
            ),
        )
    return [d if isinstance(d, str) else d.text for d in body.documents]


def _check_lengths(ctx: ServingContext, tenant: str, prompts: list[list[int]]) -> None:
    """Each document's prompt and its one token within the context (the tenant's
    ``max_context`` where lower): a 400 naming the document."""
    spec = ctx.governance.spec(tenant)
    context = ctx.door.context_for(spec)
    whose = spec.name if context < ctx.door.context else None
    for i, prompt in enumerate(prompts):
        if len(prompt) + 1 > context:
            error = PromptTooLong(len(prompt), 1, context, param=f"documents[{i}]", tenant=whose)
            raise _refused(ctx, tenant, error)


async def create_rerank(ctx: ServingContext, body: RerankRequest, http: Request) -> dict[str, Any]:
    record = access_record(http)
    record.model = ctx.served_model_name
    tenant = record.tenant or DEFAULT_TENANT
    charge(ctx.governance, tenant)
    texts = _checked_texts(ctx, tenant, body)
    spec = ctx.governance.spec(tenant)
    # Characters and the fewest tokens each document's text can be, before tokenizing.
    ctx.door.counted(
        tenant, ctx.door.check_prompts, [([body.query, t], 0) for t in texts], spec, "documents"
    )
    prompts = await off_loop(judge_prompts, ctx, body.query, texts, None)
    _check_lengths(ctx, tenant, prompts)
    record.prompt_tokens = sum(len(p) for p in prompts)
    work = judge(ctx, http, body.query, prompts, f"rerank-{record.request_id}")
    judged = await unless_disconnected(http, work)  # a client gone: its requests aborted
    record.completion_tokens = judged.completion_tokens
    top_n = body.top_n or len(texts)
    results = []
    for i in reorder(judged.scores)[:top_n]:
        result: dict[str, Any] = {"index": i, "relevance_score": relevance(judged.scores[i])}
        if body.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    used = judged.prompt_tokens + judged.completion_tokens
    return {
        "id": f"rerank-{record.request_id}",
        "model": ctx.served_model_name,
        "usage": {
            "prompt_tokens": judged.prompt_tokens,
            "completion_tokens": judged.completion_tokens,
            "total_tokens": used,
        },
        "results": results,
    }


def install_rerank_routes(app: FastAPI) -> None:
    async def rerank(body: RerankRequest, request: Request, route: Route) -> Response:
        ctx = route(body.model)
        try:
            return JSONResponse(await create_rerank(ctx, body, request))
        except ClientDisconnected:
            return Response(status_code=499)

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], response_model=None)
