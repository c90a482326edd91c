"""``POST /v1/embeddings`` on the real multilingual-e5-small weights: OpenAI's shape, float
and base64, ``dimensions``, a text's vector alone and in a batch of 64, the official client
and LangChain, ``input_type``, the model in ``/v1/models``, the refusals, and the tenant's
rates, usage record and access log."""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from langchain_openai import OpenAIEmbeddings
from llama_index.embeddings.openai_like import OpenAILikeEmbedding

from kvgate.retrieval.retrieval import E5Embedder
from kvgate.server.embedding_model import NAME
from tests.server.conftest import LiveServer, start_tenants_server
from tests.server.test_schema_fuzz import ANY_JSON, FUZZ, check, field

#: Outside the fast tier (scripts/test.sh --fast): the e5 encoder and a live server.
pytestmark = pytest.mark.slow

TENANTS = """
admin_keys = ["sk-admin"]
[tenants.a]
keys = ["sk-a"]
[tenants.chat-only]
keys = ["sk-chat"]
models = ["tiny"]
[tenants.both]
keys = ["sk-both"]
models = ["tiny", "multilingual-e5-small"]
[tenants.lean]
keys = ["sk-lean"]
tokens_per_minute = 60
[tenants.slow]
keys = ["sk-slow"]
requests_per_minute = 2
"""

SENTENCES = [
    "劳动者连续工作一年以上的，享受带薪年休假。",
    "How many days of paid annual leave does an employee get?",
    "用人单位应当保证劳动者每周至少休息一日。",
    "The contract ends when the agreed term expires.",
    "第五百零九条 当事人应当按照约定全面履行自己的义务。",
    "Overtime pay is at least 150% of the normal wage.",
]
#: 64 texts of mixed lengths and scripts.
BATCH = [f"{SENTENCES[i % len(SENTENCES)]} ({i}) " + "补充说明。" * (i % 7) for i in range(64)]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # float32, the precision tests/retrieval/test_e5.py holds batch-invariant: the 1e-5
    # bounds below are float32's, on any CPU (bf16's GEMMs may block rows differently).
    live = start_tenants_server(
        tiny_llama_dir, TENANTS, tmp_path_factory.mktemp("emb"), embed_precision="float32"
    )
    yield live
    live.stop()


def _post(live: LiveServer, body: dict[str, Any], key: str | None = "sk-a", **kw: Any) -> Any:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    headers.update(kw.pop("headers", {}))
    return httpx.post(f"{live.api_url}/embeddings", json=body, headers=headers, timeout=120)


def _vectors(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def _error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


@pytest.fixture(scope="module")
def local() -> E5Embedder:
    """The same model in this process: what the server's vectors must be."""
    return E5Embedder("float32")


def test_shape_usage_and_the_vectors_are_e5s_of_the_text_as_given(
    server: LiveServer, local: E5Embedder
) -> None:
    r = _post(server, {"model": NAME, "input": SENTENCES[:3]})
    body = r.json()
    assert body["object"] == "list" and body["model"] == NAME
    assert all(d["object"] == "embedding" for d in body["data"])
    got = _vectors(r)
    assert got.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    tokens = local.tokens(SENTENCES[:3])
    read = sum(len(t) + 2 for t in tokens)  # <s> and </s> are read too
    assert body["usage"] == {"prompt_tokens": read, "total_tokens": read}
    np.testing.assert_allclose(got, local.vectors(tokens), atol=1e-5)
    one = _post(server, {"model": NAME, "input": SENTENCES[0]})  # a string: one vector
    assert _vectors(one).shape == (1, 384)
    assert one.headers["x-kvgate-model-version"].startswith(f"{NAME}-")


def test_input_type_adds_e5s_prefix_as_the_store_does(
    server: LiveServer, local: E5Embedder
) -> None:
    text = SENTENCES[1]
    query = _vectors(_post(server, {"model": NAME, "input": [text], "input_type": "query"}))
    np.testing.assert_allclose(query[0], local.query(text), atol=1e-5)
    passage = _vectors(_post(server, {"model": NAME, "input": [text], "input_type": "passage"}))
    np.testing.assert_allclose(passage[0], local.passages([text])[0], atol=1e-5)
    plain = _vectors(_post(server, {"model": NAME, "input": [text]}))
    assert float(plain[0] @ query[0]) < 0.999  # as given is neither


def test_base64_is_the_float_vectors_bytes(server: LiveServer) -> None:
    floats = _vectors(_post(server, {"model": NAME, "input": SENTENCES}))
    r = _post(server, {"model": NAME, "input": SENTENCES, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]]
    )
    assert decoded.shape == (len(SENTENCES), 384)
    np.testing.assert_array_equal(decoded, floats)  # the same float32s, bit for bit


def test_dimensions_is_384_or_refused(server: LiveServer) -> None:
    assert _vectors(_post(server, {"model": NAME, "input": "x", "dimensions": 384})).shape[1] == 384
    error = _error(_post(server, {"model": NAME, "input": "x", "dimensions": 256}), 400,
                   "invalid_request_error")  # fmt: skip
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]


