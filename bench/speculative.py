"""Speculative decoding by prompt lookup (``--speculative ngram``): output tokens/s with and
without it, measured in the same run on the same engine settings.

Two kinds of work, at each concurrency (requests kept in flight, greedy, the same requests
in both modes, so both must produce the very same tokens, which this checks):

- ``extractive``: a question of ``shared/longdoc/dev_questions.jsonl`` with five articles of
  its law (the gold one among four neighbours), and an instruction to answer and quote the
  clause it rests on: what a document-QA answer copies from its prompt;
- ``random``: random-token text, as ``bench/serving.py`` sends, continued with
  ``ignore_eos``, sampled at temperature 1 with a seed per request (greedy, a small model
  falls into loops on such text, which the drafter predicts perfectly: that is copying
  too): nothing to copy, so the drafter's cost shows alone.

Greedy and seeded outputs are token-identical with and without drafts when the steps are
composed alike; at one stream they are, and the run fails if a token differs. With several
streams, requests that finish earlier change when the next prompts are admitted and how
they are chunked, and a chunked prompt's float sums differ from a whole one's in the last
bits, so there only the share of identical outputs is printed.

Each mode runs on an engine of its own (plain: no drafter at all), alternated ``--repeats``
times. Prints the medians of tokens/s and of the ratio, the acceptance rate (accepted /
drafted tokens) and the mean tokens per verifying step. SmolLM2 cannot write Chinese: on
the extractive set it mostly copies the articles, which measures what copying does.

    python bench/speculative.py --model qwen2.5-coder-1.5b --concurrency 1 8
    python bench/speculative.py --model smollm2 --concurrency 1 8 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.model import cpu_isa
from kvgate.sampling_params import SamplingParams

LONGDOC = Path(__file__).resolve().parents[2] / "shared" / "longdoc"
_ARTICLE = re.compile(r"\n(?=第[一二三四五六七八九十百千零〇]+条)")
SYSTEM = (
    "你是一名法律助理。只根据用户给出的条文回答问题：先用一句话给出结论，"
    "再原文引用所依据的条款，并注明条号。"
)


def extractive_prompts(engine: LLMEngine, n: int, seed: int) -> list[list[int]]:
    """``n`` chat prompts: a development question with its gold article and four neighbours."""
    rows = [json.loads(line) for line in (LONGDOC / "dev_questions.jsonl").open(encoding="utf-8")]
    rng = random.Random(seed)
    prompts = []
    for q in rows[:n]:
        text = (LONGDOC / "corpus" / q["doc"]).read_text(encoding="utf-8")
        articles = [a.strip() for a in _ARTICLE.split(text) if a.strip().startswith("第")]
        at = next(
            (i for i, a in enumerate(articles) if a.startswith(q["article"])), len(articles) // 2
        )
        lo = max(0, min(at - rng.randint(0, 4), len(articles) - 5))
        context = "\n\n".join(articles[lo : lo + 5])
        user = f"条文：\n{context}\n\n问题：{q['question']}"
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        prompts.append(engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ))  # fmt: skip
    return prompts


def random_prompts(engine: LLMEngine, n: int, seed: int) -> list[list[int]]:
    """Random token ids decoded to text and encoded again (``bench/serving.py``'s kind)."""
    rng = random.Random(seed)
    tok = engine.tokenizer
    return [
        tok.encode(tok.decode([rng.randrange(1000, 40000) for _ in range(rng.randint(50, 200))]))
        for _ in range(n)
    ]


@dataclass
class Result:
    seconds: float
    tokens: dict[int, list[int]]
    #: Per request: (first token, last token) time.perf_counter() instants.
    times: dict[int, tuple[float, float]]
    drafted: int
    accepted: int
    verify_steps: int

    @property
    def rate(self) -> float:
        return sum(map(len, self.tokens.values())) / self.seconds

    @property
    def tpot_ms(self) -> float:
        """Mean time per output token after the first, over requests (vLLM's TPOT)."""
        per = [
            (end - first) / (len(self.tokens[i]) - 1)
            for i, (first, end) in self.times.items()
            if len(self.tokens[i]) > 1
        ]
        return 1000 * sum(per) / len(per) if per else 0.0


def run(
    engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int, greedy: bool
) -> Result:
    """Every prompt, ``concurrency`` in flight at a time; wall time from first add to last.
    ``greedy``: until EOS; else seeded sampling at temperature 1 with ``ignore_eos``."""
    drafter = engine.drafter
    before = (
        (drafter.num_draft_tokens, drafter.num_accepted_tokens, drafter.num_drafts)
        if (drafter)
        else (0, 0, 0)
    )
    tokens: dict[int, list[int]] = {}
    times: dict[int, tuple[float, float]] = {}
    pending = list(enumerate(prompts))
    in_flight = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            params = (
                SamplingParams(max_tokens=max_tokens, temperature=0.0)
                if greedy
                else SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)
            )
            engine.add_request(f"b{id(prompts)}-{concurrency}-{i}", prompt, params)
            in_flight += 1
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            i = int(out.request_id.rsplit("-", 1)[1])
            tokens.setdefault(i, []).extend(out.new_token_ids)
            times[i] = (times.get(i, (now, now))[0], now)
            in_flight -= out.finished
    seconds = time.perf_counter() - start
    after = (
        (drafter.num_draft_tokens, drafter.num_accepted_tokens, drafter.num_drafts)
        if (drafter)
        else (0, 0, 0)
    )
    return Result(
        seconds, tokens, times, after[0] - before[0], after[1] - before[1], after[2] - before[2]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=None, help="per run (default 2 x C, >= 4)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--sets", nargs="+", default=["extractive", "random"])
    p.add_argument(
        "--repeats", type=int, default=1, help="plain and ngram runs alternated; medians shown"
    )
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args()
    base = EngineConfig(model=a.model, kv_cache_memory="2GiB", max_model_len=4096)
    plain = LLMEngine(base)
    spec = LLMEngine(
        replace(base, speculative="ngram", num_speculative_tokens=a.num_speculative_tokens)
    )
    print(f"{a.model}, {cpu_isa.describe_cpu()}, "
          f"k={a.num_speculative_tokens}, max_tokens={a.max_tokens}")  # fmt: skip
    rows = []
    for name in a.sets:
        for c in a.concurrency:
            n = a.requests or max(4, 2 * c)
            make = extractive_prompts if name == "extractive" else random_prompts
            prompts = make(plain, n, seed=c)
            greedy = name == "extractive"  # answers end where the model ends them
            run(plain, prompts[:1], 1, 8, greedy)  # warm-up: kernels built, caches touched
            run(spec, prompts[:1], 1, 8, greedy)
            pairs = [
                (run(plain, prompts, c, a.max_tokens, greedy),
                 run(spec, prompts, c, a.max_tokens, greedy))
                for _ in range(a.repeats)
            ]  # fmt: skip
            base, fast = pairs[0]
            same = sum(base.tokens[i] == fast.tokens[i] for i in base.tokens) / len(base.tokens)
            drafted = sum(f.drafted for _, f in pairs)
            accepted = sum(f.accepted for _, f in pairs)
            verify_steps = sum(f.verify_steps for _, f in pairs)
            acc = accepted / drafted if drafted else 0.0
            per_step = (accepted + verify_steps) / verify_steps if verify_steps else 0.0
            plain_rate = statistics.median(b.rate for b, _ in pairs)
            spec_rate = statistics.median(f.rate for _, f in pairs)
            ratio = statistics.median(f.rate / b.rate for b, f in pairs)
            plain_tpot = statistics.median(b.tpot_ms for b, _ in pairs)
            spec_tpot = statistics.median(f.tpot_ms for _, f in pairs)
            row = {
                "set": name, "concurrency": c, "requests": n,
                "output_tokens": sum(map(len, base.tokens.values())),
                "plain_tok_s": round(plain_rate, 2), "spec_tok_s": round(spec_rate, 2),
                "ratio": round(ratio, 3), "ratios": [round(f.rate / b.rate, 3) for b, f in pairs],
                "acceptance": round(acc, 3), "tokens_per_verify_step": round(per_step, 2),
                "drafts": verify_steps, "plain_tpot_ms": round(plain_tpot, 1),
                "spec_tpot_ms": round(spec_tpot, 1), "identical": same,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:10s} c={c:<3d} plain {plain_rate:7.2f} tok/s  ngram {spec_rate:7.2f} tok/s"
                f"  x{ratio:.2f}  TPOT {plain_tpot:.1f} -> {spec_tpot:.1f} ms"
                f"  acceptance {acc:.2f}  {per_step:.2f} tokens/verify  identical {same:.0%}",
                flush=True,
            )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["identical"] == 1 for r in rows if r["concurrency"] == 1) else 1


if __name__ == "__main__":
    raise SystemExit(main())
