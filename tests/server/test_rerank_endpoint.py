"""``POST /v1/rerank`` (and ``/rerank``, ``/v2/rerank``) on the tiny model: the Cohere / Jina
shape vLLM serves, every document scored once in (0, 1) and sorted, ``top_n``, the refusals,
and the documents charged to the caller's tenant like any generation. The tiny model's
random weights score every document 0.5 (neither Yes nor No among its top tokens): the
scores' spread and order are checked on SmolLM2 (slow tier)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.retrieval.rerank import relevance
from kvgate.server.embedding_model import NAME as EMBEDDING_MODEL
from kvgate.server.rerank_endpoint import MAX_DOCUMENTS
from tests.server.conftest import LiveServer, scrape_metrics, start_tenants_server
from tests.server.test_schema_fuzz import ANY_JSON, FUZZ, check, field

TENANTS = """
admin_keys = ["sk-admin"]
[tenants.a]
keys = ["sk-a"]
[tenants.judge]
keys = ["sk-judge"]
[tenants.slow]
keys = ["sk-slow"]
requests_per_minute = 2
[tenants.narrow]
keys = ["sk-narrow"]
max_context = 64
"""

JSON = {"content-type": "application/json"}
QUERY = "How many days of paid leave after one year of work?"
DOCUMENTS: list[Any] = [
    "An employee who has worked for one year gets five days of paid annual leave.",
    {"text": "The canteen opens at noon."},
    "Overtime is paid at one and a half times the normal wage.",
    {"text": "劳动者连续工作一年以上的，享受带薪年休假。"},
    "Paid leave is not taken during public holidays.",
]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_tenants_server(tiny_llama_dir, TENANTS, tmp_path_factory.mktemp("rerank"))
    yield live
    live.stop()


def _rerank(
    live: LiveServer, body: dict[str, Any], key: str | None = "sk-a", path: str = "/v1/rerank",
    **headers: str,
) -> httpx.Response:  # fmt: skip
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{live.base_url}{path}", json=body, headers=headers, timeout=120)


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def test_every_document_is_scored_once_and_sorted(server: LiveServer) -> None:
    r = _rerank(server, {"model": "tiny", "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "tiny" and body["id"].startswith("rerank-")
    results = body["results"]
    assert sorted(x["index"] for x in results) == list(range(len(DOCUMENTS)))  # a permutation
    scores = [x["relevance_score"] for x in results]
    assert all(0 < s < 1 for s in scores) and scores == sorted(scores, reverse=True)
    for x in results:
        given = DOCUMENTS[x["index"]]
        assert x["document"] == {"text": given if isinstance(given, str) else given["text"]}
    usage = body["usage"]
    assert usage["completion_tokens"] == len(DOCUMENTS)  # one token judged per document
    assert usage["total_tokens"] == usage["prompt_tokens"] + len(DOCUMENTS)
    assert usage["prompt_tokens"] > len(DOCUMENTS) * 20  # the question, the template, the text


def test_top_n_return_documents_and_the_other_paths(server: LiveServer) -> None:
    full = _rerank(server, {"query": QUERY, "documents": DOCUMENTS}).json()["results"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
        r = _rerank(server, body, path=path)
        assert r.status_code == 200, (path, r.text)
        top = r.json()["results"]
        assert len(top) == 2 and all(set(x) == {"index", "relevance_score"} for x in top)
        # The best two of the whole ranking (greedy, float32: the same scores each time).
        for x, want in zip(top, full[:2], strict=True):
            assert x["relevance_score"] == pytest.approx(want["relevance_score"], rel=1e-4)
    everything = _rerank(server, {"query": QUERY, "documents": DOCUMENTS, "top_n": 0})
    assert len(everything.json()["results"]) == len(DOCUMENTS)  # vLLM's 0: all


def test_refusals(server: LiveServer) -> None:
    body = {"query": QUERY, "documents": DOCUMENTS}
    _error(_rerank(server, {**body, "query": "  "}), 400, "invalid_request_error")
    _error(_rerank(server, {**body, "documents": []}), 400, "invalid_request_error")
    _error(_rerank(server, {**body, "documents": [{"txt": "x"}]}), 400, "invalid_request_error")
    many = _rerank(server, {**body, "documents": ["a"] * (MAX_DOCUMENTS + 1)})
    assert str(MAX_DOCUMENTS) in _error(many, 400, "request_too_large")["message"]
    long = _rerank(server, {**body, "documents": ["short", "word " * 700]})
    assert _error(long, 400, "context_length_exceeded")["param"] == "documents[1]"
    narrow = _rerank(server, {**body, "documents": ["one two three " * 8]}, key="sk-narrow")
    assert "Tenant 'narrow'" in _error(narrow, 400, "context_length_exceeded")["message"]
    _error(_rerank(server, {**body, "model": "gpt-4"}), 404, "model_not_found")
    embedder = _rerank(server, {**body, "model": EMBEDDING_MODEL})
    assert "embedding model" in _error(embedder, 404, "model_not_found")["message"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        _error(_rerank(server, body, key=None, path=path), 401, "invalid_api_key")
        _error(_rerank(server, body, key="sk-wrong", path=path), 401, "invalid_api_key")
        # Refused before its body is read: not a 400 for the broken JSON.
        raw = httpx.post(f"{server.base_url}{path}", content=b"{", headers=JSON)
        _error(raw, 401, "invalid_api_key")


def _generated(live: LiveServer, tenant: str) -> float:
    """Tokens the engine generated for ``tenant`` (its /metrics counter)."""
    values = scrape_metrics(live, "sk-admin")
    return sum(
        v for k, v in values.items()
        if k.startswith("kvgate:tenant_generation_tokens") and f'tenant="{tenant}"' in k
    )  # fmt: skip


def test_the_documents_are_the_tenants_requests(server: LiveServer) -> None:
    before = _generated(server, "judge")
    r = _rerank(server, {"query": QUERY, "documents": DOCUMENTS}, key="sk-judge",
                **{"x-request-id": "rerank-usage-1"})  # fmt: skip
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert _generated(server, "judge") - before == len(DOCUMENTS)  # one token each, its own
    records = httpx.get(
        f"{server.base_url}/admin/usage", params={"tenant": "judge"},
        headers={"authorization": "Bearer sk-admin"},
    ).json()["records"]  # fmt: skip
    (record,) = [x for x in records if x["request_id"] == "rerank-usage-1"]
    assert record["model"] == "tiny" and record["status"] == "settled"
    assert record["prompt_tokens"] == usage["prompt_tokens"]
    assert record["completion_tokens"] == len(DOCUMENTS)
    # requests_per_minute = 2: one request however many documents.
    codes = [
        _rerank(server, {"query": QUERY, "documents": DOCUMENTS}, key="sk-slow").status_code
        for _ in range(3)
    ]
    assert codes == [200, 200, 429]


#: Bodies of every shape, mostly plausible (test_schema_fuzz.py's way).
BODIES = st.fixed_dictionaries(
    {"query": field(st.text(max_size=16)),
     "documents": field(st.lists(st.text(max_size=12)
                                 | st.fixed_dictionaries({"text": st.text(max_size=12)}),
                                 max_size=3))},
    optional={
        "model": field(st.sampled_from(["tiny", "gpt-4o", EMBEDDING_MODEL])),
        "top_n": field(st.integers(-1, 4)),
        "return_documents": field(st.booleans()),
    },
)  # fmt: skip


@pytest.mark.slow  # hypothesis fuzzing, as test_schema_fuzz.py
@FUZZ
@given(path=st.sampled_from(["/v1/rerank", "/rerank", "/v2/rerank"]), body=BODIES)
def test_any_body_is_answered_in_openai_shape(
    server: LiveServer, path: str, body: dict[str, Any]
) -> None:
    check(_rerank(server, body, path=path))


@pytest.mark.slow
@FUZZ
@given(raw=st.binary(max_size=40) | ANY_JSON.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_answered_in_openai_shape(server: LiveServer, raw: bytes) -> None:
    check(
        httpx.post(
            f"{server.base_url}/v1/rerank", content=raw,
            headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
        )
    )  # fmt: skip


def test_relevance_is_the_sigmoid_of_the_log_odds() -> None:
    assert relevance(0.0) == 0.5
    assert relevance(math.log(3)) == pytest.approx(0.75)  # P(yes) = 3 P(no)
    assert relevance(-math.log(3)) == pytest.approx(0.25)
    assert relevance(-1000.0) == 0.0 and relevance(1000.0) == 1.0  # no overflow


@pytest.mark.slow
def test_a_real_model_judges_the_documents_apart(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    """On SmolLM2-135M-Instruct (the tiny model's random weights never put Yes or No among
    their top tokens: every score is 0.5 there): the scores differ and sort the results."""
    from kvgate.config import EngineConfig
    from kvgate.server.config import ServerConfig
    from tests.server.conftest import start_server

    live = start_server(
        EngineConfig(model=str(smollm2_gguf_path), kv_cache_memory="128MiB", max_model_len=1024),
        ServerConfig(served_model_name="smollm2", data_dir=str(tmp_path / "data")),
    )
    try:
        r = _rerank(live, {"model": "smollm2", "query": QUERY, "documents": DOCUMENTS}, key=None)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
    finally:
        live.stop()
    scores = [x["relevance_score"] for x in results]
    assert sorted(x["index"] for x in results) == list(range(len(DOCUMENTS)))
    assert all(0 < s < 1 for s in scores) and scores == sorted(scores, reverse=True)
    assert len(set(scores)) == len(DOCUMENTS)  # judged, not tied at 0.5