def test_a_text_has_the_same_vector_alone_and_in_a_batch_of_64(server: LiveServer) -> None:
    batch = _vectors(_post(server, {"model": NAME, "input": BATCH}))
    assert batch.shape == (64, 384)
    for i in (0, 17, 38, 63):
        alone = _vectors(_post(server, {"model": NAME, "input": BATCH[i]}))[0]
        np.testing.assert_allclose(batch[i], alone, atol=1e-5)


def test_the_openai_client(server: LiveServer) -> None:
    floats = _vectors(_post(server, {"model": NAME, "input": SENTENCES[:2]}))
    with openai.OpenAI(base_url=server.api_url, api_key="sk-a", max_retries=0) as client:
        made = client.embeddings.create(model=NAME, input=SENTENCES[:2])  # base64 on the wire
        assert made.model == NAME and made.usage.prompt_tokens > 0
        np.testing.assert_array_equal(np.array([d.embedding for d in made.data], "f4"), floats)
        plain = client.embeddings.create(model=NAME, input=SENTENCES[0], encoding_format="float")
        np.testing.assert_array_equal(np.array(plain.data[0].embedding, "f4"), floats[0])
        with pytest.raises(openai.NotFoundError) as missing:
            client.embeddings.create(model="text-embedding-3-small", input="x")
        assert missing.value.code == "model_not_found"


def test_langchain_embeds_documents_and_a_query(server: LiveServer) -> None:
    floats = _vectors(_post(server, {"model": NAME, "input": SENTENCES}))
    emb = OpenAIEmbeddings(
        model=NAME, base_url=server.api_url, api_key="sk-a",  # type: ignore[arg-type]
        check_embedding_ctx_length=False,
    )  # fmt: skip
    docs = emb.embed_documents(SENTENCES)
    np.testing.assert_allclose(np.array(docs, dtype=np.float32), floats, atol=1e-6)
    query = emb.embed_query(SENTENCES[1])
    np.testing.assert_allclose(np.array(query, dtype=np.float32), floats[1], atol=1e-6)


def test_llama_index_embeds_documents_and_a_query(server: LiveServer) -> None:
    floats = _vectors(_post(server, {"model": NAME, "input": SENTENCES}))
    emb = OpenAILikeEmbedding(model_name=NAME, api_base=server.api_url, api_key="sk-a",
                              embed_batch_size=8)  # fmt: skip
    docs = emb.get_text_embedding_batch(SENTENCES)
    np.testing.assert_allclose(np.array(docs, dtype=np.float32), floats, atol=1e-6)
    query = emb.get_query_embedding(SENTENCES[1])
    np.testing.assert_allclose(np.array(query, dtype=np.float32), floats[1], atol=1e-6)


def test_refusals(server: LiveServer) -> None:
    _error(_post(server, {"model": NAME, "input": ""}), 400, "invalid_request_error")
    bad = _error(_post(server, {"model": NAME, "input": ["a", ""]}), 400, "invalid_request_error")
    assert "input[1]" in bad["message"]
    _error(_post(server, {"model": NAME, "input": []}), 400, "invalid_request_error")
    ids = _error(_post(server, {"model": NAME, "input": [[1, 2, 3]]}), 400,
                 "invalid_request_error")  # fmt: skip
    assert "check_embedding_ctx_length=False" in ids["message"]
    _error(_post(server, {"model": NAME, "input": [1, 2, 3]}), 400, "invalid_request_error")
    many = _error(_post(server, {"model": NAME, "input": ["a"] * 2049}), 400, "request_too_large")
    assert "2048" in many["message"]
    long = _error(_post(server, {"model": NAME, "input": ["ok", "word " * 600]}), 400,
                  "context_length_exceeded")  # fmt: skip
    assert "input[1]" in long["message"] and "512" in long["message"]
    _error(_post(server, {"model": NAME, "input": "x", "encoding_format": "int8"}), 400,
           "invalid_request_error")  # fmt: skip
    _error(_post(server, {"model": "gpt-4", "input": "x"}), 404, "model_not_found")
    chat = _error(_post(server, {"model": "tiny", "input": "x"}), 404, "model_not_found")
    assert "chat model" in chat["message"]
    _error(_post(server, {"model": NAME, "input": "x"}, key=None), 401, "invalid_api_key")
    _error(_post(server, {"model": NAME, "input": "x"}, key="sk-wrong"), 401, "invalid_api_key")
    _error(_post(server, {"model": NAME, "input": "x"}, key="sk-chat"), 403, "model_not_allowed")
    # The embedding model named on a route that generates: a 404 that says where it is.
    r = httpx.post(
        f"{server.api_url}/chat/completions",
        json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": "Bearer sk-a"},
    )
    assert "/v1/embeddings" in _error(r, 404, "model_not_found")["message"]


