"""``kvgate serve``: the OpenAI-compatible server on uvicorn.

``--model`` may be given several times (or the config file may hold a ``models`` list):
each model gets an engine and a KV pool of its own, the pools sized from the one
``--kv-cache-memory`` budget split by ``--kv-weight``; requests go to the model they name.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kvgate.config import DEFAULT_MODEL, EngineConfig, available_memory_bytes, parse_memory
from kvgate.docs.bounds import IngestLimits, MiB
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.core_client import EngineClient
from kvgate.engine.front import EngineFront
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.stats import StatsListener
from kvgate.errors import InvalidConfig
from kvgate.server.config import EMBED_PRECISIONS, ServerConfig
from kvgate.server.limits import RequestLimits

log = logging.getLogger("kvgate.server")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--config", default=None, help="TOML or YAML file with any of these settings")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="the name clients send (default: --model's name); once per --model, in order",
    )
    g.add_argument(
        "--kv-weight",
        action="append",
        type=float,
        default=None,
        help="with several --model: each one's part of --kv-cache-memory, in order "
        "(default: equal parts)",
    )
    g.add_argument(
        "--api-keys-file",
        default=None,
        help="file of 'KEY [TENANT]' lines; when given, every API call needs a key",
    )
    g.add_argument(
        "--tenants",
        default=None,
        help="tenants file (TOML/YAML): keys, priorities, KV quotas, rate limits; "
        "re-read on SIGHUP or POST /admin/reload",
    )
    g.add_argument(
        "--metrics-key",
        action="append",
        default=[],
        help="a key (or sha256:<hex>) that may read per-tenant /metrics and /dashboard figures "
        "(repeatable; the tenants file's metrics_keys and admin_keys may too); without one, "
        "callers see aggregates only",
    )
    g.add_argument(
        "--scheduling",
        default="fair",
        choices=["fair", "fifo"],
        help="fair: tenant priorities, fair shares and quotas; fifo: arrival order",
    )
    g.add_argument(
        "--max-queue-len",
        type=int,
        default=256,
        help="requests that may wait beyond --max-num-seqs before new ones get 503",
    )
    g.add_argument(
        "--usage-db",
        default=None,
        help="the usage ledger's SQLite file (default: $KVGATE_USAGE_DB, else "
        "~/.local/state/kvgate/usage.sqlite3); read it with GET /admin/usage",
    )
    g.add_argument(
        "--access-log", default="-", help="JSON-lines access log: a file, '-' stderr, '' off"
    )
    g.add_argument(
        "--data-dir",
        default=None,
        help="where uploaded files, vector stores and their indexes live (default: "
        "$KVGATE_DATA_DIR, else ~/.local/share/kvgate)",
    )
    g.add_argument(
        "--strict-data-dir",
        action="store_true",
        help="refuse to start when --data-dir or the usage ledger's folder may be read by "
        "other users (default: a warning); kvgate makes its own folders 0700, files 0600",
    )
    g.add_argument(
        "--docs-url",
        default=None,
        help="the documents database: postgresql://user@host/db to share files and vector "
        "stores between replicas (default: $KVGATE_DOCS_URL, else SQLite in --data-dir)",
    )
    g.add_argument(
        "--ingest-priority",
        default="batch",
        choices=["critical", "standard", "batch"],
        help="the priority class of document ingestion (its process's OS priority)",
    )
    add_ingest_limit_args(p)
    g.add_argument(
        "--embed-precision",
        default="auto",
        choices=list(EMBED_PRECISIONS),
        help="the document embedder's arithmetic (auto: bfloat16 where oneDNN has bf16 GEMMs, "
        "else float32; logged at start)",
    )
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the server's log level (stderr)",
    )
    c = p.add_argument_group("replicas (Ray Serve: kvgate.cluster)")
    c.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N engine replicas behind one ingress on a local Ray (prefix-cache "
        "affinity routing, the tenants' rates shared by all)",
    )
    c.add_argument(
        "--rates-unreachable",
        default="open",
        choices=["open", "closed"],
        help="with --replicas, when the shared rate state cannot be reached: open (each "
        "replica limits alone) or closed (rate-limited tenants get 503)",
    )
    c.add_argument(
        "--fault",
        default=None,
        help="with --replicas, for trying rollbacks: errors=F (a fraction F of requests "
        "answered 500) and/or latency=S (S seconds before each), comma-separated",
    )
    c.add_argument(
        "--engine-process",
        default=os.environ.get("KVGATE_ENGINE_PROCESS", "off"),
        choices=["on", "off"],
        help="on: the engine (model, scheduler) runs in a process of its own, the HTTP front "
        "end in this one, over ZeroMQ; a dead engine process is restarted. off: a thread of "
        "this process (the default: see docs/operator/engine-process.md). "
        "Default from $KVGATE_ENGINE_PROCESS",
    )
    c.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds a stopping server (SIGTERM) or replica gives its requests in flight",
    )
    lim = p.add_argument_group("limits (refused before any work is done on the request)")
    d = RequestLimits()
    lim.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body (413 above it)",
    )
    lim.add_argument(
        "--max-upload-bytes",
        type=int,
        default=d.max_upload_bytes,
        help="largest file upload, POST /v1/files (413 above it)",
    )
    lim.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="longest prompt in characters, before tokenizing (default: the "
        "context times the longest token's characters)",
    )
    lim.add_argument(
        "--max-messages", type=int, default=d.max_messages, help="most messages in a chat request"
    )
    lim.add_argument("--max-stop", type=int, default=d.max_stop, help="most stop strings")
    lim.add_argument(
        "--max-stop-chars", type=int, default=d.max_stop_chars, help="longest stop string"
    )
    lim.add_argument(
        "--max-stop-token-ids", type=int, default=d.max_stop_token_ids, help="most stop_token_ids"
    )
    lim.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        help="seconds to send a request's headers before the connection closes",
    )
    lim.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout,
        help="seconds without body bytes before the request gets 408",
    )
    lim.add_argument(
        "--body-deadline",
        type=float,
        default=d.body_deadline,
        help="seconds a whole request body may take before the request gets 408",
    )
    lim.add_argument(
        "--min-body-rate",
        type=int,
        default=d.min_body_rate,
        help="slowest average body rate in bytes/s, after --body-rate-grace (408 below; 0: off)",
    )
    lim.add_argument(
        "--body-rate-grace",
        type=float,
        default=d.body_rate_grace,
        help="seconds of a body before --min-body-rate applies",
    )
    lim.add_argument(
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections past which requests get 503",
    )
    lim.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        help="open connections from one address past which one is refused with 503 "
        "(default: a quarter of --max-connections)",
    )
    lim.add_argument(
        "--stalled-client-timeout",
        type=float,
        default=d.stalled_client_timeout,
        help="seconds a stream may wait for its client to read before it is aborted",
    )


@dataclass(frozen=True)
class ModelToServe:
    """One model of ``kvgate serve``: the name clients send, its engine's configuration,
    and its weight in the split of the KV memory budget."""

    name: str
    engine: EngineConfig
    kv_weight: float = 1.0


#: Engine settings a ``models`` entry of the config file may set for its model alone.
_PER_MODEL = frozenset({
    "dtype", "quantization", "gguf_blocks", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "num_spare_seqs", "block_size", "enable_prefix_caching",
    "native_kernels",
})  # fmt: skip


def default_name(model: str) -> str:
    """The served name of ``--model``: a shipped alias as is, a path's last part."""
    return model if model == DEFAULT_MODEL else os.path.basename(model.rstrip("/"))


