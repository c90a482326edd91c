"""Book-keeping of one response while its choices run: what each choice produced, time to
first token, tokens used (refunds), usage records, the trace span, the resource profile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.request import Request
from kvgate.engine.stats import RequestMetrics
from kvgate.errors import QueueTimeout, RequestFailed
from kvgate.governance.usage import Counts, UsageLedger
from kvgate.server.access_log import AccessRecord
from kvgate.server.governance import Admission
from kvgate.server.tracing import RequestSpan


@dataclass
class ChoiceResult:
    """One choice, whole: what a non-streamed response is built from."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


def check_finish(out: RequestOutput) -> None:
    """Finish reasons that are failures of the request, raised as their errors."""
    if out.finish_reason == "error":
        raise RequestFailed(out.error or "generation failed")
    if out.finish_reason == "queue_timeout":
        raise QueueTimeout(
            "the request waited longer than its tenant's max_queue_time and was not started; "
            "retry later"
        )


class Tracker:
    """Book-keeping shared by whole and streamed responses: time to first token for the
    access log, tokens used per choice (admission refunds what was not), totals for usage,
    the request's trace span. ``close`` once the response is over, however it ended."""

    def __init__(
        self,
        record: AccessRecord,
        admission: Admission,
        requests: Sequence[Request],
        span: RequestSpan,
        response_id: str,
        n: int,
        ledger: UsageLedger,
        usage_row: str,
    ) -> None:
        self.ledger = ledger
        self.usage_row = usage_row
        self.delivered = False  # the usage row knows tokens reached the client
        self.settled = False
        self.record = record
        self.admission = admission
        self.span = span
        self.response_id = response_id
        self.n = n
        self.start = time.monotonic()
        record.door_s = round(self.start - record.received, 4)
        self.results = [ChoiceResult() for _ in requests]
        self.error: str | None = None

    def counts(self) -> Counts:
        """Tokens so far, for the usage record (each prompt once, however many choices)."""
        firsts = self.results[:: self.n]
        metrics = [r.metrics for r in self.results if r.metrics is not None]
        return Counts(
            prompt_tokens=sum(r.num_prompt_tokens for r in firsts)
            or self.record.prompt_tokens
            or 0,
            completion_tokens=sum(r.num_output_tokens for r in self.results),
            cached_tokens=sum(r.num_cached_tokens for r in firsts),
            kv_block_seconds=round(sum(m.kv_block_seconds for m in metrics), 6),
        )

    async def deliver(self) -> None:
        """Tokens are about to reach the client: the usage row must say so first."""
        if not self.delivered:
            self.delivered = True
            await asyncio.wrap_future(self.ledger.delivered(self.usage_row, self.counts()))

    async def settle_whole(self) -> None:
        """A whole response is about to be sent: its final usage record, committed first."""
        self.settled = True
        self.delivered = True
        reason = ",".join(r.finish_reason or "" for r in self.results)
        future = self.ledger.settle(self.usage_row, self.counts(), reason, delivered=True)
        await asyncio.wrap_future(future)

    def close(self) -> None:
        if not self.settled:  # a stream's end (or a failure): queued, not waited for
            self.settled = True
            reason = self.error or ",".join(r.finish_reason or "" for r in self.results)
            self.ledger.settle(self.usage_row, self.counts(), reason)
        self.admission.release()
        firsts = self.results[:: self.n]
        self.span.finish(
            [r.metrics for r in self.results],
            response_id=self.response_id,
            finish_reasons=[r.finish_reason for r in self.results],
            input_tokens=sum(r.num_prompt_tokens for r in firsts),
            output_tokens=sum(r.num_output_tokens for r in self.results),
            cached_tokens=sum(r.num_cached_tokens for r in firsts),
            error=self.error if self.error is not None else self.record.error_code,
        )

    def on_output(self, i: int, out: RequestOutput) -> None:
        if self.record.ttft_s is None and out.new_token_ids:
            # A whole response gets one output at the end: the engine's clock says when the
            # first token came (the same clock as ``start``).
            first = out.metrics.first_token_time if out.metrics is not None else None
            now = first if out.finished and first is not None else time.monotonic()
            self.record.ttft_s = round(now - self.start, 4)
        result = self.results[i]
        result.text += out.text
        result.logprobs.extend(out.logprobs)
        result.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            self.admission.used[i] = out.num_prompt_tokens + out.num_output_tokens
            if out.metrics is not None and self.record.queue_s is None:
                self.record.queue_s = round(out.metrics.queue_seconds, 4)
                self.record.prefill_s = round(out.metrics.prefill_seconds, 4)
                self.record.decode_s = round(out.metrics.decode_seconds, 4)
            check_finish(out)
            result.finish_reason = out.finish_reason
            result.num_prompt_tokens = out.num_prompt_tokens
            result.num_output_tokens = out.num_output_tokens  # the engine's count, final
            result.num_cached_tokens = out.num_cached_tokens
            result.metrics = out.metrics

    def profile(self) -> dict[str, Any]:
        return profile_of(self.results)

    def usage(self) -> dict[str, Any]:
        """Usage over all choices; each prompt counts once however many choices it has."""
        firsts = self.results[:: self.n]
        u = usage(
            sum(r.num_prompt_tokens for r in firsts),
            sum(r.num_output_tokens for r in self.results),
            sum(r.num_cached_tokens for r in firsts),
        )
        u["profile"] = self.profile()
        self.record.completion_tokens = u["completion_tokens"]
        self.record.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
        self.record.finish_reason = ",".join(r.finish_reason or "" for r in self.results)
        return u


PROFILE_HEADERS = {
    "queue_seconds": "x-kvgate-queue-seconds",
    "prefill_seconds": "x-kvgate-prefill-seconds",
    "decode_seconds": "x-kvgate-decode-seconds",
    "peak_kv_blocks": "x-kvgate-peak-kv-blocks",
}


def profile_of(results: Sequence[ChoiceResult]) -> dict[str, Any]:
    """Where the request's time and memory went (kvgate's documented ``usage.profile``):
    the slowest choice's queue, prefill and decode seconds; KV blocks at peak, all choices."""
    metrics = [r.metrics for r in results if r.metrics is not None]
    return {
        "queue_seconds": round(max((m.queue_seconds for m in metrics), default=0.0), 4),
        "prefill_seconds": round(max((m.prefill_seconds for m in metrics), default=0.0), 4),
        "decode_seconds": round(max((m.decode_seconds for m in metrics), default=0.0), 4),
        "peak_kv_blocks": sum(m.peak_kv_blocks for m in metrics),
    }


def profile_headers(profile: dict[str, Any]) -> dict[str, str]:
    return {header: str(profile[key]) for key, header in PROFILE_HEADERS.items()}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
