"""Relative links in the Markdown files outside docs/ (the README, bench/README.md, the
changelog, bench/results/) point at files that exist. Links inside docs/ are checked by
``mkdocs build --strict`` (scripts/test.sh)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "bench" / "results").glob("*.md")),
]
# [text](target) outside code spans; the target up to a space, ')' or '#'.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)\s]*)?\)")


def _links(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # fenced code
    prose = re.sub(r"`[^`\n]*`", "", prose)  # code spans
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    links = _links(page.read_text(encoding="utf-8"))
    missing = [t for t in links if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_readme_links_into_the_docs_and_the_results() -> None:
    links = _links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert any(t.startswith("docs/") for t in links)
    assert any(t.startswith("bench/results/") for t in links)