def models_to_serve(
    a: argparse.Namespace, base: EngineConfig, file_models: Sequence[Mapping[str, Any]] = ()
) -> list[ModelToServe]:
    """The models to serve: ``--model`` (repeatable) with ``--served-model-name`` and
    ``--kv-weight`` by position, else the config file's ``models`` list, else the default
    model; ``base`` holds the engine settings they share. The KV budget (``base``'s
    ``kv_cache_memory``, a fraction resolved once, now) is split by weight."""
    names = list(a.served_model_name or ())
    weights = list(a.kv_weight or ())
    entries: list[dict[str, Any]]
    if a.model:
        entries = [{"model": m} for m in a.model]
        if len(names) > len(entries) or len(weights) > len(entries):
            raise InvalidConfig(
                f"{len(entries)} --model but {len(names)} --served-model-name and "
                f"{len(weights)} --kv-weight: give at most one of each per --model",
                param="served_model_name",
            )
        for entry, name in zip(entries, names, strict=False):
            entry["name"] = name
        for entry, weight in zip(entries, weights, strict=False):
            entry["kv_weight"] = weight
    elif file_models:
        entries = [dict(m) for m in file_models]
        if len(entries) == 1 and names:
            entries[0].setdefault("name", names[0])
    else:
        entries = [{"model": DEFAULT_MODEL, **({"name": names[0]} if names else {})}]
    models = [_model_entry(e, base, i) for i, e in enumerate(entries)]
    seen: set[str] = set()
    for m in models:
        if m.name in seen:
            raise InvalidConfig(
                f"two models are served as {m.name!r}; give each its own --served-model-name",
                param="served_model_name",
            )
        seen.add(m.name)
    if len(models) == 1:
        return models
    total = parse_memory(base.kv_cache_memory, available_memory_bytes())
    weight = sum(m.kv_weight for m in models)
    return [
        dataclasses.replace(
            m,
            engine=dataclasses.replace(
                m.engine, kv_cache_memory=max(1, int(total * m.kv_weight / weight))
            ),
        )
        for m in models
    ]


