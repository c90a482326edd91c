"""Admission: refuse up front what cannot succeed, rate-limit what may.

Runs on the server's event loop (one thread), before a request reaches the engine:

- a request that can never fit its tenant's limits is refused with a code naming the limit
  and its value: ``context_length_exceeded`` (max_context) or ``tenant_limit_exceeded``
  (tokens_per_minute, kv_ceiling);
- a tenant over its requests- or tokens-per-minute, or at its maximum concurrent requests,
  gets ``rate_limit_exceeded`` (429) with Retry-After and ``x-ratelimit-*`` headers.

Rates are token buckets refilled continuously: a bucket of ``limit`` per minute holds at most
``limit``. Tokens are charged as prompt + max_tokens at admission; what a request did not use
is given back when it ends.

A server of several models has one ``TenantGate`` per model (its KV pool sizes the ceiling,
its request slots the queue share) and one ``TenantRates`` shared by them all: a tenant's
rates and ``max_concurrent`` hold for the whole server, whichever models it calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.errors import KVGateError, Overloaded, PromptTooLong, TenantLimitExceeded
from kvgate.governance.tenants import TenantSpec

#: Of the server's request slots, the part a tenant past its fair share cannot take.
RESERVE_FRACTION = 0.25


class RateLimited(KVGateError):
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))
        self.headers = headers


@dataclass
class _Bucket:
    limit: float  # per minute; also the capacity
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + (now - self.stamp) * self.limit / 60.0)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 if it is)."""
        return max(0.0, (amount - self.level) * 60.0 / self.limit)


@dataclass
class _Buckets:
    requests: _Bucket | None = None
    tokens: _Bucket | None = None


@dataclass(frozen=True)
class Shortfall:
    """Why ``RateBuckets.take`` took nothing: the limit that is short, its value, and the
    seconds until it holds enough."""

    limit: str
    value: int
    wait: float


class RateBuckets:
    """Every tenant's requests- and tokens-per-minute buckets: plain data, no clock of its
    own (``now`` is given), so the same object serves one process (``TenantRates``) or a
    whole deployment of replicas behind one shared state (``kvgate.cluster.state``)."""

    def __init__(self) -> None:
        self._buckets: dict[str, _Buckets] = {}

    def take(
        self,
        tenant: str,
        limits: tuple[int | None, int | None],
        amounts: tuple[int, int],
        now: float,
    ) -> tuple[Shortfall | None, dict[str, str]]:
        """Take ``amounts`` = (requests, tokens) from the tenant's buckets of ``limits`` =
        (requests_per_minute, tokens_per_minute) (None: no such limit), both or neither.
        Returns what was short (None: taken) and the ``x-ratelimit-*`` headers after."""
        state = self._buckets.setdefault(tenant, _Buckets())
        rpm, tpm = limits
        requests, tokens = amounts
        if requests or rpm is None:
            state.requests = _sync(state.requests, rpm, now)
        state.tokens = _sync(state.tokens, tpm, now)
        short = []
        if requests and state.requests is not None and state.requests.level < requests:
            assert rpm is not None
            short.append(Shortfall("requests_per_minute", rpm, state.requests.wait_for(requests)))
        if tokens and state.tokens is not None and state.tokens.level < tokens:
            assert tpm is not None
            short.append(Shortfall("tokens_per_minute", tpm, state.tokens.wait_for(tokens)))
        if short:
            return max(short, key=lambda s: s.wait), _headers(state)
        if requests and state.requests is not None:
            state.requests.level -= requests
        if tokens and state.tokens is not None:
            state.tokens.level -= tokens
        return None, _headers(state)

    def give(self, tenant: str, amounts: tuple[int, int], now: float) -> None:
        """Give back (requests, tokens) taken and not used, up to each bucket's capacity."""
        state = self._buckets.get(tenant)
        if state is None:
            return
        for bucket, amount in ((state.requests, amounts[0]), (state.tokens, amounts[1])):
            if bucket is not None and amount:
                bucket.refill(now)
                bucket.level = min(bucket.limit, bucket.level + amount)

    def headers(self, tenant: str) -> dict[str, str]:
        state = self._buckets.get(tenant)
        return _headers(state) if state is not None else {}


