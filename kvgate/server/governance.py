"""The server's side of tenant governance: who the caller is, what its request may use, and
the refusals counted by reason. The scheduling itself happens in the engine's policy.

A reload (SIGHUP or ``POST /admin/reload``) swaps the tenants config atomically: requests
already admitted keep running; an invalid file is refused with its error and the old config
stays in force.

A server of several models has one engine, KV pool and scheduling policy per model: each is
attached under its served name with a ``TenantGate`` of its own (KV ceilings and queue
shares are shares of that model's pool and slots), while the tenants' rates and
``max_concurrent`` are one ``TenantRates`` for the whole server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.autopilot import SloPolicy
from kvgate.engine.policy import TenantShare
from kvgate.engine.request import Request
from kvgate.engine.snapshot import EngineSnapshot, TenantSnapshot
from kvgate.errors import InvalidConfig, KVGateError
from kvgate.governance.admission import RateBuckets, TenantGate, TenantRates, Ticket
from kvgate.governance.tenants import TenantsConfig, TenantSpec

#: Hands a model's fair policy the tenants' shares (on the engine's side, between steps).
ShareUpdate = Callable[[Mapping[str, TenantShare], TenantShare, SloPolicy | None], None]

log = logging.getLogger("kvgate.server")


@dataclass(frozen=True)
class RequestContext:
    """Per-request governance fields handed to the engine with each choice."""

    tenant: str = "default"
    cache_salt: bytes | None = None
    deadline: float | None = None  # time.monotonic()
    queue_deadline: float | None = None


@dataclass
class Admission:
    """Tickets of one HTTP request's choices; ``release`` once it is over (idempotent)."""

    tickets: list[Ticket]
    #: Tokens each choice used (prompt + output); what it did not use is given back.
    used: dict[int, int] = field(default_factory=dict)

    def release(self) -> None:
        for i, ticket in enumerate(self.tickets):
            ticket.release(self.used.get(i))


@dataclass(frozen=True)
class _Pool:
    """One model's engine, as governance sees it."""

    gate: TenantGate
    #: Hands the engine's fair policy new shares; None: the engine schedules FIFO.
    update_shares: ShareUpdate | None

    @property
    def num_blocks(self) -> int:
        return self.gate.num_blocks


