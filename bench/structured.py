"""Constrained decoding's cost: output tokens/s with a JSON schema against the same load
unconstrained, at 1 and 32 sequences; and grammar compile time, cold and cached.

Same load: the constrained run goes first (temperature 1, one seed per sequence, the test
schemas of tests/data/schemas.json in turn); the unconstrained run right after asks each
sequence for exactly as many tokens as its constrained twin produced (``ignore_eos``), on
the same prompts. The ratio is the median over the repeats of each pair's ratio. Both run on
the offline engine (SmolLM2, the default dtype), all sequences added at once.

    python bench/structured.py                 # 1 and 32 sequences, 3 alternating repeats
    python bench/structured.py --seqs 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from kvgate.entrypoints.llm import LLM
from kvgate.model import cpu_isa
from kvgate.sampling_params import SamplingParams
from kvgate.structured.compiler import GrammarCompiler
from kvgate.structured.spec import Grammar, json_schema_grammar

SCHEMAS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parent.parent / "tests" / "data" / "schemas.json").read_text()
)


def run(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[list[int], float]:
    """(output tokens per sequence, seconds) for all sequences at once."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"s{i}-{time.monotonic_ns()}", prompt, p)
    counts: dict[str, int] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                counts[out.request_id] = out.num_output_tokens
    wall = time.perf_counter() - start
    return [counts[k] for k in sorted(counts, key=lambda k: int(k[1:].split("-")[0]))], wall


def workload(llm: LLM, seqs: int) -> tuple[list[str], list[SamplingParams]]:
    """``seqs`` chat prompts, the test schemas in turn, temperature 1, a seed each."""
    names = sorted(SCHEMAS)
    tok = llm.engine.tokenizer
    prompts, params = [], []
    for i in range(seqs):
        entry = SCHEMAS[names[i % len(names)]]
        prompts.append(tok.apply_chat_template([{"role": "user", "content": entry["prompt"]}]))
        grammar = json_schema_grammar(entry["schema"], "response_format")
        p = SamplingParams(max_tokens=300, seed=i, grammar=grammar, final_only=True)
        params.append(p)
    return prompts, params


def throughput(llm: LLM, seqs: int, repeats: int) -> dict[str, float]:
    """Constrained then unconstrained (as many tokens each), ``repeats`` times; medians."""
    prompts, constrained = workload(llm, seqs)
    run(llm, prompts, constrained)  # warm-up: grammars compiled, prefixes cached
    con, free, tokens = [], [], []
    for _ in range(repeats):
        counts, t_con = run(llm, prompts, constrained)
        unconstrained = [
            SamplingParams(max_tokens=n, seed=i, ignore_eos=True, final_only=True)
            for i, n in enumerate(counts)
        ]
        again, t_free = run(llm, prompts, unconstrained)
        assert again == counts
        tokens.append(sum(counts))
        con.append(sum(counts) / t_con)
        free.append(sum(counts) / t_free)
    return {
        "tokens": statistics.median(tokens),
        "constrained": statistics.median(con),
        "unconstrained": statistics.median(free),
        "ratio": statistics.median(c / f for c, f in zip(con, free, strict=True)),
    }


def compile_times(llm: LLM) -> list[tuple[str, float, float]]:
    """(schema, cold ms, cached ms): a fresh cache per schema, the vocabulary built once."""
    engine = llm.engine
    shared = engine.grammars.lltokenizer
    rows = []
    for name, entry in SCHEMAS.items():
        compiler = GrammarCompiler(engine.tokenizer, engine.grammars.eos_token_ids)
        compiler._lltokenizer = shared  # the vocabulary once; only the schema is cold
        grammar: Grammar = json_schema_grammar(entry["schema"], "response_format")
        start = time.perf_counter()
        compiler.check(grammar)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compiler.matcher(grammar)
        cached = time.perf_counter() - start
        rows.append((name, cold * 1e3, cached * 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory="1GiB", max_num_seqs=max(args.seqs))
    start = time.perf_counter()
    _ = llm.engine.grammars.lltokenizer
    vocab_s = time.perf_counter() - start
    print(f"cpu: {cpu_isa.describe_cpu()}; model {llm.engine.config.model or 'SmolLM2'}, "
          f"dtype {llm.engine.model.dtype}")  # fmt: skip
    print(f"vocabulary set-up (once per engine): {vocab_s * 1e3:.0f} ms")
    print(f"{'schema':<10} {'compile cold ms':>16} {'cached ms':>10}")
    for name, cold, cached in compile_times(llm):
        print(f"{name:<10} {cold:>16.2f} {cached:>10.3f}")
    print(f"{'seqs':>5} {'tokens':>7} {'json tok/s':>11} {'free tok/s':>11} {'ratio':>6}")
    for seqs in args.seqs:
        r = throughput(llm, seqs, args.repeats)
        ratio = r["ratio"]  # the median of the paired ratios
        print(f"{seqs:>5} {int(r['tokens']):>7} {r['constrained']:>11.1f} "
              f"{r['unconstrained']:>11.1f} {ratio:>6.3f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
