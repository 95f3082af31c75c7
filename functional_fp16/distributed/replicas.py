"""Identical trees on every rank: checking that they match, and broadcasting one rank's values."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist

from functional_fp16._deprecation import keyword_only
from functional_fp16._tree import PyTree, tree_flatten, tree_paths, tree_unflatten
from functional_fp16.distributed.buckets import _buckets, _pack, _unpack
from functional_fp16.distributed.process_group import ProcessGroup, _require_group

__all__ = ["check_same_tree", "broadcast_state"]


def _fingerprint(tree: PyTree) -> list[tuple[str, str]]:
    leaves, _ = tree_flatten(tree)
    out = []
    for path, leaf in zip(tree_paths(tree), leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            # The device type, not the index: cuda:0 and cuda:1 are alike.
            out.append(
                (path, f"{leaf.dtype} tensor of shape {tuple(leaf.shape)} on {leaf.device.type}")
            )
        else:
            # Host values (an epoch counter, a name) may differ; their type may not.
            out.append((path, type(leaf).__name__))
    return out


def _first_difference(
    name: str, ref: list[tuple[str, str]], ref_rank: int, other: list[tuple[str, str]], rank: int
) -> str:
    ref_map, other_map = dict(ref), dict(other)
    for path, desc in ref:
        if path not in other_map:
            return f"{name}{path} ({desc}) exists on rank {ref_rank} but not on rank {rank}"
        if other_map[path] != desc:
            return f"{name}{path} is a {desc} on rank {ref_rank} but a {other_map[path]} on rank {rank}"
    for path, desc in other:
        if path not in ref_map:
            return f"{name}{path} ({desc}) exists on rank {rank} but not on rank {ref_rank}"
    return f"{name} flattens in a different leaf order on rank {rank} than on rank {ref_rank}"


def check_same_tree(tree: PyTree, group: ProcessGroup = None, *, name: str = "tree") -> None:
    """Checks that every rank holds a tree of the same structure, shapes and dtypes.

    Each rank hashes the list of (leaf path, dtype, shape, device type) and the
    hashes are all-gathered; only when they differ is the full list gathered
    to name the first differing leaf. Every rank raises the same error, so no
    rank is left waiting in a later collective. Values are never compared.

    Raises:
      ValueError: naming the first leaf path that differs and the two ranks.
    """
    _require_group("check_same_tree")
    meta = _fingerprint(tree)
    digest = hashlib.sha256(repr(meta).encode()).hexdigest()
    world = dist.get_world_size(group)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    if all(d == digests[0] for d in digests):
        return
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, meta, group=group)
    rank = next(r for r in range(world) if digests[r] != digests[0])
    raise ValueError(
        "ranks hold differently shaped trees: "
        + _first_difference(name, metas[0], 0, metas[rank], rank)
    )


@keyword_only("src", "group")
def broadcast_state(
    tree: PyTree, *, src: int = 0, group: ProcessGroup = None, name: str = "state"
) -> PyTree:
    """Every rank gets ``src``'s values of ``tree`` (e.g. the initial :class:`~functional_fp16.FP16State`).

    All tensor leaves are sent (for an ``FP16State``: parameters, master
    copies, optimiser state, loss scale and counters), grouped by device and
    dtype into one flat broadcast each; host values among the leaves (numbers,
    strings, as in a checkpoint's ``{"state": ..., "epoch": 3}``) follow in one
    ``broadcast_object_list``. Static configuration (the optimiser, the
    loss-scale settings) is not sent: each rank keeps its own, which should be
    built by the same code. The trees are first compared with
    :func:`check_same_tree`.

    Args:
      tree: this rank's tree; only its structure, shapes and dtypes are used on
        ranks other than ``src``.
      src: the rank whose values everyone receives (a rank of the default group).
      group: the process group (default: the default group).
      name: how the tree is named in error messages.

    Returns:
      A new tree with ``src``'s values; ``tree`` itself is never written to.
    """
    _require_group("broadcast_state")
    check_same_tree(tree, group, name=name)
    leaves, spec = tree_flatten(tree)
    if not leaves:
        return tree
    is_src = dist.get_rank() == src
    out: list[Any] = list(leaves)
    tensor_ids = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_ids]
    # bool travels as uint8, which every backend supports.
    dtypes = [torch.uint8 if t.dtype == torch.bool else t.dtype for t in tensors]
    received: list[Any] = [None] * len(tensors)
    for indices in _buckets(tensors, dtypes, 2**62):
        dtype, device = dtypes[indices[0]], tensors[indices[0]].device
        if is_src:
            flat = _pack(tensors, indices, dtype, 1.0)
        else:
            flat = torch.empty(sum(tensors[i].numel() for i in indices), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        _unpack(flat, tensors, indices, received)
    for i, t in zip(tensor_ids, received, strict=True):
        out[i] = t
    host_ids = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)]
    if host_ids:
        values = [leaves[i] for i in host_ids]
        dist.broadcast_object_list(values, src=src, group=group)
        for i, v in zip(host_ids, values, strict=True):
            out[i] = v
    return tree_unflatten(spec, out)
