"""The engine loop: one thread that owns an ``LLMEngine``, takes commands, steps, and hands
each step's outputs to a ``Sink``.

Where the outputs go is the sink's business: streams in this process (``AsyncLLM``), or a
socket to the front end when the engine runs in a process of its own (``core_proc.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvgate.engine.autopilot import SloPolicy
from kvgate.engine.llm_engine import EngineStep, LLMEngine
from kvgate.engine.lora_ops import LoraOp
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.policy import TenantShare
from kvgate.engine.request import Request
from kvgate.errors import RequestFailed

log = logging.getLogger("kvgate.engine")


@dataclass(frozen=True)
class Add:
    request: Request


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Call:
    fn: Callable[[], None]


@dataclass(frozen=True)
class Shares:
    """New tenant shares for the engine's fair policy, and SLO targets for its autopilot
    (a tenants-file reload)."""

    shares: dict[str, TenantShare]
    default: TenantShare
    slo: SloPolicy | None = None


Command = Add | Abort | Call | Shares | LoraOp | None  # None: shut down

#: How long a stalled engine loop waits for a command before it looks at deadlines again.
_STALL_WAIT_S = 0.005


class Sink(Protocol):
    """Where the loop's results go; called on the engine thread."""

    def outputs(self, outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs (the snapshot was just published)."""

    def error(self, request_id: str, exc: BaseException) -> None:
        """One request failed before or instead of its outputs."""

    def gone(self, request_ids: Sequence[str]) -> None:
        """Aborted requests that were already over: no output will come for them."""

    def published(self) -> None:
        """The engine published a snapshot outside a step (after commands)."""

    def lora_done(self, token: int, error: BaseException | None) -> None:
        """A ``LoraOp`` was applied (``error`` None) or refused."""

    def dead(self, exc: BaseException, *, shutdown: bool = False) -> None:
        """The loop stopped: asked to (``shutdown``), or errors too frequent to be
        transient, or a bug in the loop."""


class EngineLoop:
    """The supervisor: after an unexpected error in a step, every request in flight ends
    with an error and the loop carries on; more than MAX_RECOVERIES of them within
    RECOVERY_WINDOW_S seconds and the loop stops (``Sink.dead``)."""

    MAX_RECOVERIES = 5
    RECOVERY_WINDOW_S = 60.0

    def __init__(self, engine: LLMEngine, sink: Sink) -> None:
        self.engine = engine
        self.sink = sink
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._recoveries: list[float] = []
        # Commands taken off the queue inside a step but applied only after it (see
        # _between_layers); the engine thread alone touches this list.
        self._deferred: list[Command] = []
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, command: Command) -> None:
        """From any thread."""
        self._commands.put(command)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        stalled = False  # the last step ran nothing: every queued request is held back
        try:
            while True:
                idle = not self.engine.has_unfinished()
                # Stalled (e.g. a tenant at its KV ceiling), wait a little for a command rather
                # than spin; requests may still expire, so do not wait for ever.
                wait = None if idle else (_STALL_WAIT_S if stalled else 0.0)
                if idle:  # the autopilot's knobs still go back while nothing runs
                    wait = self.engine.autopilot.next_due(self.engine.clock())
                if not self._drain_commands(wait):
                    self._close_engine()
                    self.sink.dead(RuntimeError("engine shut down"), shutdown=True)
                    return
                if idle and self.engine.steer(self.engine.clock()):
                    self.engine.publish()
                    self.sink.published()
                if not self.engine.has_unfinished():
                    continue
                try:
                    outputs = self._step()
                except Exception as exc:
                    self._recover(exc)
                    continue
                stalled = not outputs and self.engine.last_batch_size == 0
                if not stalled:
                    self.sink.outputs(outputs)
        except BaseException as exc:  # a bug in the loop itself: fail every stream, loudly
            log.exception("engine loop died")
            self.sink.dead(exc)

    def _close_engine(self) -> None:
        """A clean shutdown: the engine writes what it has pending (its KV tier)."""
        try:
            self.engine.close()
        except Exception:
            log.exception("closing the engine failed")

    def _recover(self, exc: Exception) -> None:
        """An unexpected error in a step: end every request in flight with an error event,
        and go on; raise it (the loop dies) when errors come too often to be transient."""
        now = time.monotonic()
        self._recoveries = [t for t in self._recoveries if now - t < self.RECOVERY_WINDOW_S]
        self._recoveries.append(now)
        if len(self._recoveries) > self.MAX_RECOVERIES:
            raise exc
        log.exception(
            "engine step failed unexpectedly; ending every request in flight and carrying on "
            "(%d in the last %.0f s)", len(self._recoveries), self.RECOVERY_WINDOW_S,
        )  # fmt: skip
        for request in self.engine.recover(exc):
            self.sink.error(
                request.request_id,
                RequestFailed(f"the engine failed and ended this request: {request.error}"),
            )
        self.sink.published()

    def _step(self) -> list[RequestOutput]:
        """One step, owned here: advanced layer by layer, with new work looked at between
        each two layers (``_between_layers``), then ended."""
        step = self.engine.begin_step(pause=True)
        while step.advance():
            try:
                self._between_layers(step)
            except Exception as exc:  # a bug there fails the step in flight, as a kernel would
                log.exception("taking in work between two layers failed; failing the step")
                step.fail(exc)
        return self.engine.end_step(step)

    def _between_layers(self, step: EngineStep) -> None:
        """Inside ``step``, between two of its layers: take in requests that arrived, and
        let the engine run an urgent one's prefill now (``LLMEngine.step_urgent``) instead
        of after the step. Aborts and calls wait for the step's end: the step in flight
        still uses its requests' blocks."""
        if self._commands.empty():
            return
        while True:
            try:
                cmd = self._commands.get(block=False)
            except queue.Empty:
                break
            if isinstance(cmd, Add):
                self._add(cmd.request)
            else:
                self._deferred.append(cmd)
        urgent = self.engine.step_urgent(step)
        if urgent:
            self.sink.outputs(urgent)

    def _add(self, request: Request) -> None:
        try:
            self.engine.add(request)
        except Exception as exc:
            self.sink.error(request.request_id, exc)

    def _drain_commands(self, wait: float | None) -> bool:
        """Apply queued commands, waiting up to ``wait`` seconds for the first one (None: for
        ever), then publish the engine's snapshot once if any was applied; False once
        shutdown was asked for."""
        applied = self._apply_commands(wait)
        if applied:
            self.engine.publish()
            self.sink.published()
        return applied is not None

    def _apply_commands(self, wait: float | None) -> int | None:
        """How many commands were applied; None once shutdown was asked for."""
        applied = 0
        deferred, self._deferred = self._deferred, []
        first = not deferred
        while True:
            cmd: Command
            if deferred:
                cmd = deferred.pop(0)
            else:
                try:
                    if first and wait != 0.0:
                        cmd = self._commands.get(timeout=wait)
                    else:
                        cmd = self._commands.get(block=False)
                except queue.Empty:
                    return applied
            first = False
            if cmd is None:
                return None
            applied += 1
            self._apply(cmd)

    def _apply(self, cmd: Add | Abort | Call | Shares | LoraOp) -> None:
        if isinstance(cmd, Add):
            self._add(cmd.request)
        elif isinstance(cmd, LoraOp):
            error: BaseException | None = None
            try:
                self.engine.lora_op(cmd.name, cmd.path)
            except Exception as exc:
                error = exc
            self.sink.lora_done(cmd.token, error)
        elif isinstance(cmd, Abort):
            live = self.engine.scheduler.requests
            ended = [rid for rid in cmd.request_ids if rid not in live]
            self.engine.abort(cmd.request_ids)
            if ended:
                self.sink.gone(ended)
        else:
            fn = cmd.fn if isinstance(cmd, Call) else self._update_shares(cmd)
            try:
                fn()
            except Exception:
                log.exception("engine-thread call failed")

    def _update_shares(self, cmd: Shares) -> Callable[[], None]:
        return lambda: self.engine.update_shares(cmd.shares, cmd.default, cmd.slo)
