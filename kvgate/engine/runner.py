"""The model runner: turns a SchedulerOutput into one flat batch, runs the model, samples.

With the model, the only tensor code in the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import llguidance
import torch

from kvgate.engine.messages import RunnerOutput, ScheduledSequence, SchedulerOutput
from kvgate.engine.sampler import Sampler, SamplingState
from kvgate.model.attention import AttentionMetadata, PrefillSlice
from kvgate.model.config import ModelConfig
from kvgate.model.llama import LlamaModel
from kvgate.sampling_params import SamplingParams
from kvgate.structured.compiler import GrammarCompiler
from kvgate.structured.masks import MaskBuilder

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate_kv_caches(
    config: ModelConfig,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> KVCaches:
    """One (K, V) pair per layer, each of the attention backend's cache ``shape``."""
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_layers)
    ]


@dataclass
class _RequestState:
    """What the runner remembers of a request between steps (survives preemption)."""

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator | None
    output_token_ids: list[int] = field(default_factory=list)
    #: The grammar's state after every output token (constrained requests). It lives here,
    #: not in the KV cache, so it survives preemption and recompute unchanged.
    matcher: llguidance.LLMatcher | None = None


@dataclass(frozen=True)
class FlatBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] row of the last token of each sampling sequence
    sample_ids: tuple[str, ...]  # request id of each sampling row, in order


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_caches: KVCaches,
        block_size: int,
        sampler: Sampler | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """``grammars``: compiles constrained requests' grammars (None: none may come)."""
        self.model = model
        self.grammars = grammars
        self._masks: MaskBuilder | None = None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = model.device
        self.sampler = sampler or Sampler()
        self.states: dict[str, _RequestState] = {}

    def execute(
        self, out: SchedulerOutput, between_layers: Callable[[], None] | None = None
    ) -> RunnerOutput:
        """Run one step. ``between_layers``: see ``LlamaModel.forward``."""
        for rid in out.finished_request_ids:
            self.states.pop(rid, None)
        for new in out.new_requests:
            gen = None
            if new.params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(new.params.seed)
            state = _RequestState(new.prompt_token_ids, new.params, gen)
            if new.matcher is not None:
                state.matcher = new.matcher
            elif new.params.grammar is not None:  # made without its matcher: build it here
                if self.grammars is None:
                    raise RuntimeError("a constrained request reached a runner without grammars")
                state.matcher = self.grammars.matcher(new.params.grammar)
            self.states[new.request_id] = state
        if out.is_empty:
            return RunnerOutput(sampled_token_ids={})

        batch = self.build_batch(out.sequences)
        # Constrained rows' masks are computed on llguidance's threads during the forward.
        guided = [
            (row, matcher)
            for row, rid in enumerate(batch.sample_ids)
            if (matcher := self.states[rid].matcher) is not None
        ]
        masks = self._mask_builder().start([m for _, m in guided]) if guided else None
        hidden = self.model.forward(
            batch.input_ids, batch.positions, self.kv_caches, batch.meta, between_layers
        )
        if not batch.sample_ids:
            return RunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        sampling = [self._sampling_state(rid) for rid in batch.sample_ids]
        allowed = None
        if masks is not None:
            allowed = ([row for row, _ in guided], masks.result())
        result = self.sampler(logits, sampling, allowed)
        sampled: dict[str, int] = {}
        logprobs = {}
        complete: set[str] = set()
        failed: dict[str, str] = {}
        for i, rid in enumerate(batch.sample_ids):
            token = result.token_ids[i]
            sampled[rid] = token
            state = self.states[rid]
            state.output_token_ids.append(token)
            if state.matcher is not None:
                state.matcher.consume_token(token)
                if state.matcher.is_error():  # never expected under the mask
                    failed[rid] = state.matcher.get_error()
                elif state.matcher.is_stopped():  # complete: nothing may follow
                    complete.add(rid)
            lp = result.logprobs[i]
            if lp is not None:
                logprobs[rid] = lp
        return RunnerOutput(
            sampled_token_ids=sampled,
            logprobs=logprobs,
            grammar_complete=frozenset(complete),
            grammar_failed=failed,
        )

    def _mask_builder(self) -> MaskBuilder:
        if self._masks is None:
            assert self.grammars is not None
            self._masks = MaskBuilder(self.grammars.vocab_size)
        return self._masks

    def _sampling_state(self, request_id: str) -> SamplingState:
        s = self.states[request_id]
        return SamplingState(
            params=s.params,
            generator=s.generator,
            prompt_token_ids=s.prompt_token_ids,
            output_token_ids=s.output_token_ids,
        )

    def build_batch(self, sequences: tuple[ScheduledSequence, ...]) -> FlatBatch:
        """Decodes first (one row each, batched attention), then prefill chunks."""
        bs = self.block_size
        decodes = [s for s in sequences if s.num_tokens == 1]
        prefills = [s for s in sequences if s.num_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for seq in decodes + prefills:
            table = seq.block_ids
            for offset, token in enumerate(seq.token_ids):
                pos = seq.start_pos + offset
                input_ids.append(token)
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            if seq.sample:
                sample_rows.append(len(input_ids) - 1)
                sample_ids.append(seq.request_id)

        dev = self.device
        num_dec = len(decodes)
        if num_dec:
            max_blocks = max(-(-s.context_len // bs) for s in decodes)
            flat_tables: list[int] = []
            for s in decodes:
                table = s.block_ids[:max_blocks]
                flat_tables += table
                flat_tables += [0] * (
                    max_blocks - len(table)
                )  # padding, past decode_lens: never read
            decode_blocks = torch.tensor(flat_tables, dtype=torch.int64, device=dev)
            lens = torch.tensor([s.context_len for s in decodes], dtype=torch.int64, device=dev)
        else:
            decode_blocks = torch.empty((0,), dtype=torch.int64, device=dev)
            lens = torch.empty((0,), dtype=torch.int64, device=dev)

        slices: list[PrefillSlice] = []
        row = num_dec
        for seq in prefills:
            num_blocks = -(-seq.context_len // bs)
            seq_table = torch.tensor(seq.block_ids[:num_blocks], dtype=torch.int64, device=dev)
            slices.append(PrefillSlice(row, row + seq.num_tokens, seq.start_pos, seq_table))
            row += seq.num_tokens

        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decodes=num_dec,
            decode_blocks=decode_blocks,
            decode_lens=lens,
            prefills=tuple(slices),
        )
        return FlatBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            meta=meta,
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=dev),
            sample_ids=tuple(sample_ids),
        )
