"""Which grammar library: llguidance against xgrammar on SmolLM2's vocabulary (49,152 tokens).

For each test schema (tests/data/schemas.json) and each library: the one-off tokenizer set-up,
the schema's compile time (cold: a fresh compiler, no cache), and the time to compute the
next-token mask and advance the matcher, per token, along the tokens of a valid instance
(the schema's ``example``), one thread. This picked the library kvgate uses (see README).

xgrammar is not a kvgate dependency (it requires torch, transformers and triton at run time);
to rerun, install it beside kvgate without its dependencies:

    pip install --no-deps xgrammar apache-tvm-ffi
    python bench/grammar_libs.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.model import cpu_isa
from kvgate.model.gguf_loader import load_gguf_tokenizer
from kvgate.model.registry import DEFAULT_MODEL, resolve_model_path
from kvgate.tokenizer import Tokenizer

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "schemas.json"


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def llguidance_runner(tok: Tokenizer) -> tuple[float, Callable[[dict[str, Any], list[int]], Any]]:
    import llguidance
    import llguidance.numpy as llnp

    lltok, setup = timed(
        lambda: llguidance.LLTokenizer(
            tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
        )
    )

    def run(schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float]]:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher, compile_s = timed(lambda: llguidance.LLMatcher(lltok, grammar))
        assert not matcher.is_error(), matcher.get_error()
        mask = llnp.allocate_token_bitmask(1, tok.vocab_size)
        steps = []
        for t in ids:
            start = time.perf_counter()
            llnp.fill_next_token_bitmask(matcher, mask)
            assert (mask[0, t // 32] >> (t % 32)) & 1, "the example's token was masked out"
            assert matcher.consume_token(t), matcher.get_error()
            steps.append(time.perf_counter() - start)
        return compile_s, steps

    return setup, run


def xgrammar_runner(tok: Tokenizer) -> tuple[float, Callable[[dict[str, Any], list[int]], Any]]:
    import xgrammar as xgr

    def make_info() -> Any:
        vocab = [tok.id_to_token(i) or "" for i in range(tok.vocab_size)]
        return xgr.TokenizerInfo(
            vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, stop_token_ids=list(tok.eos_token_ids)
        )

    info, setup = timed(make_info)

    def run(schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float]]:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled, compile_s = timed(lambda: compiler.compile_json_schema(json.dumps(schema)))
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
        steps = []
        for t in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            word = int(mask[0, t // 32]) & 0xFFFFFFFF
            assert (word >> (t % 32)) & 1, "the example's token was masked out"
            assert matcher.accept_token(t)
            steps.append(time.perf_counter() - start)
        return compile_s, steps

    return setup, run


def main() -> None:
    tok = load_gguf_tokenizer(resolve_model_path(DEFAULT_MODEL))
    schemas = json.loads(SCHEMAS.read_text())
    print(f"cpu: {cpu_isa.describe_cpu()}; vocabulary {tok.vocab_size} tokens; one thread")
    print(f"{'library':<11} {'schema':<10} {'compile ms':>10} {'mask+advance us/token':>22} "
          f"{'p99 us':>8} {'tokens':>6}")  # fmt: skip
    for name, make in (("llguidance", llguidance_runner), ("xgrammar", xgrammar_runner)):
        try:
            setup, run = make(tok)
        except ImportError as exc:
            print(f"{name:<11} not installed ({exc})")
            continue
        print(f"{name:<11} {'(set-up)':<10} {setup * 1e3:>10.1f}")
        for sname, entry in schemas.items():
            text = json.dumps(entry["example"])
            ids = tok.encode(text, add_special_tokens=False)
            compile_s, steps = run(entry["schema"], ids)
            p99 = float(np.percentile(steps, 99)) * 1e6
            print(f"{name:<11} {sname:<10} {compile_s * 1e3:>10.2f} "
                  f"{statistics.mean(steps) * 1e6:>22.1f} {p99:>8.1f} {len(ids):>6}")  # fmt: skip


if __name__ == "__main__":
    main()
