"""The runner tells a model whose prompt tokens take other linears (``Model.prompt_tiles``)
which rows of a step are prompt tokens: by position against the request's prompt length,
never by how the step is built (a one-token prompt chunk among the decodes, a preempted
request's generated tokens recomputed in a prefill chunk)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgate import SamplingParams
from kvgate.engine.messages import ScheduledSequence
from kvgate.engine.runner import _RequestState
from kvgate.entrypoints.llm import LLM
from kvgate.model.cpu_kernels import load_quant_lib
from kvgate.model.row_roles import RowRoles
from tests.model.steps import one_prefill
from tests.model.test_gguf_quantized import _model


def _llm(tmp_path: Path) -> LLM:
    path = _model(tmp_path, "llama-Q4_0")
    return LLM(str(path), kv_cache_memory="16MiB", max_model_len=256, gguf_blocks="native")


def test_prompt_rows_are_the_positions_below_each_prompt_length(tmp_path: Path) -> None:
    engine = _llm(tmp_path).engine
    assert engine.kv_cache.roles_apart == engine.model.prompt_tiles  # the prefix cache follows
    runner = engine.runner
    runner.model.prompt_tiles = True  # as on an AMX CPU (the runner reads only the flag)
    for rid, prompt in (("decode", 4), ("last", 6), ("again", 6)):
        runner.states[rid] = _RequestState(tuple(range(2, 2 + prompt)), SamplingParams(), None)
    batch = runner.build_batch((
        ScheduledSequence("again", (2, 3, 4, 5, 6, 7, 2, 3), 2, ((2,),), True),  # recomputed
        ScheduledSequence("decode", (3,), 9, ((0,),), True),  # a generated token
        ScheduledSequence("last", (7,), 5, ((1,),), True),  # its prompt's last token alone
    ))  # fmt: skip
    assert batch.roles is not None
    # decodes first (as the runner orders rows), then the chunk at positions 2..9 of a
    # 6-token prompt: 4 prompt rows, then the 4 generated tokens it recomputes
    assert batch.roles.mask.tolist() == [False, True] + [True] * 4 + [False] * 4
    runner.model.prompt_tiles = False
    assert runner.build_batch((ScheduledSequence("last", (7,), 5, ((1,),), True),)).roles is None


def test_each_row_takes_the_product_of_its_role(tmp_path: Path) -> None:
    """On the bf16 tiles (an AMX CPU), a prompt's first token, which attends to itself
    alone, gets the same hidden state as a prompt row whatever the other rows' roles, and
    another one as a generated row: the roles reach every linear, row by row."""
    llm = _llm(tmp_path)
    model = llm.engine.model
    if load_quant_lib() is None or not model.prompt_tiles:
        pytest.skip("prompt tokens take the int8 products here too (bf16 tiles need AMX)")
    ids = torch.tensor([2, 5, 3, 7, 4, 6, 2, 3, 5])
    n, bs = len(ids), llm.engine.config.block_size
    meta = one_prefill(n, bs)

    def first_row(roles: RowRoles | None) -> torch.Tensor:
        with torch.no_grad():
            hidden = model.forward(ids, torch.arange(n), llm.engine.runner.kv_caches, meta, roles)
            return model.compute_logits(hidden[:1])

    as_prompt, as_generated = first_row(RowRoles.of([True] * n)), first_row(None)
    assert not torch.equal(as_prompt, as_generated)
    assert torch.equal(first_row(RowRoles.of([True] + [False] * (n - 1))), as_prompt)
    assert torch.equal(first_row(RowRoles.of([False] + [True] * (n - 1))), as_generated)
