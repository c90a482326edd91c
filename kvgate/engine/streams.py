"""The caller side of an engine: one asyncio queue per request, fed from another thread.

Both fronts of the engine use it: ``AsyncLLM`` (the engine loop on a thread of this process)
and ``EngineClient`` (the engine in a process of its own). Whoever runs the engine calls
``deliver_all`` with each step's outputs; each request's handler reads its own stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from kvgate.engine.outputs import RequestOutput
from kvgate.engine.request import Request
from kvgate.errors import DuplicateRequestId, EngineDead, KVGateError, Overloaded
from kvgate.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvgate.engine.front import EngineView


#: Told, once, the last output the engine made for a request whose caller left before its
#: final one (None: it made none, or the engine died): what it generated, for billing.
OnAbandoned = Callable[[RequestOutput | None], None]


class _Stream:
    """Where one request's outputs go. An abandoned stream (the caller left early) stays
    registered until the engine confirms the abort, so its id is not reused too soon; its
    outputs from then on go to ``on_abandoned`` (the last of them, once the engine is done)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_abandoned: OnAbandoned | None) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.abandoned = False
        self.on_abandoned = on_abandoned
        self.last: RequestOutput | None = None  # the latest output, once abandoned

    def put(self, item: RequestOutput | BaseException) -> None:
        # A closed event loop raises RuntimeError: its caller is gone, nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.receive, item)

    def receive(self, item: RequestOutput | BaseException) -> None:
        """On the event loop: queue ``item`` for the caller or, abandoned, keep the latest
        output and end once the request has."""
        if not self.abandoned:
            self.queue.put_nowait(item)
            return
        if isinstance(item, RequestOutput):
            self.last = item
        if isinstance(item, BaseException) or item.finished:
            self.end()

    def abandon(self) -> bool:
        """On the event loop: the caller left. Outputs it did not read count as the
        engine's; returns whether the request had already ended among them."""
        self.abandoned = True
        ended = False
        while not self.queue.empty():
            item = self.queue.get_nowait()
            self.receive(item)
            ended = ended or isinstance(item, BaseException) or item.finished
        return ended

    def end(self) -> None:
        """On the event loop: the engine is done with an abandoned request; told once."""
        callback, self.on_abandoned = self.on_abandoned, None
        if callback is not None:
            callback(self.last)

    def end_soon(self) -> None:
        """``end`` from any thread (after whatever was put before it)."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.end)


def _put_all(batch: Sequence[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """On the streams' event loop: hand each item to its stream, in order."""
    for stream, item in batch:
        stream.receive(item)


class Streams:
    """Open request streams by request id; thread-safe."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.dead: BaseException | None = None

    @property
    def num_in_flight(self) -> int:
        """Requests whose caller is still listening (queued or running)."""
        with self._lock:
            return sum(1 for s in self._streams.values() if not s.abandoned)

    async def run(
        self,
        request: Request,
        submit: Callable[[Request], None],
        abort: Callable[[str], None],
        on_abandoned: OnAbandoned | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Register ``request``'s stream, ``submit`` it, and yield its outputs until the last;
        leaving early (a client disconnect cancels the generator) calls ``abort``.
        ``on_abandoned`` is called exactly once unless the caller reads the final output
        (refused, failed or left early), once the engine is done with the request."""
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), on_abandoned)
        with self._lock:  # the same lock under which a dying engine fails every stream
            refused: KVGateError | None = None
            if self.dead is not None:
                refused = EngineDead(f"engine loop stopped: {self.dead}")
            elif rid in self._streams:
                refused = DuplicateRequestId(rid)
            else:
                self._streams[rid] = stream
        if refused is not None:
            stream.end()  # nothing generated
            raise refused
        finished = False
        try:
            submit(request)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Left early: outputs not read yet count as the engine's (``abandon``); the stream
            # stays registered until the engine confirms the abort, unless the request is over.
            ended = finished or stream.abandon()
            with self._lock:
                if ended or self.dead is not None:
                    self._streams.pop(rid, None)
            if finished:
                pass
            elif ended or self.dead is not None:
                stream.end()  # no abort to wait for
            else:
                abort(rid)

    def deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._listener(request_id, item)
        if stream is not None:
            stream.put(item)

    def deliver_all(self, outputs: Sequence[RequestOutput]) -> None:
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

    def gone(self, request_ids: Sequence[str]) -> None:
        """These requests were over before their abort arrived: no final output will come,
        so their abandoned streams are dropped now."""
        with self._lock:
            for rid in request_ids:
                stream = self._streams.get(rid)
                if stream is not None and stream.abandoned:
                    del self._streams[rid]
                    stream.end_soon()

    def fail_all(self, exc: BaseException) -> None:
        """The engine stopped: every open stream ends with ``EngineDead``, and new ones are
        refused until ``revive``."""
        with self._lock:
            self.dead = exc
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:  # an abandoned one ends with it (its caller is not told)
            stream.put(EngineDead(f"engine loop stopped: {type(exc).__name__}: {exc}"))

    def revive(self) -> None:
        """A fresh engine took over: streams may open again."""
        with self._lock:
            self.dead = None

    def _listener(self, request_id: str, item: RequestOutput | BaseException) -> _Stream | None:
        """The stream that listens for ``request_id``, if any (under ``_lock``)."""
        stream = self._streams.get(request_id)
        if stream is not None and stream.abandoned:
            # Nobody listens (``on_abandoned`` may); once the request has ended its id may
            # be used again.
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
            return stream if stream.on_abandoned is not None else None
        return stream


class StreamingFront:
    """The caller side both fronts share (``AsyncLLM``, ``EngineClient``): requests made
    by ``engine``, streamed through ``Streams``, handed on by ``_submit``."""

    engine: EngineView
    max_queue_len: int | None

    def __init__(self, max_queue_len: int | None) -> None:
        self.max_queue_len = max_queue_len
        self._streams = Streams()
        self._ids = itertools.count()

    def _submit(self, request: Request) -> None:
        raise NotImplementedError

    def abort(self, request_id: str | Sequence[str]) -> None:
        raise NotImplementedError

    @property
    def num_in_flight(self) -> int:
        """Requests whose caller is still listening (queued or running)."""
        return self._streams.num_in_flight

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
        capacity = self.capacity
        count = self.num_in_flight if in_flight is None else in_flight
        if capacity is None or count + num_new <= capacity:
            return
        running = self.engine.config.max_num_seqs
        raise Overloaded(
            f"server is at capacity: {count} requests in flight, limit {capacity} "
            f"({running} running + {capacity - running} queued); retry later",
            retry_after=1,
        )

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

    async def stream(
        self, request: Request, on_abandoned: OnAbandoned | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request built (and so validated) by ``engine.make_request``.

        Callers that must refuse bad input before they commit to a response (an HTTP stream
        whose headers are not sent yet) build the request first, then stream it. Leaving
        early aborts the request; ``on_abandoned`` then hears what it generated.
        """
        async for out in self._streams.run(request, self._submit, self.abort, on_abandoned):
            yield out
