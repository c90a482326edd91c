"""The engine in a process of its own: the model, scheduler and engine loop, behind two
ZeroMQ sockets to the front end (``core_client.py``).

The front end binds both sockets; this process connects. Commands come in on one (``Add``,
``Abort``, ``Shares``, None to stop), pickled; on the other go out, pickled, one message per
step with every request's outputs of that step, the engine's snapshot after it and the step's
statistics (the front end's metrics listeners get them there), and a few others:

- ``("ready", EngineInfo, snapshot)`` once the model is loaded, or ``("failed", error)``;
- ``("step", outputs, snapshot, stats)``; ``("snap", snapshot)`` after commands;
- ``("error", request_id, error)``; ``("gone", request_ids)``; ``("dead", error, shutdown)``.

Both sockets are CURVE-authenticated (``channel.py``): the process gets its keys with its
other arguments on its stdin pipe.

The process ends with its parent: a thread of its own looks at its parent's pid every second
from the start, model load included (not Linux's ``PR_SET_PDEATHSIG``, which fires when the
*thread* that started the process ends, and the server loads models on a thread that ends).
When the parent is gone it removes the sockets' directory, which nobody else would, and
exits at once (``os._exit``: no thread, socket linger or engine step to wait for), so a
front end killed -9 leaves neither an engine holding the memory nor a directory behind.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import shutil
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from kvgate.config import EngineConfig
from kvgate.engine.channel import Channel, connect_secured
from kvgate.engine.llm_engine import KVPoolInfo, LLMEngine
from kvgate.engine.loop import Add, Command, EngineLoop
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.stats import IterationStats
from kvgate.errors import RequestFailed
from kvgate.model.config import ModelConfig
from kvgate.model.kv_layout import KVLayout
from kvgate.tokenizer import Tokenizer

log = logging.getLogger("kvgate.engine")

#: How often the process looks at whether its parent is still there (and its command loop at
#: whether the engine loop stopped), in seconds.
_PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class EngineInfo:
    """What the front end needs of a loaded engine: to tokenize and validate requests on its
    side, size governance against the KV pool, and report what it serves."""

    pid: int
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    eos_token_ids: frozenset[int]
    kv_pool: KVPoolInfo
    kv_layout: KVLayout
    load_seconds: float
    source: str
    build_info: dict[str, str]

    @staticmethod
    def of(engine: LLMEngine) -> EngineInfo:
        return EngineInfo(
            os.getpid(),
            engine.config,
            engine.model_config,
            engine.tokenizer,
            engine.max_model_len,
            engine.eos_token_ids,
            engine.kv_pool,
            engine.kv_layout,
            engine.load_seconds,
            str(engine.source),
            dict(engine.build_info),
        )


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RequestFailed`` that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RequestFailed(f"{type(exc).__name__}: {exc}")
    return exc


class _Stats:
    """Collects each step's statistics for the next message (engine thread only)."""

    def __init__(self) -> None:
        self.pending: list[IterationStats] = []

    def on_step(self, stats: IterationStats) -> None:
        self.pending.append(stats)

    def take(self) -> list[IterationStats]:
        taken, self.pending = self.pending, []
        return taken


class SocketSink:
    """The engine loop's results, sent to the front end. Sends come from the engine thread
    and the receiving thread (a grammar that fails on arrival): one lock around the socket."""

    def __init__(self, socket: zmq.Socket[bytes], stats: _Stats) -> None:
        self.socket = socket
        self.stats = stats
        self.engine: LLMEngine | None = None
        self._lock = threading.Lock()
        self.stopped = threading.Event()

    def send(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.socket.send(data, copy=False)

    def outputs(self, outputs: Sequence[RequestOutput]) -> None:
        assert self.engine is not None
        self.send(("step", list(outputs), self.engine.snapshot, self.stats.take()))

    def error(self, request_id: str, exc: BaseException) -> None:
        self.send(("error", request_id, portable(exc)))

    def gone(self, request_ids: Sequence[str]) -> None:
        self.send(("gone", list(request_ids)))

    def published(self) -> None:
        assert self.engine is not None
        self.send(("snap", self.engine.snapshot))

    def lora_done(self, token: int, error: BaseException | None) -> None:
        self.send(("lora", token, None if error is None else portable(error)))

    def dead(self, exc: BaseException, *, shutdown: bool = False) -> None:
        self.send(("dead", portable(exc), shutdown))
        self.stopped.set()


def _end_with_parent(channel: Channel) -> None:
    """The watching thread: once the front end is gone (the process is re-parented), remove
    the channel's directory and end the process."""
    while os.getppid() == channel.front_pid:
        time.sleep(_PARENT_CHECK_S)
    log.error("the front end (pid %d) is gone; stopping the engine", channel.front_pid)
    shutil.rmtree(channel.directory, ignore_errors=True)
    os._exit(1)


def run_core(
    config: EngineConfig,
    policy: SchedulingPolicy | None,
    channel: Channel,
    log_level: int,
) -> None:
    """The engine process's main (``core_main``; the front end spawns it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end says when to stop
    logging.basicConfig(
        level=log_level,
        format="%(asctime)s %(levelname)s %(name)s [engine %(process)d]: %(message)s",
        stream=sys.stderr,
    )
    threading.Thread(
        target=_end_with_parent, args=(channel,), name="kvgate-parent-watch", daemon=True
    ).start()
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    connect_secured(commands, channel.keys)
    commands.connect(channel.commands)
    results = context.socket(zmq.PUSH)
    results.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs: the front reads all
    results.setsockopt(zmq.LINGER, 5000)
    connect_secured(results, channel.keys)
    results.connect(channel.results)
    stats = _Stats()
    sink = SocketSink(results, stats)
    try:
        engine = LLMEngine(config, listeners=[stats], policy=policy)
    except BaseException as exc:
        log.error("the engine failed to load: %s", exc)
        sink.send(("failed", portable(exc)))
        commands.close(linger=0)
        results.close()
        context.term()
        return
    sink.engine = engine
    # As the server does after loading (see server/app.py): everything alive now lives as
    # long as the process, so keep it out of the collector's full passes, each of which
    # walks the whole heap with the GIL held.
    gc.collect()
    gc.freeze()
    loop = EngineLoop(engine, sink)
    loop.start()
    sink.send(("ready", EngineInfo.of(engine), engine.snapshot))
    asked_to_stop = False
    try:
        while not sink.stopped.is_set():
            if not commands.poll(int(_PARENT_CHECK_S * 1000)):
                continue
            command: Command = pickle.loads(commands.recv())
            if isinstance(command, Add):
                request = command.request
                if request.params.grammar is not None and request.matcher is None:
                    try:  # here, not on the engine thread: compiling takes milliseconds
                        request.matcher = engine.grammars.matcher(request.params.grammar)
                    except Exception as exc:
                        sink.error(request.request_id, exc)
                        continue
            loop.put(command)
            if command is None:
                asked_to_stop = True
                break
    finally:
        loop.put(None)
        loop.join(30)
        commands.close(linger=0)
        results.close()
        context.term()
    # The loop gave up (errors too frequent to be transient): say so by the exit status, so
    # that the front end's supervisor starts a fresh engine.
    sys.exit(0 if asked_to_stop else 1)
