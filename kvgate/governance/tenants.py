"""The tenants file: API keys (stored as hashes) -> tenants, and what each tenant may use.

TOML (or YAML, by extension)::

    admin_keys = ["sha256:9f86d0..."]          # may call /admin/*; plain keys are hashed on load
    metrics_keys = ["sk-prometheus"]           # may read per-tenant /metrics and /dashboard

    [tenants.search]
    keys = ["sha256:2c26b4...", "sk-search-2"]
    priority = "critical"                      # critical | standard | batch
    weight = 4                                 # fair share against tenants of the same class
    kv_guaranteed = 0.3                        # fraction of the KV pool it can always reclaim
    kv_ceiling = 0.8                           # most of the pool it may ever hold
    requests_per_minute = 600
    tokens_per_minute = 200000                 # prompt + max_tokens, charged at admission
    max_context = 4096                         # prompt + max_tokens
    max_concurrent = 32
    max_queue_time = 10                        # seconds before a queued request is refused
    default_deadline = 60                      # seconds, when the request gives no timeout
    max_deadline = 300                         # caps a request's own timeout
    prefix_isolation = true                    # never share prefix-cache blocks with others
    models = ["smollm2"]                       # the served models it may call (default: all)
    max_files = 1000                           # files it may store (/v1/files)
    max_storage_bytes = 1073741824             # bytes stored: files, their text, indexes
    max_vector_stores = 100                    # vector stores it may have
    max_chunks = 1000000                       # chunks (one vector each), all its stores
    max_store_bytes = 268435456                # bytes of one store's chunks and vectors
    slo = { ttft_p99 = 0.5, itl_p99 = 0.1 }    # this tenant's own SLO (else its class's)

    [slo]                                      # the SLO autopilot (engine/autopilot.py)
    window = 2.0                               # seconds of traffic each judgement looks at
    recover_windows = 3                        # calm windows before a knob moves back
    floor = 0.25                               # no knob below this share of its setting
    [slo.critical]                             # targets per class, in seconds
    ttft_p90 = 0.5
    ttft_p99 = 1.0
    itl_p99 = 0.2

Without a tenants file the server runs open as one ``default`` tenant with no limits.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvgate.engine.autopilot import METRICS as SLO_METRICS
from kvgate.engine.autopilot import SloPolicy, SloTarget
from kvgate.engine.policy import TenantShare
from kvgate.errors import InvalidConfig
from kvgate.settings_file import read_table

DEFAULT_TENANT = "default"
PRIORITIES = {"critical": 0, "standard": 1, "batch": 2}


def _bad(message: str) -> InvalidConfig:
    return InvalidConfig(message, param="tenants")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_key(entry: object, where: str) -> bytes:
    """A key as written in a file: ``sha256:<64 hex>`` or the key itself (hashed here)."""
    if not isinstance(entry, str) or not entry.strip():
        raise _bad(f"{where}: a key must be a non-empty string")
    entry = entry.strip()
    if entry.startswith("sha256:"):
        try:
            digest = bytes.fromhex(entry.removeprefix("sha256:"))
        except ValueError:
            digest = b""
        if len(digest) != 32:
            raise InvalidConfig(
                f"{where}: 'sha256:' must be followed by 64 hex digits", param="tenants"
            )
        return digest
    return key_digest(entry)


@dataclass(frozen=True)
class TenantSpec:
    name: str
    priority: str = "standard"
    weight: float = 1.0
    kv_guaranteed: float = 0.0
    kv_ceiling: float = 1.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_context: int | None = None
    max_concurrent: int | None = None
    max_queue_time: float | None = None
    default_deadline: float | None = None
    max_deadline: float | None = None
    prefix_isolation: bool = True
    #: The served model names this tenant may call; None: every one.
    models: tuple[str, ...] | None = None
    #: Most files the tenant may store (/v1/files), and bytes in all: the files, their
    #: extracted text, and each vector store's chunks with their vectors; None: no limit.
    max_files: int | None = None
    max_storage_bytes: int | None = None
    #: Most vector stores; chunks (one vector each) over all its stores; bytes of one
    #: store's chunks and vectors (docs/quota.py). None: no limit.
    max_vector_stores: int | None = None
    max_chunks: int | None = None
    max_store_bytes: int | None = None
    #: Most responses the tenant may keep stored (``/v1/responses`` with ``store``); None:
    #: no limit but the server's retention.
    max_stored_responses: int | None = None
    #: The tenant's own SLO targets (``[slo.CLASS]`` of its class otherwise); None: its class's.
    slo: SloTarget | None = None

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def priority_rank(self) -> int:
        return PRIORITIES[self.priority]

    def share(self, num_blocks: int) -> TenantShare:
        """This tenant's scheduling entitlement in a pool of ``num_blocks`` blocks."""
        return TenantShare(
            priority=self.priority_rank,
            weight=self.weight,
            guaranteed_blocks=math.floor(self.kv_guaranteed * num_blocks),
            ceiling_blocks=None
            if self.kv_ceiling >= 1.0
            else math.floor(self.kv_ceiling * num_blocks),
        )

    @property
    def cache_salt(self) -> bytes | None:
        """Prefix-cache salt: isolated tenants hash their blocks apart from everyone else's."""
        return f"tenant:{self.name}".encode() if self.prefix_isolation else None

    def deadline_seconds(self, asked: float | None) -> float | None:
        """The request's time limit: its own (capped by the maximum), else the default."""
        if asked is None:
            return self.default_deadline
        return min(asked, self.max_deadline) if self.max_deadline is not None else asked


