"""What serves one model in the server: its engine, name, door, governance and ledger."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import kvgate
from kvgate.engine.front import EngineFront
from kvgate.engine.lineage import ModelVersion
from kvgate.governance.usage import UsageLedger
from kvgate.server.door import Door
from kvgate.server.governance import Governance
from kvgate.server.tracing import NoTracing, Tracing
from kvgate.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServingContext:
    """One served model, as a request handler needs it; a server of several models has one
    per model (``server/models.py`` picks it by the request's ``model``)."""

    engine: EngineFront
    served_model_name: str
    governance: Governance
    door: Door
    usage: UsageLedger
    tracing: Tracing | NoTracing = field(default_factory=NoTracing)
    #: What the model is (``engine/lineage.py``); None: not computed (tests' fakes).
    version: ModelVersion | None = None
    #: Makes engine request ids unique even when clients reuse an x-request-id.
    ids: itertools.count[int] = field(default_factory=itertools.count)
    #: The LoRA adapters the engine has, name -> directory (``--lora-modules`` and those
    #: loaded while serving); a request names one as its ``model``. Shared by the copies
    #: ``for_lora`` makes.
    loras: dict[str, str] = field(default_factory=dict)
    #: The adapter this request runs with (a copy made by ``for_lora``); None: the base.
    lora_name: str | None = None

    def for_lora(self, name: str) -> ServingContext:
        """This model's context for a request on its adapter ``name``."""
        return dataclasses.replace(self, lora_name=name)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def model_version(self) -> str:
        """What served the request: the lineage id (for usage records, the access log,
        traces and the ``x-kvgate-model-version`` header)."""
        if self.version is not None:
            return self.version.id
        return f"{self.served_model_name}@kvgate-{kvgate.__version__}"
