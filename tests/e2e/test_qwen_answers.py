"""A test-sized run of ``bench/answers.py``: three development questions of the shared legal
corpus answered by the shipped real model (Qwen2.5-Coder-1.5B-Instruct Q4_K_M) through
``POST /v1/responses`` with ``file_search`` over three laws, in the default and the
``extract`` answer modes, graded and their citations checked by the benchmark's own code.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.answers import SHARED, ask_responses, judge
from kvgate.config import EngineConfig
from kvgate.errors import ModelNotFound
from kvgate.model.registry import resolve_model_path
from kvgate.server.config import ServerConfig
from tests.server.conftest import LiveServer, start_server

pytestmark = pytest.mark.slow

LAWS = ("laodong_hetong_fa.md", "laodong_fa.md", "xiaofeizhe_quanyi_baohu_fa.md")
#: 15 days to move the records (paraphrased), the weekly day of rest (exact-ish), the
#: probation of a two-year contract (its twin in the other labour law is a distractor).
IDS = ("ld006", "ld067", "ld086")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, str]]:
    if not all((SHARED / "corpus" / law).exists() for law in LAWS):
        pytest.skip(f"the shared corpus is not at {SHARED}")
    try:
        path = resolve_model_path("qwen2.5-coder-1.5b")
    except ModelNotFound as exc:
        pytest.fail(f"the shipped Qwen model is part of the install: {exc.message}")
    engine = EngineConfig(model=str(path), kv_cache_memory="256MiB", max_model_len=4096)
    live = start_server(
        engine,
        ServerConfig(served_model_name="bench", data_dir=str(tmp_path_factory.mktemp("answers"))),
    )
    try:
        with httpx.Client(base_url=live.api_url, timeout=120) as http:
            ids = []
            for law in LAWS:
                body = (SHARED / "corpus" / law).read_bytes()
                r = http.post("/files", files={"file": (law, body)}, data={"purpose": "assistants"})
                ids.append(r.raise_for_status().json()["id"])
            store = http.post("/vector_stores", json={"file_ids": ids}).raise_for_status().json()
            for _ in range(1200):
                if http.get(f"/vector_stores/{store['id']}").json()["status"] == "completed":
                    break
                time.sleep(0.5)
            else:
                pytest.fail("the three laws were not indexed in 10 minutes")
        yield live, store["id"]
    finally:
        live.stop()


def _questions() -> list[dict[str, object]]:
    lines = (SHARED / "dev_questions.jsonl").read_text(encoding="utf-8").splitlines()
    found = [json.loads(line) for line in lines if line]
    return [q for q in found if q["id"] in IDS]


@pytest.mark.parametrize("mode", ["responses", "extract"])
def test_answers_are_right_and_cite_the_gold_article(
    server: tuple[LiveServer, str], mode: str
) -> None:
    live, store = server
    outcomes = []
    with httpx.Client(timeout=600) as http:
        for q in _questions():
            out, results = ask_responses(http, live.base_url, store, q, mode, 128, {})
            outcomes.append(judge(out, q, results))
    for o in outcomes:
        print(f"\n{o.id} {mode}: correct {o.correct} {o.missing}, cited {o.cited} "
              f"({o.cite_ok}), gold at rank {o.gold_rank}, {o.total:.1f} s: "
              f"{o.answer!r}")  # fmt: skip
    assert len(outcomes) == len(IDS) and not [o.error for o in outcomes if o.error]
    # On an Intel Xeon (AMX) all three were found at rank 1; responses answered 2 of 3 (ld086:
    # six months, the longest probation of any contract) and cited 3 of 3, extract answered
    # and cited 3 of 3; the same with the kernels forced to AVX2. Another CPU's kernel path
    # may word an answer otherwise, hence 2 of 3. Since neighbour support left the fusion
    # (2026-12-07: it cost recall on questions it was not tuned on), ld086's gold ranks
    # second behind its twin in the other labour law (劳动法 第二十一条): responses still
    # shows it, extract quotes the best clause only (on a Zen 4: 2 of 3 shown, answered and
    # cited there).
    if mode == "extract":
        assert sum(o.retrieved_ok for o in outcomes) >= 2
    else:
        assert all(o.retrieved_ok for o in outcomes)
    assert sum(o.correct for o in outcomes) >= 2
    assert sum(o.cite_ok for o in outcomes) >= 2
