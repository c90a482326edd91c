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
from typing import Protocol, runtime_checkable

import torch

Linear = Callable[[torch.Tensor], torch.Tensor]


@runtime_checkable
class IntoLinear(Protocol):
    """A linear with two products that can write its rows into a given output."""

    out_features: int

    @property
    def out_dtype(self) -> torch.dtype: ...

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...

    def prompt(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class RowRoles:
    """The rows of a step with at least one prompt token: which ones are."""

    mask: torch.Tensor  # [T] bool: row t is a prompt token
    prompt: torch.Tensor  # [P] int64 row indices, P >= 1
    generated: torch.Tensor  # [T - P] int64 row indices
    #: T - P when the generated rows all come first (the runner's order: decodes, then prefill
    #: chunks), so each role is a slice of the step; None when the roles interleave (a
    #: one-token prompt chunk among the decodes, a preempted request's recomputed tokens).
    split: int | None = None

    @classmethod
    def of(cls, is_prompt: Sequence[bool]) -> RowRoles | None:
        """The roles of rows flagged ``is_prompt``; None when no row is a prompt token."""
        flags = list(is_prompt)
        mask = torch.tensor(flags, dtype=torch.bool)
        if not bool(mask.any()):
            return None
        first = flags.index(True)
        split = first if all(flags[first:]) else None
        return cls(mask, mask.nonzero().flatten(), (~mask).nonzero().flatten(), split)

    def apply(self, linear: Linear, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)``, its prompt rows through ``linear.prompt`` where it has one."""
        prompt_fn: Linear | None = getattr(linear, "prompt", None)
        if prompt_fn is None or not getattr(linear, "prompt_tiles", False):
            return linear(x)
        if not self.generated.numel():
            return prompt_fn(x)
        if self.split is not None and isinstance(linear, IntoLinear):
            # Both roles slices of the step: each product writes its rows in place, with no
            # gather of x or scatter of y (5% of a 32-stream Qwen run's time on the Xeon).
            y = torch.empty((x.shape[0], linear.out_features), dtype=linear.out_dtype)
            s, x = self.split, x.contiguous()
            linear(x[:s], out=y[:s])
            linear.prompt(x[s:], out=y[s:])
            return y
        top = prompt_fn(x[self.prompt])
        y = torch.empty((x.shape[0], top.shape[1]), dtype=top.dtype)
        y[self.prompt] = top
        y[self.generated] = linear(x[self.generated])
        return y


def apply(roles: RowRoles | None, linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """``linear(x)`` for a step with ``roles`` (None: no prompt rows, or none that matter)."""
    return linear(x) if roles is None else roles.apply(linear, x)
