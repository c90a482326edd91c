"""LoRA adapters over the API (``server/lora_routes.py``): ``--lora-modules`` at start,
loading and unloading while a stream on the base model goes on, selecting an adapter by
``model``, tenants limited to their own adapters, and the errors."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from kvgate.engine.llm_engine import LLMEngine
from kvgate.sampling_params import SamplingParams
from tests.conftest import tiny_engine_config
from tests.engine.test_lora_engine import make_adapter
from tests.hf_reference import hf_greedy
from tests.server.conftest import MODEL, LiveServer, start_tenants_server
from tests.tiny_model import TINY_LLAMA

ADMIN = {"Authorization": "Bearer sk-admin"}
ONE = {"Authorization": "Bearer sk-one"}  # may use the base and adapters a and b
TWO = {"Authorization": "Bearer sk-two"}  # the base only
TENANTS = """
admin_keys = ["sk-admin"]
[tenants.one]
keys = ["sk-one"]
models = ["tiny", "a", "b"]
[tenants.two]
keys = ["sk-two"]
models = ["tiny"]
"""
PROMPT = [random.Random(5).randrange(100, 49152) for _ in range(20)]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Adapters ``a`` and ``b`` of the tiny Llama, one of another base model, and ``a``'s
    and ``b``'s greedy continuations of PROMPT in transformers + peft."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora-api")
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    peft_a = make_adapter(hf, root / "a", seed=31)
    peft_b = make_adapter(hf, root / "b", seed=32, r=4, target_modules=["q_proj", "v_proj"])
    other = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "hidden_size": 32})).eval()
    make_adapter(other, root / "other", seed=33)
    return {
        "root": root,
        "ref": {
            n: hf_greedy(m, [PROMPT], NEW_TOKENS)[0] for n, m in (("a", peft_a), ("b", peft_b))
        },
    }


@pytest.fixture(scope="module")
def live(
    tiny_llama_dir: Path, adapters: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    server = start_tenants_server(
        tiny_llama_dir,
        TENANTS,
        tmp_path_factory.mktemp("lora-tenants"),
        engine={"lora_modules": (("a", str(adapters["root"] / "a")),)},
    )
    yield server
    server.stop()


def _complete(live: LiveServer, model: str, headers: dict[str, str]) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0}
    return httpx.post(f"{live.api_url}/completions", json=body, headers=headers, timeout=60)


def _engine_text(tiny_llama_dir: Path, root: Path, name: str) -> tuple[list[int], str]:
    """The adapter's greedy tokens and text through an ``LLMEngine`` of its own."""
    engine = LLMEngine(tiny_engine_config(tiny_llama_dir, lora_modules=((name, str(root / name)),)))
    engine.add_request("ref", PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                     lora_name=name))  # fmt: skip
    tokens, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.text
    return tokens, text


def test_an_adapter_from_the_start_is_listed_and_served(
    live: LiveServer, adapters: dict[str, Any], tiny_llama_dir: Path
) -> None:
    cards = httpx.get(f"{live.api_url}/models", headers=ONE).json()["data"]
    [card] = [c for c in cards if c["id"] == "a"]
    assert card["parent"] == MODEL and card["root"] == "a"  # the directory's name, no path
    others = httpx.get(f"{live.api_url}/models", headers=TWO).json()["data"]
    assert "a" not in [c["id"] for c in others]
    tokens, text = _engine_text(tiny_llama_dir, adapters["root"], "a")
    assert tokens == adapters["ref"]["a"]
    r = _complete(live, "a", ONE)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text
    assert r.json()["model"] == "a"  # the adapter's name, as vLLM answers
    assert _complete(live, MODEL, ONE).json()["choices"][0]["text"] != text


def test_another_tenants_adapter_is_403(live: LiveServer) -> None:
    r = _complete(live, "a", TWO)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "model_not_allowed"


def test_load_and_unload_while_a_base_stream_goes_on(
    live: LiveServer, adapters: dict[str, Any], tiny_llama_dir: Path
) -> None:
    chunks: list[str] = []

    def stream() -> None:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", f"{live.api_url}/completions", json=body, headers=ONE,
                          timeout=120) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:])["choices"][0].get("finish_reason"))

    t = threading.Thread(target=stream)
    t.start()
    path = str(adapters["root"] / "b")
    r = httpx.post(f"{live.api_url}/load_lora_adapter", headers=ADMIN,
                   json={"lora_name": "b", "lora_path": path}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    again = httpx.post(f"{live.api_url}/load_lora_adapter", headers=ADMIN,
                       json={"lora_name": "b", "lora_path": path}, timeout=60)  # fmt: skip
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    _, text = _engine_text(tiny_llama_dir, adapters["root"], "b")
    got = _complete(live, "b", ONE)
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == text
    r = httpx.post(f"{live.api_url}/unload_lora_adapter", headers=ADMIN, json={"lora_name": "b"})
    assert r.status_code == 200, r.text
    assert _complete(live, "b", ONE).status_code == 404
    t.join(120)
    assert chunks and chunks[-1] == "length"  # the base stream ran to its end meanwhile


def test_the_errors(live: LiveServer, adapters: dict[str, Any]) -> None:
    url, root = live.api_url, adapters["root"]
    body = {"lora_name": "o", "lora_path": str(root / "other")}
    for headers in (ONE, {}):  # not an admin key
        r = httpx.post(f"{url}/load_lora_adapter", headers=headers, json=body)
        assert r.status_code in (401, 403), r.text
    r = httpx.post(f"{url}/load_lora_adapter", headers=ADMIN, json=body, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert (
        "'o'" in message
        and "down_proj.lora_B.weight' has shape [32, 8], expected [64, 8]" in message
    ), message
    missing = {"lora_name": "m", "lora_path": str(root / "missing")}
    r = httpx.post(f"{url}/load_lora_adapter", headers=ADMIN, json=missing, timeout=60)
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/unload_lora_adapter", headers=ADMIN, json={"lora_name": "nope"})
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
    assert _complete(live, "nope", ONE).status_code == 404