_SPEC_FIELDS = {f.name: f for f in fields(TenantSpec) if f.name != "name"}
_NUMBER_FIELDS = {
    "weight", "kv_guaranteed", "kv_ceiling", "max_queue_time", "default_deadline", "max_deadline",
}  # fmt: skip
_INT_FIELDS = {
    "requests_per_minute", "tokens_per_minute", "max_context", "max_concurrent", "max_files",
    "max_storage_bytes", "max_vector_stores", "max_chunks", "max_store_bytes",
    "max_stored_responses",
}  # fmt: skip


def _spec(name: str, raw: Mapping[str, Any], where: str) -> TenantSpec:
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "keys":
            continue
        if key not in _SPEC_FIELDS:
            known = ", ".join(["keys", *_SPEC_FIELDS])
            raise InvalidConfig(
                f"{where}: unknown setting {key!r}; known: {known}", param="tenants"
            )
        bad = f"{where}.{key}"
        if key == "priority":
            if value not in PRIORITIES:
                raise InvalidConfig(
                    f"{bad} must be one of {', '.join(PRIORITIES)}, got {value!r}", param="tenants"
                )
        elif key == "models":
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(m, str) and m for m in value)
            ):
                raise _bad(f"{bad} must be a non-empty list of served model names")
            value = tuple(value)
        elif key == "slo":
            value = _slo_target(value, bad)
        elif key == "prefix_isolation":
            if not isinstance(value, bool):
                raise _bad(f"{bad} must be true or false")
        elif key in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidConfig(
                    f"{bad} must be a positive integer, got {value!r}", param="tenants"
                )
        elif key in _NUMBER_FIELDS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise _bad(f"{bad} must be a number >= 0, got {value!r}")
            value = float(value)
        values[key] = value
    spec = TenantSpec(name=name, **values)
    if not spec.weight > 0:
        raise _bad(f"{where}.weight must be positive")
    if not 0 <= spec.kv_guaranteed <= spec.kv_ceiling <= 1:
        raise InvalidConfig(
            f"{where}: need 0 <= kv_guaranteed <= kv_ceiling <= 1, got {spec.kv_guaranteed} "
            f"and {spec.kv_ceiling}",
            param="tenants",
        )
    if (
        spec.max_deadline is not None
        and spec.default_deadline is not None
        and spec.default_deadline > spec.max_deadline
    ):
        raise _bad(f"{where}: default_deadline exceeds max_deadline")
    return spec


