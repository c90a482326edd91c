"""The front end of an engine that runs in a process of its own (``core_proc.py``).

The same surface as ``AsyncLLM``, so the server uses either: requests are tokenized and
validated here (``RemoteEngine.make_request``), streamed through ``Streams``, and their
outputs arrive one message per engine step, read by one thread that hands them to the event
loop with one wake-up per step. The HTTP event loop never waits for the engine's Python work
(scheduling, sampling, detokenizing): that runs on another interpreter.

The supervisor: when the engine process dies (killed, or its loop gave up), every request in
flight ends with ``EngineDead`` (the server sends an error event), ``is_running`` is False
(``/health`` says 503) and a fresh engine process is started; it takes requests once its
model is loaded. More than ``MAX_RESTARTS`` deaths within ``RESTART_WINDOW_S`` and it stops
trying: ``on_dead`` is called (the server exits, for its own supervisor to act).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import zmq

from kvgate.config import EngineConfig
from kvgate.engine.autopilot import SloPolicy
from kvgate.engine.channel import Channel, ChannelKeys, Gate, serve_secured
from kvgate.engine.core_proc import EngineInfo
from kvgate.engine.loop import Abort, Add, Command, Shares
from kvgate.engine.lora_ops import LoraOp, LoraOps
from kvgate.engine.policy import SchedulingPolicy, TenantShare
from kvgate.engine.request import Request
from kvgate.engine.request_factory import RequestFactory
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import StatsListener
from kvgate.engine.streams import StreamingFront
from kvgate.errors import EngineDead
from kvgate.structured.compiler import GrammarCompiler

log = logging.getLogger("kvgate.engine")

#: How often the receiving thread looks at whether the engine process is alive, in seconds.
_POLL_S = 0.1


class RemoteEngine:
    """The engine as the front end sees it (what ``AsyncLLM.engine`` is in one process):
    its tokenizer, grammar compiler and limits, to validate requests on this side."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.config = info.config
        self.model_config = info.model_config
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.kv_pool = info.kv_pool
        self.load_seconds = info.load_seconds
        self.source = info.source
        self.build_info = info.build_info
        self.grammars = GrammarCompiler(info.tokenizer, sorted(info.eos_token_ids))
        self.requests = RequestFactory(
            info.tokenizer,
            info.model_config.vocab_size,
            info.max_model_len,
            self.grammars,
            info.eos_token_ids,
            matchers=False,
            speculative=info.config.speculative is not None,
        )
        #: Validate and tokenize a request (``RequestFactory.make``), on this side.
        self.make_request = self.requests.make

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks one request of ``num_tokens`` tokens holds at most (every group's)."""
        return self.info.kv_layout.max_blocks(
            num_tokens, self.config.block_size, self.config.max_num_batched_tokens
        )


class EngineClient(StreamingFront):
    MAX_RESTARTS = 5
    RESTART_WINDOW_S = 300.0

    def __init__(
        self,
        config: EngineConfig,
        *,
        max_queue_len: int | None = None,
        listeners: Sequence[StatsListener] = (),
        policy: SchedulingPolicy | None = None,
    ) -> None:
        """Starts the engine process and returns once its model is loaded; raises what the
        load raised."""
        super().__init__(max_queue_len)
        self.on_dead: Callable[[BaseException], None] | None = None
        self.listeners = list(listeners)
        self._config = config
        self._policy = policy
        self._restarts: list[float] = []
        #: Engine processes started again after one died.
        self.num_restarts = 0
        self._shares: Shares | None = None
        self._loras = LoraOps()
        self._up = False  # an engine process is loaded and taking requests
        self._closing = False
        self._given_up = False
        self._first = threading.Event()
        self._snapshot: EngineSnapshot | None = None
        self._failure: BaseException | None = None
        self._dir = tempfile.mkdtemp(prefix="kvgate-engine-")  # 0700
        self._channel = Channel(self._dir, ChannelKeys.new(), os.getpid())
        self._context = zmq.Context()
        # Only the engine process's key gets through (channel.py): what arrives on the
        # results socket is the engine's, and commands go to the engine only.
        self._gate = Gate(self._context, self._channel.keys)
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.LINGER, 0)
        serve_secured(self._commands, self._channel.keys)
        self._commands.bind(self._channel.commands)
        self._results = self._context.socket(zmq.PULL)
        serve_secured(self._results, self._channel.keys)
        self._results.bind(self._channel.results)
        self._send_lock = threading.Lock()
        self._process = self._spawn()
        self._receiver = threading.Thread(
            target=self._receive, name="kvgate-engine-client", daemon=True
        )
        self._receiver.start()
        self._first.wait()
        if self._failure is not None:
            self._closing = True
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
            self._receiver.join(5)
            self._close_sockets()
            raise self._failure
        self.engine: RemoteEngine = RemoteEngine(self._info)

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        max_queue_len: int | None = None,
        listeners: Sequence[StatsListener] = (),
        policy: SchedulingPolicy | None = None,
    ) -> EngineClient:
        return cls(config, max_queue_len=max_queue_len, listeners=listeners, policy=policy)

    # ------------------------------------------------------------------ what AsyncLLM has
    @property
    def pid(self) -> int | None:
        """The engine process's pid."""
        return self._process.pid

    @property
    def socket_dir(self) -> str:
        """The directory of the engine channel's sockets."""
        return self._dir

    @property
    def is_running(self) -> bool:
        return self._up and self._streams.dead is None

    @property
    def is_restarting(self) -> bool:
        return not self._up and not self._given_up and not self._closing

    def snapshot(self) -> EngineSnapshot:
        """The snapshot that came with the engine's latest message."""
        assert self._snapshot is not None  # set before __init__ returns
        return self._snapshot

    def update_shares(
        self, shares: Mapping[str, TenantShare], default: TenantShare, slo: SloPolicy | None = None
    ) -> None:
        self._shares = Shares(dict(shares), default, slo)
        self._send(self._shares)

    def abort(self, request_id: str | Sequence[str]) -> None:
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        self._send(Abort(ids))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process; streams still open end with ``EngineDead``."""
        self._closing = True
        self._send(None)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._receiver.join(timeout)
        self._streams.fail_all(RuntimeError("engine shut down"))
        self._close_sockets()

    # ------------------------------------------------------------------ sending
    def _submit(self, request: Request) -> None:
        if not self._up:
            raise EngineDead("the engine process is restarting")
        request.matcher = None  # made again on the engine's side
        self._send(Add(request))

    def lora(self, name: str, path: str | None) -> Future[None]:
        """Load LoRA adapter ``name`` from ``path`` (None: unload it) in the engine process;
        the future fails with its error. Adapters loaded so are loaded again into an engine
        process started after one died."""
        if not self._up:
            raise EngineDead("the engine process is restarting")
        op, future = self._loras.start(name, path)
        self._send(op)
        return future

    def _send(self, command: Command) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        # No engine connected (it died): dropped; its streams are failed anyway.
        with self._send_lock, contextlib.suppress(zmq.ZMQError):
            self._commands.send(data, zmq.NOBLOCK, copy=False)

    # ------------------------------------------------------------------ the process
    def _spawn(self) -> subprocess.Popen[bytes]:
        args = (
            self._config,
            self._policy,
            self._channel.engine_side(),
            logging.getLogger().getEffectiveLevel(),
        )
        process = subprocess.Popen(
            [sys.executable, "-m", "kvgate.engine.core_main"], stdin=subprocess.PIPE
        )
        assert process.stdin is not None
        process.stdin.write(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        process.stdin.close()
        log.info("engine process %d starting", process.pid)
        return process

    def _receive(self) -> None:
        """The receiving thread: every message from the engine, and its death."""
        while not (self._closing and self._process.poll() is not None):
            if self._results.poll(int(_POLL_S * 1000)):
                try:
                    self._handle(pickle.loads(self._results.recv()))
                except Exception:  # one bad message (or listener) must not stop the reading
                    log.exception("handling a message from the engine process failed")
                continue
            if self._closing or self._given_up:
                if self._process.poll() is not None:
                    return
                continue
            exitcode = self._process.poll()
            if exitcode is not None:
                self._died(exitcode)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "step":
            _, outputs, snapshot, stats = message
            self._snapshot = snapshot
            self._streams.deliver_all(outputs)
            for step in stats:
                for listener in self.listeners:
                    listener.on_step(step)
        elif kind == "lora":
            self._loras.done(message[1], message[2])
        elif kind == "snap":
            self._snapshot = message[1]
        elif kind == "error":
            self._streams.deliver(message[1], message[2])
        elif kind == "gone":
            self._streams.gone(message[1])
        elif kind == "ready":
            self._ready(message[1], message[2])
        elif kind == "failed":
            self._load_failed(message[1])
        elif kind == "dead":
            _, exc, shutdown = message
            if not shutdown:
                log.error("the engine loop in process %d stopped: %s", self._process.pid, exc)
                self._up = False
                self._loras.fail_all(exc)
                self._streams.fail_all(exc)

    def _ready(self, info: EngineInfo, snapshot: EngineSnapshot) -> None:
        self._info = info
        self._snapshot = snapshot
        if self._first.is_set():
            log.info("engine process %d ready again: taking requests", info.pid)
            if self._shares is not None:
                self._send(self._shares)
            for name, path in self._loras.loaded.items():
                self._send(LoraOp(-1, name, path))
            self._streams.revive()
        self._up = True
        self._first.set()

    def _load_failed(self, exc: BaseException) -> None:
        if not self._first.is_set():
            self._failure = exc
            self._given_up = True
            self._first.set()
            return
        self._give_up(exc)

    def _died(self, exitcode: int) -> None:
        self._up = False
        exc = EngineDead(f"the engine process {self._process.pid} exited with code {exitcode}")
        self._loras.fail_all(exc)
        self._streams.fail_all(exc)
        if not self._first.is_set():
            self._load_failed(exc)
            return
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < self.RESTART_WINDOW_S]
        if len(self._restarts) >= self.MAX_RESTARTS:
            self._give_up(exc)
            return
        self._restarts.append(now)
        self.num_restarts += 1
        log.error("%s; starting a fresh one (in-flight requests ended with an error)", exc)
        self._process = self._spawn()

    def _give_up(self, exc: BaseException) -> None:
        log.error("the engine cannot be kept running (%s); giving up", exc)
        self._given_up = True
        self._streams.fail_all(exc)
        if self.on_dead is not None:
            self.on_dead(exc)

    def _close_sockets(self) -> None:
        self._commands.close(linger=0)
        self._results.close(linger=0)
        self._gate.stop()
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
