"""``kvgate serve``: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from kvgate.config import DEFAULT_MODEL, EngineConfig
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.stats import StatsListener
from kvgate.server.config import ServerConfig
from kvgate.server.limits import RequestLimits

log = logging.getLogger("kvgate.server")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--config", default=None, help="TOML or YAML file with any of these settings")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--served-model-name", default=None, help="the name clients send (default: --model)"
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
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    lim = p.add_argument_group("limits (refused before any work is done on the request)")
    d = RequestLimits()
    lim.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="largest request body (413 above it)",
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
        "--max-connections",
        type=int,
        default=d.max_connections,
        help="open connections past which requests get 503",
    )
    lim.add_argument(
        "--stalled-client-timeout",
        type=float,
        default=d.stalled_client_timeout,
        help="seconds a stream may wait for its client to read before it is aborted",
    )


def server_config(a: argparse.Namespace) -> ServerConfig:
    name = a.served_model_name
    if name is None:
        name = a.model if a.model == DEFAULT_MODEL else os.path.basename(a.model.rstrip("/"))
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
        log_level=a.log_level,
        limits=RequestLimits(
            max_body_bytes=a.max_body_bytes,
            max_prompt_chars=a.max_prompt_chars,
            max_messages=a.max_messages,
            max_stop=a.max_stop,
            max_stop_chars=a.max_stop_chars,
            max_stop_token_ids=a.max_stop_token_ids,
            header_timeout=a.header_timeout,
            body_timeout=a.body_timeout,
            max_connections=a.max_connections,
            stalled_client_timeout=a.stalled_client_timeout,
        ),
    )


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
    engine_config: EngineConfig, max_queue_len: int
) -> Callable[[Sequence[StatsListener], SchedulingPolicy | None], AsyncLLM]:
    def load(listeners: Sequence[StatsListener], policy: SchedulingPolicy | None) -> AsyncLLM:
        return AsyncLLM.from_config(
            engine_config, max_queue_len=max_queue_len, listeners=listeners, policy=policy
        )

    return load


def run_server(engine_config: EngineConfig, config: ServerConfig) -> int:
    import uvicorn

    from kvgate.server.app import build_app
    from kvgate.server.http import uvicorn_config

    setup_logging(config)
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
        engine_loader(engine_config, config.max_queue_len),
        on_load_error=on_load_error,
        on_engine_dead=on_engine_dead,
        tracer_provider=provider,
    )
    server = uvicorn.Server(
        uvicorn_config(
            app,
            config.host,
            config.port,
            config.limits,
            log_level=config.log_level,
            timeout_graceful_shutdown=5,
        )
    )
    log.info(
        "kvgate serving %r (%s, kv_cache_memory=%s) on http://%s:%d/v1 ; /health turns 200 "
        "once the model is loaded",
        config.served_model_name,
        engine_config.dtype,
        engine_config.kv_cache_memory,
        config.host,
        config.port,
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
