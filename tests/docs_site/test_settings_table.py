"""The settings reference (docs/operator/settings.md) is the parsers' own output: it lists
every ``kvgate serve`` and ``kvgate rollout`` flag with its default, and cannot drift."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from kvgate.entrypoints import settings_docs
from kvgate.entrypoints.cli import build_parser

PAGE = settings_docs.DEFAULT_PATH


def _flags(command: str) -> list[argparse.Action]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in sub.choices[command]._actions if not isinstance(a, argparse._HelpAction)]


def test_the_committed_page_is_what_the_parsers_generate() -> None:
    assert PAGE.read_text(encoding="utf-8") == settings_docs.render(), (
        f"{PAGE} is stale: run .venv/bin/python -m kvgate.entrypoints.settings_docs"
    )


@pytest.mark.parametrize("command", ["serve", "rollout"])
def test_every_flag_is_on_the_page_with_its_default(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in settings_docs.ENV_DEFAULTS:  # the page shows the defaults without them
        monkeypatch.delenv(name, raising=False)
    page = PAGE.read_text(encoding="utf-8")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines()}
    for action in _flags(command):
        name = next((n for n in action.option_strings if n.startswith("--")), None)
        row = rows.get(f"`{name}`" if name else f"`{action.dest.upper()}`")
        assert row is not None, f"kvgate {command}: {name or action.dest} is not on the page"
        if action.default not in (None, [], False, ""):
            assert f"`{action.default}`" in row, f"{name}: default {action.default!r} not shown"


def test_defaults_read_from_the_environment_do_not_change_the_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGATE_ENGINE_PROCESS", "on")
    monkeypatch.setenv("RAY_ADDRESS", "ray://elsewhere:10001")
    monkeypatch.setenv("KVGATE_API_KEY", "sk-from-the-environment")
    assert settings_docs.render() == PAGE.read_text(encoding="utf-8")
    assert os.environ["KVGATE_ENGINE_PROCESS"] == "on"  # restored after the render


def test_check_mode_says_when_the_page_is_stale(tmp_path: Path) -> None:
    out = tmp_path / "settings.md"
    assert settings_docs.main(["--out", str(out)]) == 0
    assert settings_docs.main(["--out", str(out), "--check"]) == 0
    out.write_text("old\n", encoding="utf-8")
    assert settings_docs.main(["--out", str(out), "--check"]) == 1
