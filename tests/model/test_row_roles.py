"""RowRoles: a step's prompt rows through a linear's ``prompt`` product, the others through
its ordinary one, each row back in its place."""

from __future__ import annotations

import torch

from kvgate.model.row_roles import RowRoles, apply


class _TwoProducts:
    """A linear whose prompt product (x 2) differs from its ordinary one (x 3)."""

    prompt_tiles = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("generated", x.shape[0]))
        return x * 3

    def prompt(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(("prompt", x.shape[0]))
        return x * 2


def test_prompt_rows_take_the_prompt_product_and_the_others_the_ordinary_one() -> None:
    x = torch.arange(12.0).reshape(6, 2)
    flags = [False, True, True, False, True, False]  # decodes, a chunk, a recomputed token
    roles = RowRoles.of(flags)
    assert roles is not None
    lin = _TwoProducts()
    y = roles.apply(lin, x)
    factor = torch.tensor([2.0 if p else 3.0 for p in flags])[:, None]
    assert torch.equal(y, x * factor)
    assert sorted(lin.calls) == [("generated", 3), ("prompt", 3)]  # one call per role


def test_a_step_of_prompt_rows_alone_makes_one_call_and_none_makes_no_roles() -> None:
    lin = _TwoProducts()
    x = torch.ones(4, 2)
    roles = RowRoles.of([True] * 4)
    assert roles is not None and torch.equal(roles.apply(lin, x), x * 2)
    assert lin.calls == [("prompt", 4)]
    assert RowRoles.of([False, False]) is None and RowRoles.of([]) is None
    assert torch.equal(apply(None, lin, x), x * 3)


def test_a_linear_without_a_prompt_product_runs_every_row_as_it_is() -> None:
    roles = RowRoles.of([True, False])
    assert roles is not None
    x = torch.ones(2, 3)
    assert torch.equal(roles.apply(lambda t: t + 1, x), x + 1)
    lin = _TwoProducts()
    lin.prompt_tiles = False  # has the method, but not here (a library without the tiles)
    assert torch.equal(roles.apply(lin, x), x * 3)


class _IntoProducts(_TwoProducts):
    """_TwoProducts that writes into a given output, as QuantLinear does."""

    out_features = 2
    out_dtype = torch.float32

    def __init__(self) -> None:
        super().__init__()
        self.outs: list[int] = []

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._into(super().__call__(x), out)

    def prompt(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._into(super().prompt(x), out)

    def _into(self, y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return y
        self.outs.append(out.data_ptr())
        return out.copy_(y)


def test_decodes_before_the_chunks_write_their_rows_in_place() -> None:
    """The runner's usual step (decodes, then prefill chunks): each role is a slice, and each
    product writes straight into its rows of the output; interleaved roles still gather."""
    x = torch.arange(10.0).reshape(5, 2)
    flags = [False, False, True, True, True]
    roles = RowRoles.of(flags)
    assert roles is not None and roles.split == 2
    lin = _IntoProducts()
    y = roles.apply(lin, x)
    assert torch.equal(y, x * torch.tensor([3.0, 3.0, 2.0, 2.0, 2.0])[:, None])
    assert lin.outs == [y.data_ptr(), y[2:].data_ptr()]
    assert lin.calls == [("generated", 2), ("prompt", 3)]
    mixed = RowRoles.of([False, True, False])
    assert mixed is not None and mixed.split is None
    lin = _IntoProducts()
    assert torch.equal(mixed.apply(lin, x[:3]), x[:3] * torch.tensor([3.0, 2.0, 3.0])[:, None])
    assert lin.outs == []
    prompt_first = RowRoles.of([True, False])
    assert prompt_first is not None and prompt_first.split is None
