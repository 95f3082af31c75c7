"""Identical trees on every rank: checking that they match, and broadcasting one rank's values."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from functional_fp16._util.deprecation import keyword_only
from functional_fp16._util.tree import PyTree, tree_flatten, tree_unflatten
from functional_fp16.distributed.buckets import _buckets, _pack, _unpack
from functional_fp16.distributed.process_group import ProcessGroup, require_group
from functional_fp16.update.fingerprint import agree, describe_tree

__all__ = ["check_same_tree", "broadcast_state"]


def check_same_tree(tree: PyTree, group: ProcessGroup = None, *, name: str = "tree") -> None:
    """Checks that every rank holds a tree of the same structure, configuration, shapes and dtypes.

    Compared (:func:`~functional_fp16.update.fingerprint.describe_tree`):
    every node's type and path; the static configuration of the library's
    nodes (an :class:`~functional_fp16.FP16State`'s ``tx.spec``, e.g. its
    learning rate, and shard layout less the rank; a loss scale's settings);
    every leaf's dtype, shape and device type (a sharded state's pieces by
    dtype and device, their lengths being the layout's). Each rank hashes
    its description and the hashes are all-gathered; only when they differ
    is the full description gathered to name the first rank and entry that
    differ. Every rank raises the same error, so no rank is left waiting in
    a later collective. Values are never compared.

    Raises:
      ValueError: naming the first path that differs and the two ranks.
    """
    require_group("check_same_tree")
    agree(describe_tree(tree), group, name=name, what="the ranks hold different trees")


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
    require_group("broadcast_state")
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
