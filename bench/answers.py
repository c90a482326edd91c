"""Answers to the development questions with a real model: are they right, cited, and fast?

    python bench/answers.py [--model qwen2.5-coder-1.5b] [--modes chat,responses,extract,rerank]
                            [--ids ld006,ld086] [--data-dir DIR] [--out answers.jsonl]

Starts ``kvgate serve`` with the model, uploads the shared corpus (32 laws) into one vector
store (kept in ``--data-dir`` and reused by later runs), then asks every development question
of ``../shared/longdoc`` (or of ``--questions``) one at a time, streamed, temperature 0, in
each mode:

- ``chat``: the client searches the store (top 5) and asks ``/v1/chat/completions`` with the
  chunks in the system turn, labelled and placed as the server would (docs' ``prompt.py``);
- ``responses``: ``POST /v1/responses`` with the ``file_search`` tool, kvgate's defaults;
- ``extract``: the same with ``answer_mode: "extract"`` (the best clause quoted first);
- ``rerank``: the same with ``ranking_options: {ranker: "kvgate-llm"}``.

Each answer is graded as a strict reader would (``kvgate/retrieval/grading.py``: the verdict
in the first clause, every quantity with its unit, else the gold wording); in ``extract`` the
quoted clause is the evidence, not the answer, so only what the model wrote after it is
graded. A citation is right when the first chunk the answer cites holds the gold article:
cited as the server annotates it (by its label ``[n]``, else the source the answer names by
article or copies from: docs' ``prompt.cited``), without the server's last resort for an
answer that does neither (the best source), which does not count; a chat completion carries
no annotations, so there only the labels count. Times are from the request's send,
the client's search included: to the first answer text (TTFT) and to the end.

Every answer is written to ``--out`` (JSON lines) for judging by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.longdoc_serving import ingest, wait_store
from bench.serving import SERVED_NAME, pct, start_kvgate, wait_healthy
from kvgate.retrieval.grading import grade, holds_article
from kvgate.retrieval.prompt import arrange, cited, sources_block

SHARED = Path(__file__).resolve().parents[2] / "shared" / "longdoc"
MODES = ("chat", "responses", "extract", "rerank")
STORE_NAME = "answers-corpus"
#: Chunks the ``chat`` mode puts in the prompt.
CHAT_TOP = 5
_LABEL = re.compile(r"\[(\d{1,3})\]")


@dataclass(frozen=True)
class Hit:
    """A search result as the API returns it (docs' ``prompt.Result``)."""

    file_id: str
    filename: str
    text: str
    attributes: dict[str, Any]

    @classmethod
    def of(cls, item: dict[str, Any]) -> Hit:
        text = item.get("text")
        if text is None:  # the vector store search's shape: content parts
            text = "".join(p.get("text", "") for p in item.get("content", []))
        return cls(item["file_id"], item["filename"], text, item.get("attributes") or {})


@dataclass
class Outcome:
    id: str
    type: str
    mode: str
    question: str
    gold: str
    answer: str = ""
    graded: str = ""  # the part of the answer that is graded
    correct: bool = False
    missing: list[str] = field(default_factory=list)
    cited: list[str] = field(default_factory=list)  # "filename section" of each cited chunk
    cite_ok: bool = False
    retrieved_ok: bool = False  # some chunk the model was shown holds the gold article
    gold_rank: int = 0  # of the first such chunk, from 1 (0: none)
    ttft: float = float("nan")
    total: float = float("nan")
    input_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    shown: list[dict[str, Any]] = field(default_factory=list)  # the hits, for ``--rejudge``


def questions(path: Path, ids: set[str] | None) -> list[dict[str, Any]]:
    out = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [q for q in out if ids is None or q["id"] in ids]


def _sse(response: httpx.Response) -> Iterator[tuple[str, Any]]:
    """(event name or "", parsed data) of a server-sent event stream."""
    event = ""
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data != "[DONE]":
                yield event, json.loads(data)
            event = ""


def ask_responses(
    http: httpx.Client,
    url: str,
    store: str,
    q: dict[str, Any],
    mode: str,
    max_tokens: int,
    options: dict[str, Any],
) -> tuple[Outcome, list[Hit]]:
    """``options``: ``max_num_results`` for the tool, and request fields (kvgate's
    ``expand_neighbours``, ``expand_top``); the server's defaults where absent."""
    tool: dict[str, Any] = {"type": "file_search", "vector_store_ids": [store]}
    if "max_num_results" in options:
        tool["max_num_results"] = options["max_num_results"]
    if mode == "rerank":
        tool["ranking_options"] = {"ranker": "kvgate-llm"}
    body = {
        "model": SERVED_NAME, "input": q["question"], "tools": [tool], "stream": True,
        "include": ["file_search_call.results"], "max_output_tokens": max_tokens,
        "temperature": 0, "answer_mode": "extract" if mode == "extract" else "generate",
        **{k: v for k, v in options.items() if k != "max_num_results"},
    }  # fmt: skip
    out = Outcome(q["id"], q["type"], mode, q["question"], q["answer"])
    start = time.perf_counter()
    final: dict[str, Any] = {}
    first_delta = ""
    with http.stream("POST", f"{url}/v1/responses", json=body) as r:
        if r.status_code != 200:
            out.error = f"{r.status_code} {r.read().decode()[:300]}"
            return out, []
        for event, data in _sse(r):
            kind = data.get("type", event)
            if kind == "response.output_text.delta" and out.ttft != out.ttft:
                out.ttft = time.perf_counter() - start
                first_delta = data["delta"]
            elif kind in ("response.completed", "response.failed", "response.incomplete"):
                final = data["response"]
    out.total = time.perf_counter() - start
    results: list[Hit] = []
    for item in final.get("output", []):
        if item["type"] == "file_search_call":
            results = [Hit.of(x) for x in item.get("results") or []]
        elif item["type"] == "message":
            out.answer = "".join(p["text"] for p in item["content"])
    usage = final.get("usage") or {}
    out.input_tokens = usage.get("input_tokens", 0)
    out.output_tokens = usage.get("output_tokens", 0)
    # extract: the first delta is the quoted clause with its citation; the model's answer follows
    quoted = mode == "extract" and "」[1]" in first_delta  # no sources: no quote
    out.graded = out.answer[len(first_delta) :] if quoted else out.answer
    if final.get("status") != "completed":
        out.error = json.dumps(final.get("error") or final.get("incomplete_details"))
    return out, results


def ask_chat(
    http: httpx.Client, url: str, store: str, q: dict[str, Any], max_tokens: int
) -> tuple[Outcome, list[Hit]]:
    out = Outcome(q["id"], q["type"], "chat", q["question"], q["answer"])
    start = time.perf_counter()
    found = http.post(
        f"{url}/v1/vector_stores/{store}/search",
        json={"query": q["question"], "max_num_results": CHAT_TOP},
    )
    found.raise_for_status()
    results = [Hit.of(x) for x in found.json()["data"]]
    body = {
        "model": SERVED_NAME, "stream": True, "max_tokens": max_tokens, "temperature": 0,
        "stream_options": {"include_usage": True},
        # its own prefix-cache space: the same prompt in another mode must not hit its KV
        "cache_salt": "bench-chat",
        "messages": [{"role": "system", "content": sources_block(arrange(results))},
                     {"role": "user", "content": q["question"]}],
    }  # fmt: skip
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            out.error = f"{r.status_code} {r.read().decode()[:300]}"
            return out, results
        for _, data in _sse(r):
            for choice in data.get("choices") or []:
                text = choice.get("delta", {}).get("content") or ""
                if text and out.ttft != out.ttft:
                    out.ttft = time.perf_counter() - start
                out.answer += text
            if data.get("usage"):
                out.input_tokens = data["usage"]["prompt_tokens"]
                out.output_tokens = data["usage"]["completion_tokens"]
    out.total = time.perf_counter() - start
    out.graded = out.answer
    return out, results


def judge(out: Outcome, q: dict[str, Any], results: list[Hit]) -> Outcome:
    out.shown = [asdict(h) for h in results]
    g = grade(out.graded, q["answer"], q.get("answer_span", ""))
    out.correct, out.missing = g.correct and not out.error, list(g.missing)
    if out.mode == "chat":  # a chat completion carries no annotations: its labels are all
        labelled = any(1 <= int(n) <= len(results) for n in _LABEL.findall(out.answer))
        refs = [results[i] for i, _ in cited(out.answer, results)] if labelled else []
    else:  # as the server annotates, without its last resort (the best source)
        refs = [results[i] for i, _ in cited(out.answer, results)]
    out.cited = [f"{h.filename} {h.attributes.get('section', '')}".strip() for h in refs]

    def gold(h: Hit) -> bool:
        return h.filename == q["doc"] and holds_article(h.text, q["article"], q["evidence"])

    out.cite_ok = bool(refs) and gold(refs[0])
    ranks = [i + 1 for i, h in enumerate(results) if gold(h)]
    out.retrieved_ok, out.gold_rank = bool(ranks), ranks[0] if ranks else 0
    return out


def find_store(url: str) -> str | None:
    """A completed store of an earlier run in the same data directory."""
    listed = httpx.get(f"{url}/v1/vector_stores", params={"limit": 100}).json()["data"]
    done = [s for s in listed if s["name"] == STORE_NAME and s["status"] == "completed"]
    return done[0]["id"] if done else None


def report(outcomes: list[Outcome], modes: list[str]) -> None:
    types = sorted({o.type for o in outcomes})
    print("\nmode       answers  cited  (shown the gold)  TTFT p50/p90 s  whole p50/p90 s  "
          "prompt tok  " + "  ".join(f"{t[:10]:>10}" for t in types))  # fmt: skip
    for mode in modes:
        rows = [o for o in outcomes if o.mode == mode]
        if not rows:
            continue
        n = len(rows)
        ttft = [o.ttft for o in rows if o.ttft == o.ttft]
        total = [o.total for o in rows if not o.error]
        by_type = []
        for t in types:
            of = [o for o in rows if o.type == t]
            by_type.append(f"{sum(o.correct for o in of):>4}/{len(of):<5}" if of else " " * 10)
        shown = sum(o.retrieved_ok for o in rows) / n
        print(
            f"{mode:<10} {sum(o.correct for o in rows) / n:>7.2f}  "
            f"{sum(o.cite_ok for o in rows) / n:>5.2f}  {shown:>16.2f}  "
            f"{pct(ttft, 50):>6.1f} / {pct(ttft, 90):<5.1f}  {pct(total, 50):>7.1f} / "
            f"{pct(total, 90):<6.1f}  {sum(o.input_tokens for o in rows) / n:>10.0f}  "
            + "  ".join(by_type)
        )  # fmt: skip
    errors = [o for o in outcomes if o.error]
    for o in errors:
        print(f"error: {o.mode} {o.id}: {o.error}")
    print("targets: answers >= 0.80, cited >= 0.90, whole answer p50 <= 8 s")


def rejudge(path: Path, qfile: Path) -> int:
    """Grade the answers of an earlier run with today's grading and citation code."""
    by_id = {q["id"]: q for q in questions(qfile, None)}
    outcomes = []
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        hits = [Hit(**h) for h in row.pop("shown")]
        outcomes.append(judge(Outcome(**row), by_id[row["id"]], hits))
    report(outcomes, [m for m in MODES if any(o.mode == m for o in outcomes)])
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--shared", default=str(SHARED), help="the longdoc folder")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--ids", default="", help="question ids, comma-separated (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--data-dir", default="", help="kept between runs (the store is reused)")
    p.add_argument("--out", default="", help="every answer, as JSON lines")
    p.add_argument("--num-results", type=int, help="file_search's max_num_results")
    p.add_argument("--expand-neighbours", type=int, help="kvgate's expand_neighbours")
    p.add_argument("--server-arg", action="append", default=[], help="passed to kvgate serve")
    p.add_argument("--rejudge", default="", help="grade an earlier --out file again, ask nothing")
    p.add_argument(
        "--questions",
        default="",
        help="a questions file (default: the development questions; "
        "bench/data/longdoc_heldout.jsonl is held out: measure on it, never tune on it)",
    )
    a = p.parse_args()
    qfile = Path(a.questions) if a.questions else Path(a.shared) / "dev_questions.jsonl"
    if a.rejudge:
        return rejudge(Path(a.rejudge), qfile)
    modes = [m for m in a.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    shared = Path(a.shared)
    todo = questions(qfile, set(a.ids.split(",")) if a.ids else None)
    data = Path(a.data_dir) if a.data_dir else Path(tempfile.mkdtemp(prefix="kvgate-answers-"))
    data.mkdir(parents=True, exist_ok=True)
    data.chmod(0o700)
    options: dict[str, Any] = {}
    if a.num_results is not None:
        options["max_num_results"] = a.num_results
    if a.expand_neighbours is not None:
        options["expand_neighbours"] = a.expand_neighbours
    extra = [x for arg in a.server_arg for x in arg.split()]
    server = start_kvgate("kvgate", a.model, a.port, a.threads, 8, "--data-dir", str(data), *extra)
    outcomes: list[Outcome] = []
    try:
        wait_healthy(server, 900)
        url = server.url
        store = find_store(url)
        if store is None:
            t0 = time.monotonic()
            store, chars, _ = ingest(url, shared / "corpus", name=STORE_NAME)
            waited = wait_store(url, store)
            print(f"ingested {chars} characters in {time.monotonic() - t0 + waited:.0f} s")
        with httpx.Client(timeout=900) as http:
            for q in todo:
                for mode in modes:
                    if mode == "chat":
                        out, results = ask_chat(http, url, store, q, a.max_tokens)
                    else:
                        out, results = ask_responses(
                            http, url, store, q, mode, a.max_tokens, options
                        )
                    outcomes.append(judge(out, q, results))
                    mark = "ok " if out.correct else "NO "
                    mark += "cited" if out.cite_ok else "uncited"
                    tail = out.answer[-160:]
                    print(f"{q['id']} {mode:<9} {mark:<12} {out.total:5.1f} s "
                          f"{out.input_tokens:>5} tok | {tail!r}", flush=True)  # fmt: skip
    finally:
        server.stop()
        if not a.data_dir:
            shutil.rmtree(data, ignore_errors=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            for o in outcomes:
                f.write(json.dumps(asdict(o), ensure_ascii=False) + "\n")
    report(outcomes, modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
