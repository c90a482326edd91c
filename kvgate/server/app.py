"""The FastAPI app: routes, auth, model loading in the background, metrics.

The app starts serving at once; the models load on a thread, one after another (see
``server/models.py``), and until a model is ready requests for it get 503 ``model_loading``
with Retry-After; /health answers 503 until every model is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from prometheus_client.process_collector import ProcessCollector

from kvgate.engine.front import EngineView
from kvgate.engine.lineage import model_version
from kvgate.engine.policy import TenantFairPolicy, TenantShare
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import StatsListener
from kvgate.errors import InvalidConfig, KVGateError
from kvgate.governance.admission import RateBuckets
from kvgate.governance.tenants import TenantsConfig, parse_key
from kvgate.governance.usage import UsageLedger
from kvgate.governance.usage import default_path as usage_default_path
from kvgate.retrieval.extra import missing_modules, unavailable
from kvgate.retrieval.retrieval import E5Embedder
from kvgate.retrieval.service import DocsService, StorageLimits
from kvgate.retrieval.store import DocStore
from kvgate.retrieval.store import default_dir as docs_default_dir
from kvgate.server.access_log import AccessLogMiddleware
from kvgate.server.admin import install_admin_routes
from kvgate.server.auth import load_api_keys_file
from kvgate.server.config import ServerConfig
from kvgate.server.dashboard import RecentLatencies, install_dashboard
from kvgate.server.door import Door
from kvgate.server.drain import Drain, DrainMiddleware
from kvgate.server.embedding_model import NAME as EMBEDDING_MODEL
from kvgate.server.embedding_model import EmbeddingModel
from kvgate.server.embeddings import install_embedding_routes
from kvgate.server.errors import install_error_handlers
from kvgate.server.files import install_file_routes
from kvgate.server.governance import Governance
from kvgate.server.limits import GuardMiddleware
from kvgate.server.lora_routes import install_lora_routes
from kvgate.server.metrics import EngineCollector, PrometheusStatsListener, TenantCollector
from kvgate.server.models import EngineLoader, ModelSlot, ServedModels
from kvgate.server.openai_routes import install_openai_routes
from kvgate.server.probes import install_probe_routes
from kvgate.server.rerank_endpoint import install_rerank_routes
from kvgate.server.responses import install_response_routes
from kvgate.server.responses.background import BackgroundRuns
from kvgate.server.responses.stored import ResponseStore
from kvgate.server.serving import ServingContext
from kvgate.server.tracing import NoTracing, Tracing
from kvgate.server.vector_stores import install_vector_store_routes

log = logging.getLogger("kvgate.server")


@dataclass
class ServerState:
    config: ServerConfig
    governance: Governance
    usage: UsageLedger
    models: ServedModels
    #: None where the ``retrieval`` extra is not installed (document endpoints: 501).
    docs: DocsService | None
    tracing: Tracing | NoTracing = field(default_factory=NoTracing)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    #: Set once every model has loaded (or one failed).
    ready: threading.Event = field(default_factory=threading.Event)
    #: Requests in flight, and whether the server is draining (SIGTERM: see drain.py).
    drain: Drain = field(default_factory=Drain)
    #: Stored responses (``/v1/responses``), in the documents' database (set by build_app).
    responses: ResponseStore | None = None
    #: Background responses running in this process.
    background: BackgroundRuns = field(default_factory=BackgroundRuns)
    #: The embedding model of /v1/embeddings (the store's embedder); None without ``docs``.
    embedding: EmbeddingModel | None = None

    @property
    def serving(self) -> ServingContext | None:
        """The default (first) model's; None until it is loaded."""
        return self.models.default.serving

    @property
    def engine(self) -> EngineView | None:
        return self.serving.engine.engine if self.serving is not None else None

    @property
    def load_error(self) -> BaseException | None:
        return next((s.load_error for s in self.models if s.load_error is not None), None)

    def snapshots(self) -> dict[str, EngineSnapshot]:
        """Each loaded model's latest published engine state, by served name."""
        return self.models.snapshots()


