"""Offline throughput of kvgate against HF transformers on the same weights, in one run.

Method (nano-vllm's, from shared/brief/bench.md): N sequences with random prompt and output
lengths, ignore_eos, throughput = generated tokens / wall time including prefill, one warm-up
first. The peer is HF ``generate`` with static batching (left-padded batch of all N prompts,
run until the longest output is done; only the requested tokens are counted for both).

Also measures batch-1 decode against this machine's memory-bandwidth bound: a decode step
must read every weight once, so tokens/s <= copy bandwidth / weight bytes.

    python bench/throughput.py                 # 1, 8, 32, 64 sequences, --dtype auto
    python bench/throughput.py --concurrency 32 --dtype float32
    python bench/throughput.py --concurrency 1 32 --quantization int8
    python bench/throughput.py --concurrency 1 32 --gguf-blocks native   # SmolLM2's Q4_1 blocks
    python bench/throughput.py --model gemma3-270m --concurrency 1 8 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

from kvgate import LLM, SamplingParams
from kvgate.model import cpu_isa
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.hf_export import save_hf_checkpoint
from kvgate.model.registry import DEFAULT_MODEL

CACHE = Path.home() / ".cache" / "kvgate" / "bench"


def export_for_peers(dtype: str, model: str = DEFAULT_MODEL) -> Path:
    """A model (an alias, or a GGUF path: dequantized from that GGUF) as an HF directory, cached
    outside the repo (a path by its file name)."""
    name = str(model)
    if os.sep in name:
        name = Path(name).name.removesuffix(".gguf")
    target = CACHE / f"{name}-hf-{dtype}"
    if not (target / "model.safetensors").exists():
        save_hf_checkpoint(load_checkpoint(model), target, getattr(torch, dtype))
    return target


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s over a buffer far larger than the caches.

    copy: bytes copied / time, how shared/brief/bench.md states this machine's figure.
    read: a streaming float32 sum, the access pattern of reading weights once per token;
    the strict bound for batch-1 decode. Random contents, so no page is shared or zero.
    """
    src = torch.randint(-(2**31), 2**31 - 1, (num_bytes // 4,), dtype=torch.int32)
    dst = torch.empty_like(src)
    as_float = src.view(torch.float32).nan_to_num_(0.0)

    def best(fn: object) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()  # type: ignore[operator]
            times.append(time.perf_counter() - t)
        return min(times)

    return num_bytes / best(lambda: dst.copy_(src)), num_bytes / best(as_float.sum)


def workload(n: int, seed: int, prompt_range: tuple[int, int], out_range: tuple[int, int]):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, 49000) for _ in range(rng.randint(*prompt_range))] for _ in range(n)
    ]
    outs = [rng.randint(*out_range) for _ in range(n)]
    return prompts, outs


def run_kvgate(llm: LLM, prompts: list[list[int]], outs: list[int]) -> float:
    params = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    assert [len(r.token_ids) for r in results] == outs
    return sum(outs) / dt


