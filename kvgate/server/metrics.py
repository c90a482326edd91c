"""Prometheus metrics under vLLM's names, so existing dashboards and autoscalers read them.

Two sources, one registry per app (no process-global registry):
- ``EngineCollector`` reads the engine's latest snapshot at scrape time (running / waiting
  requests, KV usage, prefix-cache and preemption counters: ``engine/snapshot.py``), taken
  after every step, add and abort, so a scrape right after a burst of aborts already shows
  the pool back at its baseline, and never a state torn between two moments;
- ``PrometheusStatsListener`` turns each step's ``IterationStats`` into histograms (TTFT,
  inter-token latency, end-to-end, queue, prefill, decode) and token counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.engine.snapshot import EngineSnapshot
from kvgate.engine.stats import IterationStats
from kvgate.governance.tenants import PRIORITIES
from kvgate.server.governance import Governance

# Seconds. From a few ms (GPU decode) to many minutes (long CPU prefills behind a queue).
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
               1.0, 2.5, 5.0, 10.0, 20.0)  # fmt: skip
REQUEST_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                 100000)  # fmt: skip

LABELS = ("model_name",)


class EngineCollector(Collector):
    """The engine's latest snapshot; yields nothing until the engine exists."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot | None], model_name: str) -> None:
        self._snapshot = snapshot
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()  # one moment: every figure below comes from it
        if snap is None:
            return
        labels = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        info = GaugeMetricFamily(
            "kvgate:build_info",
            "What this server runs, always 1: the CPU ISA level the native kernels were built "
            "for, the compute dtype, and each op's kernel path (or torch).",
            labels=[*LABELS, *snap.build_info],
        )
        info.add_metric([*labels, *snap.build_info.values()], 1)
        yield info
        yield counter(
            "kvgate:engine_restarts",
            "Times the engine's supervisor ended every request in flight after an unexpected "
            "error in a step and carried on.",
            snap.recoveries,
        )
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", snap.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run.", snap.waiting)
        yield counter(
            "kvgate:engine_requests_added",
            "Requests handed to the engine's scheduler (running + waiting + finished).",
            snap.added,
        )
        yield counter(
            "kvgate:engine_requests_finished",
            "Requests that ended in the engine, any way (finished, aborted, refused, expired).",
            snap.finished,
        )
        yield counter("kvgate:engine_steps", "Engine steps run.", snap.steps)
        yield gauge(
            "kvgate:num_requests_running_spare",
            "Running requests in spare slots beyond max_num_seqs (instead of preempting).",
            snap.running_spare,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (1 = full).",
            snap.kv_usage,
        )
        yield counter(
            "kvgate:kv_window_freed_blocks",
            "KV blocks given back because they fell out of every sliding window that reads them.",
            snap.kv_window_freed,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            snap.prefix_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.prefix_hits
        )
        yield counter(
            "vllm:num_preemptions", "Requests preempted for lack of KV blocks.", snap.preemptions
        )
        blocks = GaugeMetricFamily(
            "kvgate:kv_cache_blocks",
            "KV-cache blocks by state: used (held by requests), cached (free but holding a "
            "reusable prefix), free.",
            labels=(*LABELS, "state"),
        )
        yield gauge(
            "kvgate:kv_fragmentation_ratio",
            "Reserved but unfilled KV slots over reserved slots (running requests).",
            snap.kv_fragmentation,
        )
        by_reason = CounterMetricFamily(
            "kvgate:preemptions",
            "Preemptions by cause: pool (no free block), quota (tenant ceiling), slot.",
            labels=(*LABELS, "reason"),
        )
        for reason, n in snap.preemptions_by_reason.items():
            by_reason.add_metric([*labels, reason], n)
        yield by_reason
        blocks.add_metric([*labels, "used"], snap.kv_used)
        blocks.add_metric([*labels, "cached"], snap.kv_cached)
        blocks.add_metric([*labels, "free"], snap.kv_free)
        yield blocks


