"""Prometheus metrics under vLLM's names, so existing dashboards and autoscalers read them.

Two sources, one registry per app (no process-global registry):
- ``EngineCollector`` reads the engine's latest snapshot at scrape time (running / waiting
  requests, KV usage, prefix-cache and preemption counters: ``engine/snapshot.py``), taken
  after every step, add and abort, so a scrape right after a burst of aborts already shows
  the pool back at its baseline, and never a state torn between two moments;
- ``PrometheusStatsListener`` turns each step's ``IterationStats`` into histograms (TTFT,
  inter-token latency, end-to-end, queue, prefill, decode) and token counters.

Every engine figure carries ``model_name``: a server of several models has one series per
model in each family (and per tenant and model in the per-tenant ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.engine.autopilot import AutopilotState
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
    """Each loaded model's latest engine snapshot; nothing for a model not loaded yet."""

    def __init__(self, snapshots: Callable[[], Mapping[str, EngineSnapshot]]) -> None:
        self._snapshots = snapshots

    def collect(self) -> Iterator[Metric]:
        snaps = self._snapshots()  # one moment per model: its figures below all come from it
        if not snaps:
            return
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(
            kind: type[GaugeMetricFamily | CounterMetricFamily],
            name: str,
            doc: str,
            labels: list[str],
            value: float,
            extra: tuple[str, ...] = (),
        ) -> None:
            family = families.get(name)
            if family is None:
                family = families[name] = kind(name, doc, labels=(*LABELS, *extra))
            family.add_metric(labels, value)

        # Exported even while no model has preempted anything (dashboards and rules read it).
        families["kvgate:preemptions"] = CounterMetricFamily(
            "kvgate:preemptions",
            "Preemptions by cause: pool (no free block), quota (tenant ceiling), slot.",
            labels=(*LABELS, "reason"),
        )
        keys = sorted({k for snap in snaps.values() for k in snap.build_info})
        for model, snap in snaps.items():
            m = [model]

            def gauge(name: str, doc: str, value: float, m: list[str] = m) -> None:
                add(GaugeMetricFamily, name, doc, m, value)

            def counter(name: str, doc: str, value: float, m: list[str] = m) -> None:
                add(CounterMetricFamily, name, doc, m, value)

            add(
                GaugeMetricFamily,
                "kvgate:build_info",
                "What this server runs, always 1: the CPU ISA level the native kernels were "
                "built for, the compute dtype, and each op's kernel path (or torch).",
                [*m, *(snap.build_info.get(k, "") for k in keys)],
                1,
                tuple(keys),
            )
            counter(
                "kvgate:engine_restarts",
                "Times the engine's supervisor ended every request in flight after an "
                "unexpected error in a step and carried on.",
                snap.recoveries,
            )
            gauge("vllm:num_requests_running", "Requests in the running batch.", snap.running)
            gauge("vllm:num_requests_waiting", "Requests waiting to run.", snap.waiting)
            counter(
                "kvgate:engine_requests_added",
                "Requests handed to the engine's scheduler (running + waiting + finished).",
                snap.added,
            )
            counter(
                "kvgate:engine_requests_finished",
                "Requests that ended in the engine, any way (finished, aborted, refused, expired).",
                snap.finished,
            )
            counter("kvgate:engine_steps", "Engine steps run.", snap.steps)
            gauge(
                "kvgate:num_requests_running_spare",
                "Running requests in spare slots beyond max_num_seqs (instead of preempting).",
                snap.running_spare,
            )
            gauge(
                "vllm:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (1 = full).",
                snap.kv_usage,
            )
            counter(
                "kvgate:kv_window_freed_blocks",
                "KV blocks given back because they fell out of every sliding window that "
                "reads them.",
                snap.kv_window_freed,
            )
            counter(
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                snap.prefix_queries,
            )
            counter(
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                snap.prefix_hits,
            )
            counter(
                "vllm:num_preemptions",
                "Requests preempted for lack of KV blocks.",
                snap.preemptions,
            )
            gauge(
                "kvgate:kv_cache_capacity_tokens",
                "Tokens of KV the pool holds (fixed at load).",
                snap.kv_capacity_tokens,
            )
            gauge(
                "kvgate:kv_cache_bytes_per_token",
                "Bytes a token of KV costs across every layer, as the model's KV specs lay it "
                "out (a latent cache keeps one vector a token and layer; fixed at load).",
                snap.kv_bytes_per_token,
            )
            gauge(
                "kvgate:kv_cache_held_bytes_per_token",
                "KV bytes the running requests' blocks hold per token of their context (with "
                "sliding windows and compressed entries, less than a block's bytes over its "
                "tokens); 0 when nothing runs.",
                snap.kv_held_bytes_per_token,
            )
            gauge(
                "kvgate:kv_fragmentation_ratio",
                "Reserved but unfilled KV slots over reserved slots (running requests).",
                snap.kv_fragmentation,
            )
            if snap.kv_tier is not None:
                _tier_metrics(snap, gauge, counter)
            if snap.autopilot is not None:
                _slo_metrics(snap.autopilot, m, add)
            for reason, n in snap.preemptions_by_reason.items():
                families["kvgate:preemptions"].add_metric([*m, reason], n)
            for state, n in (
                ("used", snap.kv_used), ("cached", snap.kv_cached), ("free", snap.kv_free)
            ):  # fmt: skip
                add(
                    GaugeMetricFamily,
                    "kvgate:kv_cache_blocks",
                    "KV-cache blocks by state: used (held by requests), cached (free but "
                    "holding a reusable prefix), free.",
                    [*m, state],
                    n,
                    ("state",),
                )
        yield from families.values()


