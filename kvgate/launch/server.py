"""Build and run the server of a :class:`~kvgate.launch.settings.Launch`: logging, the
engines' loaders (in this process or each in one of its own), the data folders' check, the
app, and uvicorn with a draining shutdown. The CLI runs it; a Ray replica builds the same app
(:func:`build_server`) and feeds it requests without a socket."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvgate.config import EngineConfig
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.core_client import EngineClient
from kvgate.engine.front import EngineFront
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.stats import StatsListener
from kvgate.errors import InvalidConfig
from kvgate.launch.plan import log_plan
from kvgate.launch.settings import Launch
from kvgate.server.config import ServerConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("kvgate.server")


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


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before anything loads: a port in use is a clear
    error at once (uvicorn binds only after the app's startup, which had begun loading the
    model, and logged "Application startup complete" before ``[Errno 98]``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidConfig(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (another process holds "
            "the port? choose another with --port)",
            param="port",
        ) from exc
    return sock


def build_server(launch: Launch, **hooks: Any) -> FastAPI:
    """The app of ``launch``: one engine loader per model (each engine in a process of its
    own with ``--engine-process on``); ``hooks`` go to ``build_app`` (``on_load_error``,
    ``on_engine_dead``, ``tracer_provider``, ``rate_buckets``)."""
    from kvgate.server.app import build_app

    config = launch.config
    loaders = {
        m.name: engine_loader(m.engine, config.max_queue_len, own_process=config.engine_process)
        for m in launch.models
    }
    return build_app(config, loaders, **hooks)


def run_server(launch: Launch) -> int:
    """Serve ``launch`` on uvicorn until SIGTERM/SIGINT (the first drains, a second stops);
    0, or 1 when a model failed to load or its engine failed repeatedly."""
    import uvicorn

    from kvgate.server.http import uvicorn_config
    from kvgate.server.tracing import tracer_provider_from_env

    models, config = launch.models, launch.config
    setup_logging(config)
    check_data_dirs(config)
    listener = bind_listener(config.host, config.port)
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

    provider = tracer_provider_from_env()
    if provider is not None:
        log.info("tracing on: OTLP/HTTP export as configured by the OTEL_* variables")
    app = build_server(
        launch,
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
        log_plan(m.engine, m.name)  # what `kvgate plan` predicts for it (launch/plan.py)
    log.info(
        "kvgate serving %s on http://%s:%d/v1 ; /health turns 200 once %s loaded",
        ", ".join(repr(m.name) for m in models),
        config.host,
        config.port,
        "the model is" if len(models) == 1 else "every model is",
    )
    # uvicorn re-raises Ctrl-C after its graceful shutdown: that is a normal stop.
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listener])
    if failed:
        print(f"kvgate: error: the model failed to load: {failed[0]}", file=sys.stderr)
        return 1
    if dead:
        print(f"kvgate: error: the engine failed repeatedly: {dead[0]}", file=sys.stderr)
        return 1
    return 0
