"""The SLO autopilot: the engine turns its own knobs to hold latency targets.

Operators write targets per priority class (and per tenant) in the tenants file: time to first
token at p90 / p99 and the gap between tokens at p99, in seconds (``SloPolicy``). The engine
hands every token's latency to ``Autopilot.observe``; at the end of each window
(``SloPolicy.window_seconds``) the autopilot compares each SLO group's percentiles with its
targets and moves one stage:

- a breach of inter-token p99: the step is too long (on a memory-bound CPU a step costs a
  fixed part plus a part per token it runs). Cut the prefill chunk and the per-step token
  budget by the breach's ratio (0.9 x target / observed, at least halved); with both at their
  floors, run a quarter fewer sequences (not while a TTFT target is missed too);
- a breach of a TTFT target alone: queueing, not long steps. A sequence cap lowered before
  goes up a stage (it is what holds new requests back); the step is never shrunk for it;
- any breach of a class that has lower classes below it: hold the lower classes' new work (a
  held tenant with nothing running may still start one request, so every class keeps
  progressing; its running requests go on);
- ``recover_windows`` windows in a row with every group within ``RELAX_MARGIN`` of its
  targets, or without traffic: one stage back towards the configured values (one more class
  admitted, the sequence cap up a stage, chunk and budget doubled). Windows between the margin
  and the target change nothing (a band). A step back that a breach follows at once doubles
  the calm windows the next one waits for (up to ``MAX_RELAX_WAIT``), so under a steady load
  the knobs settle where the targets hold instead of flapping; ``recover_windows`` windows
  without traffic reset the wait.

A request still without its first token older than its group's TTFT target counts as a
sample at its age: a queue that never drains is a breach before its requests are served.

Floors keep throughput from collapsing: no knob goes below ``SloPolicy.floor`` times its
configured value, and the token budget never below the sequences that may run (each running
sequence keeps its decode row in every step). Pure Python and clock-driven: no tensors, no
threads; the engine owns one and the scheduler reads its ``knobs``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

log = logging.getLogger("kvgate.engine")

#: A window counts towards relaxing only with every observed figure at most this share of its
#: target: between it and the target, the knobs stay where they are.
RELAX_MARGIN = 0.8
#: Each tightening runs this share of the sequences it ran before (once chunk and budget are
#: at their floors).
RUNNING_STEP = 0.75
#: The most calm windows a step back may wait for (see ``Autopilot._relax_wait``).
MAX_RELAX_WAIT = 64
#: Adjustments kept for the dashboard and ``/admin``.
HISTORY = 32
METRICS = ("ttft_p90", "ttft_p99", "itl_p99")


@dataclass(frozen=True)
class SloTarget:
    """One group's targets, in seconds; None: no target on that figure."""

    ttft_p90: float | None = None
    ttft_p99: float | None = None
    itl_p99: float | None = None

    def __post_init__(self) -> None:
        for name in METRICS:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in METRICS)

    def items(self) -> Iterable[tuple[str, float]]:
        """(metric, seconds) of the targets set."""
        for name in METRICS:
            value = getattr(self, name)
            if value is not None:
                yield name, value


@dataclass(frozen=True)
class SloPolicy:
    """What the tenants file says: targets per class rank (0 = critical) and per tenant,
    and how the autopilot moves."""

    classes: Mapping[int, SloTarget] = field(default_factory=dict)
    tenants: Mapping[str, SloTarget] = field(default_factory=dict)
    #: Rank -> the class's name (labels in metrics and logs).
    class_names: Mapping[int, str] = field(default_factory=dict)
    window_seconds: float = 2.0
    recover_windows: int = 3
    floor: float = 0.25

    def __post_init__(self) -> None:
        if not self.window_seconds > 0:
            raise ValueError(f"window must be positive, got {self.window_seconds!r}")
        if self.recover_windows < 1:
            raise ValueError(f"recover_windows must be >= 1, got {self.recover_windows!r}")
        if not 0 < self.floor <= 1:
            raise ValueError(f"floor must be in (0, 1], got {self.floor!r}")

    @property
    def active(self) -> bool:
        """Some target is set: without one the autopilot never moves a knob."""
        return any(not t.empty for t in (*self.classes.values(), *self.tenants.values()))

    def group_of(self, tenant: str, rank: int) -> tuple[str, SloTarget] | None:
        """The SLO group ``tenant`` (of class ``rank``) is judged in: its own targets
        (``tenant:NAME``), else its class's; None: no target applies to it."""
        own = self.tenants.get(tenant)
        if own is not None and not own.empty:
            return f"tenant:{tenant}", own
        target = self.classes.get(rank)
        if target is None or target.empty:
            return None
        return self.class_names.get(rank, str(rank)), target


