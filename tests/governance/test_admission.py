"""Admission: limits a request can never fit, rate limits with Retry-After, refunds."""

from __future__ import annotations

import pytest

from kvgate.errors import PromptTooLong, TenantLimitExceeded
from kvgate.governance.admission import RateLimited, TenantGate, TenantRates
from kvgate.governance.tenants import TenantSpec


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock: Clock) -> TenantGate:
    return TenantGate(num_blocks=100, block_size=16, clock=clock)


def test_limits_that_can_never_be_met_are_refused_with_their_values() -> None:
    g = gate(Clock())
    with pytest.raises(PromptTooLong) as ctx:
        g.admit(TenantSpec("a", max_context=1000), prompt_tokens=900, max_tokens=200)
    assert ctx.value.code == "context_length_exceeded"
    assert ctx.value.message.startswith("Tenant 'a''s maximum context length is 1000 tokens")
    with pytest.raises(TenantLimitExceeded) as lim:
        g.admit(TenantSpec("a", kv_ceiling=0.1), prompt_tokens=150, max_tokens=20)  # 11 > 10
    assert (lim.value.code, lim.value.param, lim.value.value) == (
        "tenant_limit_exceeded", "kv_ceiling", 10,
    )  # fmt: skip
    with pytest.raises(TenantLimitExceeded) as tpm:
        g.admit(TenantSpec("a", tokens_per_minute=100), prompt_tokens=90, max_tokens=20)
    assert tpm.value.param == "tokens_per_minute"
    assert g.in_flight("a") == 0


def test_requests_per_minute_refill_continuously() -> None:
    clock = Clock()
    g = gate(clock)
    spec = TenantSpec("a", requests_per_minute=2)
    g.admit(spec, 10, 10).release()
    g.admit(spec, 10, 10).release()
    with pytest.raises(RateLimited) as info:
        g.admit(spec, 10, 10)
    assert info.value.code == "rate_limit_exceeded" and info.value.retry_after == 30
    assert info.value.headers["x-ratelimit-limit-requests"] == "2"
    assert info.value.headers["x-ratelimit-remaining-requests"] == "0"
    clock.now += 30  # one request's worth refilled
    g.admit(spec, 10, 10)


def test_tokens_per_minute_refund_what_was_not_used() -> None:
    clock = Clock()
    g = gate(clock)
    spec = TenantSpec("a", tokens_per_minute=1000)
    first = g.admit(spec, prompt_tokens=100, max_tokens=500)  # charged 600
    with pytest.raises(RateLimited) as info:
        g.admit(spec, prompt_tokens=100, max_tokens=400)  # 500 > 400 left
    assert "tokens_per_minute" in info.value.message
    first.release(used_tokens=150)  # 450 back
    g.admit(spec, prompt_tokens=100, max_tokens=400)


def test_max_concurrent() -> None:
    g = gate(Clock())
    spec = TenantSpec("a", max_concurrent=2)
    one, two = g.admit(spec, 1, 1), g.admit(spec, 1, 1)
    with pytest.raises(RateLimited, match="max_concurrent=2"):
        g.admit(spec, 1, 1)
    one.release()
    one.release()  # releasing twice is harmless
    g.admit(spec, 1, 1)
    assert g.in_flight("a") == 2
    two.release()
    assert g.in_flight("a") == 1


def test_choices_are_admitted_together_or_not_at_all() -> None:
    clock = Clock()
    g = gate(clock)
    spec = TenantSpec("a", tokens_per_minute=4000, requests_per_minute=3)
    # Two choices of 2500 tokens can never fit 4000 per minute: refused as such, not a 429.
    with pytest.raises(TenantLimitExceeded) as never:
        g.admit_all(spec, [(500, 2000), (500, 2000)])
    assert never.value.param == "tokens_per_minute"
    with pytest.raises(TenantLimitExceeded, match="max_concurrent=1"):
        g.admit_all(TenantSpec("b", max_concurrent=1), [(1, 1), (1, 1)])
    # The second choice is rate-limited: the first one's charge is given back in full.
    g.admit_all(spec, [(100, 1400)])  # 1500 of 4000 tokens, 1 of 3 requests
    with pytest.raises(RateLimited):
        g.admit_all(spec, [(100, 1400), (100, 1400)])  # 1500 fits, the next 1500 does not
    assert g.in_flight("a") == 1
    g.admit_all(spec, [(100, 900), (100, 900)])  # 2000 left: both fit now
    assert g.in_flight("a") == 3


