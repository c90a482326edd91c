"""An immutable picture of the engine, taken on the engine thread after everything that
changes what it shows (a step, an add, an abort), and published by swapping one reference.

Other threads (``/metrics``, ``/admin/tenants``, ``/dashboard``) read only this: every figure
in one snapshot comes from the same moment, so none of them can show a request in two
states or in none (``running + waiting + finished == added`` always holds), and none of them
walks a list the engine is changing.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvgate.engine.autopilot import AutopilotState
from kvgate.engine.offload import TierState

if TYPE_CHECKING:
    from kvgate.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class TenantSnapshot:
    kv_blocks: int = 0
    running: int = 0
    waiting: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    kv_block_seconds: float = 0.0
    finished: Mapping[str, int] = field(default_factory=dict)  # finish reason -> requests

    def __reduce__(self) -> tuple[Any, ...]:
        return (_thaw, (type(self), _plain(self)))


@dataclass(frozen=True)
class EngineSnapshot:
    taken_at: float  # time.monotonic()
    steps: int
    #: Requests handed to the scheduler, and those that ended there (any way).
    added: int
    finished: int
    running: int
    waiting: int
    running_spare: int
    kv_blocks: int
    kv_used: int
    kv_cached: int  # free, but holding a reusable prefix
    kv_fragmentation: float
    kv_window_freed: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    preemptions_by_reason: Mapping[str, int]
    recoveries: int
    tenants: Mapping[str, TenantSnapshot]
    build_info: Mapping[str, str]  # what runs each op (fixed at load)
    #: The pool's size (fixed at load): tokens it holds, and the bytes a token of KV costs
    #: across every layer, as the model's KV specs lay it out (``kv_spec.py``).
    kv_capacity_tokens: int = 0
    kv_bytes_per_token: int = 0
    #: KV bytes the running requests' blocks hold per token of their context: what a token
    #: really costs with sliding windows and compressed entries (0: nothing running).
    kv_held_bytes_per_token: float = 0.0
    #: The second KV tier's figures (None: no tier), and requests loading from it.
    kv_tier: TierState | None = None
    kv_loading: int = 0
    #: The SLO autopilot's knobs, targets and last window (``engine/autopilot.py``); None
    #: while no target is set.
    autopilot: AutopilotState | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled for the front end when the engine runs in a process of its own: the
        # read-only mappings travel as dicts and are made read-only again on arrival.
        return (_thaw, (type(self), _plain(self)))

    @property
    def kv_free(self) -> int:
        """Free blocks holding nothing reusable."""
        return self.kv_blocks - self.kv_used - self.kv_cached

    @property
    def kv_usage(self) -> float:
        return self.kv_used / max(self.kv_blocks, 1)

    @staticmethod
    def capture(engine: LLMEngine) -> EngineSnapshot:
        """On the engine thread only."""
        sched, kv, ledger = engine.scheduler, engine.kv_cache, engine.ledger
        pool = kv.pool
        running: Counter[str] = Counter(r.tenant for r in sched.running)
        # A request loading its prefix from the KV tier waits: it computes nothing yet.
        waiting: Counter[str] = Counter(r.tenant for r in (*sched.waiting, *sched.loading.values()))
        finished: dict[str, dict[str, int]] = {}
        for (tenant, reason), n in ledger.finished.items():
            finished.setdefault(tenant, {})[reason] = n
        names = (
            set(running) | set(waiting) | set(kv.tenant_blocks) | set(ledger.prompt_tokens)
            | set(finished) | set(kv.tenant_prefix_queries)
        )  # fmt: skip
        tenants = {
            name: TenantSnapshot(
                kv_blocks=kv.tenant_blocks.get(name, 0),
                running=running[name],
                waiting=waiting[name],
                prefix_queries=kv.tenant_prefix_queries.get(name, 0),
                prefix_hits=kv.tenant_prefix_hits.get(name, 0),
                prompt_tokens=ledger.prompt_tokens[name],
                generation_tokens=ledger.generation_tokens[name],
                kv_block_seconds=ledger.block_seconds.get(name, 0.0),
                finished=MappingProxyType(finished.get(name, {})),
            )
            for name in names
        }
        return EngineSnapshot(
            taken_at=time.monotonic(),
            steps=engine.num_steps,
            added=sched.num_added,
            finished=sched.num_finished,
            running=len(sched.running),
            waiting=len(sched.waiting) + len(sched.loading),
            running_spare=len(sched.spare),
            kv_blocks=pool.num_blocks,
            kv_used=pool.num_used_blocks,
            kv_cached=pool.num_free_cached_blocks(),
            kv_fragmentation=kv.fragmentation(sched.running),
            kv_window_freed=kv.num_window_freed,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
            preemptions=sched.num_preemptions,
            preemptions_by_reason=MappingProxyType(dict(sched.preemptions_by_reason)),
            recoveries=engine.num_recoveries,
            tenants=MappingProxyType(tenants),
            build_info=MappingProxyType(dict(getattr(engine, "build_info", {}))),
            kv_capacity_tokens=engine.kv_pool.num_tokens,
            kv_bytes_per_token=engine.kv_pool.bytes // max(engine.kv_pool.num_tokens, 1),
            kv_held_bytes_per_token=kv.held_bytes_per_token(
                sched.running, engine.kv_pool.bytes // max(pool.num_blocks, 1)
            ),
            kv_tier=kv.tier.state() if kv.tier_enabled else None,
            kv_loading=len(sched.loading),
            autopilot=pilot.state()
            if (pilot := getattr(engine, "autopilot", None)) and pilot.active
            else None,
        )


def _plain(snapshot: TenantSnapshot | EngineSnapshot) -> dict[str, Any]:
    return {
        f.name: dict(v) if isinstance(v := getattr(snapshot, f.name), MappingProxyType) else v
        for f in dataclasses.fields(snapshot)
    }


def _thaw(cls: type[Any], fields: dict[str, Any]) -> Any:
    return cls(**{k: MappingProxyType(v) if isinstance(v, dict) else v for k, v in fields.items()})
