#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check kvgate tests bench
.venv/bin/ruff format --check kvgate tests bench
.venv/bin/mypy
if [ "$#" -eq 0 ]; then
  # The documentation site, built outside the tree: a broken link or anchor fails it.
  # (Not --quiet: it hides the warnings that --strict turns into a failure.)
  site="$(mktemp -d)"
  trap 'rm -rf "$site"' EXIT
  .venv/bin/mkdocs build --strict --site-dir "$site"
fi
.venv/bin/python -m pytest "$@"
if [ "$#" -eq 0 ]; then
  # The server suite again, with every server's engine in a process of its own
  # (--engine-process on): everything the server does must work through the split too.
  KVGATE_ENGINE_PROCESS=on .venv/bin/python -m pytest tests/server -p no:cacheprovider
fi
