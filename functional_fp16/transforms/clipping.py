"""Gradient clipping by global norm, computed in float32."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import PyTree, tree_flatten, tree_unflatten
from functional_fp16.transforms.base import EmptyState, GradientTransformation

__all__ = [
    "global_norm",
    "clip_by_global_norm",
    "clip_factors",
    "ClipSpec",
    "norm_of_sum_of_squares",
    "sums_of_squares_reduced",
]

# Set only while a sharded update runs: how this process's partial sum of
# squares becomes the sum over all shards (an all-reduce over the group).
_SHARD_SUM: contextvars.ContextVar[Callable[[torch.Tensor], torch.Tensor] | None] = (
    contextvars.ContextVar("functional_fp16_shard_sum", default=None)
)


@contextlib.contextmanager
def sums_of_squares_reduced(reduce: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Within the block, every global norm sums its squares with ``reduce`` first.

    Used by :func:`functional_fp16.distributed.sharded_update`, where each
    process holds one slice of the tree: ``reduce`` all-reduces the float64
    partial sums, so that ``clip_by_global_norm`` clips by the norm of the
    whole tree. Outside such a block nothing is reduced.
    """
    token = _SHARD_SUM.set(reduce)
    try:
        yield
    finally:
        _SHARD_SUM.reset(token)


def norm_of_sum_of_squares(sum_sq: torch.Tensor) -> torch.Tensor:
    r""":math:`\sqrt{s}` of a float64 sum of squares, rounded once to float32.

    Inside :func:`sums_of_squares_reduced` the sum is first reduced across
    the shards of the tree.
    """
    reduce = _SHARD_SUM.get()
    if reduce is not None:
        sum_sq = reduce(sum_sq)
    return torch.sqrt(sum_sq).float()


class ClipSpec(NamedTuple):
    """Declared form of :func:`clip_by_global_norm`."""

    max_norm: float


def global_norm(tree: PyTree) -> torch.Tensor:
    r"""The L2 norm of all leaves together, :math:`\sqrt{\sum_i \sum_j x_{ij}^2}`.

    Each element is taken as a float32 value (an FP16 square overflows above
    about 256); squares and sums are formed in float64, where every square of
    a float32 is exact, so the result hardly depends on the summation order,
    and the root is rounded once to float32. The fused update computes the same
    sum in its own order and almost always gets the same float32 norm. Inside
    :func:`~functional_fp16.distributed.sharded_update` the partial sums of
    the shards are added up across the ranks first, so the norm is the whole
    tree's. Returns a 0-d float32 tensor.
    """
    leaves = tree_flatten(tree)[0]
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    sq = [torch.sum(torch.square(x.float().double())) for x in leaves]
    return norm_of_sum_of_squares(torch.stack(sq).sum())


def clip_factors(norm: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(divisor, factor)`` such that clipping is :math:`u \mapsto (u / \text{divisor}) \cdot \text{factor}`.

    :math:`(1, 1)` inside the ball (:math:`\lVert u\rVert < c`; ``u / 1 * 1 == u``
    exactly, so no per-element select is needed), :math:`(\lVert u\rVert, c)` outside.
    """
    inside = norm < max_norm
    one = torch.ones_like(norm)
    return torch.where(inside, one, norm), torch.where(inside, one, torch.full_like(norm, max_norm))


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    r"""Rescales the updates so that their global norm is at most ``max_norm``.

    .. math:: u \leftarrow \begin{cases} u & \lVert u\rVert < c \\ (u / \lVert u\rVert)\, c & \text{otherwise}\end{cases}

    This is optax's rule (no epsilon, the division before the multiplication).
    Inside :func:`~functional_fp16.fp16_update` it sees unscaled FP32 gradients.

    Args:
      max_norm: :math:`c`, finite and > 0.
    """
    max_norm = validate.real("max_norm", max_norm, positive=True)

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        del params
        leaves, spec = tree_flatten(updates)
        if not leaves:
            return updates, state
        divisor, factor = clip_factors(global_norm(updates).to(leaves[0].device), max_norm)
        out = [(u / divisor.to(u.dtype)) * factor.to(u.dtype) for u in leaves]
        return tree_unflatten(spec, out), state

    return GradientTransformation(init, update, ClipSpec(max_norm))
