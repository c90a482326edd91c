"""The models one server serves, and which of them a request goes to.

Each served model has an engine of its own (model, KV pool sized from its part of the memory
budget, scheduler and policy), a door (its tokenizer and context) and a governance gate (its
pool's KV quotas and request slots). A request goes to the model its body names; one that
names none goes to the first model its tenant may use, in the order the models were given.
A tenant limited to some models (``models = [...]`` in the tenants file) is refused the
others with 403 ``model_not_allowed``; a name no model has is 404 ``model_not_found``.

The models load one after another on the loader thread; each serves as soon as it is ready,
and /health is 200 once all are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvgate.engine.front import EngineFront
from kvgate.engine.policy import SchedulingPolicy
from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import StatsListener
from kvgate.errors import EngineDead
from kvgate.governance.tenants import TenantSpec
from kvgate.server.errors import ModelLoading, ModelNotAllowed, ModelNotServed
from kvgate.server.serving import ServingContext

#: Builds one model's engine (on the loading thread), given the listeners it must report to
#: and its scheduling policy (None: FIFO).
EngineLoader = Callable[[Sequence[StatsListener], SchedulingPolicy | None], EngineFront]


@dataclass
class ModelSlot:
    """One served model: how to load it and, once loaded, what serves it. Written only by
    the loader thread (``serving`` or ``load_error``, once each), read by the event loop."""

    name: str
    loader: EngineLoader
    serving: ServingContext | None = None
    load_error: BaseException | None = None

    @property
    def status(self) -> str:
        """``loading``, ``ready``, ``failed`` (it did not load), ``restarting`` (its engine
        process died and a fresh one is loading) or ``dead`` (its engine stopped)."""
        if self.load_error is not None:
            return "failed"
        if self.serving is None:
            return "loading"
        if self.serving.engine.is_running:
            return "ready"
        return "restarting" if self.serving.engine.is_restarting else "dead"

    def check(self) -> ServingContext:
        """What serves this model; else the 503 that says why not."""
        if self.load_error is not None:
            raise EngineDead(f"the model {self.name!r} failed to load: {self.load_error}")
        if self.serving is None:
            raise ModelLoading(f"the model {self.name!r} is still loading; retry shortly")
        if self.serving.engine.is_restarting:
            raise ModelLoading(
                f"the engine of {self.name!r} is restarting after a failure; retry shortly"
            )
        if not self.serving.engine.is_running:
            raise EngineDead(f"the engine of {self.name!r} has stopped; restart the server")
        return self.serving

    def snapshot(self) -> EngineSnapshot | None:
        return self.serving.engine.snapshot() if self.serving is not None else None


class ServedModels:
    """The server's models by served name, in the order given (the first is the default)."""

    def __init__(self, slots: Sequence[ModelSlot]) -> None:
        if not slots:
            raise ValueError("a server needs at least one model")
        self.slots = {slot.name: slot for slot in slots}
        if len(self.slots) != len(slots):
            raise ValueError("two models have the same served name")

    def __iter__(self) -> Iterator[ModelSlot]:
        return iter(self.slots.values())

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    @property
    def default(self) -> ModelSlot:
        return next(iter(self.slots.values()))

    def allowed(self, spec: TenantSpec) -> list[ModelSlot]:
        return [slot for slot in self if spec.allows(slot.name)]

    def adapter(self, name: str) -> ModelSlot | None:
        """The loaded model that has LoRA adapter ``name`` (None: none has)."""
        for slot in self:
            if slot.serving is not None and name in slot.serving.loras:
                return slot
        return None

    def slot_for(self, model: str | None, spec: TenantSpec) -> ModelSlot:
        """The slot a request naming ``model`` (None: none) goes to, for tenant ``spec``;
        raises 404 for a name no model has and 403 for one the tenant may not use. A LoRA
        adapter's name goes to the model that has it (an allow-list names adapters as
        models)."""
        if model is None:
            allowed = self.allowed(spec)
            if not allowed:
                raise ModelNotAllowed(self.default.name, spec.name, spec.models or ())
            return allowed[0]
        slot = self.slots.get(model) or self.adapter(model)
        if slot is None:
            raise ModelNotServed(model, [s.name for s in self.allowed(spec)] or self.names)
        if not spec.allows(model):
            raise ModelNotAllowed(model, spec.name, [s.name for s in self.allowed(spec)])
        return slot

    def route(self, model: str | None, spec: TenantSpec) -> ServingContext:
        """What serves a request naming ``model`` for tenant ``spec`` (see ``slot_for``);
        503 while that model loads or after its engine failed."""
        ctx = self.slot_for(model, spec).check()
        if model is not None and model not in self.slots and model in ctx.loras:
            return ctx.for_lora(model)
        return ctx

    def snapshots(self) -> dict[str, EngineSnapshot]:
        """Each loaded model's latest engine snapshot, by served name."""
        out = {}
        for slot in self:
            snap = slot.snapshot()
            if snap is not None:
                out[slot.name] = snap
        return out

    @property
    def all_ready(self) -> bool:
        return all(slot.status == "ready" for slot in self)