def _model_entry(entry: Mapping[str, Any], base: EngineConfig, i: int) -> ModelToServe:
    where = f"models[{i}]"
    model = entry.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidConfig(f"{where}: needs 'model', a name or a path", param="models")
    name = entry.get("name", default_name(model))
    if not isinstance(name, str) or not name:
        raise InvalidConfig(f"{where}.name must be a non-empty string", param="models")
    weight = entry.get("kv_weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise InvalidConfig(
            f"{where}.kv_weight must be a positive number, got {weight!r}", param="kv_weight"
        )
    settings = {k.replace("-", "_"): v for k, v in entry.items()}
    unknown = set(settings) - _PER_MODEL - {"model", "name", "kv_weight"}
    if unknown:
        known = ", ".join(sorted(_PER_MODEL | {"model", "name", "kv_weight"}))
        raise InvalidConfig(
            f"{where}: unknown setting(s) {sorted(unknown)}; known: {known}", param="models"
        )
    overrides = {k: v for k, v in settings.items() if k in _PER_MODEL}
    return ModelToServe(
        name, dataclasses.replace(base, model=model, **overrides), kv_weight=float(weight)
    )


def add_ingest_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ingestion limits (per file; past one, the file fails alone)")
    d = IngestLimits()
    g.add_argument("--ingest-job-timeout", type=float, default=d.job_seconds,
                   help="seconds one file's ingestion may run before it is stopped")  # fmt: skip
    g.add_argument("--ingest-memory-mib", type=int, default=d.memory_bytes // MiB,
                   help="MiB of memory the ingestion process may hold")  # fmt: skip
    g.add_argument("--ingest-max-chars", type=int, default=d.max_text_chars,
                   help="characters of text one file may have")  # fmt: skip
    g.add_argument("--ingest-max-pages", type=int, default=d.max_pdf_pages,
                   help="pages one PDF may have")  # fmt: skip
    g.add_argument("--ingest-max-unzipped-mib", type=int, default=d.max_unzipped_bytes // MiB,
                   help="MiB a .docx may inflate to (its parts, as declared)")  # fmt: skip


def ingest_limits(a: argparse.Namespace) -> IngestLimits:
    return IngestLimits(
        max_unzipped_bytes=a.ingest_max_unzipped_mib * MiB,
        max_pdf_pages=a.ingest_max_pages,
        max_text_chars=a.ingest_max_chars,
        job_seconds=a.ingest_job_timeout,
        memory_bytes=a.ingest_memory_mib * MiB,
    )


def server_config(a: argparse.Namespace, models: Sequence[ModelToServe] = ()) -> ServerConfig:
    """``models``: what ``models_to_serve`` gave (the first names the default model)."""
    if models:
        name = models[0].name
    elif a.served_model_name:
        name = a.served_model_name[0]
    else:
        name = default_name(a.model[0] if a.model else DEFAULT_MODEL)
    return ServerConfig(
        host=a.host,
        port=a.port,
        served_model_name=name,
        api_keys_file=a.api_keys_file,
        tenants_file=a.tenants,
        metrics_keys=tuple(a.metrics_key),
        scheduling=a.scheduling,
        max_queue_len=a.max_queue_len,
        access_log=a.access_log,
        usage_db=a.usage_db,
        data_dir=a.data_dir,
        strict_data_dir=a.strict_data_dir,
        docs_url=a.docs_url,
        ingest_priority=a.ingest_priority,
        ingest_limits=ingest_limits(a),
        embed_precision=a.embed_precision,
        log_level=a.log_level,
        shutdown_timeout=a.shutdown_timeout,
        engine_process=a.engine_process == "on",
        rates_unreachable=a.rates_unreachable,
        limits=RequestLimits(
            max_body_bytes=a.max_body_bytes,
            max_upload_bytes=a.max_upload_bytes,
            max_prompt_chars=a.max_prompt_chars,
            max_messages=a.max_messages,
            max_stop=a.max_stop,
            max_stop_chars=a.max_stop_chars,
            max_stop_token_ids=a.max_stop_token_ids,
            header_timeout=a.header_timeout,
            body_timeout=a.body_timeout,
            body_deadline=a.body_deadline,
            min_body_rate=a.min_body_rate,
            body_rate_grace=a.body_rate_grace,
            max_connections=a.max_connections,
            max_connections_per_client=a.max_connections_per_client,
            stalled_client_timeout=a.stalled_client_timeout,
        ),
    )


def _memory(value: str | float) -> str:
    return f"{value / 2**20:.0f}MiB" if isinstance(value, int) and value > 1 else str(value)


