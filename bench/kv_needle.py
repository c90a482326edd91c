"""Needles in a haystack with quantized KV (``--kv-cache-dtype int8`` / ``fp8``): how often
the model finds a number hidden in a long text, per KV dtype, context length and depth.

    python bench/kv_needle.py                            # smollm2: 2k, 4k, 8k x 5 depths
    python bench/kv_needle.py --lengths 8192 --trials 3
    python bench/kv_needle.py --model qwen2.5-coder-1.5b --lengths 2048,4096

A haystack is the Apache License 2.0 (``tests/e2e/data/apache-2.0.txt``, a fixed public
text) repeated to fill the context, with one needle per depth, each a 4-digit number of its
own kind (``The locker number is 3201.``) placed between two sentences at that fraction of
the text. Each needle is asked for in its own chat turn (the question after the text,
greedy), so the other needles are distractors; the prompts differ only in the question, so
the haystack is prefilled once per KV dtype and the rest read it from the prefix cache
(which reads K/V exactly as a fresh prefill does: ``model/kv_codec.py``). A needle is found
when the answer holds its number (not as part of a longer number). Trials rotate which kind
sits at which depth and draw new numbers. A prompt and its answer fit ``--lengths``, which
the model's context bounds (SmolLM2: 8192).

Prints one table of found needles per KV dtype, length and depth, then the totals.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.entrypoints.llm import LLM
from kvgate.model import cpu_isa
from kvgate.sampling_params import SamplingParams
from kvgate.tokenizer import Tokenizer

FILLER = Path(__file__).resolve().parents[1] / "tests" / "e2e" / "data" / "apache-2.0.txt"
DTYPES = ("auto", "int8", "fp8")
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
MAX_NEW = 24  # answers look like "The locker number mentioned in the text is 3201."
#: (needle, question) per kind; the needle's ``{}`` is the number.
KINDS = (
    (
        "The secret passphrase is {}.",
        "What is the secret passphrase mentioned in the text above? "
        "Answer with the passphrase only.",
    ),
    (
        "The locker number is {}.",
        "What is the locker number mentioned in the text above? Answer with the number only.",
    ),
    (
        "The PIN of the bank card is {}.",
        "What is the PIN of the bank card mentioned in the text above? Answer with the PIN only.",
    ),
    (
        "The meeting is in room {}.",
        "In which room is the meeting mentioned in the text above? "
        "Answer with the room number only.",
    ),
    (
        "The combination of the safe is {}.",
        "What is the combination of the safe mentioned in the text above? "
        "Answer with the combination only.",
    ),
)


@dataclass(frozen=True)
class Needle:
    depth: float  # fraction of the haystack before the needle
    secret: str
    prompt: list[int]  # the chat prompt: haystack with every needle, then this one's question


def filler_sentences() -> list[str]:
    """The filler text's sentences, whitespace collapsed."""
    text = " ".join(FILLER.read_text(encoding="utf-8").split())
    return [s for s in re.split(r"(?<=\.)\s+", text) if s]


def haystack(
    tokenizer: Tokenizer, length: int, depths: Sequence[float], seed: int, single: bool = False
) -> list[Needle]:
    """One haystack with a needle at each of ``depths``, as one prompt per needle of at most
    ``length - MAX_NEW`` tokens (``single``: each prompt holds its own needle only). ``seed``
    draws the numbers and rotates the kinds over the depths (kind ``seed % 5`` first)."""
    if len(depths) > len(KINDS):
        raise ValueError(f"at most {len(KINDS)} depths, one kind of needle each")
    rng = random.Random(seed)
    kinds = [KINDS[(seed + i) % len(KINDS)] for i in range(len(depths))]
    codes = [str(rng.randrange(1000, 10000)) for _ in depths]
    sentences = filler_sentences()
    sizes = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in sentences]

    def document(body: list[str], only: int | None) -> str:
        """The haystack with needle ``only`` or (None) every needle."""
        # Token counts through each sentence: a needle goes after the first past its depth.
        ends = list(itertools.accumulate(sizes[i % len(sizes)] for i in range(len(body))))
        text = list(body)
        for depth, j in sorted((d, j) for j, d in enumerate(depths) if only in (None, j))[::-1]:
            at = bisect.bisect_left(ends, depth * ends[-1]) + 1 if body else 0
            text.insert(at, kinds[j][0].format(codes[j]))
        return " ".join(text)

    def prompts(body: list[str]) -> list[list[int]]:
        shared = None if single else document(body, None)
        texts = [document(body, j) if shared is None else shared for j in range(len(kinds))]
        return [
            tokenizer.encode_chat([{"role": "user", "content": f"{text}\n\n{question}"}])
            for text, (_, question) in zip(texts, kinds, strict=True)
        ]

    # Fill with sentences by their token counts, then trim the last ones until every prompt
    # fits (the needles, questions and chat template take the rest).
    room = length - MAX_NEW
    overhead = max(len(p) for p in prompts([]))
    body: list[str] = []
    used = overhead
    while used + sizes[len(body) % len(sizes)] <= room:
        used += sizes[len(body) % len(sizes)]
        body.append(sentences[len(body) % len(sentences)])
    out = prompts(body)
    while max(len(p) for p in out) > room:
        body.pop()
        out = prompts(body)
    return [Needle(d, c, p) for d, c, p in zip(depths, codes, out, strict=True)]


