"""The fast tier (``scripts/test.sh --fast``, ``-m "not slow"``) covers every package: each
subpackage of kvgate has a test module under ``tests/<package>/`` that is not slow as a whole."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A module-wide slow mark: ``pytestmark = pytest.mark.slow`` (alone or first in a list).
SLOW_MODULE = re.compile(r"^pytestmark\s*=\s*\[?\s*pytest\.mark\.slow\b", re.MULTILINE)


def _packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "kvgate").glob("*/__init__.py"))


def _fast_modules(package: str) -> list[Path]:
    return [
        path
        for path in sorted((ROOT / "tests" / package).glob("**/test_*.py"))
        if not SLOW_MODULE.search(path.read_text(encoding="utf-8"))
    ]


def test_every_package_has_fast_tests() -> None:
    packages = _packages()
    assert {"engine", "server", "model", "retrieval"} <= set(packages)
    missing = [p for p in packages if not _fast_modules(p)]
    assert not missing, f"packages with no test module in the fast tier: {missing}"


def test_the_slow_mark_is_recognised() -> None:
    assert SLOW_MODULE.search("import pytest\n\npytestmark = pytest.mark.slow\n")
    assert SLOW_MODULE.search("pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]\n")
    assert not SLOW_MODULE.search("@pytest.mark.slow\ndef test_x() -> None: ...\n")
