"""``/v1/embeddings`` throughput and ``/v1/rerank`` latency through the server.

    python bench/embeddings.py [--texts 256] [--repeats 10] [--embed-precision auto]

Starts ``kvgate serve`` (SmolLM2, the default model; a data directory of its own, so the
embedder is the document store's multilingual-e5-small), warms both endpoints up, then, one
request at a time (no other load):

- embeddings of ``--texts`` Chinese sentences, then as many English ones, sent one per
  request (batch 1) and 64 per request: texts/s, characters/s and e5 tokens/s (from the
  responses' usage), and each request's latency p50;
- ``--repeats`` reranks of 10 passages (5 Chinese, 5 English, ~30-60 tokens each) against a
  question on SmolLM2, numbered so that no prompt is in the prefix cache: latency p50 / p90
  and the prompt tokens judged.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import SERVED_NAME, pct, start_kvgate, wait_healthy

ZH = [
    "劳动者连续工作一年以上的，享受带薪年休假。",
    "用人单位应当保证劳动者每周至少休息一日。",
    "当事人应当按照约定全面履行自己的义务。",
    "国家实行劳动者每日工作时间不超过八小时的工时制度。",
    "职工累计工作已满一年不满十年的，年休假五天。",
    "用人单位安排劳动者延长工作时间的，应当支付不低于工资百分之一百五十的工资报酬。",
    "合同当事人的权利和义务，依照法律的规定确定。",
    "劳动合同期满的，劳动合同终止。",
    "生产经营单位的主要负责人对本单位的安全生产工作全面负责。",
    "产品质量应当检验合格，不得以不合格产品冒充合格产品。",
    "农民工工资应当以货币形式，通过银行转账或者现金支付给农民工本人。",
    "消费者享有自主选择商品或者服务的权利。",
    "任何组织或者个人不得侵犯他人的个人信息权益。",
    "国家鼓励和支持科学研究和技术开发，推广先进技术。",
    "城市规划区内的建设工程，应当符合城市规划。",
    "公民的合法的私有财产不受侵犯。",
]
EN = [
    "An employee who has worked for one year is entitled to paid annual leave.",
    "The employer shall ensure that workers have at least one day off each week.",
    "The parties shall fully perform their obligations as agreed in the contract.",
    "Working hours shall not exceed eight hours a day on average.",
    "Overtime is paid at no less than one hundred and fifty percent of the normal wage.",
    "The labour contract ends when its agreed term expires.",
    "The principal person in charge is fully responsible for safety at work.",
    "Products shall pass inspection; substandard goods may not be sold as qualified.",
    "Wages of migrant workers shall be paid in money, directly to the workers themselves.",
    "Consumers have the right to choose goods and services on their own.",
    "No organisation or individual may infringe on the personal information of others.",
    "The state encourages scientific research and the spread of advanced technology.",
    "Construction within a city's planning area must conform to the city plan.",
    "The lawful private property of citizens shall not be encroached upon.",
    "A contract that violates a mandatory provision of law is void.",
    "Each party may terminate the agreement with thirty days' written notice.",
]
QUESTION = "职工工作满一年后每年可以休几天带薪年休假？"
PASSAGES = [
    "职工累计工作已满1年不满10年的，年休假5天；已满10年不满20年的，年休假10天；已满20年的，"
    "年休假15天。国家法定休假日、休息日不计入年休假的假期。",
    "用人单位由于生产经营需要，经与工会和劳动者协商后可以延长工作时间，一般每日不得超过一小时。",
    "劳动者在同一用人单位连续工作满十年以上，当事人双方同意续延劳动合同的，应当订立无固定期限"
    "的劳动合同。",
    "单位确因工作需要不能安排职工休年休假的，经职工本人同意，可以不安排职工休年休假。",
    "生产经营单位必须遵守本法和其他有关安全生产的法律、法规，加强安全生产管理。",
    "Employees with at least one year of continuous service receive five days of paid annual "
    "leave; public holidays and weekly rest days are not counted as leave days.",
    "Overtime on a statutory public holiday is paid at no less than three times the normal "
    "wage, and may not be replaced by time off.",
    "The employer must keep wage records for at least two years and show them to the worker "
    "on request.",
    "A worker who is ill may take sick leave; the leave does not count towards annual leave "
    "for the same year.",
    "The canteen on the third floor opens at noon and serves lunch until two o'clock.",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def texts_of(base: list[str], n: int) -> list[str]:
    """``n`` texts cycling ``base``, each made distinct by a number."""
    return [f"{base[i % len(base)]}（{i}）" for i in range(n)]


def embed_run(http: httpx.Client, texts: list[str], batch: int) -> dict[str, float]:
    latencies: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        t0 = time.perf_counter()
        r = http.post("/v1/embeddings", json={"model": "multilingual-e5-small",
                                              "input": texts[i : i + batch]})  # fmt: skip
        r.raise_for_status()
        latencies.append(time.perf_counter() - t0)
        tokens += r.json()["usage"]["prompt_tokens"]
    wall = time.perf_counter() - start
    chars = sum(len(t) for t in texts)
    return {
        "texts_s": len(texts) / wall, "chars_s": chars / wall, "tokens_s": tokens / wall,
        "p50_ms": statistics.median(latencies) * 1e3, "tokens": tokens,
    }  # fmt: skip


def rerank_run(http: httpx.Client, repeats: int, first: int = 0) -> tuple[list[float], int]:
    """Each request's question is numbered: the question leads every passage's prompt, so
    no request finds another's passages in the prefix cache."""
    latencies: list[float] = []
    prompt = 0
    for i in range(first, first + repeats):
        body = {"model": SERVED_NAME, "query": f"{QUESTION}（{i}）", "documents": PASSAGES}
        t0 = time.perf_counter()
        r = http.post("/v1/rerank", json=body)
        r.raise_for_status()
        latencies.append(time.perf_counter() - t0)
        prompt = r.json()["usage"]["prompt_tokens"]
    return sorted(latencies), prompt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--texts", type=int, default=256, help="texts per language")
    p.add_argument("--repeats", type=int, default=10, help="rerank requests")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--embed-precision", default="auto")
    a = p.parse_args()
    data = Path(tempfile.mkdtemp(prefix="kvgate-embeddings-"))
    server = start_kvgate(
        "kvgate", a.model, _free_port(), a.threads, 32, "--data-dir", str(data),
        "--embed-precision", a.embed_precision,
    )  # fmt: skip
    rows = []
    try:
        wait_healthy(server)
        with httpx.Client(base_url=server.url, timeout=600) as http:
            embed_run(http, texts_of(ZH + EN, 64), 64)  # loads the embedder, warms it
            rerank_run(http, 2)
            for lang, base in (("Chinese", ZH), ("English", EN)):
                texts = texts_of(base, a.texts)
                for batch in (1, 64):
                    rows.append((lang, batch, embed_run(http, texts, batch)))
            rerank, prompt = rerank_run(http, a.repeats, first=2)
            version = http.get("/v1/models/multilingual-e5-small").json()["version"]
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    print(f"embeddings ({version}, --embed-precision {a.embed_precision}), one request at a time")
    print("| texts | batch | texts/s | characters/s | e5 tokens/s | request p50 ms |")
    print("|---|---:|---:|---:|---:|---:|")
    for lang, batch, r in rows:
        print(f"| {a.texts} {lang} | {batch} | {r['texts_s']:.1f} | {r['chars_s']:.0f} | "
              f"{r['tokens_s']:.0f} | {r['p50_ms']:.1f} |")  # fmt: skip
    print(f"rerank, 10 passages on {a.model} ({prompt} prompt tokens): "
          f"p50 {pct(rerank, 50) * 1e3:.0f} ms, p90 {pct(rerank, 90) * 1e3:.0f} ms, "
          f"min {rerank[0] * 1e3:.0f} ms over {a.repeats}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
