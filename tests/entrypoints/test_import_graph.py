"""The CLI is a leaf: no kvgate package imports ``kvgate.entrypoints`` (servers are built by
``kvgate.launch``). ``kvgate/__init__.py`` alone may, lazily: ``kvgate.LLM`` is the offline
API that lives there."""

from __future__ import annotations

import ast
from pathlib import Path

import kvgate

ROOT = Path(kvgate.__file__).parent


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_nothing_outside_the_entrypoints_imports_them() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if relative.parts[0] == "entrypoints" or relative == Path("__init__.py"):
            continue
        named = sorted(m for m in _imports(path) if m.split(".")[:2] == ["kvgate", "entrypoints"])
        offenders += [f"kvgate/{relative}: {m}" for m in named]
    assert not offenders, "\n".join(offenders)


def test_the_package_root_imports_only_the_offline_api() -> None:
    named = {m for m in _imports(ROOT / "__init__.py") if m.startswith("kvgate.entrypoints")}
    assert named <= {"kvgate.entrypoints.llm", "kvgate.entrypoints.llm.LLM"}


def test_the_check_sees_an_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from kvgate.entrypoints.cli import parse\n")
    assert "kvgate.entrypoints.cli" in _imports(module)
