"""Reductions over every rank of a device mesh, and the mesh a sub-mesh was sliced from.

Used by :mod:`functional_fp16.update.dtensor` (the update of a DTensor state)
and by ``fp16_init`` (agreeing that the initial parameters are finite).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from functional_fp16._util.tree import tree_flatten

__all__ = [
    "root_mesh",
    "spans_default_group",
    "whole_mesh_groups",
    "all_reduce",
    "finite_everywhere",
]


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself if none): DeviceMesh's ``_get_root_mesh``."""
    root = getattr(mesh, "_get_root_mesh", None)
    return mesh if root is None else root()


def spans_default_group(x) -> bool:
    """Whether ``x`` is a DTensor whose mesh (or the one it was sliced from) spans every
    rank of the default process group (which must be initialised)."""
    return isinstance(x, DTensor) and (root_mesh(x.device_mesh).size() == dist.get_world_size())


def whole_mesh_groups(root) -> list:
    """Process groups whose all-reduces in turn span every rank of ``root``: one group
    where it is 1-D or spans the default group (``None``), else one per dimension."""
    if root.ndim == 1:
        return [root.get_group()]
    if (
        root.size() == dist.get_world_size()
        and dist.get_backend(root.get_group(0)) == dist.get_backend()
    ):
        return [None]
    return [root.get_group(d) for d in range(root.ndim)]


def all_reduce(x: torch.Tensor, op, groups: list) -> torch.Tensor:
    """``x`` all-reduced in place by ``op`` over each of ``groups`` in turn (``None``: the
    default group); returns ``x``."""
    for group in groups:
        dist.all_reduce(x, op=op, group=group)
    return x


def finite_everywhere(tree, flags: torch.Tensor) -> torch.Tensor:
    """``flags`` (one bool per leaf of ``tree``, from this rank's shards) ANDed over every
    rank, by one all-reduce (MIN) over the default group, when ``tree``'s leaves are
    DTensors on a mesh that spans it; otherwise ``flags`` as they are. So a parameter
    that is not finite on one rank's shard is refused by every rank, naming it."""
    leaves = tree_flatten(tree)[0]
    if not (dist.is_initialized() and leaves and spans_default_group(leaves[0])):
        return flags
    return all_reduce(flags.to(torch.int32), dist.ReduceOp.MIN, [None]).to(torch.bool)
