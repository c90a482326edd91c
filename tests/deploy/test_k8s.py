"""deploy/k8s/: every core resource valid against the Kubernetes schemas
(kubernetes-validate, strict: no unknown fields), and the manifests consistent with each
other and with kvgate itself (flags it accepts, probe paths it serves, metrics it exports)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from kvgate.launch.settings import parse_serve
from tests.server.conftest import LiveServer

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
#: The oldest Kubernetes the manifests are for (PodDisruptionBudget policy/v1, HPA v2).
VERSION = "1.27"
#: Custom resources: no schema in kubernetes-validate; checked by reference below.
CRDS = {"ServiceMonitor"}


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize(
    "doc",
    [d for d in _docs() if d["kind"] not in CRDS],
    ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_valid_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_refuses_a_broken_manifest() -> None:
    broken = _one("Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = (
        "/health"
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_the_pieces_refer_to_each_other() -> None:
    deployment, service = _one("Deployment"), _one("Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert _one("PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= (
        pod_labels.items()
    )
    hpa = _one("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] > _one("PodDisruptionBudget")["spec"]["minAvailable"]
    monitor = _one("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= service_ports
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container_ports = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    # The HPA's metric is the one the adapter's rule serves.
    rules = yaml.safe_load(_one("ConfigMap")["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"] for rule in rules}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in served


def test_the_container_runs_a_command_kvgate_accepts() -> None:
    deployment = _one("Deployment")
    spec = deployment["spec"]["template"]["spec"]
    args = spec["containers"][0]["args"]
    assert args[0] == "serve"
    parsed = parse_serve(args[1:])
    assert parsed.host == "0.0.0.0" and parsed.port == 8000
    # Room to drain: the grace period outlasts the server's own shutdown timeout.
    assert spec["terminationGracePeriodSeconds"] > parsed.shutdown_timeout


def test_probes_and_metrics_are_what_the_server_serves(live_server: LiveServer) -> None:
    container = _one("Deployment")["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        path = container[probe]["httpGet"]["path"]
        assert httpx.get(f"{live_server.base_url}{path}").status_code == 200, probe
    text = httpx.get(f"{live_server.base_url}/metrics").text
    for rule in yaml.safe_load(_one("ConfigMap")["data"]["config.yaml"])["rules"]:
        assert rule["name"]["matches"] in text  # the adapter's series is exported