def _slo_metrics(
    state: AutopilotState,
    m: list[str],
    add: Callable[..., None],
) -> None:
    """The SLO autopilot's figures (``engine/autopilot.py``): targets and the last window's
    observations per SLO group, each knob now and as configured, breaches and adjustments."""
    for group, row in state.groups.items():
        for metric, (target, observed) in row.items():
            labels = [*m, group, metric]
            add(
                GaugeMetricFamily,
                "kvgate:slo_target_seconds",
                "SLO target per group (a class, or tenant:NAME) and metric (ttft_p90, "
                "ttft_p99, itl_p99).",
                labels,
                target,
                ("slo_group", "metric"),
            )
            if observed is not None:
                add(
                    GaugeMetricFamily,
                    "kvgate:slo_observed_seconds",
                    "The metric's value in the autopilot's last window (absent: no sample).",
                    labels,
                    observed,
                    ("slo_group", "metric"),
                )
    for (group, metric), n in state.breaches.items():
        add(
            CounterMetricFamily,
            "kvgate:slo_breaches",
            "Windows in which a group's metric was over its target.",
            [*m, group, metric],
            n,
            ("slo_group", "metric"),
        )
    for knob in ("token_budget", "chunk_size", "max_running"):
        for which, knobs in (("current", state.knobs), ("configured", state.configured)):
            add(
                GaugeMetricFamily,
                "kvgate:slo_knob",
                "The scheduler's knobs: the per-step token budget, the prefill chunk, the "
                "running sequences' cap; as the autopilot set them and as configured.",
                [*m, knob, which],
                getattr(knobs, knob),
                ("knob", "value"),
            )
    add(
        GaugeMetricFamily,
        "kvgate:slo_held_tenants",
        "Tenants whose new requests the autopilot holds for a higher class's SLO.",
        m,
        len(state.knobs.held),
    )
    for (knob, direction), n in state.adjustments.items():
        add(
            CounterMetricFamily,
            "kvgate:slo_adjustments",
            "Times the autopilot moved a knob (admission: the held classes), by direction.",
            [*m, knob, direction],
            n,
            ("knob", "direction"),
        )
    add(
        CounterMetricFamily, "kvgate:slo_windows", "Windows the autopilot judged.", m, state.windows
    )


def _tier_metrics(
    snap: EngineSnapshot,
    gauge: Callable[[str, str, float], None],
    counter: Callable[[str, str, float], None],
) -> None:
    """The second KV tier's figures (``--kv-tier``)."""
    tier = snap.kv_tier
    assert tier is not None
    c = tier.counters
    gauge("kvgate:kv_tier_used_bytes", "Bytes the KV tier's files take.", tier.used_bytes)
    gauge("kvgate:kv_tier_capacity_bytes", "The KV tier's size limit.", tier.capacity_bytes)
    gauge("kvgate:kv_tier_blocks", "KV blocks held in the tier.", tier.num_blocks)
    gauge(
        "kvgate:kv_tier_requests_loading",
        "Requests waiting for their prefix to load from the KV tier.",
        snap.kv_loading,
    )
    for name, doc, value in (
        ("loads", "Prefixes loaded from the KV tier (one per request admitted).", c.loads),
        ("loaded_blocks", "KV blocks loaded from the tier back into the pool.", c.loaded_blocks),
        ("failed_loads", "Loads that failed (a file gone or corrupt): recomputed.", c.failed_loads),
        ("stored_blocks", "KV blocks written to the tier.", c.stored_blocks),
        (
            "dropped_stores",
            "KV blocks not written to the tier (the writer behind, or the disk failed).",
            c.dropped_stores,
        ),
        ("read_bytes", "Bytes read from the KV tier.", c.bytes_read),
        ("written_bytes", "Bytes written to the KV tier.", c.bytes_written),
        (
            "load_seconds",
            "Seconds loads took, from start to the last block read (divide by "
            "kvgate:kv_tier_loads for the mean load latency).",
            c.load_seconds,
        ),
        ("corrupt_files", "Tier files skipped as truncated or corrupt.", c.corrupt),
        (
            "evicted_blocks",
            "KV blocks evicted from the tier (least recently used).",
            c.evicted_blocks,
        ),
    ):
        counter(f"kvgate:kv_tier_{name}", doc, value)


