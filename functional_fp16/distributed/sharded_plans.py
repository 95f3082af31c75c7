"""What one rank writes or reads in a sharded checkpoint, planned and checked before any collective.

:func:`plan_save` and :func:`plan_load` do every check that can fail on one
rank alone (the arguments, the tree's leaves and layouts, the marker against
``like``, DCP's metadata against the marker); the caller reports their
outcome to every rank in one all-gather, so that the ranks raise together
instead of leaving some in a collective (see
:mod:`~functional_fp16.distributed.sharded_checkpoints`).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from functional_fp16._util.tree import PyTree
from functional_fp16.checkpoint.format import SHOWN_PATH_CHARS, show
from functional_fp16.distributed.all_reduce import check_bucket_bytes
from functional_fp16.distributed.dcp_io import chunked
from functional_fp16.distributed.dcp_metadata import Expected, read_dcp_metadata
from functional_fp16.distributed.fingerprint import describe_arguments, describe_tree
from functional_fp16.distributed.process_group import ProcessGroup
from functional_fp16.distributed.shard_layout import piece_shape
from functional_fp16.distributed.sharded_format import (
    FORMAT,
    VERSION,
    Slot,
    chunk_elements,
    compare,
    numel,
    read_marker,
    record,
    slots,
)

__all__ = ["SavePlan", "plan_save", "LoadPlan", "plan_load", "loaded_tree", "as_directory"]


def as_directory(path: Any) -> str:
    """``path`` as a str (a str or an ``os.PathLike`` of one)."""
    directory = os.fspath(path)
    if not isinstance(directory, str):
        raise TypeError(f"path must be a str or an os.PathLike of str, got {type(path).__name__}")
    return directory


class SavePlan(NamedTuple):
    directory: str
    body: dict[str, Any]  # the marker, less folder and checksum
    state_dict: dict[str, torch.Tensor]  # what DCP writes from this rank
    entries: list[tuple[str, str]]  # the tree's description, which every rank must share


def plan_save(path: Any, tree: PyTree, group: ProcessGroup, bucket_bytes: Any) -> SavePlan:
    """This rank's part of a save; every check that can fail on one rank alone happens here."""
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    directory = as_directory(path)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(
            f"{show(directory, SHOWN_PATH_CHARS)}: is a file; a sharded checkpoint is a directory "
            "(whole-file checkpoints are written by save_checkpoint_rank0)"
        )
    leaf_slots, leaves, _ = slots(tree, group, "save_checkpoint_sharded")
    state_dict: dict[str, torch.Tensor] = {}
    for slot, x in zip(leaf_slots, leaves, strict=True):
        if slot.kind == "tensor" and x.numel() > 0:
            state_dict[slot.path] = x.detach()
        elif slot.kind == "flat":
            lo, hi = slot.write
            if hi == lo:
                continue
            flat = x.detach().reshape(-1)  # a copy only for a leaf that is not contiguous
            if not slot.piece:
                flat = flat[lo:hi]
            chunk = chunk_elements(bucket_bytes, x.element_size())
            state_dict[slot.path] = chunked(flat.view(-1), numel(slot.shape), lo, chunk)
    world = dist.get_world_size(group)
    body = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": world,
        "bucket_bytes": bucket_bytes,
        "leaves": [record(s, x) for s, x in zip(leaf_slots, leaves, strict=True)],
        "structure": [list(e) for e in describe_tree(tree, leaves=False, layouts=False, tx=False)],
        "config": [list(e) for e in describe_tree(tree, leaves=False, layouts=False)],
    }
    entries = describe_tree(tree) + describe_arguments(world, bucket_bytes=bucket_bytes)
    return SavePlan(directory, body, state_dict, entries)


class LoadPlan(NamedTuple):
    directory: str
    folder: str
    metadata: Any  # DCP's metadata, checked and rebuilt
    state_dict: dict[str, torch.Tensor]  # the tensors DCP fills on this rank
    slots: list[Slot]
    values: dict[str, Any]  # host values from the marker
    spec: Any  # like's tree structure
    like_leaves: list[Any]
    entries: list[tuple[str, str]]  # like's description and the marker's checksum


def plan_load(path: Any, like: PyTree, group: ProcessGroup, check_tx: bool) -> LoadPlan:
    """This rank's part of a load: the marker and DCP's metadata read and checked against ``like``."""
    directory = as_directory(path)
    marker = read_marker(directory)
    leaf_slots, like_leaves, spec = slots(like, group, "load_checkpoint_sharded")
    wanted = [record(s, x) for s, x in zip(leaf_slots, like_leaves, strict=True)]
    key = "config" if check_tx else "structure"
    config = describe_tree(like, leaves=False, layouts=False, tx=check_tx)
    compare(directory, marker, wanted, [list(e) for e in config], key)
    state_dict: dict[str, torch.Tensor] = {}
    expected: dict[str, Expected] = {}
    for slot, x in zip(leaf_slots, like_leaves, strict=True):
        if slot.kind == "tensor":
            if x.numel() > 0:
                expected[slot.path] = Expected(x.dtype, slot.shape, 1)
                state_dict[slot.path] = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif slot.kind == "flat":
            total = numel(slot.shape)
            if total > 0:
                # Each writer cuts its range into chunks: at most total / chunk + 1 per writer.
                chunk = chunk_elements(marker["bucket_bytes"], x.element_size())
                most = total // chunk + marker["world_size"] + 1
                expected[slot.path] = Expected(x.dtype, (total,), most)
            lo, hi = slot.held
            if hi > lo:
                dest = torch.empty(hi - lo, dtype=x.dtype, device=x.device)
                state_dict[slot.path] = chunked(dest, total, lo, hi - lo)
    folder = os.path.join(directory, marker["folder"])
    metadata = read_dcp_metadata(folder, expected)
    values = {r["path"]: r["value"] for r in marker["leaves"] if r["kind"] == "value"}
    entries = describe_tree(like) + [("the marker's checksum", marker["checksum"])]
    return LoadPlan(
        directory,
        marker["folder"],
        metadata,
        state_dict,
        leaf_slots,
        values,
        spec,
        like_leaves,
        entries,
    )


def loaded_tree(plan: LoadPlan) -> PyTree:
    """The loaded tree: each destination in its leaf's shape and memory format."""
    out = []
    for slot, x in zip(plan.slots, plan.like_leaves, strict=True):
        if slot.kind == "value":
            out.append(plan.values[slot.path])
        elif slot.kind == "tensor":
            dest = plan.state_dict.get(slot.path)
            if dest is None:  # no elements
                dest = torch.empty_like(x)
            elif not dest.is_contiguous() or not x.is_contiguous():
                dest = torch.empty_like(x).copy_(dest)
            out.append(dest)
        else:
            lo, hi = slot.held
            dest = plan.state_dict.get(slot.path)
            if dest is None:
                dest = torch.empty(0, dtype=x.dtype, device=x.device)
            if slot.piece:
                out.append(dest.view(piece_shape(slot.ndim, hi - lo)))
            elif x.is_contiguous():
                out.append(dest.view(slot.shape))
            else:  # channels-last: the template's memory format
                out.append(torch.empty_like(x).copy_(dest.view(slot.shape)))
    return optree.tree_unflatten(plan.spec, out)
