"""The tenants file: parsed into specs and hashed keys; every mistake named with its place."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvgate.engine.autopilot import SloTarget
from kvgate.errors import InvalidConfig
from kvgate.governance.tenants import TenantsConfig

GOOD = """
admin_keys = ["sk-admin"]

[tenants.search]
keys = ["sk-search", "sha256:{hashed}"]
priority = "critical"
weight = 4
kv_guaranteed = 0.25
kv_ceiling = 0.5
requests_per_minute = 60
max_context = 2048
max_queue_time = 5
default_deadline = 30
max_deadline = 60
max_storage_bytes = 1000000
max_vector_stores = 3
max_chunks = 500
max_store_bytes = 20000

[tenants.batch]
keys = ["sk-batch"]
priority = "batch"
prefix_isolation = false
"""


def write(tmp_path: Path, text: str, name: str = "tenants.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_valid_file(tmp_path: Path) -> None:
    hashed = hashlib.sha256(b"sk-search-2").hexdigest()
    config = TenantsConfig.load(write(tmp_path, GOOD.format(hashed=hashed)))
    assert config.tenant_of("Bearer sk-search") == "search"
    assert config.tenant_of("Bearer sk-search-2") == "search"
    assert config.tenant_of("Bearer sk-batch") == "batch"
    assert config.tenant_of("Bearer sk-admin") is None  # an admin key is not a tenant key
    assert config.tenant_of("Bearer nope") is None and config.tenant_of(None) is None
    assert config.is_admin("Bearer sk-admin") and not config.is_admin("Bearer sk-search")
    search = config.spec("search")
    share = search.share(num_blocks=1000)
    assert (share.priority, share.weight, share.guaranteed_blocks, share.ceiling_blocks) == (
        0, 4.0, 250, 500,
    )  # fmt: skip
    assert search.deadline_seconds(None) == 30 and search.deadline_seconds(500) == 60
    assert search.cache_salt is not None and config.spec("batch").cache_salt is None
    assert b"sk-search" not in repr(config.keys).encode()
    quotas = (search.max_storage_bytes, search.max_vector_stores, search.max_chunks,
              search.max_store_bytes)  # fmt: skip
    assert quotas == (1000000, 3, 500, 20000) and config.spec("batch").max_chunks is None


def test_models_a_tenant_may_use(tmp_path: Path) -> None:
    text = "[tenants.a]\nkeys = ['k']\nmodels = ['smollm2', 'gemma']\n[tenants.b]\nkeys = ['j']\n"
    config = TenantsConfig.load(write(tmp_path, text))
    assert config.spec("a").models == ("smollm2", "gemma")
    assert config.spec("a").allows("gemma") and not config.spec("a").allows("qwen")
    assert config.spec("b").models is None and config.spec("b").allows("anything")


def test_yaml_works_too(tmp_path: Path) -> None:
    text = "tenants:\n  a:\n    keys: [sk-a]\n    weight: 2\n"
    config = TenantsConfig.load(write(tmp_path, text, "tenants.yaml"))
    assert config.spec("a").weight == 2.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tenants.a]\nkeys = ['k']\nwieght = 2\n", "tenants.a: unknown setting 'wieght'"),
        ("[tenants.a]\nkeys = ['k']\npriority = 'urgent'\n", "priority must be one of"),
        ("[tenants.a]\nkeys = ['k']\nrequests_per_minute = 0\n", "must be a positive integer"),
        ("[tenants.a]\nkeys = ['k']\nmax_vector_stores = 0\n", "must be a positive integer"),
        ("[tenants.a]\nkeys = ['k']\nmax_chunks = 1.5\n", "must be a positive integer"),
        ("[tenants.a]\nkeys = ['k']\nkv_guaranteed = 0.6\nkv_ceiling = 0.5\n", "kv_guaranteed"),
        (
            "[tenants.a]\nkeys = ['k']\nkv_guaranteed = 0.6\n"
            "[tenants.b]\nkeys = ['j']\nkv_guaranteed = 0.6\n",
            "add up to 1.20",
        ),
        ("[tenants.a]\nkeys = ['k']\n[tenants.b]\nkeys = ['k']\n", "already the key of tenant"),
        ("[tenants.a]\nkeys = ['sha256:xyz']\n", "64 hex digits"),
        ("[tenants.a]\nweight = 1\n", "no tenant has any key"),
        ("tenant = 1\n", "unknown top-level"),
        ("[tenants.a\n", "is not valid"),
        ("[tenants.a]\nkeys = ['k']\nmodels = 'smollm2'\n", "a non-empty list of served model"),
        ("[tenants.a]\nkeys = ['k']\nmodels = []\n", "a non-empty list of served model"),
        ("[tenants.a]\nkeys = ['k']\nslo = {ttft_p95 = 1}\n", "unknown target 'ttft_p95'"),
        ("[tenants.a]\nkeys = ['k']\nslo = {itl_p99 = 0}\n", "positive number of seconds"),
        ("[tenants.a]\nkeys = ['k']\nslo = 0.5\n", "must be a table of targets"),
        ("[tenants.a]\nkeys = ['k']\n[slo.urgent]\nitl_p99 = 1\n", "unknown setting 'urgent'"),
        ("[tenants.a]\nkeys = ['k']\n[slo]\nfloor = 2\n", "floor must be at most 1"),
        ("[tenants.a]\nkeys = ['k']\n[slo]\nwindow = -1\n", "window must be a positive"),
        ("[tenants.a]\nkeys = ['k']\n[slo]\nrecover_windows = 0\n", "recover_windows"),
        ("[tenants.a]\nkeys = ['k']\n[slo.critical]\nitl_p99 = 'fast'\n", "itl_p99 must be"),
    ],
)
def test_mistakes_are_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        TenantsConfig.load(write(tmp_path, text))


def test_slo_targets_per_class_and_per_tenant(tmp_path: Path) -> None:
    config = TenantsConfig.load(
        write(
            tmp_path,
            "[slo]\nwindow = 1.5\nrecover_windows = 4\n"
            "[slo.critical]\nttft_p99 = 1\nitl_p99 = 0.2\n[slo.batch]\nttft_p90 = 60\n"
            "[tenants.chat]\nkeys = ['k1']\npriority = 'critical'\n"
            "[tenants.search]\nkeys = ['k2']\nslo = {ttft_p90 = 0.4}\n",
        )
    )
    slo = config.slo
    assert slo is not None and slo.active
    assert (slo.window_seconds, slo.recover_windows, slo.floor) == (1.5, 4, 0.25)
    assert slo.classes[0] == SloTarget(ttft_p99=1.0, itl_p99=0.2)
    assert slo.classes[2] == SloTarget(ttft_p90=60.0)
    assert config.spec("search").slo == SloTarget(ttft_p90=0.4)
    assert slo.group_of("search", 1) == ("tenant:search", SloTarget(ttft_p90=0.4))
    assert slo.group_of("chat", 0) == ("critical", SloTarget(ttft_p99=1.0, itl_p99=0.2))
    assert slo.group_of("other", 1) is None  # standard has no target


def test_no_target_means_no_autopilot(tmp_path: Path) -> None:
    text = "[slo]\nwindow = 1\n[tenants.a]\nkeys = ['k']\n"
    assert TenantsConfig.load(write(tmp_path, text)).slo is None