def _load(
    state: ServerState,
    slot: ModelSlot,
    listeners: Sequence[StatsListener],
    on_engine_dead: Callable[[BaseException], None] | None = None,
) -> None:
    """Load one model and put it in service; raises what the loader raised."""
    policy = TenantFairPolicy({}, TenantShare()) if state.config.scheduling == "fair" else None
    engine = slot.loader(listeners, policy)
    engine.on_dead = on_engine_dead
    pool = engine.engine.kv_pool
    state.governance.attach(
        slot.name,
        pool.num_blocks,
        pool.block_size,
        engine.update_shares if policy is not None else None,
        blocks_for=engine.engine.blocks_for,
    )
    door = Door(
        state.config.limits, state.governance, engine.engine.tokenizer, engine.engine.max_model_len
    )
    inner = engine.engine
    version = model_version(slot.name, str(inner.source), inner.model_config, inner.config)
    # Everything alive now (modules, model, tokenizer) lives as long as the server: keep it
    # out of the garbage collector. A full collection walks every tracked object and holds
    # the GIL throughout: over this heap it stopped the event loop and the engine for
    # ~120 ms at a time under load, a quiet tenant's whole time to first token. Before the
    # model serves (``slot.serving`` makes it ready), so no request meets the collection.
    gc.collect()
    gc.freeze()
    slot.serving = ServingContext(
        engine, slot.name, state.governance, door, state.usage, state.tracing, version,
        loras=dict(engine.engine.config.lora_modules),
    )  # fmt: skip
    log.info(
        "model %r is version %s (weights sha256 %s, from %s)",
        slot.name, version.id, version.weights_sha256[:16], version.source,
    )  # fmt: skip
    log.info(
        "ready: model %r loaded in %.1f s; KV pool %d blocks x %d tokens = %d tokens (%.2f GiB)",
        slot.name,
        engine.engine.load_seconds,
        pool.num_blocks,
        pool.block_size,
        pool.num_tokens,
        pool.bytes / 2**30,
    )


def _load_all(
    state: ServerState,
    listeners: Callable[[str], Sequence[StatsListener]],
    on_load_error: Callable[[BaseException], None] | None,
    on_engine_dead: Callable[[BaseException], None] | None = None,
) -> None:
    """Every model in turn (one at a time: each load uses every core); the first that fails
    to load stops the rest and is reported."""
    try:
        for slot in state.models:
            try:
                _load(state, slot, listeners(slot.name), on_engine_dead)
            except BaseException as exc:
                slot.load_error = exc
                log.error("model %r failed to load: %s", slot.name, exc)
                if on_load_error is not None:
                    on_load_error(exc)
                return
    finally:
        state.ready.set()


def _warn_unknown_models(tenants: TenantsConfig, served: Sequence[str]) -> None:
    """A tenant's ``models`` naming nothing served is likely a typo: say so at start-up."""
    for name, spec in tenants.tenants.items():
        unknown = [m for m in spec.models or () if m not in served]
        if unknown:
            log.warning(
                "tenant %r may use model(s) %s, which this server does not serve (it serves %s)",
                name, ", ".join(map(repr, unknown)), ", ".join(map(repr, served)),
            )  # fmt: skip


def _governance(config: ServerConfig, buckets: RateBuckets | None) -> Governance:
    metrics = frozenset(parse_key(k, "--metrics-key") for k in config.metrics_keys)
    if config.tenants_file is not None:
        tenants = TenantsConfig.load(config.tenants_file)
        return Governance(tenants, config.tenants_file, metrics, buckets)
    if config.api_keys_file is not None:
        table = load_api_keys_file(config.api_keys_file)
        return Governance(TenantsConfig.from_key_table(table), None, metrics, buckets)
    return Governance(TenantsConfig.open_config(), None, metrics, buckets)


def data_dir_of(config: ServerConfig) -> str:
    """Where the server keeps files and vector stores."""
    return str(config.data_dir or os.environ.get("KVGATE_DATA_DIR") or docs_default_dir())


def usage_path_of(config: ServerConfig) -> str:
    """The usage ledger's file."""
    return str(config.usage_db or os.environ.get("KVGATE_USAGE_DB") or usage_default_path())


def _docs(config: ServerConfig, governance: Governance) -> DocsService | None:
    missing = missing_modules()
    if missing:
        log.warning("%s", unavailable(missing).message)
        return None
    directory = data_dir_of(config)
    url = config.docs_url or os.environ.get("KVGATE_DOCS_URL") or None
    try:
        store = DocStore(directory, url)
    except ValueError as exc:
        raise InvalidConfig(str(exc), param="docs_url") from None
    except Exception as exc:  # a database that cannot be reached: say which, not a traceback
        shown = url.split("@")[-1] if url else directory
        raise InvalidConfig(
            f"cannot open the documents database at {shown}: {type(exc).__name__}: {exc}",
            param="docs_url",
        ) from None
    log.info("files and vector stores: %s (uploads spooled in %s)", store.where, store.directory)

    def limits(tenant: str) -> StorageLimits:
        spec = governance.spec(tenant)
        return StorageLimits(
            max_files=spec.max_files,
            max_bytes=spec.max_storage_bytes,
            max_chunks=spec.max_chunks,
            max_stores=spec.max_vector_stores,
            max_store_bytes=spec.max_store_bytes,
        )

    embedder = functools.partial(E5Embedder, precision=config.embed_precision)  # pickles
    return DocsService(
        store, embedder, limits, priority=config.ingest_priority,
        ingest_limits=config.ingest_limits,
        tenant_class=lambda tenant: governance.spec(tenant).priority,
    )  # fmt: skip