def run_hf(model, prompts: list[list[int]], outs: list[int], pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF wants for decoder-only generate
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    new = max(outs)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t
    return sum(outs) / dt


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a shipped model: smollm2, gemma3-270m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["int8", "int8-b32"],
        help="kvgate's weights (transformers stays on the compute dtype)",
    )
    ap.add_argument(
        "--gguf-blocks",
        default="auto",
        choices=["auto", "native", "dequantize"],
        help="kvgate's --gguf-blocks: a GGUF's quantized matrices in their blocks or not",
    )
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128])
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternate kvgate and transformers this many times; report medians",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument(
        "--hf-dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="transformers' dtype (default: kvgate's); float32 is its faster one on CPUs "
        "without AVX512-BF16",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    a = ap.parse_args()
    print(cpu_isa.describe_cpu())
    copy_bw, read_bw = measure_bandwidth()
    llm = LLM(
        a.model,
        dtype=a.dtype,
        quantization=a.quantization,
        gguf_blocks=a.gguf_blocks,
        kv_cache_memory="2GiB",
        max_num_seqs=128,
        max_num_batched_tokens=1024,
    )
    dtype = a.hf_dtype or str(llm.engine.dtype).removeprefix("torch.")
    torch_dtype = getattr(torch, dtype)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads; kvgate: {llm.engine.build_info}")
    weight_bytes = llm.engine.model.weight_bytes()
    bound, strict_bound = copy_bw / weight_bytes, read_bw / weight_bytes
    print(
        f"bandwidth: copy {copy_bw / 1e9:.1f} GB/s, streaming read {read_bw / 1e9:.1f} GB/s; "
        f"weights {weight_bytes / 1e6:.0f} MB -> batch-1 decode bound {bound:.0f} tok/s "
        f"(copy), {strict_bound:.0f} tok/s (read)"
    )

    hf = None
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        # The exact weights kvgate serves, as a plain HF checkpoint: transformers' own GGUF
        # path keeps weights packed and computes in fp32, which would be an unfair peer.
        hf_dir = export_for_peers(dtype, a.model)
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch_dtype).eval()
        print(f"transformers in {dtype}")

    pad = llm.engine.tokenizer.eos_token_ids[0]
    # Warm-up both sides (allocator, oneDNN kernel selection).
    wp, wo = workload(4, 0, (16, 32), (8, 8))
    run_kvgate(llm, wp, wo)
    if hf is not None:
        run_hf(hf, wp, wo, pad_id=pad)

    # Batch-1 decode: a short prompt, then decode_tokens tokens; the prompt's share is small.
    decode_runs = [run_kvgate(llm, [[100 + i] * 8], [a.decode_tokens]) for i in range(3)]
    decode = statistics.median(decode_runs)
    print(
        f"batch-1 decode: {decode:.1f} tok/s = {decode / bound:.0%} of the copy bound, "
        f"{decode / strict_bound:.0%} of the read bound"
    )

    rows = []
    for n in a.concurrency:
        prompts, outs = workload(n, 1000 + n, tuple(a.prompt_len), tuple(a.output_len))
        ours_runs, theirs_runs = [], []
        for _ in range(a.repeats):  # interleaved, so machine noise hits both sides alike
            llm.engine.kv_cache.pool.reset_prefix_cache()  # no help from the previous repeat
            ours_runs.append(run_kvgate(llm, prompts, outs))
            if hf is not None:
                theirs_runs.append(run_hf(hf, prompts, outs, pad_id=pad))
        ours = statistics.median(ours_runs)
        theirs = statistics.median(theirs_runs) if theirs_runs else float("nan")
        rows.append(
            {"concurrency": n, "kvgate_tok_s": ours, "hf_tok_s": theirs, "ratio": ours / theirs}
        )
        peer = (
            f"   transformers {theirs:7.1f} tok/s   ratio {ours / theirs:.2f}x"
            if hf is not None
            else ""
        )
        print(f"n={n:3d}: kvgate {ours:7.1f} tok/s{peer}", flush=True)

    print("\n== ratios ==")
    print(f"batch-1 decode / copy-bandwidth bound: {decode / bound:.2f} ({decode:.1f}/{bound:.0f})")
    print(
        f"batch-1 decode / read-bandwidth bound: {decode / strict_bound:.2f} "
        f"({decode:.1f}/{strict_bound:.0f})"
    )
    for r in rows if hf is not None else []:  # --no-hf: no peer, no ratio
        print(f"kvgate / transformers at {r['concurrency']:3d} sequences: {r['ratio']:.2f}x")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(
            json.dumps(
                {
                    "build_info": llm.engine.build_info,
                    "copy_bandwidth_bytes_s": copy_bw,
                    "read_bandwidth_bytes_s": read_bw,
                    "weight_bytes": weight_bytes,
                    "decode_tok_s": decode,
                    "rows": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