def test_a_flood_cannot_take_the_whole_queue_from_the_others() -> None:
    from kvgate.errors import Overloaded

    g = gate(Clock())
    flood, quiet = TenantSpec("flood"), TenantSpec("quiet")
    weights = {"flood": 1.0, "quiet": 1.0}.__getitem__
    capacity = 8  # reserve 2: a tenant over its share leaves them free
    held = []
    for _ in range(6):  # alone, the flood may use all but the reserve
        g.check_queue_share(flood, 1, capacity, weights)
        held.append(g.admit(flood, 1, 1))
    with pytest.raises(Overloaded, match="'flood' holds 6"):
        g.check_queue_share(flood, 1, capacity, weights)
    for _ in range(2):  # the quiet tenant finds room, under its share of 3
        g.check_queue_share(quiet, 1, capacity, weights)
        held.append(g.admit(quiet, 1, 1))
    held.pop(0).release()  # a flood request ends: the slot is not the flood's to retake
    with pytest.raises(Overloaded):
        g.check_queue_share(flood, 1, capacity, weights)
    g.check_queue_share(quiet, 1, capacity, weights)  # the quiet one may grow to its share


def test_queue_shares_follow_weights() -> None:
    from kvgate.errors import Overloaded

    g = gate(Clock())
    big, small = TenantSpec("big", weight=3), TenantSpec("small")
    weights = {"big": 3.0, "small": 1.0}.__getitem__

    def fill(spec: TenantSpec) -> int:
        n = 0
        while True:
            try:
                g.check_queue_share(spec, 1, 20, weights)
            except Overloaded:
                return n
            g.admit(spec, 1, 1)
            n += 1

    g.admit(small, 1, 1)
    # Capacity 20, reserve 5: big's share is 15 * 3/4 = 11.25, and past it big may still
    # take slots while 5 stay free: 14 in all.
    assert fill(big) == 14
    # small's share is 15 * 1/4 = 3.75: it grows from 1 to 3, past the reserve line.
    assert fill(small) == 2


def test_gates_of_several_models_share_rates_but_not_pools() -> None:
    """One gate per model's pool: KV ceilings and queue counts are each pool's, while the
    tenant's rates and max_concurrent are one ``TenantRates`` for the whole server."""
    clock = Clock()
    rates = TenantRates(clock)
    big = TenantGate(num_blocks=100, block_size=16, clock=clock, rates=rates)
    small = TenantGate(num_blocks=10, block_size=16, clock=clock, rates=rates)
    spec = TenantSpec("a", max_concurrent=2, tokens_per_minute=300, kv_ceiling=0.5)
    first = big.admit(spec, 100, 100)
    second = small.admit(spec, 10, 10)
    assert (big.in_flight("a"), small.in_flight("a"), rates.in_flight("a")) == (1, 1, 2)
    assert big.total_in_flight == 1 and small.total_in_flight == 1
    with pytest.raises(RateLimited, match="max_concurrent=2"):
        big.admit(spec, 1, 1)  # two in flight, one in each model
    second.release(0)  # its 20 tokens given back: 300 - 200 left
    # The ceiling is half of each pool: 50 blocks (800 tokens) in one, 5 (80) in the other.
    assert big.room_for(spec, 0) == 300 and small.room_for(spec, 0) == 80
    with pytest.raises(TenantLimitExceeded, match="kv_ceiling=5"):
        small.admit(spec, 100, 1)
    # Tokens per minute over both models: the first model's 200 count in the second's.
    with pytest.raises(RateLimited, match="tokens_per_minute"):
        big.admit(spec, 60, 60)
    first.release()
    assert rates.in_flight("a") == 0
    assert big.headers("a") == small.headers("a")


def test_requests_per_minute_are_charged_once_for_the_server() -> None:
    clock = Clock()
    rates = TenantRates(clock)
    gates = [TenantGate(100, 16, clock=clock, rates=rates) for _ in range(2)]
    spec = TenantSpec("a", requests_per_minute=2)
    gates[0].charge_requests(spec, 1)
    gates[1].charge_requests(spec, 1)
    with pytest.raises(RateLimited, match="requests_per_minute=2"):
        rates.charge_requests(spec, 1)
