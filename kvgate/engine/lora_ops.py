"""Loading and unloading LoRA adapters while serving: a front end's call, answered by the
engine thread between two steps (the engine's own process, or this one).

The front end sends a ``LoraOp`` (a command of ``engine/loop.py``, pickled where the engine
runs in a process of its own) and waits on the future ``LoraOps.start`` gave it; the engine
loop applies it (``LLMEngine.lora_op``) and reports back (``Sink.lora_done``).
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraOp:
    """Register adapter ``name`` from directory ``path``, or with ``path`` None forget it;
    ``token`` pairs the answer with its caller (-1: nobody waits)."""

    token: int
    name: str
    path: str | None


class LoraOps:
    """The front end's LoRA calls in flight, and the adapters they loaded (replayed into a
    restarted engine process)."""

    def __init__(self) -> None:
        self._tokens = itertools.count()
        self._waiting: dict[int, tuple[LoraOp, Future[None]]] = {}
        self._lock = threading.Lock()
        #: Adapters loaded while serving, name -> path, in load order.
        self.loaded: dict[str, str] = {}

    def start(self, name: str, path: str | None) -> tuple[LoraOp, Future[None]]:
        future: Future[None] = Future()
        with self._lock:
            op = LoraOp(next(self._tokens), name, path)
            self._waiting[op.token] = (op, future)
        return op, future

    def done(self, token: int, error: BaseException | None) -> None:
        """The engine's answer to the op of ``token``: its future resolved."""
        with self._lock:
            waiting = self._waiting.pop(token, None)
            if waiting is None:
                return
            op, future = waiting
            if error is None and op.path is not None:
                self.loaded[op.name] = op.path
            elif error is None:
                self.loaded.pop(op.name, None)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)

    def fail_all(self, error: BaseException) -> None:
        """Every call in flight fails (the engine stopped)."""
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for _, future in waiting.values():
            future.set_exception(error)