def found(answer: str, secret: str) -> bool:
    """``secret`` is in ``answer`` as a number of its own (not inside ``123456789``)."""
    return re.search(rf"(?<!\d){secret}(?!\d)", answer) is not None


def ask(llm: LLM, needles: Sequence[Needle], single: bool = False) -> list[str]:
    """Greedy answers to every needle's prompt, in order. Every needle in the haystack: the
    first runs alone and leaves the haystack in the prefix cache, the rest run together from
    it. ``single`` (a needle per prompt): one at a time, the deepest needle first, so each
    finds the haystack before its needle in the cache."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    if single:
        answers: dict[int, str] = {}
        for i in sorted(range(len(needles)), key=lambda i: -needles[i].depth):
            answers[i] = llm.generate([needles[i].prompt], params)[0].text
        return [answers[i] for i in range(len(needles))]
    first = llm.generate([needles[0].prompt], params)
    rest = llm.generate([n.prompt for n in needles[1:]], params) if len(needles) > 1 else []
    return [o.text for o in [*first, *rest]]


def needle_llm(model: str, kv: str, length: int, chunk: int | None = None) -> LLM:
    """An engine for haystacks of up to ``length`` tokens: one prefill step for the whole
    prompt, or steps of ``chunk`` tokens (they read the same K/V; a whole 32k prompt's
    attention scores alone would take 48 GB on Qwen2.5), room for a haystack and its
    prompts' answers in the pool."""
    return LLM(
        model,
        kv_cache_dtype=kv,
        kv_cache_memory="2GiB",
        max_model_len=length,
        max_num_batched_tokens=chunk or length,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--depths", default=",".join(map(str, DEPTHS)))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--trials", type=int, default=2, help="haystacks per length")
    parser.add_argument(
        "--single", action="store_true", help="a needle per haystack (else every depth's in one)"
    )
    parser.add_argument("--show", action="store_true", help="print every answer")
    parser.add_argument("--chunk", type=int, help="prefill steps of this many tokens")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    dtypes = args.dtypes.split(",")
    per = "a needle per haystack" if args.single else f"{len(depths)} needles per haystack"
    print(f"# CPU: {cpu_isa.describe_cpu()}; {args.model}, {args.trials} trials, {per}")
    started = time.monotonic()
    # hits[kv, length, depth] = needles found of args.trials
    hits: dict[tuple[str, int, float], int] = {}
    for kv in dtypes:
        llm = needle_llm(args.model, kv, max(lengths), args.chunk)
        stored = llm.engine.build_info["kv_dtype"]
        for length in lengths:
            for trial in range(args.trials):
                needles = haystack(llm.tokenizer, length, depths, trial, args.single)
                answers = ask(llm, needles, args.single)
                for needle, answer in zip(needles, answers, strict=True):
                    ok = found(answer, needle.secret)
                    key = (kv, length, needle.depth)
                    hits[key] = hits.get(key, 0) + ok
                    if args.show:
                        print(
                            f"{kv} ({stored}) {length} trial {trial} depth {needle.depth}: "
                            f"{len(needle.prompt)} tokens, {needle.secret} "
                            f"{'found' if ok else 'missed'}: {answer!r}"
                        )
        del llm
    print()
    print("| --kv-cache-dtype | length | " + " | ".join(f"{d:.0%}" for d in depths) + " | all |")
    print("|---|---:|" + "---:|" * (len(depths) + 1))
    for kv in dtypes:
        for length in lengths:
            row = [hits[kv, length, d] for d in depths]
            cells = " | ".join(f"{h}/{args.trials}" for h in row)
            print(f"| {kv} | {length} | {cells} | {sum(row)}/{args.trials * len(depths)} |")
    print()
    print("| --kv-cache-dtype | found |")
    print("|---|---:|")
    total = args.trials * len(depths) * len(lengths)
    for kv in dtypes:
        got = sum(h for (k, _, _), h in hits.items() if k == kv)
        print(f"| {kv} | {got}/{total} ({got / total:.0%}) |")
    print(f"\n{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