class TenantCollector(Collector):
    """Per-tenant accounting (tenant label), read live at scrape time."""

    def __init__(
        self, snapshot: Callable[[], EngineSnapshot | None], governance: Governance
    ) -> None:
        self._snapshot = snapshot
        self._governance = governance

    def collect(self) -> Iterator[Metric]:
        report = self._governance.report(self._snapshot())
        tl = ("tenant",)

        def family(
            kind: type[CounterMetricFamily | GaugeMetricFamily],
            name: str,
            doc: str,
            labels: tuple[str, ...] = tl,
        ) -> Any:
            return kind(name, doc, labels=labels)

        prompt = family(CounterMetricFamily, "kvgate:tenant_prompt_tokens", "Prompt tokens served.")
        gen = family(CounterMetricFamily, "kvgate:tenant_generation_tokens", "Tokens generated.")
        block_s = family(
            CounterMetricFamily,
            "kvgate:tenant_kv_block_seconds",
            "KV blocks held, integrated over time (block-seconds).",
        )
        held = family(GaugeMetricFamily, "kvgate:tenant_kv_blocks", "KV blocks held now.")
        quota = family(
            GaugeMetricFamily,
            "kvgate:tenant_kv_quota_blocks",
            "KV quota in blocks: the guaranteed share and the ceiling.",
            (*tl, "kind"),
        )
        requests = family(
            GaugeMetricFamily, "kvgate:tenant_requests", "Requests by state.", (*tl, "state")
        )
        refusals = family(
            CounterMetricFamily,
            "kvgate:tenant_refusals",
            "Requests refused, by reason (the error code).",
            (*tl, "reason"),
        )
        finished = family(
            CounterMetricFamily,
            "kvgate:tenant_requests_finished",
            "Requests ended in the engine, by finish reason.",
            (*tl, "reason"),
        )
        queries = family(
            CounterMetricFamily,
            "kvgate:tenant_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
        )
        hits = family(
            CounterMetricFamily,
            "kvgate:tenant_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (hit rate = hits / queries).",
        )
        depth = family(
            GaugeMetricFamily,
            "kvgate:queue_depth",
            "Requests waiting, by priority class.",
            ("priority",),
        )
        waiting_by_class: dict[str, int] = {p: 0 for p in PRIORITIES}
        for tenant, row in report.items():
            prompt.add_metric([tenant], row["prompt_tokens"])
            gen.add_metric([tenant], row["generation_tokens"])
            block_s.add_metric([tenant], row["kv_block_seconds"])
            held.add_metric([tenant], row["kv_blocks_held"])
            quota.add_metric([tenant, "guaranteed"], row["kv_guaranteed_blocks"])
            quota.add_metric([tenant, "ceiling"], row["kv_ceiling_blocks"])
            requests.add_metric([tenant, "running"], row["running"])
            requests.add_metric([tenant, "waiting"], row["waiting"])
            for reason, n in row["refusals"].items():
                refusals.add_metric([tenant, reason], n)
            for reason, n in row["finished"].items():
                finished.add_metric([tenant, reason], n)
            queries.add_metric([tenant], row["prefix_cache_queries"])
            hits.add_metric([tenant], row["prefix_cache_hits"])
            waiting_by_class[row["priority"]] += row["waiting"]
        for priority, n in waiting_by_class.items():
            depth.add_metric([priority], n)
        yield from (prompt, gen, block_s, held, quota, requests, refusals, finished)
        yield from (queries, hits, depth)


class PrometheusStatsListener:
    """Receives ``IterationStats`` on the engine thread (prometheus_client is thread-safe)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets)

        def count(name: str, doc: str, labels: tuple[str, ...] = LABELS) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS
        )
        self.req_prompt = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per finished request.", TOKEN_BUCKETS
        )
        self.req_gen = hist(
            "vllm:request_generation_tokens",
            "Generated tokens per finished request.",
            TOKEN_BUCKETS,
        )
        self.iter_tokens = hist(
            "vllm:iteration_tokens_total", "Tokens run through the model per step.", TOKEN_BUCKETS
        )
        self.step_time = Histogram(
            "kvgate:engine_step_seconds",
            "Wall time of one engine step, by what it ran: prefill, decode or mixed.",
            (*LABELS, "phase"),
            registry=registry,
            buckets=ITL_BUCKETS,
        )
        self.batch_size = hist("kvgate:batch_size", "Sequences in one engine step.", TOKEN_BUCKETS)
        self.prompt_tokens = count("vllm:prompt_tokens", "Prompt tokens of requests that began.")
        self.generation_tokens = count("vllm:generation_tokens", "Tokens generated.")
        self.success = count(
            "vllm:request_success",
            "Finished requests by finish reason.",
            (*LABELS, "finished_reason"),
        )

    def on_step(self, stats: IterationStats) -> None:
        m = self.model_name
        if stats.batch_size:
            self.iter_tokens.labels(m).observe(stats.num_batched_tokens)
            self.batch_size.labels(m).observe(stats.batch_size)
            self.step_time.labels(m, stats.phase).observe(stats.step_seconds)
        if stats.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.labels(m).inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.ttft.labels(m).observe(ttft)
        for itl in stats.inter_token_latencies:
            self.itl.labels(m).observe(itl)
        for f in stats.finished:
            self.success.labels(m, f.finish_reason).inc()
            if f.finish_reason in ("abort", "error"):
                continue  # latencies of requests that did not complete would skew the histograms
            self.e2e.labels(m).observe(f.metrics.e2e_seconds)
            self.queue.labels(m).observe(f.metrics.queue_seconds)
            self.prefill.labels(m).observe(f.metrics.prefill_seconds)
            self.decode.labels(m).observe(f.metrics.decode_seconds)
            self.req_prompt.labels(m).observe(f.num_prompt_tokens)
            self.req_gen.labels(m).observe(f.num_output_tokens)
