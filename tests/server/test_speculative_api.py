"""The ``speculative`` request field over HTTP: refused by name where the server drafts
nothing, honoured (and opted out of) where it was started with ``--speculative ngram``, with
the same tokens either way; drafts counted by vLLM's metric names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvgate.engine.stats import IterationStats
from kvgate.server.config import ServerConfig
from kvgate.server.metrics import PrometheusStatsListener
from tests.conftest import tiny_engine_config
from tests.server.conftest import (
    API_KEY,
    METRICS_KEY,
    MODEL,
    LiveServer,
    metric,
    start_server,
    wait_idle,
)

PROMPT = [100, 200, 300, 400] * 24


@pytest.fixture(scope="module")
def spec_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    live = start_server(
        tiny_engine_config(tiny_llama_dir, speculative="ngram"),
        ServerConfig(served_model_name=MODEL, metrics_keys=(METRICS_KEY,)),
    )
    yield live
    live.stop()


def _complete(live: LiveServer, **extra: object) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **extra}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(f"{live.api_url}/completions", json=body, headers=headers, timeout=60)


def test_asking_a_server_without_drafts_to_speculate_is_a_400_naming_the_field(
    live_server: LiveServer,
) -> None:
    for path, body in [
        ("/completions", {"prompt": "hi", "max_tokens": 2, "speculative": True}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 2, "speculative": True}),
    ]:  # fmt: skip
        resp = httpx.post(
            f"{live_server.api_url}{path}",
            json={"model": MODEL, **body},
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=30,
        )
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "speculative" and "--speculative" in err["message"]
    ok = httpx.post(
        f"{live_server.api_url}/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "speculative": False},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert ok.status_code == 200, ok.text
    resp = httpx.post(
        f"{live_server.api_url}/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "speculative": "yes please"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "speculative"


def test_a_speculating_server_gives_the_tokens_an_opted_out_request_gets(
    spec_server: LiveServer,
) -> None:
    opted_out = _complete(spec_server, speculative=False)
    default = _complete(spec_server)
    asked = _complete(spec_server, speculative=True)
    assert opted_out.status_code == default.status_code == asked.status_code == 200
    texts = {r.json()["choices"][0]["text"] for r in (opted_out, default, asked)}
    assert len(texts) == 1
    usage = {r.json()["usage"]["completion_tokens"] for r in (opted_out, default, asked)}
    assert len(usage) == 1
    wait_idle(spec_server)


def test_drafts_are_counted_by_vllms_names() -> None:
    registry = CollectorRegistry()
    listener = PrometheusStatsListener(registry).for_model("m")
    listener.on_step(IterationStats(num_drafts=3, num_draft_tokens=10, num_accepted_tokens=7))
    listener.on_step(IterationStats(num_drafts=1, num_draft_tokens=4, num_accepted_tokens=0))
    text = generate_latest(registry).decode()
    values = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:spec_decode")
    }
    assert metric(values, "vllm:spec_decode_num_drafts_total") == 4
    assert metric(values, "vllm:spec_decode_num_draft_tokens_total") == 14
    assert metric(values, "vllm:spec_decode_num_accepted_tokens_total") == 7
