from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.cluster.metrics import merge


def _text(hits: int) -> str:
    registry = CollectorRegistry()
    Counter("vllm:prefix_cache_hits", "hits", ["model_name"], registry=registry).labels("m").inc(
        hits
    )
    Histogram("vllm:e2e_request_latency_seconds", "e2e", registry=registry).observe(0.2)
    return generate_latest(registry).decode()


def test_every_replica_series_is_labelled_and_families_stay_whole() -> None:
    text = merge({"r2": _text(5), "r1": _text(3)}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    hits = {
        s.labels["replica"]: s.value
        for s in families["vllm:prefix_cache_hits"].samples
        if s.name.endswith("_total")
    }
    assert hits == {"r1": 3.0, "r2": 5.0}
    assert text.count("# TYPE vllm:e2e_request_latency_seconds histogram") == 1
    assert 'vllm:e2e_request_latency_seconds_count{replica="r1"} 1.0' in text