@dataclass(frozen=True)
class TenantsConfig:
    """Who is who, and what each may use. Immutable: a reload builds a new one."""

    tenants: Mapping[str, TenantSpec]
    keys: Mapping[bytes, str] = field(default_factory=dict)
    admin_keys: frozenset[bytes] = frozenset()
    source: str | None = None
    #: Keys that may read per-tenant figures (/metrics, /dashboard) but call nothing else.
    metrics_keys: frozenset[bytes] = frozenset()
    #: Keys that name no tenant (``--api-keys-file`` lines with a key alone): each is its own
    #: caller for the prefix cache, so two such keys never share cached blocks.
    unnamed_keys: frozenset[bytes] = frozenset()
    #: The ``[slo]`` table with the tenants' own targets (the engine's autopilot); None: no
    #: target anywhere, the autopilot is off.
    slo: SloPolicy | None = None

    @property
    def open(self) -> bool:
        """No keys configured: every caller is the default tenant."""
        return not self.keys

    @classmethod
    def open_config(cls) -> TenantsConfig:
        return cls({DEFAULT_TENANT: TenantSpec(DEFAULT_TENANT, prefix_isolation=False)})

    @classmethod
    def from_key_table(cls, table: Mapping[bytes, str]) -> TenantsConfig:
        """Keys -> tenant names with default settings (the plain ``--api-keys-file``)."""
        names = set(table.values())
        unnamed = frozenset(k for k, n in table.items() if n == DEFAULT_TENANT)
        return cls({n: TenantSpec(n) for n in names}, dict(table), unnamed_keys=unnamed)

    def spec(self, tenant: str) -> TenantSpec:
        found = self.tenants.get(tenant)
        return found if found is not None else TenantSpec(tenant)

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer KEY`` header; None for a missing/wrong key."""
        if self.open:
            return DEFAULT_TENANT
        digest = _bearer_digest(authorization)
        if digest is None:
            return None
        found = None
        for known, tenant in self.keys.items():  # constant time per key
            if hmac.compare_digest(known, digest):
                found = tenant
        return found

    def key_salt(self, authorization: str | None) -> bytes | None:
        """A per-key prefix-cache salt for keys that name no tenant (None otherwise: a
        tenant's keys share its cache, which its ``prefix_isolation`` keeps from others')."""
        digest = _bearer_digest(authorization)
        if digest is None or digest not in self.unnamed_keys:
            return None
        return b"key:" + digest

    def is_admin(self, authorization: str | None) -> bool:
        digest = _bearer_digest(authorization)
        if digest is None:
            return False
        return any(hmac.compare_digest(known, digest) for known in self.admin_keys)

    def may_observe(self, authorization: str | None) -> bool:
        """Whether the caller may see per-tenant figures (names, tokens, KV blocks, refusals):
        anyone on an open server, else an admin or metrics key."""
        if self.open or self.is_admin(authorization):
            return True
        digest = _bearer_digest(authorization)
        return digest is not None and any(
            hmac.compare_digest(known, digest) for known in self.metrics_keys
        )

    def shares(self, num_blocks: int) -> dict[str, TenantShare]:
        return {name: spec.share(num_blocks) for name, spec in self.tenants.items()}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TenantsConfig:
        """Parse and validate a tenants file; every mistake is named with where it is."""
        where = os.fspath(path)
        data = read_table(path, what="tenants file", param="tenants")
        unknown = set(data) - {"tenants", "admin_keys", "metrics_keys", "slo"}
        if unknown:
            raise InvalidConfig(
                f"{where}: unknown top-level setting(s) {sorted(unknown)}; expected 'tenants', "
                "'admin_keys', 'metrics_keys' and 'slo'",
                param="tenants",
            )
        raw_tenants = data.get("tenants")
        if not isinstance(raw_tenants, dict) or not raw_tenants:
            raise InvalidConfig(
                f"{where}: needs a [tenants.NAME] table per tenant", param="tenants"
            )
        tenants: dict[str, TenantSpec] = {}
        keys: dict[bytes, str] = {}
        for name, raw in raw_tenants.items():
            here = f"{where}: tenants.{name}"
            if not isinstance(raw, dict):
                raise _bad(f"{here} must be a table")
            tenants[name] = _spec(name, raw, here)
            raw_keys = raw.get("keys", [])
            if not isinstance(raw_keys, list):
                raise _bad(f"{here}.keys must be a list")
            for i, entry in enumerate(raw_keys):
                digest = parse_key(entry, f"{here}.keys[{i}]")
                if digest in keys:
                    raise InvalidConfig(
                        f"{here}.keys[{i}] is already the key of tenant {keys[digest]!r}",
                        param="tenants",
                    )
                keys[digest] = name
        if not keys:
            raise _bad(f"{where}: no tenant has any key")
        guaranteed = sum(s.kv_guaranteed for s in tenants.values())
        if guaranteed > 1.0 + 1e-9:
            raise InvalidConfig(
                f"{where}: the kv_guaranteed shares add up to {guaranteed:.2f}, more than the "
                "whole pool",
                param="tenants",
            )
        raw_admin = data.get("admin_keys", [])
        if not isinstance(raw_admin, list):
            raise _bad(f"{where}: admin_keys must be a list")
        admin = frozenset(
            parse_key(k, f"{where}: admin_keys[{i}]") for i, k in enumerate(raw_admin)
        )
        raw_metrics = data.get("metrics_keys", [])
        if not isinstance(raw_metrics, list):
            raise _bad(f"{where}: metrics_keys must be a list")
        metrics = frozenset(
            parse_key(k, f"{where}: metrics_keys[{i}]") for i, k in enumerate(raw_metrics)
        )
        slo = _slo_policy(data.get("slo", {}), tenants, f"{where}: slo")
        return cls(tenants, keys, admin, where, metrics, slo=slo)


def _slo_target(raw: object, where: str) -> SloTarget:
    """``{ttft_p90 = s, ttft_p99 = s, itl_p99 = s}``: any of them, positive seconds."""
    if not isinstance(raw, dict) or not raw:
        raise _bad(f"{where} must be a table of targets ({', '.join(SLO_METRICS)}), in seconds")
    for key, value in raw.items():
        if key not in SLO_METRICS:
            raise _bad(f"{where}: unknown target {key!r}; known: {', '.join(SLO_METRICS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise _bad(f"{where}.{key} must be a positive number of seconds, got {value!r}")
    return SloTarget(**{k: float(v) for k, v in raw.items()})


def _slo_policy(raw: object, tenants: Mapping[str, TenantSpec], where: str) -> SloPolicy | None:
    """The ``[slo]`` table: the autopilot's settings and a table of targets per class; with
    the tenants' own ``slo``. None when no target is set anywhere (the autopilot is off)."""
    if not isinstance(raw, dict):
        raise _bad(f"{where} must be a table")
    settings: dict[str, Any] = {}
    classes: dict[int, SloTarget] = {}
    for key, value in raw.items():
        if key in PRIORITIES:
            classes[PRIORITIES[key]] = _slo_target(value, f"{where}.{key}")
        elif key in ("window", "floor"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise _bad(f"{where}.{key} must be a positive number, got {value!r}")
            if key == "floor" and value > 1:
                raise _bad(f"{where}.floor must be at most 1 (a share of each setting)")
            settings["window_seconds" if key == "window" else key] = float(value)
        elif key == "recover_windows":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(f"{where}.recover_windows must be a positive integer, got {value!r}")
            settings[key] = value
        else:
            known = ", ".join(["window", "recover_windows", "floor", *PRIORITIES])
            raise _bad(f"{where}: unknown setting {key!r}; known: {known}")
    own = {name: spec.slo for name, spec in tenants.items() if spec.slo is not None}
    policy = SloPolicy(
        classes=classes,
        tenants=own,
        class_names={rank: name for name, rank in PRIORITIES.items()},
        **settings,
    )
    return policy if policy.active else None


def _bearer_digest(authorization: str | None) -> bytes | None:
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key_digest(key.strip())