def test_models_lists_the_embedder_where_the_tenant_may_use_it(server: LiveServer) -> None:
    def ids(key: str) -> list[str]:
        r = httpx.get(f"{server.api_url}/models", headers={"authorization": f"Bearer {key}"})
        return [m["id"] for m in r.json()["data"]]

    assert ids("sk-a") == ["tiny", NAME] and ids("sk-chat") == ["tiny"]
    assert ids("sk-both") == ["tiny", NAME]  # a tenant's models list names it
    assert _post(server, {"model": NAME, "input": "x"}, key="sk-both").status_code == 200
    with openai.OpenAI(base_url=server.api_url, api_key="sk-a", max_retries=0) as client:
        card = client.models.retrieve(NAME).model_dump()
        assert card == client.models.list().data[1].model_dump()
        assert card["max_model_len"] == 512 and card["source"] == "e5-small-q4.bin"
        assert client.models.retrieve(f"intfloat/{NAME}").id == NAME
    with (
        openai.OpenAI(base_url=server.api_url, api_key="sk-chat", max_retries=0) as client,
        pytest.raises(openai.PermissionDeniedError),
    ):
        client.models.retrieve(NAME)
    with openai.OpenAI(base_url=server.api_url, api_key="sk-admin", max_retries=0) as client:
        assert str(client.models.retrieve(NAME).model_dump()["source"]).startswith("/")


def test_the_tenants_rates_hold(server: LiveServer) -> None:
    # tokens_per_minute = 60: more than it could ever hold is a 400, then the bucket runs dry.
    over = _error(_post(server, {"model": NAME, "input": "很长的文本" * 40}, key="sk-lean"), 400,
                  "tenant_limit_exceeded")  # fmt: skip
    assert over["param"] == "tokens_per_minute"
    text = "短文本" * 12  # 27 tokens: two fit in 60, a third is 21 short (21 s of refill)
    runs = [_post(server, {"model": NAME, "input": [text]}, key="sk-lean") for _ in range(3)]
    assert runs[0].json()["usage"]["prompt_tokens"] == 27
    assert [r.status_code for r in runs] == [200, 200, 429]
    assert runs[-1].json()["error"]["code"] == "rate_limit_exceeded"
    # requests_per_minute = 2: one request, however many inputs.
    slow = [_post(server, {"model": NAME, "input": SENTENCES}, key="sk-slow") for _ in range(3)]
    assert [r.status_code for r in slow] == [200, 200, 429]
    assert slow[-1].json()["error"]["code"] == "rate_limit_exceeded"


def test_usage_is_recorded_in_the_ledger_and_the_access_log(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvgate.access"):
        r = _post(server, {"model": NAME, "input": SENTENCES[:4]},
                  headers={"x-request-id": "emb-usage-1"})  # fmt: skip
        tokens = r.json()["usage"]["prompt_tokens"]

        def logged() -> list[dict[str, Any]]:
            lines = [
                json.loads(x.getMessage()) for x in caplog.records if x.name == "kvgate.access"
            ]
            return [x for x in lines if x["request_id"] == "emb-usage-1"]

        deadline = time.monotonic() + 5  # written once the response is over
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.01)
    (line,) = logged()
    assert line["tenant"] == "a" and line["model"] == NAME and line["prompt_tokens"] == tokens
    usage = httpx.get(
        f"{server.base_url}/admin/usage", params={"tenant": "a"},
        headers={"authorization": "Bearer sk-admin"},
    ).json()  # fmt: skip
    (record,) = [x for x in usage["records"] if x["request_id"] == "emb-usage-1"]
    assert record["model"] == NAME and record["status"] == "settled"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (tokens, 0)


#: Bodies of every shape, mostly plausible (test_schema_fuzz.py's way).
BODIES = st.fixed_dictionaries(
    {"input": field(st.text(max_size=20) | st.lists(st.text(max_size=8), max_size=3)
                    | st.lists(st.integers(-3, 50000), max_size=4)
                    | st.lists(st.lists(st.integers(-3, 50000), max_size=3), max_size=2))},
    optional={
        "model": field(st.sampled_from([NAME, f"intfloat/{NAME}", "tiny", "gpt-4o"])),
        "encoding_format": field(st.sampled_from(["float", "base64", "int8"])),
        "dimensions": field(st.integers(-1, 400)),
        "input_type": field(st.sampled_from(["query", "passage", "document"])),
        "user": field(st.text(max_size=5)),
    },
)  # fmt: skip


@FUZZ
@given(body=BODIES)
def test_any_body_is_answered_in_openai_shape(server: LiveServer, body: dict[str, Any]) -> None:
    check(_post(server, body))


@FUZZ
@given(raw=st.binary(max_size=40) | ANY_JSON.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_answered_in_openai_shape(server: LiveServer, raw: bytes) -> None:
    check(
        httpx.post(
            f"{server.api_url}/embeddings", content=raw,
            headers={"authorization": "Bearer sk-a", "content-type": "application/json"},
        )
    )  # fmt: skip
