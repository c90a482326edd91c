"""KV memory a long Gemma 3 sequence holds, with sliding-window blocks given back and without.

Two parts, both on the shipped Gemma 3 270M's own config (18 layers: 15 sliding with a
512-token window, 3 global; 1 KV head of 256 dims):

1. A 32k-token sequence through the real scheduler and KV cache manager (prefilled in
   chunks of ``--chunk``, then ``--decode`` tokens), with a runner that computes nothing:
   block accounting needs no model, and a 32k-token prefill of the real model would take
   hours on a small CPU. It reports the peak blocks each group held and their bytes (a
   block is ``slots`` layers x K and V x block_size tokens), against the same sequence under
   one group of all layers (what kvgate held before, and what any engine without window
   freeing holds).
2. ``--real-tokens N``: the real model generating N tokens (bf16) through the engine,
   reporting the peak blocks held and checking they match part 1's formula.

    python bench/kv_window.py
    python bench/kv_window.py --tokens 32768 --real-tokens 2048
"""

from __future__ import annotations

import argparse
import time

from kvgate import LLM, SamplingParams
from kvgate.engine.kv_cache import KVCacheManager
from kvgate.engine.messages import RunnerOutput, SchedulerOutput
from kvgate.engine.request import Request
from kvgate.engine.scheduler import Scheduler, SchedulerConfig
from kvgate.model import cpu_isa
from kvgate.model.checkpoint import load_checkpoint
from kvgate.model.config import ModelConfig
from kvgate.model.kv_layout import KVGroup, KVLayout
from kvgate.model.models import model_class
from kvgate.model.registry import resolve_model_path


class _NoModel:
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return RunnerOutput(sampled_token_ids={s.request_id: 7 for s in out.sequences if s.sample})


def peak_blocks(layout: KVLayout, tokens: int, decode: int, chunk: int, bs: int) -> list[int]:
    """Peak blocks held per group by one sequence of ``tokens`` prompt + ``decode`` output."""
    need = layout.max_blocks(tokens + decode, bs, chunk)
    kv = KVCacheManager(need + 8, bs, layout=layout)
    sched = Scheduler(SchedulerConfig(1, chunk, tokens + decode), kv)
    sched.add_request(Request("long", [5] * tokens, SamplingParams(max_tokens=decode)))
    runner, peaks = _NoModel(), [0] * layout.num_groups
    while sched.num_unfinished:
        out = sched.schedule()
        sched.update(out, runner.execute(out))
        for g, table in enumerate(kv.req_blocks.get("long", [])):
            peaks[g] = max(peaks[g], sum(1 for b in table if b is not None))
    return peaks


def block_bytes(config: ModelConfig, layout: KVLayout, bs: int, itemsize: int) -> int:
    return bs * 2 * layout.slots * config.num_kv_heads * config.head_dim * itemsize


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt tokens of part 1")
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--real-tokens", type=int, default=0, help="part 2: tokens to generate")
    a = ap.parse_args()
    print(cpu_isa.describe_cpu())
    path = resolve_model_path(a.model)
    config = load_checkpoint(path).config
    bs, itemsize = a.block_size, 2  # bf16 KV
    windowed = KVLayout.for_specs(model_class(config).kv_specs(config))
    whole = KVLayout((KVGroup(tuple(range(config.num_layers)), None),), config.num_layers)
    print(
        f"{a.model}: {config.num_layers} layers, window {config.sliding_window}; groups "
        f"{[(len(g.layers), g.window) for g in windowed.groups]}, {windowed.slots} layers a block"
    )
    rows = []
    for name, layout in (("window freeing", windowed), ("no freeing (one group)", whole)):
        t = time.perf_counter()
        peaks = peak_blocks(layout, a.tokens, a.decode, a.chunk, bs)
        size = block_bytes(config, layout, bs, itemsize)
        total = sum(peaks) * size
        rows.append(total)
        print(
            f"{name:24s}: peak blocks per group {peaks} x {size / 1024:.0f} KiB = "
            f"{total / 2**20:8.1f} MiB  ({time.perf_counter() - t:.1f} s to schedule)"
        )
    print(
        f"\n{a.tokens + a.decode}-token sequence, bf16 KV: {rows[0] / 2**20:.1f} MiB with window "
        f"freeing vs {rows[1] / 2**20:.1f} MiB without = {rows[1] / rows[0]:.2f}x less"
    )

    if a.real_tokens:
        llm = LLM(str(path), kv_cache_memory="1GiB", max_num_batched_tokens=a.chunk)
        engine = llm.engine
        prompt = [2] + [9259] * 15
        params = SamplingParams(max_tokens=a.real_tokens, temperature=0.0, ignore_eos=True)
        engine.add(engine.make_request("real", prompt, params))
        peaks = [0] * engine.kv_layout.num_groups
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            for g, table in enumerate(engine.kv_cache.req_blocks.get("real", [])):
                peaks[g] = max(peaks[g], sum(1 for b in table if b is not None))
        dt = time.perf_counter() - t
        expected = peak_blocks(engine.kv_layout, len(prompt), a.real_tokens, a.chunk, bs)
        print(
            f"\nreal {a.model} ({engine.build_info['dtype']}), {len(prompt)} + {a.real_tokens} "
            f"tokens in {dt:.1f} s: peak blocks per group {peaks} (accounting run: {expected}); "
            f"blocks given back {engine.kv_cache.num_window_freed}"
        )


if __name__ == "__main__":
    main()