class Governance:
    def __init__(
        self,
        tenants: TenantsConfig,
        tenants_file: str | None = None,
        metrics_keys: frozenset[bytes] = frozenset(),
        buckets: RateBuckets | None = None,
    ) -> None:
        """``metrics_keys``: digests of keys given on the command line that may read
        per-tenant figures; they survive reloads of the tenants file. ``buckets``: where the
        tenants' rates are kept (default: in this process; see ``TenantRates``)."""
        self.extra_metrics_keys = metrics_keys
        self.tenants = self._with_metrics_keys(tenants)
        self.tenants_file = tenants_file
        #: Rate buckets and requests in flight per tenant, across every model.
        self.rates = TenantRates(buckets=buckets)
        self._pools: dict[str, _Pool] = {}  # by served model name, as attached
        self.refusals: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()  # reload may come from a signal handler's thread

    def attach(
        self,
        model: str,
        num_blocks: int,
        block_size: int,
        update_shares: ShareUpdate | None,
        blocks_for: Callable[[int], int] | None = None,
    ) -> None:
        """``model``'s engine is ready: size quotas against its pool and hand its policy the
        shares. ``blocks_for``: see ``TenantGate``."""
        gate = TenantGate(num_blocks, block_size, blocks_for=blocks_for, rates=self.rates)
        pool = _Pool(gate, update_shares)
        with self._lock:
            self._pools[model] = pool
            self._push_shares(pool, self.tenants)

    def gate(self, model: str) -> TenantGate | None:
        """``model``'s admission gate; None until its engine is attached."""
        pool = self._pools.get(model)
        return pool.gate if pool is not None else None

    def _with_metrics_keys(self, tenants: TenantsConfig) -> TenantsConfig:
        if not self.extra_metrics_keys:
            return tenants
        return dataclasses.replace(
            tenants, metrics_keys=tenants.metrics_keys | self.extra_metrics_keys
        )

    def spec(self, tenant: str) -> TenantSpec:
        return self.tenants.spec(tenant)

    def context(
        self, tenant: str, timeout: float | None, authorization: str | None = None
    ) -> RequestContext:
        """``authorization``: the caller's header, for the per-key salt of a key that names
        no tenant (``TenantsConfig.key_salt``)."""
        spec = self.spec(tenant)
        key_salt = self.tenants.key_salt(authorization)
        now = time.monotonic()
        limit = spec.deadline_seconds(timeout)
        return RequestContext(
            tenant=tenant,
            cache_salt=key_salt if key_salt is not None else spec.cache_salt,
            deadline=None if limit is None else now + limit,
            queue_deadline=None if spec.max_queue_time is None else now + spec.max_queue_time,
        )

    def admit(
        self, tenant: str, requests: Sequence[Request], *, model: str, paid: bool = False
    ) -> Admission:
        """Admit every choice into ``model``'s engine, or none (raises the refusal, counted
        by its code). ``paid``: the choices' requests were charged at the door
        (``TenantRates.charge_requests``)."""
        gate = self.gate(model)
        assert gate is not None, "admission before the engine is ready"
        sizes = [(r.num_prompt_tokens, r.params.max_tokens) for r in requests]
        try:
            tickets = gate.admit_all(self.spec(tenant), sizes, paid=paid)
        except KVGateError as exc:
            self.count_refusal(tenant, exc.code)
            raise
        return Admission(tickets)

    def check_queue_share(self, tenant: str, n: int, capacity: int | None, model: str) -> None:
        """See ``TenantGate.check_queue_share`` (``model``'s slots); nothing to check without
        a queue limit."""
        gate = self.gate(model)
        if gate is None or capacity is None:
            return
        tenants = self.tenants
        gate.check_queue_share(tenants.spec(tenant), n, capacity, lambda t: tenants.spec(t).weight)

    def room_for(self, tenant: str, prompt_tokens: int, model: str) -> int | None:
        """See ``TenantGate.room_for`` (``model``'s pool); None before its engine is ready or
        without limits."""
        gate = self.gate(model)
        return gate.room_for(self.spec(tenant), prompt_tokens) if gate is not None else None

    def count_refusal(self, tenant: str, reason: str) -> None:
        self.refusals[(tenant, reason)] += 1

    def reload(self) -> TenantsConfig:
        """Re-read the tenants file; raises ``InvalidConfig`` (old config kept) when invalid."""
        if self.tenants_file is None:
            raise InvalidConfig("no tenants file to reload (start with --tenants FILE)")
        with self._lock:
            new = self._with_metrics_keys(TenantsConfig.load(self.tenants_file))
            self.tenants = new
            for pool in self._pools.values():
                self._push_shares(pool, new)
        log.info("tenants reloaded from %s: %s", self.tenants_file, ", ".join(sorted(new.tenants)))
        return new

    def report(self, snapshots: Mapping[str, EngineSnapshot]) -> dict[str, dict[str, Any]]:
        """Per-tenant accounting and quota use (for /admin/tenants and /metrics), from each
        model's latest engine snapshot (absent: not loaded yet) and this server's refusals.

        Each row has the tenant's figures over all models, and under ``models`` those of
        each model whose engine is attached (KV blocks and quotas are per pool)."""
        tenants = self.tenants
        refusal_items = list(self.refusals.items())  # a copy: the event loop adds to it
        pools = dict(self._pools)
        names = set(tenants.tenants) | {t for (t, _), _ in refusal_items}
        for snap in snapshots.values():
            names |= set(snap.tenants)
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(names):
            spec = tenants.spec(name)
            per_model = {
                model: _model_row(spec, pool, snapshots.get(model)) for model, pool in pools.items()
            }
            finished: Counter[str] = Counter()
            for row in per_model.values():
                finished.update(row["finished"])
            out[name] = {
                "priority": spec.priority,
                "weight": spec.weight,
                **{key: _total(per_model, key) for key in _SUMMED},
                "in_flight": self.rates.in_flight(name),
                "finished": dict(finished),
                "refusals": {r: n for (t, r), n in refusal_items if t == name},
                "models": per_model,
            }
        return out

    def _push_shares(self, pool: _Pool, tenants: TenantsConfig) -> None:
        if pool.update_shares is not None:
            pool.update_shares(tenants.shares(pool.num_blocks), TenantShare(), tenants.slo)


#: Per-model figures that add up over models in a tenant's row.
_SUMMED = (
    "kv_blocks_held", "kv_guaranteed_blocks", "kv_ceiling_blocks", "running", "waiting",
    "prompt_tokens", "generation_tokens", "kv_block_seconds", "prefix_cache_queries",
    "prefix_cache_hits",
)  # fmt: skip


def _total(rows: Mapping[str, Mapping[str, Any]], key: str) -> Any:
    total = sum(row[key] for row in rows.values())
    return round(total, 3) if isinstance(total, float) else total


def _model_row(spec: TenantSpec, pool: _Pool, snap: EngineSnapshot | None) -> dict[str, Any]:
    share = spec.share(pool.num_blocks)
    row = (snap.tenants.get(spec.name) if snap is not None else None) or TenantSnapshot()
    return {
        "kv_blocks_held": row.kv_blocks,
        "kv_guaranteed_blocks": share.guaranteed_blocks,
        "kv_ceiling_blocks": (
            share.ceiling_blocks if share.ceiling_blocks is not None else pool.num_blocks
        ),
        "running": row.running,
        "waiting": row.waiting,
        "in_flight": pool.gate.in_flight(spec.name),
        "prompt_tokens": row.prompt_tokens,
        "generation_tokens": row.generation_tokens,
        "kv_block_seconds": round(row.kv_block_seconds, 3),
        "prefix_cache_queries": row.prefix_queries,
        "prefix_cache_hits": row.prefix_hits,
        "finished": dict(row.finished),
    }