@dataclass(frozen=True)
class Knobs:
    """What the scheduler runs with. ``held``: tenants of classes held for a higher one's
    SLO; each admits a new request only while it has none running."""

    token_budget: int
    chunk_size: int
    max_running: int
    held: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Adjustment:
    """One move of the autopilot, for logs, metrics and the dashboard."""

    at: float  # the engine's clock
    direction: str  # "tighten" | "relax"
    reason: str
    knobs: Knobs


@dataclass(frozen=True)
class AutopilotState:
    """What the snapshot shows: the knobs, the configured values, the last window's figures
    per group, and the counters (``kvgate:slo_*``)."""

    active: bool
    knobs: Knobs
    configured: Knobs
    held_ranks: tuple[int, ...]
    #: Group -> metric -> (target, observed in the last window; None: no sample).
    groups: Mapping[str, Mapping[str, tuple[float, float | None]]]
    breaches: Mapping[tuple[str, str], int]
    adjustments: Mapping[tuple[str, str], int]  # (knob, "tighten" | "relax") -> times
    windows: int
    history: tuple[Adjustment, ...]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1]): the smallest value with at least q of the
    values at or below it; the maximum of fewer than 1/(1-q) values."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


class Autopilot:
    """See the module docstring. ``configured``: the engine's knobs as started;
    ``num_spare``: sequences that may run beyond ``max_running`` (the scheduler's spare
    slots), which the token budget's floor leaves a row for too."""

    def __init__(self, configured: Knobs, num_spare: int = 0, start: float = 0.0) -> None:
        self.configured = configured
        self.num_spare = num_spare
        self.knobs = configured
        self.policy = SloPolicy()
        self._ranks: dict[str, int] = {}
        self._default_rank = 1
        #: Classes above (numerically after) this rank are held; None: none is.
        self._admit_through: int | None = None
        self._window_start = start
        self._ttft: dict[str, list[float]] = {}
        self._itl: dict[str, list[float]] = {}
        self._ok_streak = 0
        #: Calm windows needed before a step back: ``recover_windows``, doubled each time a
        #: step back is followed by a breach within ``recover_windows`` (so the knobs do not
        #: flap between a setting that holds the targets and one that does not), and back to
        #: ``recover_windows`` after as many windows without any traffic.
        self._relax_wait = 1
        self._since_relax: int | None = None
        self._quiet_streak = 0
        self.windows = 0
        self.last: dict[str, dict[str, tuple[float, float | None]]] = {}
        self.breaches: Counter[tuple[str, str]] = Counter()
        self.adjustments: Counter[tuple[str, str]] = Counter()
        self.history: deque[Adjustment] = deque(maxlen=HISTORY)
        self._state: AutopilotState | None = None  # ``state()``, until something changes

    # ------------------------------------------------------------------ configuration
    def configure(self, policy: SloPolicy, ranks: Mapping[str, int], default_rank: int) -> None:
        """New targets and tenants' classes (a tenants-file reload). Without any target the
        knobs go straight back to their configured values."""
        self._state = None
        self.policy = policy
        self._relax_wait = policy.recover_windows
        self._ranks = dict(ranks)
        self._default_rank = default_rank
        if not policy.active:
            self._admit_through = None
            self.knobs = self.configured
            self._ok_streak = 0
        else:
            self.knobs = replace(self.knobs, held=self._held_tenants())

    @property
    def active(self) -> bool:
        return self.policy.active

    def rank(self, tenant: str) -> int:
        return self._ranks.get(tenant, self._default_rank)

    # ------------------------------------------------------------------ observations
    def observe(
        self, ttfts: Iterable[tuple[str, float]], itls: Iterable[tuple[str, float]]
    ) -> None:
        """A step's latency samples, (tenant, seconds) each."""
        if not self.active:
            return
        for samples, into in ((ttfts, self._ttft), (itls, self._itl)):
            for tenant, seconds in samples:
                found = self.policy.group_of(tenant, self.rank(tenant))
                if found is not None:
                    into.setdefault(found[0], []).append(seconds)

    def due(self, now: float) -> bool:
        """A window has ended: ``tick`` would judge it."""
        return self.active and now - self._window_start >= self.policy.window_seconds

    def next_due(self, now: float) -> float | None:
        """Seconds until the window ends while the knobs are away from their configured
        values (an idle engine still relaxes them); None: nothing to wait for."""
        settled = self.knobs == self.configured and self._admit_through is None
        if not self.active or settled:
            return None
        return max(self._window_start + self.policy.window_seconds - now, 0.0)

    def tick(self, now: float, waiting: Iterable[tuple[str, float]] = ()) -> Adjustment | None:
        """Judge the window(s) ended by ``now``. ``waiting``: (tenant, arrival time) of
        requests still without their first token. Returns the adjustment made, if any."""
        if not self.due(now):
            return None
        for tenant, arrived in waiting:
            found = self.policy.group_of(tenant, self.rank(tenant))
            if found is None:
                continue
            group, target = found
            limits = [t for t in (target.ttft_p90, target.ttft_p99) if t is not None]
            if limits and now - arrived > min(limits):
                self._ttft.setdefault(group, []).append(now - arrived)
        # Whole windows passed without a step (an idle engine) are windows without traffic.
        idle_windows = int((now - self._window_start) // self.policy.window_seconds) - 1
        self._window_start = now
        adjustment = self._judge(now)
        self._ttft, self._itl = {}, {}
        for _ in range(min(idle_windows, 64)):
            adjustment = self._judge(now) or adjustment
        return adjustment

    def _judge(self, now: float) -> Adjustment | None:
        """One window: its figures, then at most one stage of change."""
        self._state = None
        self.windows += 1
        figures: dict[str, dict[str, tuple[float, float | None]]] = {}
        breached: list[tuple[str, str, float, float]] = []
        calm = True
        for group, target, _ in self._groups():
            row: dict[str, tuple[float, float | None]] = {}
            for metric, limit in target.items():
                samples = (self._itl if metric == "itl_p99" else self._ttft).get(group, [])
                q = 0.9 if metric == "ttft_p90" else 0.99
                value = percentile(samples, q) if samples else None
                row[metric] = (limit, value)
                if value is None:
                    continue
                if value > limit:
                    breached.append((group, metric, value, limit))
                    self.breaches[(group, metric)] += 1
                if value > limit * RELAX_MARGIN:
                    calm = False
            figures[group] = row
        self.last = figures
        base = self.policy.recover_windows
        quiet = not self._ttft and not self._itl
        self._quiet_streak = self._quiet_streak + 1 if quiet else 0
        if self._quiet_streak >= base:
            self._relax_wait = base  # the load is gone: the next one starts afresh
        since_relax = self._since_relax
        if since_relax is not None:
            self._since_relax = since_relax + 1
        if breached:
            self._ok_streak = 0
            if since_relax is not None and since_relax < base:
                # The last step back caused this: wait twice as long before the next one.
                self._relax_wait = min(self._relax_wait * 2, MAX_RELAX_WAIT)
            self._since_relax = None
            return self._tighten(now, breached)
        if not calm:
            self._ok_streak = 0
            return None
        self._ok_streak += 1
        if self._ok_streak < self._relax_wait:
            return None
        self._ok_streak = 0
        self._since_relax = 0
        return self._relax(now)

    def _groups(self) -> list[tuple[str, SloTarget, int]]:
        """Every SLO group with targets, and the best (lowest) class rank in it."""
        seen: dict[str, tuple[SloTarget, int]] = {}
        policy = self.policy
        for rank, target in policy.classes.items():
            if not target.empty:
                seen[policy.class_names.get(rank, str(rank))] = (target, rank)
        for tenant, target in policy.tenants.items():
            if not target.empty:
                seen[f"tenant:{tenant}"] = (target, self.rank(tenant))
        return [(g, t, r) for g, (t, r) in seen.items()]

    def _group_rank(self, group: str) -> int:
        for name, _, rank in self._groups():
            if name == group:
                return rank
        return self._default_rank

    # ------------------------------------------------------------------ moves
    def _floors(self) -> tuple[int, int, int]:
        """(token budget, chunk, running) floors."""
        c, f = self.configured, self.policy.floor
        running = max(1, math.ceil(c.max_running * f))
        chunk = max(min(16, c.chunk_size), math.ceil(c.chunk_size * f))
        budget = max(
            math.ceil(c.token_budget * f),
            min(c.token_budget, self.knobs.max_running + self.num_spare),
        )
        return budget, chunk, running

    def _tighten(
        self, now: float, breached: list[tuple[str, str, float, float]]
    ) -> Adjustment | None:
        old, c = self.knobs, self.configured
        budget, chunk, running = old.token_budget, old.chunk_size, old.max_running
        itl = [value / limit for _, metric, value, limit in breached if metric == "itl_p99"]
        ttft = any(metric != "itl_p99" for _, metric, _, _ in breached)
        if itl:
            f_budget, f_chunk, f_running = self._floors()
            if chunk > f_chunk or budget > f_budget:
                # A step costs about a fixed part plus a part per token: scale the step by
                # how far over the target it is (at least halved), to meet it in one move.
                factor = min(0.5, 0.9 / max(itl))
                chunk = max(f_chunk, math.floor(chunk * factor))
                budget = max(f_budget, math.floor(budget * factor))
            elif not ttft:  # the budget keeps its floor for the sequences running before
                running = max(f_running, math.floor(running * RUNNING_STEP))
        elif ttft and running < c.max_running:
            # Queueing, not long steps: a sequence cap lowered for an earlier inter-token
            # breach is what holds new requests back. One stage up.
            running = min(c.max_running, max(running + 1, math.ceil(running / RUNNING_STEP)))
        top = min(self._group_rank(group) for group, *_ in breached)
        lower = [r for r in self._known_ranks() if r > top]
        if lower and (self._admit_through is None or self._admit_through > top):
            self._admit_through = top
        knobs = Knobs(budget, min(chunk, budget), running, self._held_tenants())
        group, metric, value, limit = breached[0]
        reason = f"{metric} of {group} {value:.3f} s > {limit:.3f} s"
        if len(breached) > 1:
            reason += f" (+{len(breached) - 1} more)"
        return self._move(now, "tighten", reason, old, knobs)

    def _relax(self, now: float) -> Adjustment | None:
        old, c = self.knobs, self.configured
        if self._admit_through is not None:
            above = [r for r in self._known_ranks() if r > self._admit_through]
            self._admit_through = min(above) if len(above) > 1 else None
        running = min(
            c.max_running, max(old.max_running + 1, math.ceil(old.max_running / RUNNING_STEP))
        )
        budget = min(c.token_budget, old.token_budget * 2)
        chunk = min(c.chunk_size, old.chunk_size * 2, budget)
        knobs = Knobs(budget, chunk, running, self._held_tenants())
        return self._move(now, "relax", "within targets", old, knobs)

    def _move(
        self, now: float, direction: str, reason: str, old: Knobs, new: Knobs
    ) -> Adjustment | None:
        if new == old:
            return None
        self.knobs = new
        changes = []
        for knob in ("token_budget", "chunk_size", "max_running"):
            before, after = getattr(old, knob), getattr(new, knob)
            if before != after:
                self.adjustments[(knob, direction)] += 1
                changes.append(f"{knob} {before} -> {after}")
        if old.held != new.held:
            self.adjustments[("admission", direction)] += 1
            held = ", ".join(sorted(new.held)) or "nobody"
            changes.append(f"held: {held}")
        adjustment = Adjustment(now, direction, reason, new)
        self.history.append(adjustment)
        log.info("slo autopilot %s (%s): %s", direction, reason, "; ".join(changes))
        return adjustment

    def _known_ranks(self) -> list[int]:
        return sorted({*self._ranks.values(), self._default_rank})

    def _held_tenants(self) -> frozenset[str]:
        through = self._admit_through
        if through is None:
            return frozenset()
        return frozenset(t for t, r in self._ranks.items() if r > through)

    # ------------------------------------------------------------------ reading
    def state(self) -> AutopilotState:
        """Built once per change (the engine's snapshot reads it after every step)."""
        if self._state is not None:
            return self._state
        through = self._admit_through
        self._state = AutopilotState(
            active=self.active,
            knobs=self.knobs,
            configured=self.configured,
            held_ranks=tuple(r for r in self._known_ranks() if through is not None and r > through),
            groups={g: dict(row) for g, row in self.last.items()},
            breaches=dict(self.breaches),
            adjustments=dict(self.adjustments),
            windows=self.windows,
            history=tuple(self.history),
        )
        return self._state
