"""Averaging gradients across ranks: bucketed all-reduces, and the agreed finite flag."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functional_fp16._util import validate
from functional_fp16._util.deprecation import keyword_only
from functional_fp16._util.tree import (
    PyTree,
    describe_tensor,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.distributed.buckets import _buckets, _pack, _unpack
from functional_fp16.distributed.process_group import ProcessGroup, require_group
from functional_fp16.distributed.replicas import check_same_tree
from functional_fp16.transforms.base import EmptyState, GradientTransformation
from functional_fp16.update.fingerprint import (
    agree_once,
    describe_arguments,
    describe_tree,
    leaf_key,
)

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AllReduceSpec",
    "tree_all_reduce_mean",
    "all_reduce_mean",
    "agree_finite",
]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Largest bucket one collective sends, in bytes (DDP's default ``bucket_cap_mb``)."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class AllReduceSpec(NamedTuple):
    """Declared form of :func:`all_reduce_mean` (so that a sharded update can refuse it)."""

    bucket_bytes: int
    comm_dtype: torch.dtype | None
    predivide_factor: float | None


def _float_leaves(tree: PyTree, name: str) -> tuple[list[torch.Tensor], Any, list[str]]:
    leaves, spec = tree_flatten(tree)
    paths = tree_paths(tree)
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(
                f"{name}{path}: expected a floating-point tensor, got {describe_tensor(leaf)}"
            )
    return leaves, spec, paths


def default_predivide(comm_dtype: torch.dtype, world: int) -> float:
    """The pre-divide factor for ``comm_dtype``: the world size for FP16/BF16, else 1."""
    return float(world) if comm_dtype in _LOW_PRECISION else 1.0


def check_bucket_bytes(bucket_bytes: int) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    return bucket_bytes


def check_comm_dtype(comm_dtype: torch.dtype | None) -> torch.dtype | None:
    if comm_dtype is not None and (
        not isinstance(comm_dtype, torch.dtype) or not comm_dtype.is_floating_point
    ):
        raise TypeError(f"comm_dtype must be None or a floating torch.dtype, got {comm_dtype!r}")
    return comm_dtype


def check_predivide(predivide_factor: float | None) -> float | None:
    if predivide_factor is None:
        return None
    return validate.real("predivide_factor", predivide_factor, positive=True)


@keyword_only("group")
def tree_all_reduce_mean(
    tree: PyTree,
    *,
    group: ProcessGroup = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    comm_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> PyTree:
    r"""The mean of ``tree`` over the ranks of ``group``, in a few flat collectives.

    With :math:`N` ranks, pre-divide factor :math:`f` and :math:`x_r` a leaf on
    rank :math:`r`, cast to the communication dtype :math:`c`:

    .. math:: \bar x = \operatorname{fl}_c\Big(\sum_{r} \operatorname{fl}_c(x_r / f)\Big) \,/\, (N / f)

    Leaves are grouped by device and communication dtype and concatenated
    into buckets of at most ``bucket_bytes``; each bucket is one
    ``all_reduce(SUM)``, all launched before any is waited on. The result has
    the structure, shapes, dtypes and devices of ``tree``, is bitwise the same
    on every rank, and ``tree`` itself is never written to. Nothing is read
    back to the host.

    The first call with a configuration (the tree's structure, leaf dtypes,
    shapes and devices, the arguments below, the world size) checks that
    every rank passes the same one (one small all-gather,
    :func:`~functional_fp16.update.fingerprint.agree_once`), so a rank
    with another shape, dtype or bucket size raises on every rank, naming
    the rank and the difference, instead of hanging in the all-reduce.
    Later calls with that configuration communicate nothing more.

    Args:
      tree: a pytree of floating-point tensors, the same structure and shapes
        on every rank.
      group: the process group (default: the default group).
      bucket_bytes: the largest bucket, in bytes of the communication dtype.
      comm_dtype: the dtype sent over the wire; default each leaf's own dtype.
        Leaves are cast to it and the result back to their dtype.
      predivide_factor: :math:`f`. Default :math:`N` for FP16/BF16
        communication (each term is at most ``fl(max / N)``, so a sum of
        finite values overflows only by rounding, when ``N`` is not a power
        of two and the values sit at the FP16 maximum; tiny values lose bits
        to underflow instead)
        and 1 otherwise (sum, then divide, as DDP does).

    Returns:
      The averaged tree.

    Raises:
      ValueError: on every rank, when the ranks' configurations differ.
    """
    require_group("tree_all_reduce_mean")
    world = dist.get_world_size(group)
    # The ranks agree on the configuration first (once per configuration), so that
    # a refusal below happens on every rank alike and none waits in the all-reduce.
    flat, spec = tree_flatten(tree)
    agree_once(
        ("tree_all_reduce_mean", spec, leaf_key(flat), bucket_bytes, comm_dtype, predivide_factor),
        lambda: (
            describe_tree(tree)
            + describe_arguments(
                world,
                bucket_bytes=bucket_bytes,
                comm_dtype=comm_dtype,
                predivide_factor=predivide_factor,
            )
        ),
        group,
        name="tree",
        what="tree_all_reduce_mean: the ranks disagree",
    )
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    comm_dtype = check_comm_dtype(comm_dtype)
    predivide_factor = check_predivide(predivide_factor)
    leaves, spec, _ = _float_leaves(tree, "tree")
    if not leaves:
        return tree
    dtypes = [comm_dtype or leaf.dtype for leaf in leaves]
    pending = []
    for indices in _buckets(leaves, dtypes, bucket_bytes):
        dtype = dtypes[indices[0]]
        pre = predivide_factor or default_predivide(dtype, world)
        flat = _pack(leaves, indices, dtype, pre)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((work, flat, indices, world / pre))
    out: list[Any] = [None] * len(leaves)
    for work, flat, indices, post in pending:
        work.wait()
        if post != 1.0:
            flat.div_(post)
        _unpack(flat, leaves, indices, out)
    return tree_unflatten(spec, out)


@keyword_only("group")
def all_reduce_mean(
    *,
    group: ProcessGroup = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    comm_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> GradientTransformation:
    r"""A transform that averages the updates over the ranks of ``group``.

    .. math:: u \mapsto \frac{1}{N} \sum_{r=1}^{N} u_r

    computed by :func:`tree_all_reduce_mean` (see it for the arguments). Put it
    first in the optimiser, e.g. ``chain(all_reduce_mean(), sgd(lr, 0.9))``.
    Inside :func:`~functional_fp16.fp16_update` it sees the unscaled FP32
    gradients, so the average is formed in FP32; pass
    ``agree=agree_finite`` to ``fp16_update`` so that every rank skips the same
    steps (its finite check runs before the optimiser, on local gradients).
    Since these gradients are unscaled, ``comm_dtype=torch.float16`` here would
    flush small ones to zero; to send FP16, average the scaled gradients with
    :func:`tree_all_reduce_mean` before the update instead.

    ``init`` needs the process group: it compares the parameter trees of all
    ranks with :func:`check_same_tree` (one small all-gather), so a rank with a
    differently shaped model fails there, naming the leaf, rather than in a
    mismatched collective later.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with an empty state.
    """
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    comm_dtype = check_comm_dtype(comm_dtype)
    predivide_factor = check_predivide(predivide_factor)

    def init(params: PyTree) -> EmptyState:
        require_group("all_reduce_mean")
        check_same_tree(params, group, name="params")
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        del params
        require_group("all_reduce_mean")
        mean = tree_all_reduce_mean(
            updates,
            group=group,
            bucket_bytes=bucket_bytes,
            comm_dtype=comm_dtype,
            predivide_factor=predivide_factor,
        )
        return mean, state

    return GradientTransformation(
        init, update, AllReduceSpec(bucket_bytes, comm_dtype, predivide_factor)
    )


@keyword_only("group")
def agree_finite(finite: torch.Tensor, *, group: ProcessGroup = None) -> torch.Tensor:
    r"""The finite flag every rank agrees on: true only if it is true on all ranks.

    .. math:: f = \neg \max_r (\neg f_r)

    One ``all_reduce(MAX)`` of a one-byte tensor on the flag's device (Megatron-LM
    and DeepSpeed reduce their overflow flag the same way); the flag is never
    read on the host. Pass it to :func:`~functional_fp16.fp16_update` as
    ``agree=agree_finite``, or ``agree=functools.partial(agree_finite, group=g)``.

    Args:
      finite: this rank's 0-d bool flag.
      group: the process group (default: the default group).

    Returns:
      A new 0-d bool tensor, the same on every rank.
    """
    require_group("agree_finite")
    if not isinstance(finite, torch.Tensor) or finite.dtype != torch.bool or finite.ndim != 0:
        raise TypeError(f"finite must be a 0-d bool tensor, got {describe_tensor(finite)}")
    overflow = torch.logical_not(finite).to(torch.uint8).reshape(1)
    dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
    return overflow.reshape(()) == 0
