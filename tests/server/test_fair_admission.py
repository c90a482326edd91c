"""Fair admission at the door: one tenant's flood cannot fill the server's queue."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import start_tenants_server

TENANTS = """
[tenants.flood]
keys = ["sk-flood"]

[tenants.quiet]
keys = ["sk-quiet"]
"""


@pytest.mark.slow
def test_a_flood_leaves_queue_slots_for_another_tenant(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    live = start_tenants_server(
        tiny_llama_dir, TENANTS, tmp_path, engine={"max_num_seqs": 2}, max_queue_len=6
    )  # 8 request slots, 2 kept free from a tenant past its share
    statuses: list[int] = []
    stop = threading.Event()

    def flood_stream(i: int) -> None:
        body = {"prompt": f"flood {i}", "max_tokens": 500, "stream": True, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{live.api_url}/completions", json=body, timeout=60,
            headers={"authorization": "Bearer sk-flood"},
        ) as resp:  # fmt: skip
            statuses.append(resp.status_code)
            for _ in resp.iter_lines():
                if stop.is_set():
                    break

    threads = [threading.Thread(target=flood_stream, args=(i,)) for i in range(10)]
    try:
        for t in threads:
            t.start()
        gate = live.state.governance.gate("tiny")
        assert gate is not None
        deadline = time.monotonic() + 10
        while len(statuses) < 10:
            assert time.monotonic() < deadline, statuses
            time.sleep(0.01)
        # The flood holds 6 of 8 slots; its other requests were refused (503, retry later).
        assert sorted(statuses) == [200] * 6 + [503] * 4 and gate.in_flight("flood") == 6
        quiet = httpx.post(
            f"{live.api_url}/completions",
            json={"prompt": "hello", "max_tokens": 2},
            headers={"authorization": "Bearer sk-quiet"},
            timeout=60,
        )
        assert quiet.status_code == 200
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        live.stop()
