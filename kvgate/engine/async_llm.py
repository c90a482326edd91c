"""The async front of the engine: one engine thread, one asyncio queue per request.

The engine loop runs on its own thread so that request handling never waits for a step and a
long step never stalls the event loop. Torch releases the GIL inside its kernels, so the two
share the process well. Each request streams as an async generator of deltas; leaving the
generator early (a client disconnect cancels it) aborts the request in the engine at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.request import Request
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import StatsListener
from kvgate.errors import DuplicateRequestId, EngineDead, Overloaded, RequestFailed
from kvgate.sampling_params import SamplingParams

log = logging.getLogger("kvgate.engine")


@dataclass(frozen=True)
class _Add:
    request: Request


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], None]


#: How long a stalled engine loop waits for a command before it looks at deadlines again.
_STALL_WAIT_S = 0.005


class _Stream:
    """Where one request's outputs go. An abandoned stream (the caller left early) stays
    registered until the engine confirms the abort, so its id is not reused too soon."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.abandoned = False

    def put(self, item: RequestOutput | BaseException) -> None:
        # A closed event loop raises RuntimeError: its caller is gone, nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(batch: Sequence[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """On the streams' event loop: hand each item to its stream, in order."""
    for stream, item in batch:
        stream.queue.put_nowait(item)


