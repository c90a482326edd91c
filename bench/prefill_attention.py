"""Prefill attention of one layer: the native kernel (``prefill_bf16.h``: AMX tiles, or
vdpbf16ps on AVX-512 registers where the CPU has AVX512-BF16 and no AMX) against the PyTorch
paths it replaces, measured in the same run on the same pool.

A step's prompt slices (P prompts of L tokens, each after S tokens already in the pool) with
K/V in a paged bf16 pool of scattered 16-token blocks, a model's head shape (query heads,
KV heads, head size). The PyTorch side is ``TorchAttention`` with the tiles turned off: the
short-prompt path (batched matmuls and the native causal softmax) for fresh prompts up to
256 tokens, SDPA over the gathered context otherwise. Prints milliseconds per layer for each,
their ratio, and the largest difference of the outputs (the PyTorch short path rounds scores
to bf16; the tiles keep them in float32).

    .venv/bin/python bench/prefill_attention.py
    .venv/bin/python bench/prefill_attention.py --heads 12 2 128 --cases 8x160+0 1x512+7680
    .venv/bin/python bench/prefill_attention.py --native-max 0   # every case native
"""

from __future__ import annotations

import argparse
import time

import torch

import kvgate.model.attention as attention
from kvgate.model import cpu_isa
from kvgate.model.attention import AttentionMetadata, PrefillSlice, TorchAttention
from kvgate.model.cpu_kernels import load_paged_decode

#: PxL+S: P prompts of L tokens after S cached ones. A 32-stream burst of SmolLM2-sized
#: prompts, a few longer ones, chunks of 512 after a long cached context, a fresh 1k prompt.
CASES = ["32x160+0", "4x512+0", "1x512+512", "1x512+2048", "1x512+3584", "1x512+7680", "1x1024+0"]


Step = tuple[TorchAttention, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]


def step(case: tuple[int, int, int], heads: list[int], seed: int) -> tuple[Step, torch.Tensor]:
    """The backend, q, the pool, the metadata, and the step's own K/V rows [2, T, Hkv, D]
    (what the fresh-prompt PyTorch path reads directly; the same values as in the pool)."""
    num, length, start = case
    hq, hkv, d = heads
    bs, ctx = 16, start + length
    per = -(-ctx // bs)
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(num * per + 1, generator=g)
    k_cache = torch.randn(hkv, num * per + 1, bs, d, generator=g).bfloat16()
    v_cache = torch.randn(hkv, num * per + 1, bs, d, generator=g).bfloat16()
    slices, own = [], []
    for i in range(num):
        table = blocks[i * per : (i + 1) * per]
        slices.append(PrefillSlice(i * length, (i + 1) * length, start, table))
        rows = torch.stack(
            [c[:, table].reshape(hkv, -1, d)[:, start:ctx] for c in (k_cache, v_cache)]
        )
        own.append(rows.transpose(1, 2))  # [2, length, Hkv, D]
    empty = torch.empty(0, dtype=torch.int64)
    meta = AttentionMetadata(empty, 0, empty, empty, tuple(slices))
    q = torch.randn(num * length, hq, d, generator=g).bfloat16()
    backend = TorchAttention(hq, hkv, d, load_paged_decode(), kv_dtype=torch.bfloat16)
    return (backend, q, k_cache, v_cache, meta), torch.cat(own, dim=1).contiguous()


def timed(s: Step, kv: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    backend, q, k_cache, v_cache, meta = s
    out = backend.attend(q, kv[0], kv[1], k_cache, v_cache, meta)  # warm-up
    t = time.perf_counter()
    for _ in range(reps):
        out = backend.attend(q, kv[0], kv[1], k_cache, v_cache, meta)
    return (time.perf_counter() - t) / reps * 1000, out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("HQ", "HKV", "D"))
    ap.add_argument("--cases", nargs="+", default=CASES, help="PxL+S each")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--native-max",
        type=int,
        default=None,
        help="context x head size up to which a slice runs natively (default: the engine's "
        "limit for this CPU; 0: no limit)",
    )
    a = ap.parse_args()
    kernel = load_paged_decode()
    if kernel is None or not kernel.prefills:
        raise SystemExit("no native prefill on this CPU (it needs AVX512-BF16)")
    torch.set_num_threads(2)
    path = "AMX tiles" if kernel.prefill_tiles else "AVX-512 registers"
    print(f"{cpu_isa.describe_cpu()}, {torch.get_num_threads()} threads; heads {a.heads}; {path}")
    tiled_max = attention.tiled_prefill_max(kernel) if a.native_max is None else a.native_max
    tiled_max = tiled_max or 1 << 62
    for case in a.cases:
        num, rest = case.split("x")
        length, start = rest.split("+")
        s, kv = step((int(num), int(length), int(start)), a.heads, seed=len(case))
        attention._TILED_PREFILL_MAX = attention._REGISTERS_PREFILL_MAX = 0
        torch_ms, ref = timed(s, kv, a.repeats)
        attention._TILED_PREFILL_MAX = attention._REGISTERS_PREFILL_MAX = tiled_max
        tiles_ms, got = timed(s, kv, a.repeats)
        diff = (got.float() - ref.float()).abs().max().item()
        print(
            f"{case:>12}: PyTorch {torch_ms:7.2f} ms | native {tiles_ms:7.2f} ms | "
            f"{torch_ms / tiles_ms:5.2f}x | max |diff| {diff:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
