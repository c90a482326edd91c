"""Book-keeping of one response while its choices run: what each choice produced, time to
first token, tokens used (refunds), usage records, the trace span, the resource profile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.request import Request
from kvgate.engine.stats import RequestMetrics
from kvgate.engine.streams import OnAbandoned
from kvgate.errors import GRAMMAR_FAILED, ConstraintUnsatisfiable, QueueTimeout, RequestFailed
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
        if out.error and out.error.startswith(GRAMMAR_FAILED):
            detail = out.error.removeprefix(GRAMMAR_FAILED).splitlines()[0][:300]
            raise ConstraintUnsatisfiable(
                "the requested output format cannot be completed with this model's vocabulary "
                f"(constrained decoding reached a dead end: {detail})"
            )
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
        self.closed = False
        # Choices whose engine stream was entered and has not told how it ended (its final
        # output read, or ``on_abandoned``): a stream cut short settles once they have, with
        # what the engine generated, delivered or not.
        self.open: set[int] = set()
        # Completion tokens (all choices) the ledger has committed, and a commit under way
        # with the tokens it holds: bounds what a crash can leave unbilled (``deliver``).
        self.committed = 0
        self.checkpoint: tuple[Future[Any], int] | None = None
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
        """Tokens are about to reach the client: the usage row must know them first.

        The first ones: the stream waits for the delivered mark's commit. Later ones go as
        progress (coalesced, written within the ledger's ``flush_s``), and every
        ``ledger.checkpoint_tokens`` (N) completion tokens as a commit the stream waits for
        only once the client would hold more than 2N tokens beyond the last committed
        count: after a crash a record lacks at most 2N tokens (plus the chunk being sent)
        of what its client received, without a write or a wait per token."""
        counts = self.counts()
        tokens = counts.completion_tokens
        if not self.delivered:
            self.delivered = True
            await asyncio.wrap_future(self.ledger.delivered(self.usage_row, counts))
            self.committed = tokens
            return
        every = self.ledger.checkpoint_tokens
        if self.checkpoint is not None:
            future, held = self.checkpoint
            if not future.done() and tokens - self.committed > 2 * every:
                await asyncio.wrap_future(future)
            if future.done():
                future.result()  # a failed write fails the stream, as the first mark's does
                self.committed, self.checkpoint = held, None
        if self.checkpoint is None and tokens - self.committed >= every:
            self.checkpoint = (self.ledger.delivered(self.usage_row, counts), tokens)
        else:
            self.ledger.progress(self.usage_row, counts)

    def watch(self, i: int) -> OnAbandoned:
        """Choice ``i``'s engine stream starts: what to tell if it is left before its end."""
        self.open.add(i)
        return lambda out: self.on_abandoned(i, out)

    def on_abandoned(self, i: int, out: RequestOutput | None) -> None:
        """Choice ``i`` ended without its final output read (the client left or stalled, or
        it failed): bill what the engine generated for it (``out``: its last output)."""
        if i not in self.open:
            return
        self.open.discard(i)
        if out is not None:
            result = self.results[i]
            result.num_output_tokens = max(result.num_output_tokens, out.num_output_tokens)
            result.num_prompt_tokens = result.num_prompt_tokens or out.num_prompt_tokens
            result.num_cached_tokens = result.num_cached_tokens or out.num_cached_tokens
            if out.finished:
                result.finish_reason = result.finish_reason or out.finish_reason
                result.metrics = result.metrics or out.metrics
        if self.closed and not self.open:
            self._settle_stream()

    def finish_reasons(self) -> str:
        """Each choice's finish reason, in choice order, comma-separated: one not finished
        by the engine has the stream's error code, or ``abort`` (the server ended it)."""
        cut = self.error or "abort"
        return ",".join(r.finish_reason or cut for r in self.results)

    async def settle_whole(self) -> None:
        """A whole response is about to be sent: its final usage record, committed first."""
        self.settled = True
        self.delivered = True
        reason = self.finish_reasons()
        future = self.ledger.settle(self.usage_row, self.counts(), reason, delivered=True)
        await asyncio.wrap_future(future)

    def _settle_stream(self) -> None:
        """A stream's end (or a failure): queued, not waited for."""
        if not self.settled:
            self.settled = True
            self.ledger.settle(self.usage_row, self.counts(), self.finish_reasons())

    def close(self) -> None:
        self.closed = True
        if not self.open:  # else once the engine has told what the cut-short choices made
            self._settle_stream()
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
        if out.finished:
            self.open.discard(i)
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
