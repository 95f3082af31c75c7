"""Replacing NaNs in the updates by zeros: ``zero_nans``, as optax's."""

from __future__ import annotations

from typing import NamedTuple

import torch

from functional_fp16._util.tree import PyTree, check_same_structure, tree_flatten, tree_unflatten
from functional_fp16.transforms.base import GradientTransformation

__all__ = ["ZeroNansState", "zero_nans"]


class ZeroNansState(NamedTuple):
    """State of :func:`zero_nans`."""

    found_nan: PyTree  # one 0-d bool per leaf, on its device: whether the last updates had a NaN


def zero_nans() -> GradientTransformation:
    r"""Replaces every NaN in the updates by zero and records, per leaf, whether it found one.

    .. math::
        u_{ij} \leftarrow \begin{cases} 0 & u_{ij} \text{ is NaN} \\ u_{ij} & \text{otherwise}\end{cases}
        \qquad \text{found\_nan}_i = \bigvee_j \operatorname{isnan}(u_{ij})

    Infinities pass through, and every other element keeps its bits (-0.0
    included). The flags are for the user to read; the transform never reads
    them back. Inside :func:`~functional_fp16.fp16_update` a NaN gradient
    skips the step before any transform runs, so this is for chains used on
    their own (or after a transform that can make NaNs of finite inputs).

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`ZeroNansState`, whose ``found_nan`` has the parameters' tree
      structure (all ``False`` after ``init``).
    """

    def init(params: PyTree) -> ZeroNansState:
        leaves, spec = tree_flatten(params)
        flags = [torch.zeros((), dtype=torch.bool, device=p.device) for p in leaves]
        return ZeroNansState(found_nan=tree_unflatten(spec, flags))

    def update(updates: PyTree, state: ZeroNansState, params: PyTree | None = None):
        del params
        leaves, spec = tree_flatten(updates)
        check_same_structure(updates, state.found_nan, name="found_nan", reference_name="updates")
        nans = [torch.isnan(u) for u in leaves]
        out = [torch.where(n, torch.zeros_like(u), u) for n, u in zip(nans, leaves)]
        found = [n.any() for n in nans]
        return tree_unflatten(spec, out), ZeroNansState(found_nan=tree_unflatten(spec, found))

    return GradientTransformation(init, update)
