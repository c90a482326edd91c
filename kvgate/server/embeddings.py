"""``POST /v1/embeddings``: OpenAI's Embeddings API, served by multilingual-e5-small
(``embedding_model.py``), the document store's own embedder.

Texts are embedded as given, as vLLM and Text Embeddings Inference serve e5: a client that
follows e5's model card sends ``query: ...`` and ``passage: ...`` itself and gets that card's
vectors. ``input_type: "query" | "passage"`` (NVIDIA NIM's field for its e5 models) makes the
server add the prefix, as the document store does for its chunks and searches.

Before any encoding, in order, each refusal counted for the tenant: the model (404, 403), the
tenant's request rate (one request however many inputs), the inputs (count, empty strings,
token ids, ``dimensions``, characters against ``--max-prompt-chars``); then, tokenized, each
input against the model's 512 positions and the request's tokens against the tenant's
``tokens_per_minute``. Tokenizing and encoding run on worker threads, never on the event
loop. Usage counts the tokens the model read (``<s>`` and ``</s>`` included); it is in the
access log and the usage ledger like a generation's prompt tokens.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvgate.errors import InvalidRequest, KVGateError, RequestTooLarge, TenantLimitExceeded
from kvgate.governance.tenants import TenantSpec
from kvgate.governance.usage import Counts
from kvgate.retrieval.extra import missing_modules, unavailable
from kvgate.server.access_log import access_record
from kvgate.server.door import charge
from kvgate.server.embedding_model import DIMENSIONS, MAX_TOKENS, NAME
from kvgate.server.governance import Governance
from kvgate.server.routing import authenticate

if TYPE_CHECKING:
    from kvgate.server.app import ServerState

#: OpenAI's limits: inputs in one request, and their tokens in all.
MAX_INPUTS = 2048
MAX_REQUEST_TOKENS = 300_000
PREFIXES = {"query": "query: ", "passage": "passage: "}


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    #: A string or a list of strings; token ids (a list of ints, or of lists) are parsed so
    #: that they can be refused with a reason.
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    #: kvgate's (NVIDIA NIM's name): add e5's ``query: `` or ``passage: `` prefix.
    input_type: Literal["query", "passage"] | None = None


class InputTooLong(InvalidRequest):
    """An input over the model's positions (400, OpenAI's code for it)."""

    code = "context_length_exceeded"


def texts_of(body: EmbeddingRequest, max_chars: int | None) -> list[str]:
    """The inputs as texts, or the 400 that says what is wrong with them."""
    given = [body.input] if isinstance(body.input, str) else body.input
    if not given:
        raise InvalidRequest("input must not be an empty list", param="input")
    if not all(isinstance(t, str) for t in given):
        raise InvalidRequest(
            "input as token ids is not supported: send text (a string or a list of strings). "
            "LangChain's OpenAIEmbeddings sends token ids of OpenAI's tokenizer unless "
            "created with check_embedding_ctx_length=False",
            param="input",
        )
    texts = [t for t in given if isinstance(t, str)]
    if len(texts) > MAX_INPUTS:
        raise RequestTooLarge(
            f"{len(texts)} inputs; at most {MAX_INPUTS} per request", param="input"
        )
    empty = next((i for i, t in enumerate(texts) if not t), None)
    if empty is not None:
        where = "input" if isinstance(body.input, str) else f"input[{empty}]"
        raise InvalidRequest(f"{where} is an empty string; every input needs text", param="input")
    if body.dimensions is not None and body.dimensions != DIMENSIONS:
        raise InvalidRequest(
            f"{NAME} gives {DIMENSIONS} dimensions only: it was not trained Matryoshka-style, "
            "so a shorter prefix of its vectors would retrieve worse without saying so",
            param="dimensions",
        )
    chars = sum(len(t) for t in texts)
    if max_chars is not None and chars > max_chars:
        raise RequestTooLarge(
            f"the input has {chars} characters; at most {max_chars} per request", param="input"
        )
    prefix = PREFIXES.get(body.input_type or "", "")
    return [prefix + t for t in texts]


def check_tokens(content: list[list[int]], single: bool) -> int:
    """The tokens the model reads for ``content`` (``<s>``, ``</s>`` included); 400 for an
    input over its positions or a request over ``MAX_REQUEST_TOKENS``."""
    for i, ids in enumerate(content):
        if len(ids) + 2 > MAX_TOKENS:
            where = "input" if single else f"input[{i}]"
            raise InputTooLong(
                f"{where} has {len(ids) + 2} tokens; {NAME}'s maximum context length is "
                f"{MAX_TOKENS} tokens (its two special tokens included)",
                param="input",
            )
    total = sum(len(ids) + 2 for ids in content)
    if total > MAX_REQUEST_TOKENS:
        raise RequestTooLarge(
            f"the inputs have {total} tokens; at most {MAX_REQUEST_TOKENS} per request",
            param="input",
        )
    return total


def charge_tokens(governance: Governance, spec: TenantSpec, tokens: int) -> None:
    """Take the inputs' tokens from the tenant's tokens per minute (429 when short; 400
    when more than the limit could ever hold)."""
    limit = spec.tokens_per_minute
    if limit is not None and tokens > limit:
        raise TenantLimitExceeded(
            f"the request's {tokens} tokens exceed tenant {spec.name!r}'s "
            f"tokens_per_minute={limit}",
            limit="tokens_per_minute",
            value=limit,
        )
    governance.rates.take(spec, 0, tokens)


def wire(vector: np.ndarray, encoding: str | None) -> list[float] | str:
    """One vector as the response carries it: floats, or OpenAI's base64 of little-endian
    float32 bytes."""
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    values: list[float] = vector.tolist()
    return values


def _counted(governance: Governance, tenant: str, check: Callable[[], Any]) -> Any:
    try:
        return check()
    except KVGateError as exc:
        governance.count_refusal(tenant, exc.code)
        raise


async def create_embeddings(
    state: ServerState, body: EmbeddingRequest, http: Request, tenant: str
) -> dict[str, Any]:
    model = state.embedding
    if model is None:
        raise unavailable(missing_modules())
    governance = state.governance
    spec = governance.spec(tenant)
    record = access_record(http)
    _counted(governance, tenant, lambda: model.check(body.model, spec, state.models.names))
    record.model = NAME
    charge(governance, tenant)
    limits = state.config.limits
    texts = _counted(governance, tenant, lambda: texts_of(body, limits.max_prompt_chars))
    version, content = await run_in_threadpool(lambda: (model.version(), model.tokens(texts)))
    record.model_version = version.id
    single = isinstance(body.input, str)
    tokens = _counted(governance, tenant, lambda: check_tokens(content, single))
    _counted(governance, tenant, lambda: charge_tokens(governance, spec, tokens))
    record.prompt_tokens = tokens
    vectors = await run_in_threadpool(model.vectors, content)
    await _record_usage(state, record.request_id, tenant, version.id, tokens)
    record.completion_tokens = 0
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": wire(v, body.encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": NAME,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _record_usage(
    state: ServerState, request_id: str, tenant: str, version: str, tokens: int
) -> None:
    """One settled usage record (its commit waited for, as a whole response's is)."""
    ledger = state.usage
    row = ledger.admit(request_id, tenant, NAME, version, prompt_tokens=tokens)
    counts = Counts(prompt_tokens=tokens)
    await asyncio.wrap_future(ledger.settle(row, counts, "stop", delivered=True))


def install_embedding_routes(app: FastAPI) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(
        body: EmbeddingRequest, request: Request, tenant: Annotated[str, Depends(authenticate)]
    ) -> JSONResponse:
        state: ServerState = request.app.state.kvgate
        return JSONResponse(await create_embeddings(state, body, request, tenant))
