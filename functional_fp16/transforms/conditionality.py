"""Transforms that apply an inner transform only under a condition."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import PyTree, tree_flatten, tree_select, tree_unflatten
from functional_fp16.precision.loss_scale import all_finite
from functional_fp16.transforms.base import (
    GradientTransformation,
    saturating_increment,
    update_with_extra_args,
)

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]


class ApplyIfFiniteState(NamedTuple):
    """State of :func:`apply_if_finite`."""

    notfinite_count: torch.Tensor  # 0-d int32: consecutive non-finite updates
    last_finite: torch.Tensor  # 0-d bool: whether the last updates were finite
    total_notfinite: torch.Tensor  # 0-d int32: non-finite updates seen in total
    inner_state: Any  # the wrapped transform's state


def apply_if_finite(
    inner: GradientTransformation, max_consecutive_errors: int
) -> GradientTransformation:
    r"""Skips updates that contain inf or NaN (optax's ``apply_if_finite``).

    With :math:`n` the number of consecutive non-finite updates (this one
    included), the inner transform is applied when the updates are finite or
    :math:`n > \text{max\_consecutive\_errors}`; otherwise it outputs zeros and
    its state is left exactly as it was.

    Inside :func:`~functional_fp16.fp16_update` this wrapper is redundant:
    the update already skips non-finite steps and rolls back the whole
    optimiser state, this wrapper's counters included. It is for chains used
    on their own, as in optax.

    Args:
      inner: the transform to protect.
      max_consecutive_errors: how many consecutive bad updates to reject
        before giving up and applying them anyway, ``>= 0``.
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"inner must be a GradientTransformation, got {type(inner).__name__}")
    validate.integer("max_consecutive_errors", max_consecutive_errors, 0)

    def init(params: PyTree) -> ApplyIfFiniteState:
        leaves = tree_flatten(params)[0]
        device = leaves[0].device if leaves else None
        zero = torch.zeros((), dtype=torch.int32, device=device)
        return ApplyIfFiniteState(
            notfinite_count=zero,
            last_finite=torch.tensor(True, device=device),
            total_notfinite=zero.clone(),
            inner_state=inner.init(params),
        )

    def update(
        updates: PyTree, state: ApplyIfFiniteState, params: PyTree | None = None, **extra_args
    ):
        finite = all_finite(updates).to(state.notfinite_count.device)
        bumped = saturating_increment(state.notfinite_count)
        notfinite_count = torch.where(finite, torch.zeros_like(bumped), bumped)
        apply = finite | (notfinite_count > max_consecutive_errors)
        new_updates, new_inner = update_with_extra_args(
            inner, updates, state.inner_state, params, **extra_args
        )
        leaves, spec = tree_flatten(new_updates)
        out = tree_unflatten(spec, [torch.where(apply, u, torch.zeros_like(u)) for u in leaves])
        total = saturating_increment(state.total_notfinite)
        return out, ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=finite,
            total_notfinite=torch.where(finite, state.total_notfinite, total),
            inner_state=tree_select(apply, new_inner, state.inner_state),
        )

    return GradientTransformation(init, update)
