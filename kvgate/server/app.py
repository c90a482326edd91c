"""The FastAPI app: routes, auth, model loading in the background, metrics.

The app starts serving at once; the model loads on a thread, and until it is ready /health
answers 503 and the API answers 503 ``model_loading`` with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.process_collector import ProcessCollector

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.policy import SchedulingPolicy, TenantFairPolicy, TenantShare
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import StatsListener
from kvgate.errors import EngineDead, InvalidRequest, KVGateError
from kvgate.governance.tenants import TenantsConfig, parse_key
from kvgate.governance.usage import UsageLedger
from kvgate.governance.usage import default_path as usage_default_path
from kvgate.server.access_log import AccessLogMiddleware, access_record
from kvgate.server.admin import install_admin_routes
from kvgate.server.auth import load_api_keys_file
from kvgate.server.chat import create_chat_completion
from kvgate.server.completions import create_completion
from kvgate.server.config import ServerConfig
from kvgate.server.dashboard import RecentLatencies, install_dashboard
from kvgate.server.door import Door, off_loop
from kvgate.server.errors import AuthenticationFailed, ModelLoading, install_error_handlers
from kvgate.server.generation import ServingContext
from kvgate.server.governance import Governance
from kvgate.server.limits import GuardMiddleware
from kvgate.server.metrics import EngineCollector, PrometheusStatsListener, TenantCollector
from kvgate.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvgate.server.streaming import ClientDisconnected
from kvgate.server.tracing import NoTracing, Tracing

log = logging.getLogger("kvgate.server")

#: Builds the engine (on the loading thread), given the listeners it must report to and the
#: scheduling policy (None: FIFO).
EngineLoader = Callable[[Sequence[StatsListener], SchedulingPolicy | None], AsyncLLM]


@dataclass
class ServerState:
    config: ServerConfig
    governance: Governance
    usage: UsageLedger
    tracing: Tracing | NoTracing = field(default_factory=NoTracing)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    serving: ServingContext | None = None
    load_error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def engine(self) -> LLMEngine | None:
        return self.serving.engine.engine if self.serving is not None else None

    def snapshot(self) -> EngineSnapshot | None:
        """The engine's latest published state; None until it is loaded."""
        return self.serving.engine.snapshot() if self.serving is not None else None


def _load(
    state: ServerState,
    loader: EngineLoader,
    listeners: Sequence[StatsListener],
    on_load_error: Callable[[BaseException], None] | None,
    on_engine_dead: Callable[[BaseException], None] | None = None,
) -> None:
    policy = TenantFairPolicy({}, TenantShare()) if state.config.scheduling == "fair" else None
    try:
        engine = loader(listeners, policy)
    except BaseException as exc:
        state.load_error = exc
        log.error("model failed to load: %s", exc)
        if on_load_error is not None:
            on_load_error(exc)
        return
    engine.on_dead = on_engine_dead
    pool = engine.engine.kv_pool
    state.governance.attach(
        pool.num_blocks,
        pool.block_size,
        policy,
        engine.call_in_engine,
        blocks_for=engine.engine.blocks_for,
    )
    door = Door(
        state.config.limits, state.governance, engine.engine.tokenizer, engine.engine.max_model_len
    )
    serving = ServingContext(
        engine, state.config.served_model_name, state.governance, door, state.usage, state.tracing
    )
    # Everything alive now (modules, model, tokenizer) lives as long as the server: keep it
    # out of the garbage collector. A full collection walks every tracked object and holds
    # the GIL throughout: over this heap it stopped the event loop and the engine for
    # ~120 ms at a time under load, a quiet tenant's whole time to first token. Before the
    # server reports ready, so no request meets the one collection here.
    gc.collect()
    gc.freeze()
    state.serving = serving
    state.ready.set()
    log.info(
        "ready: model %r loaded in %.1f s; KV pool %d blocks x %d tokens = %d tokens (%.2f GiB)",
        state.config.served_model_name,
        engine.engine.load_seconds,
        pool.num_blocks,
        pool.block_size,
        pool.num_tokens,
        pool.bytes / 2**30,
    )


class _Aggregates:
    """A registry's metric families without the per-tenant ones (``kvgate:tenant_*``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not family.name.startswith("kvgate:tenant_"):
                yield family


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kvgate
    return state


def authenticate(request: Request) -> str:
    """The caller's tenant, from its API key (``default`` when the server is open)."""
    given = request.headers.get("authorization")
    tenant = _state(request).governance.tenants.tenant_of(given)
    if tenant is None:
        raise AuthenticationFailed(
            "Incorrect API key provided"
            if given
            else "Missing API key: send 'Authorization: Bearer YOUR_KEY'"
        )
    access_record(request).tenant = tenant
    return tenant


def serving(request: Request, _tenant: Annotated[str, Depends(authenticate)]) -> ServingContext:
    """The engine, once loaded and alive; else 503 with a reason."""
    state = _state(request)
    if state.load_error is not None:
        raise EngineDead(f"the model failed to load: {state.load_error}")
    if state.serving is None:
        raise ModelLoading()
    if not state.serving.engine.is_running:
        raise EngineDead("the engine loop has stopped; restart the server")
    return state.serving


