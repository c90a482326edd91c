"""Every replica's ``/metrics`` as one exposition, each series labelled ``replica``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge(texts: Mapping[str, str]) -> bytes:
    """``texts``: replica name -> its exposition text. One family per metric name, its
    samples from every replica (by replica name, then as each replica listed them)."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = Metric(family.name, family.documentation, family.type, family.unit)
                families[family.name] = merged
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                merged.samples.append(sample._replace(labels=labels))
    return generate_latest(_Families(list(families.values())))