def _responses(
    config: ServerConfig, governance: Governance, docs: DocsService | None
) -> ResponseStore:
    """Stored responses: in the documents' database, or (without the retrieval extra) in
    an SQLite database of their own in the data directory."""
    retention = config.responses_retention

    def most(tenant: str) -> int | None:
        return governance.spec(tenant).max_stored_responses

    if docs is not None:
        return ResponseStore(docs.store.database, retention, most)
    url = config.docs_url or os.environ.get("KVGATE_DOCS_URL") or None
    try:
        directory = Path(data_dir_of(config))
        return ResponseStore.open(directory, url, retention_s=retention, max_for=most)
    except Exception as exc:
        raise InvalidConfig(
            f"cannot open the database of stored responses: {type(exc).__name__}: {exc}",
            param="docs_url",
        ) from None


def _usage_ledger(config: ServerConfig) -> UsageLedger:
    ledger = UsageLedger(usage_path_of(config))
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
    loader: EngineLoader | Mapping[str, EngineLoader],
    *,
    on_load_error: Callable[[BaseException], None] | None = None,
    on_engine_dead: Callable[[BaseException], None] | None = None,
    tracer_provider: TracerProvider | None = None,
    rate_buckets: RateBuckets | None = None,
) -> FastAPI:
    """The app; ``loader`` builds the one model (served as ``config.served_model_name``),
    or a mapping of served names to loaders builds several, the first being the default
    for requests that name no model. ``tracer_provider`` turns on request traces (see
    ``server/tracing.py``); ``rate_buckets`` keeps the tenants' rates elsewhere than in this
    process (the replicas of ``kvgate.cluster`` share theirs)."""
    loaders = loader if isinstance(loader, Mapping) else {config.served_model_name: loader}
    models = ServedModels([ModelSlot(name, load) for name, load in loaders.items()])
    tracing = Tracing(tracer_provider) if tracer_provider is not None else NoTracing()
    governance = _governance(config, rate_buckets)
    docs = _docs(config, governance)
    state = ServerState(config, governance, _usage_ledger(config), models, docs, tracing)
    state.responses = _responses(config, governance, docs)
    if docs is not None:
        state.embedding = EmbeddingModel(docs, config.embed_precision)
    served = [*models.names, *([EMBEDDING_MODEL] if docs is not None else [])]
    _warn_unknown_models(state.governance.tenants, served)
    state.registry.register(EngineCollector(state.snapshots))
    state.registry.register(TenantCollector(state.snapshots, state.governance))
    ProcessCollector(registry=state.registry)
    listener = PrometheusStatsListener(state.registry)
    recent = RecentLatencies()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        log.info("loading model(s) %s ...", ", ".join(repr(n) for n in models.names))
        thread = threading.Thread(
            target=_load_all,
            args=(
                state,
                lambda name: [listener.for_model(name), recent],
                on_load_error,
                on_engine_dead,
            ),
            name="kvgate-loader",
        )
        thread.start()
        _reload_on_sighup(state.governance)
        try:
            yield
        finally:
            await state.background.stop()  # each writes its row: failed, server stopped
            thread.join()
            for slot in models:
                if slot.serving is not None:
                    slot.serving.engine.shutdown()
            if tracer_provider is not None:
                tracer_provider.shutdown()  # flushes spans not yet exported
            state.usage.close()  # after the engine: every request settled is written
            if state.responses is not None:  # its own database only; the documents' below
                state.responses.close()
            if state.docs is not None:
                state.docs.close()

    app = FastAPI(title="kvgate", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvgate = state
    install_error_handlers(app)
    install_admin_routes(app)
    install_lora_routes(app)
    install_file_routes(app)
    install_vector_store_routes(app)
    install_response_routes(app)
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
    app.add_middleware(DrainMiddleware, drain=state.drain)
    app.add_middleware(AccessLogMiddleware)

    install_probe_routes(app)
    install_openai_routes(app)
    install_embedding_routes(app)
    install_rerank_routes(app)
    return app
