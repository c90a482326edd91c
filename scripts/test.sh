#!/usr/bin/env bash
# Lint, type-check and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check kvgate tests bench
.venv/bin/ruff format --check kvgate tests bench
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
