"""``SharedBuckets`` without Ray's cluster: the actor's calls go through ``ray.get``, which
these tests replace (answering as the actor would, or failing as an unreachable one)."""

from typing import Any

import pytest

from kvgate.cluster import state
from kvgate.cluster.state import ClusterState, SharedBuckets
from kvgate.errors import Overloaded
from kvgate.governance.admission import RateLimited, TenantRates
from kvgate.governance.tenants import TenantSpec


class _Method:
    def __init__(self, target: Any) -> None:
        self.target = target

    def remote(self, *args: Any) -> Any:
        return lambda: self.target(*args)


class _Actor:
    """The actor's class run in this process; a 'ref' is a thunk that ``ray.get`` calls."""

    def __init__(self) -> None:
        self.inner = ClusterState()

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.inner, name))


@pytest.fixture
def reachable(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    up = [True]

    def get(ref: Any, timeout: float | None = None) -> Any:
        if not up[0]:
            raise TimeoutError("no answer")
        return ref()

    monkeypatch.setattr(state.ray, "get", get)
    return up


SPEC = TenantSpec("t", requests_per_minute=3)


def test_two_replicas_share_one_bucket(reachable: list[bool]) -> None:
    actor = _Actor()
    replicas = [TenantRates(buckets=SharedBuckets(actor)) for _ in range(2)]
    for rates in (replicas[0], replicas[1], replicas[0]):
        rates.charge_requests(SPEC, 1)
    with pytest.raises(RateLimited):
        replicas[1].charge_requests(SPEC, 1)  # the sum over both replicas, not each
    assert replicas[1].headers("t")["x-ratelimit-remaining-requests"] == "0"


def test_unreachable_fails_open_on_local_buckets(reachable: list[bool]) -> None:
    rates = TenantRates(buckets=SharedBuckets(_Actor(), fail="open", retry_s=60))
    reachable[0] = False
    for _ in range(3):
        rates.charge_requests(SPEC, 1)  # this replica's own bucket of 3
    with pytest.raises(RateLimited):
        rates.charge_requests(SPEC, 1)


def test_unreachable_fails_closed_with_503(reachable: list[bool]) -> None:
    buckets = SharedBuckets(_Actor(), fail="closed", retry_s=0.0)
    rates = TenantRates(buckets=buckets)
    reachable[0] = False
    with pytest.raises(Overloaded):
        rates.charge_requests(SPEC, 1)
    rates.charge_requests(TenantSpec("free"), 5)  # no limits: never asks the actor
    reachable[0] = True
    rates.charge_requests(SPEC, 1)  # it answers again: served


def test_bad_fail_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="open"):
        SharedBuckets(object(), fail="maybe")
