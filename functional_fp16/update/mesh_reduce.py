"""Reductions over every rank of a device mesh, and the mesh a sub-mesh was sliced from.

Used by :mod:`functional_fp16.update.dtensor` (the update of a DTensor state)
and by ``fp16_init`` (agreeing that the initial parameters are finite).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from functional_fp16._util.dtensors import is_dtensor
from functional_fp16._util.tree import tree_flatten

__all__ = [
    "root_mesh",
    "describe_mesh",
    "whole_mesh_groups",
    "agreement_groups",
    "all_reduce",
    "finite_everywhere",
]


def root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself if none): DeviceMesh's ``_get_root_mesh``."""
    root = getattr(mesh, "_get_root_mesh", None)
    return mesh if root is None else root()


def describe_mesh(mesh) -> str:
    """The mesh's dimension names and shape, the mesh it was sliced from, the ranks of that
    (or its own), and whether it holds this rank: ``a mesh ('dp',) of shape (2,) sliced from
    ('dp', 'tp') of shape (2, 2) over ranks [[0, 1], [2, 3]]``. A leaf's validity depends
    on nothing else; a slice's own ranks differ between the ranks, legitimately."""
    names = "" if mesh.mesh_dim_names is None else f" {tuple(mesh.mesh_dim_names)}"
    text = f"a mesh{names} of shape {tuple(mesh.shape)}"
    root = root_mesh(mesh)
    if root is not mesh:  # its own ranks are this rank's slice: the parent's are common
        parent = "" if root.mesh_dim_names is None else f" {tuple(root.mesh_dim_names)}"
        text += f" sliced from{parent} of shape {tuple(root.shape)}"
    text += f" over ranks {root.mesh.tolist()}"
    if mesh.get_coordinate() is None:
        text += " that does not hold this rank"
    return text


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


def agreement_groups(root) -> list:
    """The process groups that the ranks of ``root`` agree over before they communicate:
    the default group (``[None]``) when ``root`` spans it, else :func:`whole_mesh_groups`."""
    if root.size() == dist.get_world_size():
        return [None]
    return whole_mesh_groups(root)


def all_reduce(x: torch.Tensor, op, groups: list) -> torch.Tensor:
    """``x`` all-reduced in place by ``op`` over each of ``groups`` in turn (``None``: the
    default group); returns ``x``."""
    for group in groups:
        dist.all_reduce(x, op=op, group=group)
    return x


def finite_everywhere(tree, flags: torch.Tensor) -> torch.Tensor:
    """``flags`` (one bool per leaf of ``tree``, from this rank's shards) ANDed over every
    rank of the first leaf's mesh (or the mesh it was sliced from), by one all-reduce (MIN)
    over each of :func:`agreement_groups`, when ``tree``'s leaves are DTensors; otherwise
    ``flags`` as they are. So a parameter that is not finite on one rank's shard is refused
    by every rank of the mesh, naming it, whether or not the mesh spans the default group."""
    leaves = tree_flatten(tree)[0]
    if not (dist.is_initialized() and leaves and is_dtensor(leaves[0])):
        return flags
    groups = agreement_groups(root_mesh(leaves[0].device_mesh))
    return all_reduce(flags.to(torch.int32), dist.ReduceOp.MIN, groups).to(torch.bool)