Serving = Annotated[ServingContext, Depends(serving)]


def _governance(config: ServerConfig) -> Governance:
    metrics = frozenset(parse_key(k, "--metrics-key") for k in config.metrics_keys)
    if config.tenants_file is not None:
        return Governance(TenantsConfig.load(config.tenants_file), config.tenants_file, metrics)
    if config.api_keys_file is not None:
        table = load_api_keys_file(config.api_keys_file)
        return Governance(TenantsConfig.from_key_table(table), metrics_keys=metrics)
    return Governance(TenantsConfig.open_config(), metrics_keys=metrics)


def _usage_ledger(config: ServerConfig) -> UsageLedger:
    path = config.usage_db or os.environ.get("KVGATE_USAGE_DB") or usage_default_path()
    ledger = UsageLedger(path)
    log.info("usage ledger: %s", ledger.path)
    return ledger


def _reload_on_sighup(governance: Governance) -> None:
    """``kill -HUP`` re-reads the tenants file (main thread only: a server on another thread,
    as in tests, reloads through the admin endpoint). Without a tenants file it only logs:
    SIGHUP's default action would end the process."""

    def reload() -> None:
        if governance.tenants_file is None:
            log.warning("SIGHUP: no tenants file to reload (start with --tenants FILE)")
            return
        try:
            governance.reload()
        except KVGateError as exc:
            log.error("tenants file not reloaded, keeping the old one: %s", exc.message)

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def build_app(
    config: ServerConfig,
    loader: EngineLoader,
    *,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_engine_dead: Callable[[BaseException], None] | None = None,
    tracer_provider: TracerProvider | None = None,
) -> FastAPI:
    """The app; ``tracer_provider`` turns on request traces (see ``server/tracing.py``)."""
    tracing = Tracing(tracer_provider) if tracer_provider is not None else NoTracing()
    state = ServerState(config, _governance(config), _usage_ledger(config), tracing)
    state.registry.register(EngineCollector(state.snapshot, config.served_model_name))
    state.registry.register(TenantCollector(state.snapshot, state.governance))
    ProcessCollector(registry=state.registry)
    listener = PrometheusStatsListener(state.registry, config.served_model_name)
    recent = RecentLatencies()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.info("loading model %r ...", config.served_model_name)
        thread = threading.Thread(
            target=_load,
            args=(state, loader, [listener, recent], on_load_error, on_engine_dead),
            name="kvgate-loader",
        )
        thread.start()
        _reload_on_sighup(state.governance)
        try:
            yield
        finally:
            thread.join()
            if state.serving is not None:
                state.serving.engine.shutdown()
            if tracer_provider is not None:
                tracer_provider.shutdown()  # flushes spans not yet exported
            state.usage.close()  # after the engine: every request settled is written

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvgate = state
    install_error_handlers(app)
    install_admin_routes(app)
    install_dashboard(app, recent)
    # Limits and the key check run before anything reads the body; only the access log
    # (which reads no body) is outside them, so refusals are logged too.
    app.add_middleware(
        GuardMiddleware,
        limits=config.limits,
        key_ok=lambda auth: (
            state.governance.tenants.tenant_of(auth) is not None
            or state.governance.tenants.may_observe(auth)  # admins and metrics keys: the schema
        ),
    )
    app.add_middleware(AccessLogMiddleware)

    @app.get("/health")
    def health() -> Response:
        if state.serving is not None and state.serving.engine.is_running:
            restarts = state.serving.engine.snapshot().recoveries
            return JSONResponse({"status": "ok", "engine_restarts": restarts})
        status = "loading" if state.load_error is None and state.serving is None else "unhealthy"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/metrics")
    def metrics(request: Request) -> Response:
        # Per-tenant series name the tenants and what they do: only for a metrics or admin
        # key (or an open server); anyone else gets the aggregates.
        if state.governance.tenants.may_observe(request.headers.get("authorization")):
            return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)
        return Response(
            generate_latest(_Aggregates(state.registry)), media_type=CONTENT_TYPE_LATEST
        )

    @app.get("/v1/models")
    def models(ctx: Serving) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": ctx.served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvgate",
                    "max_model_len": ctx.max_model_len,
                }
            ],
        }

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request, ctx: Serving) -> Any:
        try:
            return await create_chat_completion(ctx, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request, ctx: Serving) -> Any:
        try:
            return await create_completion(ctx, body, request)
        except ClientDisconnected:
            return Response(status_code=499)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, ctx: Serving) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("give exactly one of 'prompt' or 'messages'", param="prompt")
        ctx.door.check_sizes(body, None)
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
    def detokenize(body: DetokenizeRequest, ctx: Serving) -> dict[str, Any]:
        ctx.check_model(body.model)
        vocab = ctx.engine.engine.model_config.vocab_size
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise InvalidRequest(
                f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens"
            )
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    return app
