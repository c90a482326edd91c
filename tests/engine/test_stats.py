"""What the engine reports per step: token counts, TTFT/ITL samples, finished timelines."""

from __future__ import annotations

from pathlib import Path

from kvgate.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.stats import IterationStats
from kvgate.sampling_params import SamplingParams


class Recorder:
    def __init__(self) -> None:
        self.steps: list[IterationStats] = []

    def on_step(self, stats: IterationStats) -> None:
        self.steps.append(stats)


def test_stats_add_up(tiny_llama_dir: Path) -> None:
    recorder = Recorder()
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_dir), dtype="float32", kv_cache_memory="16MiB",
            max_model_len=256, max_num_batched_tokens=32,
        ),
        listeners=[recorder],
    )  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    # Served first come, first served: "c" and "b" get their first token in step one, "a"
    # (40 tokens against a 32-token budget) in step two.
    prompts = {"c": [7, 8, 9], "b": list(range(200, 210)), "a": list(range(100, 140))}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    engine.step()
    engine.abort(["c"])  # after one step: "c" (3 tokens) already has its first token
    while engine.has_unfinished():
        engine.step()

    steps = recorder.steps
    assert sum(s.num_generation_tokens for s in steps) == 5 + 5 + 1
    # Prompt tokens are counted when the request's first token arrives.
    assert sum(s.num_prompt_tokens for s in steps) == 40 + 10 + 3
    assert sum(len(s.time_to_first_tokens) for s in steps) == 3
    assert sum(len(s.inter_token_latencies) for s in steps) == 4 + 4
    # The 40-token prompt needs two chunks of the 32-token budget.
    assert max(s.num_batched_tokens for s in steps) <= 32
    finished = {f.request_id: f for s in steps for f in s.finished}
    assert {rid: f.finish_reason for rid, f in finished.items()} == {
        "a": "length", "b": "length", "c": "abort",
    }  # fmt: skip
    for f in finished.values():
        m = f.metrics
        assert min(m.queue_seconds, m.prefill_seconds, m.decode_seconds) >= 0
        assert abs(m.queue_seconds + m.prefill_seconds + m.decode_seconds - m.e2e_seconds) < 1e-6
    assert finished["a"].num_output_tokens == 5 and finished["c"].num_output_tokens == 1
