"""The shipped Prometheus alert rules and Grafana dashboard: valid, tested, and reading only
metrics the server really exports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import API_KEY, METRICS_KEY, LiveServer

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "kvgate-alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "kvgate-alerts.test.yml"
DASHBOARD = DEPLOY / "grafana" / "kvgate-dashboard.json"
METRIC = re.compile(r"\b((?:vllm|kvgate):[a-z0-9_]+|process_[a-z0-9_]+)")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing in CI (scripts/install.sh --test installs it)")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    return found


def test_rules_are_valid() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_rules_unit_tests_pass() -> None:
    out = subprocess.run(
        [promtool(), "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        cwd=RULE_TESTS.parent,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_rules_cover_what_operators_page_on() -> None:
    names = set(re.findall(r"alert: (\w+)", RULES.read_text()))
    assert names == {
        "KVGateKVCacheNearlyFull", "KVGateTenantNearQuota", "KVGateHighFragmentation",
        "KVGateTTFTRegression", "KVGateInterTokenLatencyRegression", "KVGateQueueGrowing",
        "KVGateHighErrorRate", "KVGatePreemptionStorm",
    }  # fmt: skip
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert names - tested == {"KVGateInterTokenLatencyRegression"}  # same shape as TTFT's


def _exported_families(live: LiveServer) -> set[str]:
    # Some traffic first, so that every labelled family has samples.
    httpx.post(
        f"{live.api_url}/completions",
        json={"prompt": "hello there", "max_tokens": 3},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    text = httpx.get(
        f"{live.base_url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}
    ).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def _base(name: str) -> str:
    return re.sub(r"_(bucket|sum|count|total)$", "", name)


def test_rules_and_dashboard_read_only_exported_metrics(live_server: LiveServer) -> None:
    exported = _exported_families(live_server)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    referenced = set(METRIC.findall(RULES.read_text())) | {
        m for e in exprs for m in METRIC.findall(e)
    }
    missing = sorted(n for n in referenced if _base(n) not in exported and n not in exported)
    assert not missing, f"referenced but not exported: {missing}"
    assert len(dashboard["panels"]) >= 15
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
