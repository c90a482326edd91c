"""The async front of the engine in this process: one engine thread, one asyncio queue per
request.

The engine loop (``loop.py``) runs on its own thread so that request handling never waits for
a step and a long step never stalls the event loop. Torch releases the GIL inside its
kernels, so the two share the process well. Each request streams as an async generator of
deltas (``streams.py``); leaving the generator early (a client disconnect cancels it) aborts
the request in the engine at once. ``core_client.py`` is the same front with the engine in a
process of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from kvgate.config import EngineConfig
from kvgate.engine.autopilot import SloPolicy
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.loop import Abort, Add, Call, EngineLoop, Shares
from kvgate.engine.lora_ops import LoraOps
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.policy import SchedulingPolicy, TenantShare
from kvgate.engine.request import Request
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import StatsListener
from kvgate.engine.streams import StreamingFront


class AsyncLLM(StreamingFront):
    """``max_queue_len``: requests that may wait beyond the ``max_num_seqs`` running ones;
    past that ``generate`` raises ``Overloaded`` at once instead of queueing without bound.

    The supervisor is ``EngineLoop``'s: when it gives up, every stream ends with
    ``EngineDead`` and ``on_dead`` is called (the server exits so that its own supervisor,
    e.g. Kubernetes, starts a fresh process)."""

    MAX_RECOVERIES = EngineLoop.MAX_RECOVERIES
    RECOVERY_WINDOW_S = EngineLoop.RECOVERY_WINDOW_S

    def __init__(self, engine: LLMEngine, *, max_queue_len: int | None = None) -> None:
        super().__init__(max_queue_len)
        self.engine: LLMEngine = engine
        self.on_dead: Callable[[BaseException], None] | None = None
        self._loras = LoraOps()
        self._loop = EngineLoop(engine, self)
        self._loop.start()

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
        return self._loop.is_alive and self._streams.dead is None

    num_restarts = 0  # never restarted in this process

    @property
    def is_restarting(self) -> bool:
        return False  # a dead engine thread is not restarted: the server exits

    def _submit(self, request: Request) -> None:
        self._loop.put(Add(request))

    def snapshot(self) -> EngineSnapshot:
        """The engine's latest published state (``snapshot.py``): what other threads read."""
        return self.engine.snapshot

    def call_in_engine(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread between two steps."""
        self._loop.put(Call(fn))

    def lora(self, name: str, path: str | None) -> Future[None]:
        """Load LoRA adapter ``name`` from ``path`` (None: unload it) between two steps;
        the future fails with the engine's error (``LoraCache``)."""
        op, future = self._loras.start(name, path)
        self._loop.put(op)
        return future

    def update_shares(
        self, shares: Mapping[str, TenantShare], default: TenantShare, slo: SloPolicy | None = None
    ) -> None:
        """Hand the fair policy new tenant shares, and the autopilot its SLO targets
        (between two steps)."""
        self._loop.put(Shares(dict(shares), default, slo))

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort from any thread; the engine frees the blocks before its next step."""
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        self._loop.put(Abort(ids))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop; streams still open end with ``EngineDead``."""
        self._loop.put(None)
        self._loop.join(timeout)

    # ------------------------------------------------------------------ the sink (engine thread)
    def outputs(self, outputs: Sequence[RequestOutput]) -> None:
        self._streams.deliver_all(outputs)

    def error(self, request_id: str, exc: BaseException) -> None:
        self._streams.deliver(request_id, exc)

    def gone(self, request_ids: Sequence[str]) -> None:
        self._streams.gone(request_ids)

    def published(self) -> None:
        pass  # ``snapshot()`` reads the engine's own reference

    def lora_done(self, token: int, error: BaseException | None) -> None:
        self._loras.done(token, error)

    def dead(self, exc: BaseException, *, shutdown: bool = False) -> None:
        self._loras.fail_all(exc)
        self._streams.fail_all(exc)
        if self.on_dead is not None and not shutdown:
            self.on_dead(exc)