def setup_logging(config: ServerConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    access = logging.getLogger("kvgate.access")
    access.propagate = False
    access.setLevel(logging.INFO)
    if config.access_log:
        handler: logging.Handler = (
            logging.StreamHandler(sys.stderr)
            if config.access_log == "-"
            else logging.FileHandler(config.access_log, encoding="utf-8")
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)


def engine_loader(
    engine_config: EngineConfig, max_queue_len: int, *, own_process: bool = False
) -> Callable[[Sequence[StatsListener], SchedulingPolicy | None], EngineFront]:
    """``own_process``: the engine in a process of its own (``engine/core_client.py``)."""
    front = EngineClient if own_process else AsyncLLM

    def load(listeners: Sequence[StatsListener], policy: SchedulingPolicy | None) -> EngineFront:
        return front.from_config(
            engine_config, max_queue_len=max_queue_len, listeners=listeners, policy=policy
        )

    return load


def check_data_dirs(config: ServerConfig) -> list[str]:
    """The folders the server keeps data in (files, vector stores, the usage ledger) that
    other users may read: a warning each, or, with ``--strict-data-dir``, InvalidConfig.
    Before anything is written there; a folder not there yet is made 0700."""
    from kvgate.private_files import exposed
    from kvgate.server.app import data_dir_of, usage_path_of

    folders = dict.fromkeys([data_dir_of(config), os.path.dirname(usage_path_of(config)) or "."])
    found = [why for why in map(exposed, folders) if why is not None]
    if found and config.strict_data_dir:
        raise InvalidConfig(
            "data readable by other users: " + "; ".join(found) + " (chmod 700 it, or start "
            "without --strict-data-dir)",
            param="data_dir",
        )
    for why in found:
        log.warning("%s: other local users may read what kvgate stores there (chmod 700)", why)
    return found


def run_server(models: Sequence[ModelToServe], config: ServerConfig) -> int:
    import uvicorn

    from kvgate.server.app import build_app
    from kvgate.server.http import uvicorn_config

    setup_logging(config)
    check_data_dirs(config)
    failed: list[BaseException] = []
    dead: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(exc: BaseException) -> None:
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    def on_engine_dead(exc: BaseException) -> None:
        # The supervisor gave up (errors too frequent to be transient): exit non-zero so the
        # process supervisor (systemd, Kubernetes) starts a fresh one.
        dead.append(exc)
        if server is not None:
            server.should_exit = True

    from kvgate.server.tracing import tracer_provider_from_env

    provider = tracer_provider_from_env()
    if provider is not None:
        log.info("tracing on: OTLP/HTTP export as configured by the OTEL_* variables")
    app = build_app(
        config,
        {
            m.name: engine_loader(m.engine, config.max_queue_len, own_process=config.engine_process)
            for m in models
        },
        on_load_error=on_load_error,
        on_engine_dead=on_engine_dead,
        tracer_provider=provider,
    )
    drain = app.state.kvgate.drain

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM/SIGINT drains (``server/drain.py``), a second stops now."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if drain.draining.is_set():
                super().handle_exit(sig, frame)
                return
            drain.begin()
            log.info(
                "%s: draining: no new requests; %d in flight get up to %.0f s",
                signal.Signals(sig).name, drain.active, config.shutdown_timeout,
            )  # fmt: skip
            threading.Thread(target=self._finish, name="kvgate-drain", daemon=True).start()

        def _finish(self) -> None:
            if drain.wait_idle(config.shutdown_timeout):
                log.info("drained: every request in flight finished; stopping")
            else:
                log.warning("shutdown timeout: %d request(s) still in flight are cut", drain.active)
            self.should_exit = True

    server = DrainingServer(
        uvicorn_config(
            app,
            config.host,
            config.port,
            config.limits,
            log_level=config.log_level,
            timeout_graceful_shutdown=5,
        )
    )
    for m in models:
        log.info(
            "model %r: %s (%s, kv_cache_memory=%s)",
            m.name, m.engine.model, m.engine.dtype, _memory(m.engine.kv_cache_memory),
        )  # fmt: skip
    log.info(
        "kvgate serving %s on http://%s:%d/v1 ; /health turns 200 once %s loaded",
        ", ".join(repr(m.name) for m in models),
        config.host,
        config.port,
        "the model is" if len(models) == 1 else "every model is",
    )
    # uvicorn re-raises Ctrl-C after its graceful shutdown: that is a normal stop.
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if failed:
        print(f"kvgate: error: the model failed to load: {failed[0]}", file=sys.stderr)
        return 1
    if dead:
        print(f"kvgate: error: the engine failed repeatedly: {dead[0]}", file=sys.stderr)
        return 1
    return 0