class TenantRates:
    """Per-tenant rate buckets and requests in flight, for the whole server.

    ``buckets``: where the rates are kept; by default in this process (``RateBuckets``),
    or an object with the same ``take``/``give``/``headers`` that keeps them for several
    replicas at once (``kvgate.cluster.state.SharedBuckets``). Requests in flight (for
    ``max_concurrent``) are always this process's."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, buckets: RateBuckets | None = None
    ) -> None:
        self.clock = clock
        self.buckets = buckets if buckets is not None else RateBuckets()
        self._in_flight: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._in_flight.get(tenant, 0)

    def headers(self, tenant: str) -> dict[str, str]:
        """``x-ratelimit-*`` headers for a response to ``tenant``."""
        return self.buckets.headers(tenant)

    def take(self, spec: TenantSpec, requests: int, tokens: int) -> None:
        """Take from the tenant's buckets, both or neither; raise ``RateLimited`` when
        either is short."""
        if spec.requests_per_minute is None and spec.tokens_per_minute is None:
            return
        short, headers = self.buckets.take(
            spec.name,
            (spec.requests_per_minute, spec.tokens_per_minute),
            (requests, tokens),
            self.clock(),
        )
        if short is not None:
            raise RateLimited(
                f"tenant {spec.name!r} is over {short.limit}={short.value}; "
                f"retry in {math.ceil(short.wait)} s",
                retry_after=short.wait,
                headers=headers,
            )

    def give(self, tenant: str, requests: int, tokens: int) -> None:
        if requests or tokens:
            self.buckets.give(tenant, (requests, tokens), self.clock())

    def charge_requests(self, spec: TenantSpec, n: int) -> None:
        """Take ``n`` requests from the tenant's requests-per-minute bucket, at the door,
        before any work is done for them (a request refused later still counts); raise
        ``RateLimited`` when they are not there, and ``TenantLimitExceeded`` for more
        choices than the limit could ever hold."""
        if spec.requests_per_minute is None:
            return
        if n > spec.requests_per_minute:
            raise TenantLimitExceeded(
                f"the request's {n} choices exceed tenant {spec.name!r}'s "
                f"requests_per_minute={spec.requests_per_minute}",
                limit="requests_per_minute",
                value=spec.requests_per_minute,
            )
        self.take(spec, n, 0)


@dataclass
class Ticket:
    """An admitted request's claim; ``release`` it exactly once, when the request ends."""

    gate: TenantGate
    tenant: str
    charged_tokens: int
    #: Whether ``cancel`` gives the request back (not when it was charged at the door).
    refund_request: bool = True
    released: bool = field(default=False)

    def release(self, used_tokens: int | None = None) -> None:
        if self.released:
            return
        self.released = True
        self.gate._release(self, used_tokens)

    def cancel(self) -> None:
        """Undo the admission (a sibling choice was refused): refund everything it took."""
        if self.released:
            return
        self.released = True
        self.gate._release(self, 0, refund_request=self.refund_request)