class AsyncLLM:
    """``max_queue_len``: requests that may wait beyond the ``max_num_seqs`` running ones;
    past that ``generate`` raises ``Overloaded`` at once instead of queueing without bound."""

    #: The supervisor: after an unexpected error in a step, every request in flight ends
    #: with an error and the loop carries on; more than MAX_RECOVERIES of them within
    #: RECOVERY_WINDOW_S seconds and the loop stops (``on_dead`` is called: the server exits
    #: so that its own supervisor, e.g. Kubernetes, starts a fresh process).
    MAX_RECOVERIES = 5
    RECOVERY_WINDOW_S = 60.0

    def __init__(self, engine: LLMEngine, *, max_queue_len: int | None = None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.on_dead: Callable[[BaseException], None] | None = None
        self._recoveries: list[float] = []
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        # Commands taken off the queue inside a step but applied only after it (see
        # _between_layers); the engine thread alone touches this list.
        self._deferred: list[_Abort | _Call | None] = []
        engine.between_layers = self._between_layers
        self._thread = threading.Thread(target=self._run, name="kvgate-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        max_queue_len: int | None = None,
        listeners: Sequence[StatsListener] = (),
        policy: SchedulingPolicy | None = None,
    ) -> AsyncLLM:
        return cls(
            LLMEngine(config, listeners=listeners, policy=policy), max_queue_len=max_queue_len
        )

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def num_in_flight(self) -> int:
        """Requests whose caller is still listening (queued or running)."""
        with self._lock:
            return sum(1 for s in self._streams.values() if not s.abandoned)

    @property
    def capacity(self) -> int | None:
        """Requests that may be in flight (running + queued); None: no limit."""
        if self.max_queue_len is None:
            return None
        return self.engine.config.max_num_seqs + self.max_queue_len

    def check_capacity(self, num_new: int = 1, in_flight: int | None = None) -> None:
        """Raise ``Overloaded`` if ``num_new`` more requests would overflow the queue.

        ``in_flight``: the caller's own count when it admits requests before they stream
        (a server counting at admission sees a burst that has not reached the engine yet).
        """
        if self.max_queue_len is None:
            return
        limit = self.engine.config.max_num_seqs + self.max_queue_len
        if in_flight is None:
            in_flight = self.num_in_flight
        if in_flight + num_new > limit:
            raise Overloaded(
                f"server is at capacity: {in_flight} requests in flight, limit {limit} "
                f"({self.engine.config.max_num_seqs} running + {self.max_queue_len} queued); "
                "retry later",
                retry_after=1,
            )

    # ------------------------------------------------------------------ caller side
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: bytes | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of one request. Raises typed errors for invalid input at once."""
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = self.engine.make_request(rid, prompt, params, cache_salt=cache_salt)
        async for out in self.stream(request):
            yield out

    async def stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream a request built (and so validated) by ``engine.make_request``.

        Callers that must refuse bad input before they commit to a response (an HTTP stream
        whose headers are not sent yet) build the request first, then stream it.
        """
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # the same lock under which a dying loop fails every stream
            if self._dead is not None:
                raise EngineDead(f"engine loop stopped: {self._dead}")
            if rid in self._streams:
                raise DuplicateRequestId(rid)
            self._streams[rid] = stream
        self._commands.put(_Add(request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                if finished or self._dead is not None:
                    self._streams.pop(rid, None)
                else:
                    stream.abandoned = True  # dropped when the engine confirms the abort
            if not finished:
                self.abort(rid)

    def snapshot(self) -> EngineSnapshot:
        """The engine's latest published state (``snapshot.py``): what other threads read."""
        return self.engine.snapshot

    def call_in_engine(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between two steps (e.g. to swap policy settings)."""
        self._commands.put(_Call(fn))

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort from any thread; the engine frees the blocks before its next step."""
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        self._commands.put(_Abort(ids))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop; streams still open end with ``EngineDead``."""
        self._commands.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        stalled = False  # the last step ran nothing: every queued request is held back
        try:
            while True:
                idle = not self.engine.has_unfinished()
                # Stalled (e.g. a tenant at its KV ceiling), wait a little for a command rather
                # than spin; requests may still expire, so do not wait for ever.
                wait = None if idle else (_STALL_WAIT_S if stalled else 0.0)
                if not self._drain_commands(wait):
                    self._fail_all(RuntimeError("engine shut down"))
                    return
                if not self.engine.has_unfinished():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    self._recover(exc)
                    continue
                stalled = not outputs and self.engine.last_batch_size == 0
                self._deliver_all(outputs)
        except BaseException as exc:  # a bug in the loop itself: fail every stream, loudly
            log.exception("engine loop died")
            self._fail_all(exc)
            if self.on_dead is not None:
                self.on_dead(exc)

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
            self._deliver(
                request.request_id,
                RequestFailed(f"the engine failed and ended this request: {request.error}"),
            )

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.put(EngineDead(f"engine loop stopped: {type(exc).__name__}: {exc}"))

    def _between_layers(self) -> None:
        """Inside a step, between two of its layers: take in requests that arrived, and let
        the engine run an urgent one's prefill now (``LLMEngine.step_urgent``) instead of
        after the step. Aborts and calls wait for the step's end: the step in flight still
        uses its requests' blocks."""
        if self._commands.empty():
            return
        while True:
            try:
                cmd = self._commands.get(block=False)
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._add(cmd.request)
            else:
                self._deferred.append(cmd)
        self._deliver_all(self.engine.step_urgent())

    def _add(self, request: Request) -> None:
        try:
            self.engine.add(request)
        except Exception as exc:
            self._deliver(request.request_id, exc)

    def _drain_commands(self, wait: float | None) -> bool:
        """Apply queued commands, waiting up to ``wait`` seconds for the first one (None: for
        ever), then publish the engine's snapshot once if any was applied; False once
        shutdown was asked for."""
        applied = self._apply_commands(wait)
        if applied:
            self.engine.publish()
        return applied is not None

    def _apply_commands(self, wait: float | None) -> int | None:
        """How many commands were applied; None once shutdown was asked for."""
        applied = 0
        deferred, self._deferred = self._deferred, []
        first = not deferred
        while True:
            cmd: _Add | _Abort | _Call | None
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
            if isinstance(cmd, _Call):
                try:
                    cmd.fn()
                except Exception:
                    log.exception("engine-thread call failed")
            elif isinstance(cmd, _Add):
                self._add(cmd.request)
            else:
                live = self.engine.scheduler.requests
                ended = [rid for rid in cmd.request_ids if rid not in live]
                self.engine.abort(cmd.request_ids)
                # Already over before the abort arrived: no final output will come, so an
                # abandoned stream for it is dropped now.
                with self._lock:
                    for rid in ended:
                        stream = self._streams.get(rid)
                        if stream is not None and stream.abandoned:
                            del self._streams[rid]

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._listener(request_id, item)
        if stream is not None:
            stream.put(item)

    def _deliver_all(self, outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs to their streams with one wake-up of each event loop, not one
        per output: each costs a self-pipe write, and the woken loop takes the GIL while
        the engine thread still needs it (with 32 streams, 32 hand-overs a step)."""
        if not outputs:
            return
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                stream = self._listener(out.request_id, out)
                if stream is not None:
                    batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            # A closed event loop raises RuntimeError: its callers are gone.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_put_all, batch)

    def _listener(self, request_id: str, item: RequestOutput | BaseException) -> _Stream | None:
        """The stream that listens for ``request_id``, if any (under ``_lock``)."""
        stream = self._streams.get(request_id)
        if stream is not None and stream.abandoned:
            # Nobody listens; once the request has ended its id may be used again.
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
            return None
        return stream
