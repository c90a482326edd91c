"""Which rows of a step are prompt tokens, for linears whose arithmetic depends on it.

On an AMX CPU a block-quantized linear has two products (``QuantLinear``): the int8 one, as
fast for one row as any, and bf16 tiles over the widened blocks, 1.3-2.4x faster from 32
rows on but a quarter of the speed for one row. Choosing by batch size would make a token's
logits depend on what it is batched with; choosing by the token's role does not: a prompt
position takes the bf16 tiles however its prompt is chunked, cached or batched, a generated
position the int8 product whether decoded alone or recomputed after a preemption. A role is
a property of the position (below the request's prompt length or not), never of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class RowRoles:
    """The rows of a step with at least one prompt token: which ones are."""

    mask: torch.Tensor  # [T] bool: row t is a prompt token
    prompt: torch.Tensor  # [P] int64 row indices, P >= 1
    generated: torch.Tensor  # [T - P] int64 row indices

    @classmethod
    def of(cls, is_prompt: Sequence[bool]) -> RowRoles | None:
        """The roles of rows flagged ``is_prompt``; None when no row is a prompt token."""
        mask = torch.tensor(list(is_prompt), dtype=torch.bool)
        if not bool(mask.any()):
            return None
        return cls(mask, mask.nonzero().flatten(), (~mask).nonzero().flatten())

    def apply(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)``, its prompt rows through ``linear.prompt`` where it has one."""
        prompt_fn: Linear | None = getattr(linear, "prompt", None)
        if prompt_fn is None or not getattr(linear, "prompt_tiles", False):
            return linear(x)
        if not self.generated.numel():
            return prompt_fn(x)
        top = prompt_fn(x[self.prompt])
        y = torch.empty((x.shape[0], top.shape[1]), dtype=top.dtype)
        y[self.prompt] = top
        y[self.generated] = linear(x[self.generated])
        return y


def apply(roles: RowRoles | None, linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for a step with ``roles`` (None: no prompt rows, or none that matter)."""
    return linear(x) if roles is None else roles.apply(linear, x)
