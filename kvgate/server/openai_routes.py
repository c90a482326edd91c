"""The OpenAI-compatible model routes: ``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, and vLLM's ``/tokenize`` and ``/detokenize``. The work is in
``chat.py`` and ``completions.py``; here each request finds its model (``Route``).
``/v1/models`` lists the embedding model too (``embedding_model.py``), after the chat
models, where the server has one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from kvgate.errors import InvalidRequest
from kvgate.governance.tenants import DEFAULT_TENANT
from kvgate.server.access_log import access_record
from kvgate.server.chat import create_chat_completion
from kvgate.server.completions import create_completion
from kvgate.server.door import off_loop
from kvgate.server.embedding_model import ALIASES, EmbeddingModel
from kvgate.server.embedding_model import NAME as EMBEDDING_MODEL
from kvgate.server.errors import ModelNotAllowed, ModelNotServed
from kvgate.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvgate.server.routing import Route, authenticate, router
from kvgate.server.serving import ServingContext
from kvgate.server.streaming import ClientDisconnected

if TYPE_CHECKING:
    from kvgate.server.app import ServerState


def model_card(ctx: ServingContext, *, paths: bool) -> dict[str, Any]:
    """One served model as ``/v1/models`` lists it. ``paths``: the caller may see where its
    weights are on disk (an admin key, or anyone on an open server); others get the file or
    directory name only, never the server's filesystem."""
    version = ctx.version
    source = version.source if version is not None else None
    if source is not None and not paths:
        source = PurePath(source).name
    return {
        "id": ctx.served_model_name,
        "object": "model",
        "created": version.created if version is not None else 0,
        "owned_by": "kvgate",
        "max_model_len": ctx.max_model_len,
        "version": ctx.model_version,
        "source": source,
        "weights_sha256": version.weights_sha256 if version is not None else None,
    }


def lora_cards(
    ctx: ServingContext, allows: Callable[[str], bool], *, paths: bool
) -> list[dict[str, Any]]:
    """A served model's LoRA adapters the caller may use, as ``/v1/models`` lists them
    (vLLM's shape: ``parent`` the base model's served name, ``root`` the directory)."""
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "kvgate",
            "max_model_len": ctx.max_model_len,
            "parent": ctx.served_model_name,
            "root": path if paths else PurePath(path).name,
        }
        for name, path in ctx.loras.items()
        if allows(name)
    ]


def _is_admin(request: Request) -> bool:
    state: ServerState = request.app.state.kvgate
    return state.governance.tenants.is_admin(request.headers.get("authorization"))


def _embedding(request: Request, admin: bool, refuse: bool = False) -> EmbeddingModel | None:
    """The embedding model where the caller may use it (an admin key: always); else None,
    or with ``refuse`` the 403 that says why."""
    state: ServerState = request.app.state.kvgate
    embedding = state.embedding
    if embedding is None or admin:
        return embedding
    spec = state.governance.spec(authenticate(request))
    if spec.allows(EMBEDDING_MODEL):
        return embedding
    if refuse:
        raise ModelNotAllowed(EMBEDDING_MODEL, spec.name, spec.models or ())
    return None


def install_openai_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    def list_models(request: Request) -> dict[str, Any]:
        """The models the caller may use that are ready to serve (an admin key: all of
        them, with their paths); while none of them is, the 503 that says why (loading, or
        failed)."""
        state: ServerState = request.app.state.kvgate
        models = state.models
        admin = _is_admin(request)
        if admin:
            allowed = list(models)
        else:
            allowed = models.allowed(state.governance.spec(authenticate(request)))
        ready = [slot.serving for slot in allowed if slot.status == "ready"]
        if not ready and allowed:
            allowed[0].check()
        paths = admin or state.governance.tenants.open
        data = [model_card(ctx, paths=paths) for ctx in ready if ctx is not None]
        allows = (lambda _: True) if admin else state.governance.spec(authenticate(request)).allows
        for slot in models:
            if slot.status == "ready" and slot.serving is not None:
                data += lora_cards(slot.serving, allows, paths=paths)
        embedding = _embedding(request, admin)
        if embedding is not None:
            data.append(embedding.card(paths=paths))
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
        """One model as listed: 404 for a name this server does not serve, 403 for one the
        caller's tenant may not use, 503 while it loads (as a request naming it gets)."""
        state: ServerState = request.app.state.kvgate
        admin = _is_admin(request)
        if model_id in ALIASES and model_id not in state.models.slots:
            embedding = _embedding(request, admin, refuse=True)
            if embedding is not None:
                return embedding.card(paths=admin or state.governance.tenants.open)
        if admin:
            slot = state.models.slots.get(model_id) or state.models.adapter(model_id)
            if slot is None:
                raise ModelNotServed(model_id, state.models.names)
            ctx = slot.check()
            paths = True
        else:
            ctx = router(request, authenticate(request))(model_id)
            paths = state.governance.tenants.open
        if model_id in ctx.loras and model_id != ctx.served_model_name:
            return lora_cards(ctx, lambda name: name == model_id, paths=paths)[0]
        return model_card(ctx, paths=paths)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request, route: Route) -> Any:
        ctx = route(body.model)
        try:
            return await create_chat_completion(ctx, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request, route: Route) -> Any:
        ctx = route(body.model)
        try:
            return await create_completion(ctx, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request, route: Route) -> dict[str, Any]:
        ctx = route(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of 'prompt' or 'messages'", param="prompt")
        tenant = access_record(request).tenant or DEFAULT_TENANT
        ctx.door.counted(tenant, ctx.door.check_sizes, body, None)
        tok = ctx.tokenizer
        if body.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            for m in messages:
                m.setdefault("content", "")
            add_generation_prompt = body.add_generation_prompt is not False
            ids = await off_loop(tok.encode_chat, messages, add_generation_prompt)
        else:
            assert body.prompt is not None
            add_special = body.add_special_tokens is not False
            ids = await off_loop(tok.encode, body.prompt, add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.max_model_len}

    @app.post("/detokenize")
    def detokenize(body: DetokenizeRequest, route: Route) -> dict[str, Any]:
        ctx = route(body.model)
        vocab = ctx.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise InvalidRequest(
                f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens"
            )
        return {"prompt": ctx.tokenizer.decode(body.tokens)}
