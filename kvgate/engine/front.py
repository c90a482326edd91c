"""What the server needs of an engine, wherever it runs: ``AsyncLLM`` (a thread of this
process) and ``EngineClient`` (a process of its own) are both an ``EngineFront``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

from kvgate.config import EngineConfig
from kvgate.engine.autopilot import SloPolicy
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.policy import TenantShare
from kvgate.engine.request import Request
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.streams import OnAbandoned
from kvgate.model.config import ModelConfig
from kvgate.sampling_params import SamplingParams
from kvgate.structured.compiler import GrammarCompiler
from kvgate.tokenizer import Tokenizer


class KVPool(Protocol):
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


class EngineView(Protocol):
    """The engine's fixed facts and its request validation (``LLMEngine``, or
    ``RemoteEngine`` on the front end's side of a process boundary)."""

    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    grammars: GrammarCompiler
    load_seconds: float
    build_info: dict[str, str]

    @property
    def kv_pool(self) -> KVPool: ...
    @property
    def source(self) -> str | Path: ...

    def blocks_for(self, num_tokens: int) -> int: ...

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        *,
        cache_salt: bytes | None = None,
        tenant: str = "default",
        deadline: float | None = None,
        queue_deadline: float | None = None,
    ) -> Request: ...


class EngineFront(Protocol):
    on_dead: Callable[[BaseException], None] | None

    @property
    def engine(self) -> EngineView: ...
    @property
    def is_running(self) -> bool: ...
    @property
    def is_restarting(self) -> bool:
        """The engine died and a fresh one is loading (it will take requests again)."""
        ...

    @property
    def num_restarts(self) -> int:
        """Times the engine was started again after it died (its process killed)."""
        ...

    @property
    def num_in_flight(self) -> int: ...
    @property
    def capacity(self) -> int | None: ...

    def check_capacity(self, num_new: int = 1, in_flight: int | None = None) -> None: ...
    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: bytes | None = None,
    ) -> AsyncIterator[RequestOutput]: ...
    def stream(
        self, request: Request, on_abandoned: OnAbandoned | None = None
    ) -> AsyncIterator[RequestOutput]: ...
    def snapshot(self) -> EngineSnapshot: ...
    def update_shares(
        self, shares: Mapping[str, TenantShare], default: TenantShare, slo: SloPolicy | None = None
    ) -> None: ...
    def abort(self, request_id: str | Sequence[str]) -> None: ...
    def shutdown(self, timeout: float = 10.0) -> None: ...
    def lora(self, name: str, path: str | None) -> Future[None]:
        """Load LoRA adapter ``name`` from directory ``path`` (None: unload it) between two
        steps (``engine/lora_ops.py``); the future fails with the engine's refusal."""
        ...
