"""The /dashboard status page in headless Chromium (Debian's chromium + chromedriver)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, METRICS_KEY, MODEL, LiveServer, wait_idle

webdriver = pytest.importorskip("selenium.webdriver")


def _chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        if os.environ.get("CI"):
            pytest.fail("chromium/chromedriver missing in CI (scripts/install.sh --test)")
        pytest.skip("chromium and chromedriver not installed (apt-get install chromium-driver)")
    return browser, driver


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium.webdriver.chrome.service import Service

    binary, driver = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


def _wait(predicate: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the page did not update in time"
        time.sleep(0.1)


def test_dashboard_shows_live_state(browser: object, live_server: LiveServer) -> None:
    from selenium.webdriver.common.by import By

    chrome = browser
    client = openai.OpenAI(base_url=live_server.api_url, api_key=API_KEY, max_retries=0)
    client.completions.create(model=MODEL, prompt="warm the latencies", max_tokens=4)
    wait_idle(live_server)
    # Poll fast: the tiny model's longest request lasts well under a second.
    # The metrics key in the fragment: the page shows the tenants' rows.
    url = f"{live_server.base_url}/dashboard?refresh=100#key={METRICS_KEY}"
    chrome.get(url)  # type: ignore[attr-defined]

    def text(element_id: str) -> str:
        return str(chrome.find_element(By.ID, element_id).text)  # type: ignore[attr-defined]

    _wait(lambda: text("status") == "ready" and text("running") == "0")
    assert text("model") == MODEL
    assert "blocks" in text("kv-blocks") and text("kv-usage").endswith("%")
    assert text("ttft") != "-" and " ms" in text("ttft")
    # A long stream in flight shows up as running, with KV in use and its tenant's row.
    streams = [
        client.completions.create(
            model=MODEL,
            prompt=f"x{i}",
            max_tokens=480,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for i in range(4)
    ]
    for s in streams:
        next(iter(s))
    try:
        _wait(lambda: text("running") not in ("0", "-"))
        _wait(lambda: not text("kv-blocks").startswith("0 used"))
        # Rows are rebuilt on every refresh: read them in one script call.
        tenants_js = (
            "return [...document.querySelectorAll('#tenants tr')].map(r => r.dataset.tenant)"
        )
        _wait(lambda: "team-a" in chrome.execute_script(tenants_js))  # type: ignore[attr-defined]
    finally:
        for s in streams:
            s.close()
    wait_idle(live_server)
    _wait(lambda: text("running") == "0" and text("kv-blocks").startswith("0 used"))
    before = chrome.find_element(By.TAG_NAME, "body").get_attribute("data-updated")  # type: ignore[attr-defined]
    _wait(
        lambda: chrome.find_element(By.TAG_NAME, "body").get_attribute("data-updated") != before  # type: ignore[attr-defined]
    )


def test_dashboard_data_is_open_json_without_tenant_names(live_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=live_server.api_url, api_key=API_KEY, max_retries=0)
    client.completions.create(model=MODEL, prompt="so team-a has a row", max_tokens=2)
    data = httpx.get(f"{live_server.base_url}/dashboard/data").json()
    assert data["ready"] is True and data["kv"]["blocks"] > 0
    assert set(data["latency"]) >= {"ttft_p50", "ttft_p99", "itl_p50", "generation_tok_s"}
    # Without a metrics or admin key: aggregates only, no tenant named.
    assert data["tenants"] == [] and data["tenants_hidden"] is True
    for key in (API_KEY, "sk-nobody"):  # a tenant key is not enough either
        hidden = httpx.get(
            f"{live_server.base_url}/dashboard/data", headers={"authorization": f"Bearer {key}"}
        ).json()
        assert hidden["tenants"] == []
    shown = httpx.get(
        f"{live_server.base_url}/dashboard/data",
        headers={"authorization": f"Bearer {METRICS_KEY}"},
    ).json()
    assert "team-a" in [t["name"] for t in shown["tenants"]] and not shown["tenants_hidden"]
