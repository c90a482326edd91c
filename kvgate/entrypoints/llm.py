"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.messages import TokenLogprobs
from kvgate.engine.outputs import CompletionOutput
from kvgate.sampling_params import SamplingParams
from kvgate.tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    """Load a model and generate for a batch of prompts, all scheduled together.

    Keyword arguments are ``EngineConfig`` fields (``dtype``, ``kv_cache_memory``,
    ``max_num_batched_tokens``, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        config = (
            EngineConfig(**engine_args)
            if model is None
            else EngineConfig(model=model, **engine_args)
        )
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        A prompt is text or a list of token ids. Invalid prompts raise before anything runs.
        """
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompt_list: list[Prompt] = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        param_list = (
            [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        )
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")

        # Validate everything first so a bad prompt rejects the batch before any work.
        # Nothing streams here: each request reports once, when it ends.
        requests = [
            self.engine.make_request(f"offline-{next(self._ids)}", p, replace(sp, final_only=True))
            for p, sp in zip(prompt_list, param_list, strict=True)
        ]
        for request in requests:
            self.engine.add(request)

        by_id = {r.request_id: r for r in requests}
        texts: dict[str, list[str]] = {r.request_id: [] for r in requests}
        logprobs: dict[str, list[TokenLogprobs]] = {r.request_id: [] for r in requests}
        results: dict[str, CompletionOutput] = {}
        while len(results) < len(requests):
            for out in self.engine.step():
                texts[out.request_id].append(out.text)
                logprobs[out.request_id].extend(out.logprobs)
                if out.finished:
                    request = by_id[out.request_id]
                    results[out.request_id] = CompletionOutput(
                        request_id=out.request_id,
                        prompt_token_ids=request.prompt_token_ids,
                        token_ids=tuple(request.output_token_ids),
                        text="".join(texts[out.request_id]),
                        logprobs=tuple(logprobs[out.request_id]),
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        num_cached_tokens=out.num_cached_tokens,
                    )
        return [results[r.request_id] for r in requests]

    def chat(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams | None = None,
    ) -> CompletionOutput:
        """One chat turn through the model's chat template."""
        prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        token_ids = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        return self.generate([token_ids], params or replace(SamplingParams(), max_tokens=256))[0]
