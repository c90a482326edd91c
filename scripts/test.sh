#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (what CI runs).
#   bash scripts/test.sh             # everything: the docs site, the suite, the server suite
#                                    # again with the engine in its own process
#   bash scripts/test.sh --fast      # lint, types and the fast tier: every package's tests
#                                    # but those marked slow (real models, Ray clusters,
#                                    # server processes); under 3 minutes on 2 cores
#   bash scripts/test.sh tests/x.py  # lint, types, then pytest with these arguments
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fast" ]; then
  shift
  set -- -m "not slow" "$@"
  fast=1
fi
.venv/bin/ruff check kvgate tests bench
.venv/bin/ruff format --check kvgate tests bench
.venv/bin/mypy
if [ "$#" -eq 0 ] || [ -n "${fast:-}" ]; then
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
