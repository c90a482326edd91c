"""End to end: the official ``openai`` client against a real uvicorn on 127.0.0.1."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import httpx
import openai
import pytest

from kvgate import SamplingParams
from kvgate.entrypoints.llm import LLM
from kvgate.model import cpu_isa
from kvgate.server.embedding_model import NAME as EMBEDDING_MODEL
from tests.server.conftest import API_KEY, MODEL, LiveServer, metric, scrape_metrics, wait_idle

PROMPT_IDS = [400, 401, 402, 403, 404, 405]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.api_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLM:
    """The offline engine on the same weights: what the server must return, token for token."""
    return LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=512)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    # The chat model, then the documents' embedder (/v1/embeddings): the test install has it.
    assert [m.id for m in models.data] == [MODEL, EMBEDDING_MODEL]


def test_greedy_completion_matches_the_offline_engine(
    client: openai.OpenAI, reference: LLM
) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    (expected,) = reference.generate(
        [PROMPT_IDS], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (6, 12)
    assert resp.usage.total_tokens == 18


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(
            **kwargs,  # type: ignore[call-overload]
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_whole_and_streamed(client: openai.OpenAI) -> None:
    messages: list[dict[str, object]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
    ]
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=15,
        temperature=0,  # type: ignore[arg-type]
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens <= 15
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=15,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == ""
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    with_reason = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(with_reason) == 1 and with_reason[0] is chunks[-2]
    assert with_reason[0].choices[0].finish_reason == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices_and_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        resp = client.completions.create(
            model=MODEL,
            prompt="The weather today",
            max_tokens=10,
            temperature=1.0,
            n=2,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        assert sorted(c.index for c in resp.choices) == [0, 1]
        assert resp.usage is not None and resp.usage.completion_tokens == 20
        return [c.text for c in sorted(resp.choices, key=lambda c: c.index)]

    first, again = sample(), sample()
    assert first == again
    assert first[0] != first[1]  # choice j samples with seed + j


def test_n_choices_stream_under_one_id(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            n=2,
            seed=7,
            stream=True,
        )
    )
    assert len({c.id for c in chunks}) == 1
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert mine[-1].finish_reason is not None
        assert all(m.finish_reason is None for m in mine[:-1])


def test_stop_string_is_honoured_and_never_emitted(client: openai.OpenAI, reference: LLM) -> None:
    (free,) = reference.generate(
        [PROMPT_IDS], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    stop = free.text[8:11]
    assert stop.strip(), "the reference text is too short to pick a stop string from"
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=24, temperature=0, stop=[stop]
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == free.text[: free.text.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPT_IDS, max_tokens=24, temperature=0, stop=stop, stream=True
        )
        if c.choices
    )
    assert streamed == choice.text


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    for item in lp.content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert [t.logprob for t in item.top_logprobs] == sorted(
            (t.logprob for t in item.top_logprobs), reverse=True
        )
    raw = b"".join(bytes(item.bytes or []) for item in lp.content)
    assert raw.decode("utf-8", errors="replace") == resp.choices[0].message.content


def test_completion_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT_IDS, max_tokens=4, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert lp.top_logprobs is not None and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset is not None and lp.text_offset[0] == 0


# ------------------------------------------------------------------ errors


def test_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=600)
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "context_length_exceeded"
    assert err["type"] == "invalid_request_error"
    assert "512" in err["message"]


def test_wrong_type_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens="ten",  # type: ignore[arg-type]
        )
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "max_tokens"


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    err = info.value.body
    assert isinstance(err, dict) and err["code"] == "model_not_found" and err["param"] == "model"


def test_missing_or_wrong_key_is_a_401(live_server: LiveServer) -> None:
    for key in ("sk-wrong", ""):
        bad = openai.OpenAI(base_url=live_server.api_url, api_key=key or "x", max_retries=0)
        if not key:
            bad = bad.with_options(default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        err = info.value.body
        assert isinstance(err, dict) and err["code"] == "invalid_api_key"


def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_body={"some_future_field": {"a": 1}}
    )
    assert resp.usage is not None and resp.usage.completion_tokens <= 2


def test_malformed_json_is_a_400(live_server: LiveServer) -> None:
    r = httpx.post(
        f"{live_server.api_url}/completions",
        content=b'{"prompt": "hi", "max_tokens": ',
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------ ids, logs, other routes


def test_request_id_header_and_access_log(
    live_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "x-request-id": "trace-123"}
    with caplog.at_level(logging.INFO, logger="kvgate.access"):
        r = httpx.post(
            f"{live_server.api_url}/completions",
            json={"prompt": "abc", "max_tokens": 3, "ignore_eos": True},
            headers=headers,
        )
        generated = httpx.get(f"{live_server.base_url}/health")

        def logged() -> list[dict[str, object]]:
            lines = [
                json.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"
            ]
            return [x for x in lines if x["request_id"] == "trace-123"]

        # The line is written once the response is over, which may be just after the client
        # has it.
        deadline = time.monotonic() + 5
        while not logged() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-123"
    assert r.json()["id"] == "cmpl-trace-123"
    assert len(generated.headers["x-request-id"]) == 32
    (line,) = logged()
    assert line["tenant"] == "team-a" and line["status"] == 200
    assert line["completion_tokens"] == 3 and line["prompt_tokens"] >= 1
    assert line["ttft_s"] >= 0 and line["duration_s"] >= line["ttft_s"]


def test_tokenize_detokenize_round_trip(live_server: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    text = "Hello 世界 🎉"
    tok = httpx.post(f"{live_server.base_url}/tokenize", json={"prompt": text}, headers=auth)
    assert tok.status_code == 200 and tok.json()["count"] == len(tok.json()["tokens"])
    detok = httpx.post(
        f"{live_server.base_url}/detokenize", json={"tokens": tok.json()["tokens"]}, headers=auth
    )
    assert detok.json()["prompt"] == text
    chat = httpx.post(
        f"{live_server.base_url}/tokenize",
        json={"messages": [{"role": "user", "content": text}]},
        headers=auth,
    )
    assert chat.json()["count"] > tok.json()["count"]  # the template adds role markers
    bad = httpx.post(f"{live_server.base_url}/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics_count_the_traffic(live_server: LiveServer, client: openai.OpenAI) -> None:
    wait_idle(live_server)

    def scrape() -> dict[str, float]:
        values = scrape_metrics(live_server)
        return {name.split("{")[0]: metric(values, name.split("{")[0]) for name in values}

    before = scrape()
    for _ in range(3):
        client.completions.create(
            model=MODEL, prompt=list(range(500, 540)), max_tokens=4, extra_body={"ignore_eos": True}
        )
    wait_idle(live_server)
    after = scrape()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("vllm:prompt_tokens_total") == 3 * 40
    assert delta("vllm:generation_tokens_total") == 3 * 4
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 3 * 3
    assert delta("vllm:prefix_cache_queries_total") == 3 * 40
    # 40 tokens = 2 full blocks of 16; the 2nd and 3rd requests reuse both.
    assert delta("vllm:prefix_cache_hits_total") == 2 * 32
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_build_info_names_the_kernel_path_of_each_op(live_server: LiveServer) -> None:
    (info,) = [name for name in scrape_metrics(live_server) if name.startswith("kvgate:build_info")]
    labels = dict(part.split("=") for part in info.split("{")[1].rstrip("}").split(","))
    labels = {key: value.strip('"') for key, value in labels.items()}
    assert labels["isa"] == cpu_isa.default_level()
    assert {"dtype", "linear", "attention", "elementwise", "decode", "torch"} <= set(labels)
    assert scrape_metrics(live_server)[info] == 1


def test_usage_carries_the_request_profile(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=list(range(600, 640)), max_tokens=5, extra_body={"ignore_eos": True}
    )
    resp = raw.parse()
    assert resp.usage is not None and resp.usage.model_extra is not None
    profile = resp.usage.model_extra["profile"]
    assert set(profile) == {"queue_seconds", "prefill_seconds", "decode_seconds", "peak_kv_blocks"}
    assert profile["peak_kv_blocks"] == 3  # 40 prompt + 5 new tokens in blocks of 16
    assert profile["prefill_seconds"] > 0 and profile["decode_seconds"] > 0
    assert raw.headers["x-kvgate-peak-kv-blocks"] == "3"
    assert float(raw.headers["x-kvgate-decode-seconds"]) == profile["decode_seconds"]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=list(range(600, 640)), max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    usage = chunks[-1].usage
    assert usage is not None and usage.model_extra is not None
    assert usage.model_extra["profile"]["peak_kv_blocks"] == 3
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 32  # the first run's two full blocks
