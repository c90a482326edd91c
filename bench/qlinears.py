"""Rates of the block-format kernels (``csrc/qlinear.c``) per GGML type and ISA level.

For each type, the layers of one Qwen2.5-1.5B decoder layer (qkv, o, gate_up, down) repeated
until the weights far exceed the L3 cache (so one row reads them from memory, as a decode step
does), random blocks (speed does not depend on the values): GB/s of weights read at 1 row and
GFLOP/s (2 x rows x N x K per second) at 32 rows, next to this machine's streaming read
bandwidth measured in the same run.

    .venv/bin/python bench/qlinears.py [--levels avx2 avx512bf16] [--rows 1 8 32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvgate.model import cpu_isa
from kvgate.model.cpu_kernels import load_quant_lib
from kvgate.model.quant_linear import QuantLinear
from tests.model.quant_blocks import QTYPES, random_quant

#: (out, in) of Qwen2.5-1.5B's qkv, o, gate_up and down projections.
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
MIN_BYTES = 256 << 20  # of weights per pass: 8x a 32 MiB L3


def read_bandwidth(nbytes: int = 1 << 30) -> float:
    """Streaming float32 sum over a buffer far larger than the caches, bytes/s (best of 3)."""
    x = torch.rand(nbytes // 4)
    best = min(_timed(x.sum) for _ in range(3))
    return nbytes / best


def _timed(fn: object) -> float:
    t = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    levels = [lv for lv in cpu_isa.supported_levels() if lv != "generic"]
    ap.add_argument("--levels", nargs="+", default=levels)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--types", nargs="+", default=[t.name for t in QTYPES])
    a = ap.parse_args()
    print(cpu_isa.describe_cpu(), f"torch threads {torch.get_num_threads()}")
    print(f"streaming read: {read_bandwidth() / 1e9:.1f} GB/s")
    for level in a.levels:
        lib = load_quant_lib(level)
        if lib is None:
            print(f"{level}: no library (no compiler?)")
            continue
        for name in a.types:
            qtype = GGMLQuantizationType[name]
            layer = [random_quant(qtype, n, k, seed=i) for i, (n, k) in enumerate(SHAPES)]
            per_layer = sum(t.nbytes() for t in layer)
            copies = max(1, -(-MIN_BYTES // per_layer))
            # distinct copies of the bytes: a pass reads every one from memory
            tensors = [
                type(t)(t.qtype, t.shape, t.data.clone(), t.name)
                for _ in range(copies)
                for t in layer
            ]
            lins = [QuantLinear([t], None, lib, io_dtype=torch.bfloat16) for t in tensors]
            nbytes = per_layer * copies
            flops = 2 * sum(n * k for n, k in SHAPES) * copies
            parts = []
            for rows in a.rows:
                calls = [(lin, torch.randn(rows, lin.in_features).bfloat16()) for lin in lins]
                best = min(_timed(lambda c=calls: [lin(x) for lin, x in c]) for _ in range(4))
                rate = f"{nbytes / best / 1e9:5.1f} GB/s" if rows == 1 else ""
                parts.append(f"{rows:3d} rows {rate} {rows * flops / best / 1e9:6.1f} GFLOP/s")
            print(f"{level:10s} {name:5s} ({nbytes >> 20} MiB) " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
