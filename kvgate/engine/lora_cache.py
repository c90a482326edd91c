"""The engine's LoRA adapters: registered by name, loaded on first use, kept resident in an
LRU under a memory cap.

A request names its adapter (``SamplingParams.lora``); ``LLMEngine.add`` takes it from here
(``acquire``): loaded (``model/lora.py``, checked against the engine's model) unless
resident, then most recently used. Resident adapters are evicted least recently used first
while their bytes (``LoraAdapter.nbytes``: float32 factors) exceed ``max_bytes``, but never
one that a request still in the scheduler (waiting, running or preempted) uses: ``in_use``
says which names those are. An adapter that cannot fit beside the ones in use is refused.

Each adapter has a cache salt (``salt``): its name and the SHA-256 of its weights file, so
KV blocks computed under one adapter are never a prefix-cache hit for another or the base.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from kvgate.errors import InvalidConfig, InvalidRequest, KVGateError
from kvgate.model.config import ModelConfig
from kvgate.model.lora import PARAM, LoraAdapter

#: The weights file whose digest keys an adapter's cached KV blocks.
WEIGHTS_FILE = "adapter_model.safetensors"


class LoraNotFound(KVGateError):
    """No adapter is registered under this name (404 at the API)."""

    code = "model_not_found"


class LoraExists(InvalidRequest):
    """An adapter is already registered under this name (400 at the API, as vLLM)."""

    code = "lora_exists"


class LoraMemoryFull(InvalidRequest):
    """The adapter does not fit under the memory cap beside the adapters in use."""

    code = "lora_memory_full"


def weights_digest(path: Path) -> bytes:
    """SHA-256 of the adapter directory's weights file (32 bytes)."""
    h = hashlib.sha256()
    with open(path / WEIGHTS_FILE, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.digest()


class LoraCache:
    """Adapters by name (``register``), the resident ones in LRU order (``acquire``)."""

    def __init__(
        self,
        config: ModelConfig,
        max_bytes: int,
        in_use: Callable[[], Collection[str]],
        *,
        supported: bool = True,
        model_name: str = "the model",
        device: torch.device | str = "cpu",
    ) -> None:
        """``max_bytes``: the cap on resident adapters' bytes; ``in_use``: names of the
        adapters requests in the engine use (never evicted); ``supported``: whether the
        model class applies adapters (``DecoderModel.supports_lora``)."""
        self.config = config
        self.max_bytes = max_bytes
        self.in_use = in_use
        self.supported = supported
        self.model_name = model_name
        self.device = torch.device(device)
        self.paths: dict[str, Path] = {}
        self._salts: dict[str, bytes] = {}
        self.resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        #: Adapters loaded from disk since start (a reload after eviction counts again).
        self.num_loads = 0

    @property
    def resident_bytes(self) -> int:
        return sum(a.nbytes for a in self.resident.values())

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Add adapter ``name`` from directory ``path``, loaded now so a bad one is refused
        at once (``InvalidConfig``: naming the tensor and shapes that do not fit);
        ``LoraExists`` for a name already registered."""
        if not self.supported:
            raise InvalidConfig(
                f"{self.model_name} ({self.config.architecture}) does not support LoRA adapters",
                param=PARAM,
            )
        if not name or name in self.paths:
            raise LoraExists(
                f"a LoRA adapter named {name!r} is already loaded"
                if name
                else "lora_name must not be empty",
                param="lora_name",
            )
        p = Path(path)
        if not p.is_dir():
            raise InvalidConfig(
                f"LoRA adapter {name!r}: {str(p)!r} is not a directory", param="lora_path"
            )
        self.paths[name] = p
        try:
            return self.acquire(name)
        except BaseException:
            del self.paths[name]
            raise

    def unregister(self, name: str) -> None:
        """Forget adapter ``name`` (``LoraNotFound`` where there is none). Requests that
        use it keep their copy until they end."""
        if name not in self.paths:
            raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        del self.paths[name]
        self._salts.pop(name, None)
        self.resident.pop(name, None)

    def acquire(self, name: str) -> LoraAdapter:
        """Adapter ``name``, loaded where it is not resident, now the most recently used;
        others not in use evicted while over the cap. ``LoraNotFound``, ``InvalidConfig``
        (a file that no longer fits), ``LoraMemoryFull``."""
        if name not in self.paths:
            raise LoraNotFound(f"no LoRA adapter named {name!r} is loaded", param="model")
        adapter = self.resident.get(name)
        if adapter is not None:
            self.resident.move_to_end(name)
            return adapter
        path = self.paths[name]
        adapter = LoraAdapter(path, self.config, name=name, device=self.device)
        self._salts[name] = name.encode() + b"\0" + weights_digest(path)
        self.num_loads += 1
        self._make_room(name, adapter.nbytes)
        self.resident[name] = adapter
        return adapter

    def _make_room(self, name: str, nbytes: int) -> None:
        """Evict least recently used adapters not in use until ``nbytes`` more fit."""
        busy = set(self.in_use())
        for other in list(self.resident):
            if self.resident_bytes + nbytes <= self.max_bytes:
                break
            if other not in busy:
                del self.resident[other]
        if self.resident_bytes + nbytes > self.max_bytes:
            raise LoraMemoryFull(
                f"LoRA adapter {name!r} needs {nbytes} bytes; {self.resident_bytes} of the "
                f"{self.max_bytes} allowed (--max-lora-memory) are held by adapters in use",
                param="model",
            )

    def salt(self, name: str) -> bytes:
        """The adapter's share of a request's cache salt: its name and weights digest (it
        must have been acquired)."""
        return self._salts[name]
