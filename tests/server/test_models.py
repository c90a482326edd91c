"""Several models in one server: a tiny Llama and a tiny Qwen3, each with its own engine and
KV pool (one budget split 3:1), requests routed by ``model``, tenants limited to some
models, one rate limit across both, and every engine figure labelled by model."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.governance.tenants import TenantSpec
from kvgate.launch.settings import engine_config, models_to_serve, parse_serve, server_config
from kvgate.server.embedding_model import NAME as EMBEDDING_MODEL
from kvgate.server.errors import ModelNotAllowed, ModelNotServed
from kvgate.server.models import ModelSlot, ServedModels
from kvgate.tokenizer import Tokenizer
from tests.server.conftest import LiveServer, scrape_metrics, start_server, wait_idle
from tests.tiny_model import build_tiny_qwen3

TENANTS = """
admin_keys = ["sk-admin"]

[tenants.both]
keys = ["sk-both"]

[tenants.llama-only]
keys = ["sk-llama"]
models = ["llama"]

[tenants.qwen-only]
keys = ["sk-qwen"]
models = ["qwen"]

[tenants.limited]
keys = ["sk-limited"]
requests_per_minute = 3
"""

PROMPT = "The two models must not answer alike"
BUDGET = 32 * 2**20


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def two_models(
    tiny_llama_dir: Path, tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    tenants.write_text(TENANTS)
    # As `kvgate serve` reads its command line: two --model, one budget, weights 3 and 1.
    args = parse_serve([
        "--tenants", str(tenants), "--dtype", "float32", "--max-model-len", "512",
        "--kv-cache-memory", str(BUDGET), "--max-num-batched-tokens", "256",
        "--model", str(tiny_llama_dir), "--served-model-name", "llama", "--kv-weight", "3",
        "--model", str(tiny_qwen3_dir), "--served-model-name", "qwen",
    ])  # fmt: skip
    models = models_to_serve(args, engine_config(args))
    live = start_server({m.name: m.engine for m in models}, server_config(args, models))
    yield live
    live.stop()


def _client(live: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.api_url, api_key=key, max_retries=0)


def _offline(model_dir: Path) -> str:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=512)
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return out[0].text


def _complete(live: LiveServer, key: str, model: str | None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    body["ignore_eos"] = True
    if model is not None:
        body["model"] = model
    return httpx.post(
        f"{live.api_url}/completions",
        json={**body, **extra},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


def test_each_model_has_its_own_pool_from_one_split_budget(two_models: LiveServer) -> None:
    slots = two_models.state.models.slots
    pools = {}
    for name, slot in slots.items():
        assert slot.serving is not None
        pools[name] = slot.serving.engine.engine.kv_pool
    llama, qwen = pools["llama"], pools["qwen"]
    assert llama is not qwen
    assert llama.bytes + qwen.bytes <= BUDGET
    # 3:1 of the budget, each rounded down to whole blocks.
    assert abs(llama.bytes - BUDGET * 3 / 4) < llama.bytes / llama.num_blocks
    assert abs(qwen.bytes - BUDGET / 4) < qwen.bytes / qwen.num_blocks
    health = httpx.get(f"{two_models.base_url}/health").json()
    assert health["status"] == "ok" and health["models"] == {"llama": "ready", "qwen": "ready"}


def test_requests_go_to_the_model_they_name(
    two_models: LiveServer, tiny_llama_dir: Path, tiny_qwen3_dir: Path
) -> None:
    expected = {"llama": _offline(tiny_llama_dir), "qwen": _offline(tiny_qwen3_dir)}
    assert expected["llama"] != expected["qwen"]  # so routing is what makes the match
    client = _client(two_models, "sk-both")
    for name, text in expected.items():
        got = client.completions.create(
            model=name, prompt=PROMPT, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert got.model == name and got.choices[0].text == text
        stream = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            stream=True,
        )  # fmt: skip
        assert {chunk.model for chunk in stream} == {name}
    # No model named: the first one the tenant may use.
    assert _complete(two_models, "sk-both", None).json()["choices"][0]["text"] == expected["llama"]
    assert _complete(two_models, "sk-qwen", None).json()["choices"][0]["text"] == expected["qwen"]


def test_both_engines_run_at_once(two_models: LiveServer) -> None:
    results: dict[str, int] = {}

    def run(name: str) -> None:
        r = _complete(two_models, "sk-both", name, max_tokens=40)
        results[name] = r.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=run, args=(n,)) for n in ("llama", "qwen") * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {"llama": 40, "qwen": 40}
    wait_idle(two_models)  # every model's engine


def test_models_lists_what_the_tenant_may_use(two_models: LiveServer) -> None:
    def ids(key: str) -> list[str]:
        return [m.id for m in _client(two_models, key).models.list().data]

    # The embedding model after the chat models, for the tenants whose ``models`` allow it.
    assert ids("sk-both") == ["llama", "qwen", EMBEDDING_MODEL]
    assert ids("sk-llama") == ["llama"]
    assert ids("sk-qwen") == ["qwen"]


def test_a_tenant_sees_no_paths_and_the_admin_key_does(two_models: LiveServer) -> None:
    def cards(key: str) -> list[dict[str, object]]:
        resp = httpx.get(
            f"{two_models.base_url}/v1/models", headers={"authorization": f"Bearer {key}"}
        )
        assert resp.status_code == 200
        data: list[dict[str, object]] = resp.json()["data"]
        return data

    admin = {c["id"]: c["source"] for c in cards("sk-admin")}
    assert all(str(src).startswith("/") for src in admin.values()), admin
    for card in cards("sk-both"):
        source = str(card["source"])
        assert "/" not in source and source == Path(str(admin[card["id"]])).name, card


def test_one_model_is_retrieved_as_listed(two_models: LiveServer) -> None:
    client = _client(two_models, "sk-llama")
    model = client.models.retrieve("llama")
    assert model.id == "llama" and model.object == "model"
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.PermissionDeniedError):
        client.models.retrieve("qwen")  # served, but not to this tenant
    admin = _client(two_models, "sk-admin")
    assert str(admin.models.retrieve("qwen").model_dump()["source"]).startswith("/")
    with pytest.raises(openai.NotFoundError):
        admin.models.retrieve("gpt-4")


def test_a_model_the_tenant_may_not_use_is_403_and_unknown_ones_404(
    two_models: LiveServer,
) -> None:
    r = _complete(two_models, "sk-llama", "qwen")
    assert r.status_code == 403
    err = r.json()["error"]
    assert err["code"] == "model_not_allowed" and err["param"] == "model"
    assert "'llama'" in err["message"]  # what it may use instead
    with pytest.raises(openai.PermissionDeniedError):
        _client(two_models, "sk-llama").chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": "hi"}]
        )
    r = _complete(two_models, "sk-both", "gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    tok = httpx.post(
        f"{two_models.base_url}/tokenize",
        json={"model": "qwen", "prompt": "hi"},
        headers={"authorization": "Bearer sk-llama"},
    )
    assert tok.status_code == 403
    # Refusals are counted for the tenant under their code.
    values = scrape_metrics(two_models, "sk-admin")
    assert (
        values['kvgate:tenant_refusals_total{reason="model_not_allowed",tenant="llama-only"}'] >= 3
    )


def test_a_rate_limit_holds_across_models(two_models: LiveServer) -> None:
    statuses = [_complete(two_models, "sk-limited", m).status_code for m in ("llama", "qwen")]
    statuses.append(_complete(two_models, "sk-limited", "qwen").status_code)
    assert statuses == [200, 200, 200]
    refused = _complete(two_models, "sk-limited", "llama")
    assert refused.status_code == 429  # 3 per minute, whichever models they went to
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_metrics_and_accounting_are_per_model(two_models: LiveServer) -> None:
    for slot in two_models.state.models:
        assert slot.serving is not None
        wait_idle(two_models)
    before = scrape_metrics(two_models, "sk-admin")
    assert _complete(two_models, "sk-qwen", "qwen", max_tokens=7).status_code == 200
    wait_idle(two_models)
    after = scrape_metrics(two_models, "sk-admin")

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta('vllm:generation_tokens_total{model_name="qwen"}') == 7
    assert delta('vllm:generation_tokens_total{model_name="llama"}') == 0
    assert delta('kvgate:tenant_generation_tokens_total{model_name="qwen",tenant="qwen-only"}') == 7
    for name in ("llama", "qwen"):
        for family in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            assert f'{family}{{model_name="{name}"}}' in after
    # One family per name in the exposition, whatever the number of models.
    text = httpx.get(
        f"{two_models.base_url}/metrics", headers={"authorization": "Bearer sk-admin"}
    ).text
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names))
    info = [line for line in text.splitlines() if line.startswith("kvgate:build_info{")]
    assert len(info) == 2
    # /admin/tenants: the tenant's figures over both models, and each model's.
    row = httpx.get(
        f"{two_models.base_url}/admin/tenants", headers={"authorization": "Bearer sk-admin"}
    ).json()["tenants"]["qwen-only"]
    assert set(row["models"]) == {"llama", "qwen"}
    qwen_pool = two_models.state.models.slots["qwen"].serving
    assert qwen_pool is not None
    assert row["models"]["qwen"]["kv_ceiling_blocks"] == qwen_pool.engine.engine.kv_pool.num_blocks
    assert row["generation_tokens"] == sum(m["generation_tokens"] for m in row["models"].values())


# ------------------------------------------------------------------ routing, without a server


def _models() -> ServedModels:
    def never(*_: Any) -> Any:
        raise AssertionError("not loaded in these tests")

    return ServedModels([ModelSlot("a", never), ModelSlot("b", never)])


def test_routing_rules() -> None:
    models = _models()
    anyone = TenantSpec("t")
    only_b = TenantSpec("u", models=("b",))
    assert models.slot_for(None, anyone).name == "a"
    assert models.slot_for(None, only_b).name == "b"
    assert models.slot_for("b", anyone).name == "b"
    with pytest.raises(ModelNotAllowed, match="may use 'b'"):
        models.slot_for("a", only_b)
    with pytest.raises(ModelNotServed, match="'a', 'b'"):
        models.slot_for("c", anyone)
    nothing = TenantSpec("v", models=("z",))
    with pytest.raises(ModelNotAllowed):
        models.slot_for(None, nothing)
    assert models.slots["a"].status == "loading"
    with pytest.raises(ValueError, match="same served name"):
        ServedModels([ModelSlot("a", print), ModelSlot("a", print)])  # type: ignore[arg-type]


def test_a_model_serves_while_the_next_one_still_loads(tiny_llama_dir: Path) -> None:
    import gc
    import time

    from fastapi.testclient import TestClient

    from kvgate.engine.async_llm import AsyncLLM
    from kvgate.engine.policy import SchedulingPolicy
    from kvgate.engine.stats import StatsListener
    from kvgate.launch.server import engine_loader
    from kvgate.server.app import build_app
    from kvgate.server.config import ServerConfig
    from tests.conftest import tiny_engine_config

    release = threading.Event()
    load = engine_loader(tiny_engine_config(tiny_llama_dir, kv_cache_memory="8MiB"), 8)

    def slow(listeners: Sequence[StatsListener], policy: SchedulingPolicy | None) -> AsyncLLM:
        release.wait(30)
        return load(listeners, policy)

    app = build_app(ServerConfig(served_model_name="first"), {"first": load, "second": slow})
    with TestClient(app) as http:
        deadline = time.monotonic() + 30
        while http.get("/health").json().get("models", {}).get("first") != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        health = http.get("/health")
        assert health.status_code == 503
        assert health.json() == {
            "status": "loading",
            "models": {"first": "ready", "second": "loading"},
        }
        body = {"prompt": "hi", "max_tokens": 2}
        assert http.post("/v1/completions", json={**body, "model": "first"}).status_code == 200
        r = http.post("/v1/completions", json={**body, "model": "second"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert "'second'" in r.json()["error"]["message"] and r.headers["retry-after"] == "5"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [
            "first",
            EMBEDDING_MODEL,
        ]
        gc.unfreeze()
        release.set()
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert http.post("/v1/completions", json={**body, "model": "second"}).status_code == 200
