"""Tenants end to end: keys, refusals with their codes, isolation, deadlines, priority,
accounting and reload, against a real uvicorn with the official client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.server.config import ServerConfig
from tests.server.conftest import (
    LiveServer,
    metric,
    scrape_metrics,
    start_server,
    tiny_engine_config,
    wait_idle,
)

TENANTS = """
admin_keys = ["sk-admin"]

[tenants.alpha]
keys = ["sk-alpha"]
max_context = 300

[tenants.beta]
keys = ["sk-beta"]

[tenants.shared1]
keys = ["sk-shared1"]
prefix_isolation = false

[tenants.shared2]
keys = ["sk-shared2"]
prefix_isolation = false

[tenants.limited]
keys = ["sk-limited"]
requests_per_minute = 2

[tenants.capped]
keys = ["sk-capped"]
kv_ceiling = 0.001
"""


def client(live: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.api_url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    path.write_text(TENANTS)
    return path


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tenants_file: Path) -> Iterator[LiveServer]:
    live = start_server(
        tiny_engine_config(tiny_llama_dir),
        ServerConfig(served_model_name="tiny", tenants_file=str(tenants_file)),
    )
    yield live
    live.stop()


def test_keys_map_to_tenants(server: LiveServer) -> None:
    for key in ("sk-alpha", "sk-beta"):
        assert client(server, key).models.list().data[0].id == "tiny"
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-nobody").models.list()
    # The admin key is not a tenant key: it may list the models (with their paths on disk),
    # not ask them for work.
    assert str(client(server, "sk-admin").models.list().data[0].model_dump()["source"])[0] == "/"
    with pytest.raises(openai.AuthenticationError):
        client(server, "sk-admin").completions.create(model="tiny", prompt="hi", max_tokens=1)


def test_rate_limit_is_a_429_with_retry_after_and_headers(server: LiveServer) -> None:
    c = client(server, "sk-limited")
    for _ in range(2):
        c.completions.create(model="tiny", prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        c.completions.create(model="tiny", prompt="hi", max_tokens=1)
    headers = info.value.response.headers
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "rate_limit_exceeded"
    assert "requests_per_minute=2" in body["message"]


def test_limits_a_request_can_never_fit_are_refused_up_front(server: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(server, "sk-alpha").completions.create(
            model="tiny", prompt=list(range(100, 300)), max_tokens=200
        )
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert "300" in body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client(server, "sk-capped").completions.create(
            model="tiny", prompt=list(range(100, 200)), max_tokens=100
        )
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "tenant_limit_exceeded"
    assert body["param"] == "kv_ceiling" and "at most kv_ceiling=8 blocks" in body["message"]


def test_prefix_cache_isolation(server: LiveServer) -> None:
    prompt = list(range(1000, 1064))  # 4 full blocks

    def cached(key: str) -> int:
        r = client(server, key).completions.create(model="tiny", prompt=prompt, max_tokens=1)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("sk-alpha") == 0
    assert cached("sk-alpha") == 48  # its own prefix: hit (the last block is always computed)
    assert cached("sk-beta") == 0  # isolated: never another tenant's
    shared = list(range(2000, 2064))
    prompt = shared
    assert cached("sk-shared1") == 0
    assert cached("sk-shared2") == 48  # both opted out of isolation: they share


def test_deadline_ends_a_request_with_its_partial_output(server: LiveServer) -> None:
    c = client(server, "sk-alpha")
    r = c.completions.create(
        model="tiny", prompt="x", max_tokens=290, extra_body={"ignore_eos": True, "timeout": 0.05}
    )
    assert r.choices[0].finish_reason == "deadline"
    assert r.usage is not None and 0 < r.usage.completion_tokens < 290
    assert r.choices[0].text
    streamed = list(
        c.with_options(default_headers={"x-request-timeout": "0.05"}).completions.create(
            model="tiny", prompt="x", max_tokens=290, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert streamed[-1].choices[0].finish_reason == "deadline"
    bad = httpx.post(
        f"{server.api_url}/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"Authorization": "Bearer sk-alpha", "x-request-timeout": "soon"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-timeout"


def test_admin_endpoints_and_accounting(server: LiveServer) -> None:
    client(server, "sk-beta").completions.create(model="tiny", prompt="abc def", max_tokens=3)
    wait_idle(server)
    denied = httpx.get(
        f"{server.base_url}/admin/tenants", headers={"Authorization": "Bearer sk-beta"}
    )
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
    r = httpx.get(f"{server.base_url}/admin/tenants", headers={"Authorization": "Bearer sk-admin"})
    assert r.status_code == 200
    report = r.json()["tenants"]
    assert report["beta"]["generation_tokens"] >= 3 and report["beta"]["prompt_tokens"] >= 2
    assert report["beta"]["kv_block_seconds"] > 0
    assert report["capped"]["kv_ceiling_blocks"] == 8
    assert report["limited"]["refusals"].get("rate_limit_exceeded", 0) >= 1
    # Per-tenant counters add up to the engine's totals.
    values = scrape_metrics(server, "sk-admin")
    assert metric(values, "kvgate:tenant_prompt_tokens_total") == metric(
        values, "vllm:prompt_tokens_total"
    )
    assert metric(values, "kvgate:tenant_generation_tokens_total") == metric(
        values, "vllm:generation_tokens_total"
    )
    assert any(
        k.startswith("kvgate:tenant_refusals_total") and 'tenant="limited"' in k for k in values
    )


# ------------------------------------------------------------------ one slot: queue and priority

ONE_SLOT = """
admin_keys = ["sk-admin"]