class TenantCollector(Collector):
    """Per-tenant accounting (tenant label), read live at scrape time."""

    def __init__(
        self, snapshots: Callable[[], Mapping[str, EngineSnapshot]], governance: Governance
    ) -> None:
        self._snapshots = snapshots
        self._governance = governance

    def collect(self) -> Iterator[Metric]:
        report = self._governance.report(self._snapshots())
        tl = ("tenant", *LABELS)  # engine figures: per tenant and model

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
            ("tenant", "reason"),
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
            for reason, n in row["refusals"].items():
                refusals.add_metric([tenant, reason], n)
            waiting_by_class[row["priority"]] += row["waiting"]
            for model, mrow in row["models"].items():
                t = [tenant, model]
                prompt.add_metric(t, mrow["prompt_tokens"])
                gen.add_metric(t, mrow["generation_tokens"])
                block_s.add_metric(t, mrow["kv_block_seconds"])
                held.add_metric(t, mrow["kv_blocks_held"])
                quota.add_metric([*t, "guaranteed"], mrow["kv_guaranteed_blocks"])
                quota.add_metric([*t, "ceiling"], mrow["kv_ceiling_blocks"])
                requests.add_metric([*t, "running"], mrow["running"])
                requests.add_metric([*t, "waiting"], mrow["waiting"])
                for reason, n in mrow["finished"].items():
                    finished.add_metric([*t, reason], n)
                queries.add_metric(t, mrow["prefix_cache_queries"])
                hits.add_metric(t, mrow["prefix_cache_hits"])
        for priority, n in waiting_by_class.items():
            depth.add_metric([priority], n)
        yield from (prompt, gen, block_s, held, quota, requests, refusals, finished)
        yield from (queries, hits, depth)


class PrometheusStatsListener:
    """The per-step histograms and counters of every model; each model's engine reports to
    its ``for_model`` view, on its engine thread (prometheus_client is thread-safe)."""

    def __init__(self, registry: CollectorRegistry) -> None:

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
        # Speculative decoding, by vLLM's names: acceptance rate = accepted / draft tokens.
        self.spec_drafts = count("vllm:spec_decode_num_drafts", "Speculative drafts verified.")
        self.spec_draft_tokens = count(
            "vllm:spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_accepted_tokens = count(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens the model accepted."
        )
        self.success = count(
            "vllm:request_success",
            "Finished requests by finish reason.",
            (*LABELS, "finished_reason"),
        )

    def for_model(self, model_name: str) -> ModelStatsListener:
        return ModelStatsListener(self, model_name)

    def on_step(self, model_name: str, stats: IterationStats) -> None:
        m = model_name
        if stats.batch_size:
            self.iter_tokens.labels(m).observe(stats.num_batched_tokens)
            self.batch_size.labels(m).observe(stats.batch_size)
            self.step_time.labels(m, stats.phase).observe(stats.step_seconds)
        if stats.num_prompt_tokens:
            self.prompt_tokens.labels(m).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.labels(m).inc(stats.num_generation_tokens)
        if stats.num_drafts:
            self.spec_drafts.labels(m).inc(stats.num_drafts)
            self.spec_draft_tokens.labels(m).inc(stats.num_draft_tokens)
            self.spec_accepted_tokens.labels(m).inc(stats.num_accepted_tokens)
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


class ModelStatsListener:
    """One model's engine's ``StatsListener``: its steps, under its ``model_name``."""

    def __init__(self, metrics: PrometheusStatsListener, model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def on_step(self, stats: IterationStats) -> None:
        self.metrics.on_step(self.model_name, stats)