class TenantGate:
    """Per-tenant admission into one model's engine. ``block_size`` and ``num_blocks`` (its
    pool) size the KV ceiling; ``rates`` (None: a gate of its own) may be shared with the
    gates of the server's other models."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        clock: Callable[[], float] = time.monotonic,
        blocks_for: Callable[[int], int] | None = None,
        rates: TenantRates | None = None,
    ) -> None:
        """``blocks_for``: the KV blocks one request of n tokens holds at most (the engine's
        ``KVLayout.max_blocks``); None: n / block_size, rounded up."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rates = rates if rates is not None else TenantRates(clock)
        self.clock = self.rates.clock
        self.blocks_for = blocks_for or (lambda n: -(-n // block_size))
        self._in_flight: dict[str, int] = {}  # this engine's, by tenant

    def in_flight(self, tenant: str) -> int:
        """The tenant's requests admitted into this engine and not yet released."""
        return self._in_flight.get(tenant, 0)

    @property
    def total_in_flight(self) -> int:
        """Admitted and not yet released, all tenants: this engine's queue as it stands."""
        return sum(list(self._in_flight.values()))

    def admit_all(
        self, spec: TenantSpec, sizes: list[tuple[int, int]], *, paid: bool = False
    ) -> list[Ticket]:
        """Admit the (prompt tokens, max tokens) of every choice of one request, or none.

        What the choices can never fit together (more tokens than tokens_per_minute, more
        choices than max_concurrent) is refused as such, not rate-limited for ever."""
        total = sum(p + m for p, m in sizes)
        if spec.tokens_per_minute is not None and total > spec.tokens_per_minute:
            raise TenantLimitExceeded(
                f"the request's {len(sizes)} choices need {total} tokens (prompt + max_tokens "
                f"each), over tenant {spec.name!r}'s tokens_per_minute={spec.tokens_per_minute}",
                limit="tokens_per_minute",
                value=spec.tokens_per_minute,
            )
        if spec.max_concurrent is not None and len(sizes) > spec.max_concurrent:
            raise TenantLimitExceeded(
                f"the request's {len(sizes)} choices exceed tenant {spec.name!r}'s "
                f"max_concurrent={spec.max_concurrent}",
                limit="max_concurrent",
                value=spec.max_concurrent,
            )
        tickets: list[Ticket] = []
        try:
            for prompt_tokens, max_tokens in sizes:
                tickets.append(self.admit(spec, prompt_tokens, max_tokens, paid=paid))
        except KVGateError:
            for ticket in tickets:
                ticket.cancel()
            raise
        return tickets

    def room_for(self, spec: TenantSpec, prompt_tokens: int) -> int | None:
        """Most output tokens one request of ``prompt_tokens`` may ask for under the
        tenant's limits (max_context, tokens_per_minute, kv_ceiling); None: no such limit.
        A request that gives no max_tokens is charged this much, not the whole context, so
        it is never refused for a limit it could not have reached."""
        caps = []
        if spec.max_context is not None:
            caps.append(spec.max_context)
        if spec.tokens_per_minute is not None:
            caps.append(spec.tokens_per_minute)
        ceiling = spec.share(self.num_blocks).ceiling_blocks
        if ceiling is not None:
            caps.append(self._tokens_within(ceiling))
        return min(caps) - prompt_tokens if caps else None

    def _tokens_within(self, num_blocks: int) -> int:
        """The most tokens one request may have and hold at most ``num_blocks`` blocks."""
        lo, hi = 0, num_blocks * self.block_size  # blocks_for(n) >= n / block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for(mid) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def check_queue_share(
        self, spec: TenantSpec, n: int, capacity: int, weight_of: Callable[[str], float]
    ) -> None:
        """Fair admission at the door: ``capacity`` requests may be in flight in the server
        (running + queued), shared by the tenants holding some, in proportion to their
        weights. A tenant past its share may still take a slot while ``RESERVE_FRACTION`` of
        the capacity stays free, so idle capacity is used, yet a tenant that arrives always
        finds room: a flood cannot starve the others of queue slots, whatever its
        ``max_concurrent``. Raises ``Overloaded`` for a request over its tenant's share."""
        reserve = math.floor(capacity * RESERVE_FRACTION)  # none in a server of 1-3 slots
        active = {t for t, n in list(self._in_flight.items()) if n > 0} | {spec.name}
        total_weight = sum(weight_of(t) for t in active)
        share = (capacity - reserve) * weight_of(spec.name) / total_weight
        mine = self.in_flight(spec.name)
        free_after = capacity - self.total_in_flight - n
        if mine + n > share and free_after < reserve:
            raise Overloaded(
                f"tenant {spec.name!r} holds {mine} of the server's {capacity} request slots, "
                f"its share is {share:.0f} while {len(active) - 1} other tenant(s) are served; "
                "retry later",
                retry_after=1,
            )

    def charge_requests(self, spec: TenantSpec, n: int) -> None:
        """See ``TenantRates.charge_requests``."""
        self.rates.charge_requests(spec, n)

    def admit(
        self, spec: TenantSpec, prompt_tokens: int, max_tokens: int, *, paid: bool = False
    ) -> Ticket:
        """Admit one request (``n`` choices count as ``n`` calls) or raise. ``paid``: its
        request was charged at the door (``charge_requests``), not here."""
        total = prompt_tokens + max_tokens
        if spec.max_context is not None and total > spec.max_context:
            raise PromptTooLong(prompt_tokens, max_tokens, spec.max_context, tenant=spec.name)
        share = spec.share(self.num_blocks)
        blocks = self.blocks_for(total)
        if share.ceiling_blocks is not None and blocks > share.ceiling_blocks:
            raise TenantLimitExceeded(
                f"the request needs {blocks} KV blocks ({total} tokens) but tenant "
                f"{spec.name!r} may hold at most kv_ceiling={share.ceiling_blocks} blocks",
                limit="kv_ceiling",
                value=share.ceiling_blocks,
            )
        if spec.tokens_per_minute is not None and total > spec.tokens_per_minute:
            raise TenantLimitExceeded(
                f"the request's {total} tokens (prompt + max_tokens) exceed tenant "
                f"{spec.name!r}'s tokens_per_minute={spec.tokens_per_minute}",
                limit="tokens_per_minute",
                value=spec.tokens_per_minute,
            )
        rates = self.rates
        if spec.max_concurrent is not None and rates.in_flight(spec.name) >= spec.max_concurrent:
            raise RateLimited(
                f"tenant {spec.name!r} has max_concurrent={spec.max_concurrent} requests in "
                "flight; retry when one finishes",
                retry_after=1,
                headers=rates.headers(spec.name),
            )
        rates.take(spec, 0 if paid else 1, total)
        rates._in_flight[spec.name] = rates.in_flight(spec.name) + 1
        self._in_flight[spec.name] = self.in_flight(spec.name) + 1
        return Ticket(self, spec.name, total, refund_request=not paid)

    def headers(self, tenant: str) -> dict[str, str]:
        """``x-ratelimit-*`` headers for a response to ``tenant``."""
        return self.rates.headers(tenant)

    def _release(
        self, ticket: Ticket, used_tokens: int | None, refund_request: bool = False
    ) -> None:
        self._in_flight[ticket.tenant] -= 1
        self.rates._in_flight[ticket.tenant] -= 1
        unused = 0 if used_tokens is None else max(ticket.charged_tokens - used_tokens, 0)
        self.rates.give(ticket.tenant, 1 if refund_request else 0, unused)


def _sync(bucket: _Bucket | None, limit: int | None, now: float) -> _Bucket | None:
    """The bucket for the tenant's current limit (a reload may have changed it), refilled."""
    if limit is None:
        return None
    if bucket is not None:
        bucket.refill(now)  # what was owed under the old limit, before any change
    if bucket is None or bucket.limit != limit:
        level = limit if bucket is None else min(bucket.level, limit)
        bucket = _Bucket(float(limit), float(level), now)
    bucket.refill(now)
    return bucket


def _headers(state: _Buckets) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, bucket in (("requests", state.requests), ("tokens", state.tokens)):
        if bucket is None:
            continue
        out[f"x-ratelimit-limit-{name}"] = str(int(bucket.limit))
        out[f"x-ratelimit-remaining-{name}"] = str(max(int(bucket.level), 0))
        reset = (bucket.limit - bucket.level) * 60.0 / bucket.limit
        out[f"x-ratelimit-reset-{name}"] = f"{max(reset, 0.0):.1f}s"
    return out
