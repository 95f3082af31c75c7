"""Gradient clipping: element-wise (:func:`clip`) and by global norm, computed in float32."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import PyTree, tree_flatten, tree_unflatten
from functional_fp16.transforms.base import EmptyState, GradientTransformation

__all__ = [
    "clip",
    "global_norm",
    "clip_by_global_norm",
    "clip_factors",
    "ClipSpec",
    "norm_of_sum_of_squares",
    "norm_of_leaf_sums",
    "LeafSums",
    "wants_leaf_sums",
]


def norm_of_sum_of_squares(
    sum_sq: torch.Tensor, global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    r""":math:`\sqrt{s}` of a float64 sum of squares :math:`s`, rounded once to float32.

    With ``global_sum`` (a state that holds one shard of the tree), :math:`s`
    is first mapped from this shard's sum to the whole tree's.
    """
    if global_sum is not None:
        sum_sq = global_sum(sum_sq)
    return torch.sqrt(sum_sq).float()


class LeafSums:
    r"""A ``global_sum`` hook that is told each leaf's own sum of squares.

    Where the processes hold the leaves in different ways (a DTensor state with
    leaves sharded over different mesh dimensions, or replicated beside
    sharded ones), the whole tree's sum counts each distinct shard once:

    .. math:: S = \sum_l \sum_{r} w_{l,r}\, S_{l,r}

    where :math:`S_{l,r}` is leaf :math:`l`'s sum on process :math:`r` and
    :math:`w_{l,r} \in \{0, 1\}` is 1 on exactly one holder of each shard.
    One number per process cannot carry that when the weights differ between
    the leaves of one process, so such a hook takes the vector of the leaves'
    sums (:meth:`of_leaves`). ``per_leaf`` says whether it needs them; when it
    is false the hook is an ordinary one (``hook(partial)``).
    """

    per_leaf: bool = False

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def of_leaves(self, sums: torch.Tensor, tree: PyTree | None) -> torch.Tensor:
        """The whole tree's float64 sum from ``sums``, this process's sum of each leaf of
        ``tree`` (in its flattening order; ``None``: every leaf of the state, in order)."""
        raise NotImplementedError  # pragma: no cover - abstract


def wants_leaf_sums(global_sum) -> bool:
    """Whether ``global_sum`` must be given each leaf's sum (a :class:`LeafSums` that says so)."""
    return isinstance(global_sum, LeafSums) and global_sum.per_leaf


def norm_of_leaf_sums(
    sums: torch.Tensor, global_sum: Callable[[torch.Tensor], torch.Tensor] | None, tree=None
) -> torch.Tensor:
    r""":math:`\sqrt{S}` rounded once to float32, from the float64 sums of squares of the
    leaves of ``tree`` (``None``: all the state's leaves, in order); see :class:`LeafSums`."""
    if wants_leaf_sums(global_sum):
        return torch.sqrt(global_sum.of_leaves(sums, tree)).float()
    total = sums.reshape(()) if sums.shape == (1,) else sums.sum()  # one group: no launch
    return norm_of_sum_of_squares(total, global_sum)


class ClipSpec(NamedTuple):
    """Declared form of :func:`clip_by_global_norm`."""

    max_norm: float


def global_norm(
    tree: PyTree, *, global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    r"""The L2 norm of all leaves together, :math:`\sqrt{\sum_i \sum_j x_{ij}^2}`.

    Each element is taken as a float32 value (an FP16 square overflows above
    about 256); squares and sums are formed in float64, where every square of
    a float32 is exact, so the result hardly depends on the summation order,
    and the root is rounded once to float32. The fused update computes the same
    sum in its own order and almost always gets the same float32 norm.

    Args:
      tree: the tree (or, with ``global_sum``, this process's shard of it).
      global_sum: ``None``, or a function from this shard's float64 sum of
        squares to the whole tree's (an all-reduce over the ranks that hold
        the shards, as :func:`~functional_fp16.distributed.sharded_update`
        passes it); a :class:`LeafSums` that asks for them gets each leaf's
        sum and ``tree``.

    Returns:
      A 0-d float32 tensor.
    """
    leaves = tree_flatten(tree)[0]
    if not leaves:
        if global_sum is not None:  # the other shards may hold leaves
            return norm_of_leaf_sums(torch.zeros((0,), dtype=torch.float64), global_sum, tree)
        return torch.zeros((), dtype=torch.float32)
    sq = [torch.sum(torch.square(x.float().double())) for x in leaves]
    return norm_of_leaf_sums(torch.stack(sq), global_sum, tree)


def clip_factors(norm: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(divisor, factor)`` such that clipping is :math:`u \mapsto (u / \text{divisor}) \cdot \text{factor}`.

    :math:`(1, 1)` inside the ball (:math:`\lVert u\rVert < c`; ``u / 1 * 1 == u``
    exactly, so no per-element select is needed), :math:`(\lVert u\rVert, c)` outside.
    """
    inside = norm < max_norm
    one = torch.ones_like(norm)
    if isinstance(max_norm, torch.Tensor):  # an injected hyperparameter
        cap = max_norm.to(norm)
    else:
        cap = torch.full_like(norm, max_norm)
    return torch.where(inside, one, norm), torch.where(inside, one, cap)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    r"""Rescales the updates so that their global norm is at most ``max_norm``.

    .. math:: u \leftarrow \begin{cases} u & \lVert u\rVert < c \\ (u / \lVert u\rVert)\, c & \text{otherwise}\end{cases}

    This is optax's rule (no epsilon, the division before the multiplication).
    Inside :func:`~functional_fp16.fp16_update` it sees unscaled FP32 gradients.
    Its ``update`` takes one extra keyword argument, ``global_sum`` (see
    :func:`global_norm`), which
    :func:`~functional_fp16.distributed.sharded_update` passes so that a
    shard is clipped by the whole tree's norm.

    Args:
      max_norm: :math:`c`, finite and > 0.
    """
    max_norm = validate.real("max_norm", max_norm, positive=True, tensor=True)

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(
        updates: PyTree,
        state: EmptyState,
        params: PyTree | None = None,
        *,
        global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        del params
        leaves, spec = tree_flatten(updates)
        norm = global_norm(updates, global_sum=global_sum)  # collective even without leaves
        if not leaves:
            return updates, state
        divisor, factor = clip_factors(norm.to(leaves[0].device), max_norm)
        out = [(u / divisor.to(u.dtype)) * factor.to(u.dtype) for u in leaves]
        return tree_unflatten(spec, out), state

    return GradientTransformation(init, update, ClipSpec(max_norm))


def clip(max_delta: float) -> GradientTransformation:
    r"""Clips every element of the updates to :math:`[-\delta, \delta]` (optax's ``clip``).

    .. math:: u_{ij} \leftarrow \min(\max(u_{ij}, -\delta), \delta)

    in each leaf's own dtype (a bound that the dtype cannot hold exactly
    clips to its nearest value there); NaN stays NaN. Inside
    :func:`~functional_fp16.fp16_update` it sees the unscaled FP32 gradients.

    Args:
      max_delta: :math:`\delta`, finite and >= 0 (with 0, every element
        becomes a zero of its own sign).

    Returns:
      A stateless :class:`~functional_fp16.GradientTransformation`
      (state :class:`~functional_fp16.EmptyState`).
    """
    max_delta = validate.real("max_delta", max_delta)

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        del params
        leaves, spec = tree_flatten(updates)
        out = [torch.clamp(u, -max_delta, max_delta) for u in leaves]
        return tree_unflatten(spec, out), state

    return GradientTransformation(init, update)