[tenants.impatient]
keys = ["sk-impatient"]
max_queue_time = 0.3

[tenants.crit]
keys = ["sk-crit"]
priority = "critical"

[tenants.bulk]
keys = ["sk-bulk"]
priority = "batch"
"""


@pytest.fixture(scope="module")
def one_slot(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("one-slot") / "tenants.toml"
    path.write_text(ONE_SLOT)
    live = start_server(
        tiny_engine_config(tiny_llama_dir, max_num_seqs=1, num_spare_seqs=0),
        ServerConfig(served_model_name="tiny", tenants_file=str(path)),
    )
    yield live
    live.stop()


def test_queue_timeout_is_refused_with_its_code(one_slot: LiveServer) -> None:
    # A critical request holds the only slot: the standard-class newcomer cannot preempt it.
    hold = client(one_slot, "sk-crit").completions.create(
        model="tiny", prompt="a", max_tokens=480, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(hold))
    try:
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            client(one_slot, "sk-impatient").completions.create(
                model="tiny", prompt="b", max_tokens=4
            )
        assert time.monotonic() - start > 0.25  # it waited its max_queue_time first
        assert info.value.status_code == 503
        body = info.value.body
        assert isinstance(body, dict) and body["code"] == "queue_timeout"
    finally:
        hold.close()
    wait_idle(one_slot)


def test_critical_request_preempts_batch_work(one_slot: LiveServer) -> None:
    """The single running slot belongs to a batch stream and there is no spare one: a
    critical request takes it at once (the batch request is preempted, then resumes and
    still completes in full)."""

    async def run() -> tuple[int, float, float]:
        bulk = openai.AsyncOpenAI(base_url=one_slot.api_url, api_key="sk-bulk", max_retries=0)
        crit = openai.AsyncOpenAI(base_url=one_slot.api_url, api_key="sk-crit", max_retries=0)
        stream = await bulk.completions.create(
            model="tiny", prompt="a", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        tokens = 0
        crit_done = 0.0

        async def critical() -> None:
            nonlocal crit_done
            await crit.completions.create(model="tiny", prompt="b", max_tokens=8)
            crit_done = time.monotonic()

        task = None
        async for chunk in stream:
            tokens += 1 if chunk.choices and chunk.choices[0].text else 0
            if task is None:
                task = asyncio.create_task(critical())
        bulk_done = time.monotonic()
        assert task is not None
        await task
        await bulk.close()
        await crit.close()
        return tokens, crit_done, bulk_done

    tokens, crit_done, bulk_done = asyncio.run(run())
    assert crit_done < bulk_done  # served while the batch request still had work to do
    assert tokens > 0
    values = scrape_metrics(one_slot, "sk-admin")
    assert metric(values, "vllm:num_preemptions_total") >= 1
    wait_idle(one_slot)


# ------------------------------------------------------------------ reload


def test_reload_keeps_running_requests_and_refuses_a_bad_file(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('admin_keys = ["sk-admin"]\n[tenants.a]\nkeys = ["sk-a"]\n')
    live = start_server(
        tiny_engine_config(tiny_llama_dir),
        ServerConfig(served_model_name="tiny", tenants_file=str(path)),
    )
    admin = {"Authorization": "Bearer sk-admin"}
    try:
        stream = client(live, "sk-a").completions.create(
            model="tiny", prompt="a", max_tokens=300, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = [next(iter(stream))]
        path.write_text(
            'admin_keys = ["sk-admin"]\n[tenants.a]\nkeys = ["sk-a"]\n'
            '[tenants.b]\nkeys = ["sk-b"]\npriority = "batch"\n'
        )
        r = httpx.post(f"{live.base_url}/admin/reload", headers=admin)
        assert r.status_code == 200 and r.json()["tenants"] == ["a", "b"]
        chunks += list(stream)  # the running request goes on to its end
        assert chunks[-1].choices[0].finish_reason == "length"
        assert client(live, "sk-b").models.list().data  # the new tenant's key works
        path.write_text("[tenants.a]\nkeys = ['sk-a']\nweight = -1\n")
        bad = httpx.post(f"{live.base_url}/admin/reload", headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_config"
        assert "weight" in bad.json()["error"]["message"]
        assert client(live, "sk-b").models.list().data  # the old config is still in force
        denied = httpx.post(
            f"{live.base_url}/admin/reload", headers={"Authorization": "Bearer sk-b"}
        )
        assert denied.status_code == 403
    finally:
        live.stop()


def test_slo_targets_reach_the_engine_metrics_and_dashboard_and_go_with_a_reload(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    with_slo = (
        'admin_keys = ["sk-admin"]\n[slo]\nwindow = 0.2\n[slo.critical]\nitl_p99 = 5.0\n'
        '[tenants.a]\nkeys = ["sk-a"]\npriority = "critical"\n'
        '[tenants.b]\nkeys = ["sk-b"]\nslo = {ttft_p99 = 30.0}\n'
    )
    path.write_text(with_slo)
    live = start_server(
        tiny_engine_config(tiny_llama_dir),
        ServerConfig(served_model_name="tiny", tenants_file=str(path)),
    )
    admin = {"Authorization": "Bearer sk-admin"}
    try:
        for key in ("sk-a", "sk-b"):
            client(live, key).completions.create(model="tiny", prompt="hello", max_tokens=4)
        deadline = time.monotonic() + 30
        while True:  # the engine judges a window at its next step or its idle wake-up
            values = scrape_metrics(live, "sk-admin")
            if metric(values, "kvgate:slo_windows_total") >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert metric(values, "kvgate:slo_windows_total") >= 1
        targets = {k: v for k, v in values.items() if k.startswith("kvgate:slo_target_seconds")}
        assert any('slo_group="critical"' in k and 'metric="itl_p99"' in k for k in targets)
        assert any('slo_group="tenant:b"' in k and v == 30.0 for k, v in targets.items())
        knob = 'kvgate:slo_knob{knob="token_budget",model_name="tiny",value="configured"}'
        assert values[knob] == 256
        data = httpx.get(f"{live.base_url}/dashboard/data", headers=admin).json()
        assert set(data["slo"]["tiny"]["groups"]) == {"critical", "tenant:b"}
        hidden = httpx.get(
            f"{live.base_url}/dashboard/data", headers={"Authorization": "Bearer sk-a"}
        ).json()
        assert set(hidden["slo"]["tiny"]["groups"]) == {"critical"}  # no tenant's name
        anonymous = scrape_metrics(live, "sk-a")  # a tenant's key: the aggregates
        assert any(k.startswith("kvgate:slo_target_seconds") for k in anonymous)
        assert not [k for k in anonymous if "tenant:b" in k]
        path.write_text('admin_keys = ["sk-admin"]\n[tenants.a]\nkeys = ["sk-a"]\n')
        assert httpx.post(f"{live.base_url}/admin/reload", headers=admin).status_code == 200
        client(live, "sk-a").completions.create(model="tiny", prompt="hi", max_tokens=2)
        deadline = time.monotonic() + 30
        while metric(scrape_metrics(live, "sk-admin"), "kvgate:slo_windows_total"):
            assert time.monotonic() < deadline, "the autopilot outlived its targets"
            time.sleep(0.1)
    finally:
        live.stop()
