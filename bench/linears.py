"""GFLOP/s of the four linears of a SmolLM2 layer, per weight format and row count.

Each native path (bf16 weights; int8 per channel and in blocks of 32 with x as int16, the
``WidenLinear`` path; int8 as Q8_0 blocks with x as int8 per 32 inputs, the W8A8 ``QuantLinear``
path that ``--quantization int8`` takes where ``qlinear.c`` is built) against PyTorch's
float32 ``F.linear`` (MKL) on the same shapes, measured in the same run; random weights
(speed does not depend on the values). The weights' GB/s is printed for one row, where
decode is bound by reading them.

    .venv/bin/python bench/linears.py [--level avx2] [--rows 1 4 32 512]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvgate.model import cpu_isa
from kvgate.model.cpu_kernels import load_linear_lib, load_quant_lib
from kvgate.model.linear import LinearFactory

#: (out, in) of SmolLM2-135M's qkv, o, gate_up and down projections.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def gflops(calls: list[Callable[[], object]], rows: int) -> float:
    for call in calls:  # warm-up
        call()
    reps = max(3, 2000 // rows)
    t = time.perf_counter()
    for _ in range(reps):
        for call in calls:
            call()
    seconds = (time.perf_counter() - t) / reps
    return sum(2 * rows * n * k for n, k in SHAPES) / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--level", default=None, help="ISA level (default: this CPU's best)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32, 512])
    a = ap.parse_args()
    level = a.level or cpu_isa.default_level()
    lib = load_linear_lib(level)
    print(f"{cpu_isa.describe_cpu()}; level {level}; {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    paths: dict[str, tuple[torch.dtype, list[Callable[[torch.Tensor], torch.Tensor]], int]] = {}
    for name, quant in (("bf16", None), ("int8", "int8"), ("int8-b32", "int8-b32")):
        factory = LinearFactory.for_device(torch.bfloat16, torch.device("cpu"), lib, quant)
        layers = [factory(w, None) for w in weights]
        paths[name] = (torch.bfloat16, list(layers), sum(x.weight_bytes() for x in layers))
    quant_lib = load_quant_lib(level)
    if quant_lib is not None:
        factory = LinearFactory.for_device(
            torch.bfloat16, torch.device("cpu"), lib, "int8", quant=quant_lib
        )
        layers = [factory(w, None) for w in weights]
        paths["int8 W8A8 (Q8_0)"] = (
            torch.bfloat16,
            list(layers),
            sum(x.weight_bytes() for x in layers),
        )
    fp32 = [lambda x, w=w: F.linear(x, w) for w in weights]
    paths["float32 (torch)"] = (torch.float32, fp32, sum(w.numel() * 4 for w in weights))
    print(f"{'rows':>5} | " + " | ".join(f"{name:>16}" for name in paths))
    for rows in a.rows:
        cells = []
        for dtype, layers, nbytes in paths.values():
            xs = [torch.randn(rows, k).to(dtype) for _, k in SHAPES]
            rate = gflops([lambda f=f, x=x: f(x) for f, x in zip(layers, xs, strict=True)], rows)
            seconds = sum(2 * rows * n * k for n, k in SHAPES) / rate / 1e9
            extra = f" ({nbytes / seconds / 1e9:.0f} GB/s)" if rows == 1 else ""
            cells.append(f"{rate:.1f}{extra}")
        print(f"{rows:>5} | " + " | ".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
