"""Reading checkpoints of the retired sharded format (version 1) into today's states.

Sharded states are DTensor states now, and DTensor states are saved with
:func:`~functional_fp16.distributed.save_dcp_state` (DCP's own format,
resharded on load). A directory written by the former
``save_checkpoint_sharded`` (a marker ``checkpoint.json`` beside one DCP
folder ``step-<32 hex>``, every per-parameter tensor stored flattened to 1-D)
still loads with :func:`load_checkpoint_sharded`; to convert one::

    tree = ffd.load_checkpoint_sharded("old_ckpt", like)     # like: {"state": ..., "epoch": 0}
    ffd.save_dcp_state(tree["state"], "new_ckpt")             # and keep tree["epoch"] yourself

The DCP folder is read like every DCP checkpoint of the library, without
trusting it (:class:`~functional_fp16.distributed.dcp_reader.CheckedReader`).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

import optree
import torch
from torch.distributed.checkpoint import CheckpointException

from functional_fp16._util.tree import (
    NAMESPACE,
    PyTree,
    format_path,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.checkpoint.format import CheckpointCorruptError, CheckpointMismatchError, show
from functional_fp16.distributed.dcp_reader import CheckedReader, check_entries, dcp_failure
from functional_fp16.distributed.dcp_state import one_process_is_intended
from functional_fp16.distributed.sharding import full_like, map_sharded, shard_like
from functional_fp16.update.state import (
    ADDED_FIELDS,
    FP16State,
    added_field_value,
    old_checkpoint_note,
)

__all__ = ["load_checkpoint_sharded", "MARKER"]

MARKER = "checkpoint.json"
"""The marker file of a version-1 sharded checkpoint."""

_FORMAT = "functional_fp16.sharded_checkpoint"
_FOLDER = re.compile(r"step-[0-9a-f]{32}")
_MAX_MARKER_BYTES = 1 << 28


def _marker(directory: str) -> dict[str, Any]:
    name = os.path.join(directory, MARKER)
    if not os.path.isfile(name):
        raise FileNotFoundError(
            f"{show(directory)} holds no {MARKER}: not a sharded checkpoint of the former "
            "format (a DCP checkpoint of today's loads with load_dcp_state)"
        )
    if os.path.getsize(name) > _MAX_MARKER_BYTES:
        raise CheckpointCorruptError(f"{show(name)}: larger than any marker the format writes")
    try:
        with open(name, encoding="utf-8") as f:
            marker = json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(f"{show(name)}: not JSON ({err})") from None
    if not isinstance(marker, dict) or marker.get("format") != _FORMAT:
        raise CheckpointCorruptError(f"{show(name)}: not the marker of a sharded checkpoint")
    if marker.get("version") != 1:
        raise CheckpointMismatchError(
            f"{show(name)}: version {show(repr(marker.get('version')))}; this release reads "
            "version 1 only"
        )
    folder, leaves = marker.get("folder"), marker.get("leaves")
    if not isinstance(folder, str) or not _FOLDER.fullmatch(folder):
        raise CheckpointCorruptError(f"{show(name)}: no valid 'folder'")
    if not isinstance(leaves, list) or not all(
        isinstance(x, dict) and isinstance(x.get("path"), str) for x in leaves
    ):
        raise CheckpointCorruptError(f"{show(name)}: no valid 'leaves'")
    return marker


def _expect(record: dict[str, Any], leaf: Any, path: str) -> tuple[int, ...] | None:
    """The shape the stored entry of ``record`` has, after checking it against ``leaf``."""
    kind = record.get("kind")
    if kind == "value":
        if isinstance(leaf, torch.Tensor):
            raise CheckpointMismatchError(
                f"tree{path}: a tensor in like, a value in the checkpoint"
            )
        return None
    if kind not in ("flat", "tensor") or not isinstance(leaf, torch.Tensor):
        raise CheckpointMismatchError(
            f"tree{path}: {show(repr(kind))} in the checkpoint, {type(leaf).__name__} in like"
        )
    if record.get("dtype") != str(leaf.dtype) or record.get("shape") != list(leaf.shape):
        raise CheckpointMismatchError(
            f"tree{path}: {show(str(record.get('dtype')))} of shape "
            f"{show(str(record.get('shape')))} in the checkpoint, {leaf.dtype} of shape "
            f"{tuple(leaf.shape)} in like"
        )
    return (leaf.numel(),) if kind == "flat" else tuple(leaf.shape)


def load_checkpoint_sharded(path: str | os.PathLike, like: PyTree) -> PyTree:
    """The tree saved at ``path`` by the former ``save_checkpoint_sharded`` (version 1),
    laid out like ``like``.

    Every process reads the whole checkpoint (DCP without collectives), so it
    loads at any world size, or in one process without a process group.
    States that are sharded in ``like`` (:func:`shard_state`) come back
    sharded on ``like``'s mesh, the others whole; numbers and strings come
    from the checkpoint. Every leaf's path, dtype and shape must match
    ``like``'s; a mismatch raises :class:`~functional_fp16.CheckpointMismatchError`
    naming the path, and a malformed marker
    :class:`~functional_fp16.CheckpointCorruptError`.
    """
    import torch.distributed.checkpoint as dcp

    directory = os.fspath(path)
    marker = _marker(directory)
    records = {x["path"]: x for x in marker["leaves"]}
    full = map_sharded(full_like, like)
    leaves, spec = tree_flatten(full)
    paths = tree_paths(full)
    # Fields written after these files were: they start afresh (path -> the field).
    later = _added_paths(full)
    counters = {p: later[p] for p in paths if p not in records and p in later}
    if counters:
        missing = [f for f in ADDED_FIELDS if f in counters.values()]
        warnings.warn(old_checkpoint_note(show(directory), missing), stacklevel=2)
        for p in counters:
            records[p] = {"path": p, "added": True}
    if set(paths) != set(records):
        missing = sorted(set(paths) - set(records))[:3]
        extra = sorted(set(records) - set(paths))[:3]
        raise CheckpointMismatchError(
            f"{show(directory)} does not hold like's tree: missing {missing}, not in like "
            f"{[show(x) for x in extra]}"
        )
    wanted: dict[str, torch.Tensor] = {}
    for p, leaf in zip(paths, leaves):
        if p in counters:
            continue
        shape = _expect(records[p], leaf, p)
        if shape is not None:
            wanted[p] = torch.empty(shape, dtype=leaf.dtype, device=leaf.device)
    folder = os.path.join(directory, marker["folder"])
    reader = CheckedReader(folder)
    check_entries(wanted, reader.read_metadata(), show(folder))
    try:
        with one_process_is_intended():
            dcp.load(wanted, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as err:
        raise CheckpointCorruptError(
            f"{show(folder)}: DCP could not read it ({dcp_failure(err)})"
        ) from err
    out = []
    for p, leaf in zip(paths, leaves):
        if p in counters:
            out.append(added_field_value(counters[p], leaf))
            continue
        if p not in wanted:
            out.append(records[p].get("value"))
            continue
        value = wanted[p].view(leaf.shape)
        out.append(value if leaf.is_contiguous() else torch.empty_like(leaf).copy_(value))
    tree = tree_unflatten(spec, out)
    return shard_like(tree, like)


def _added_paths(tree: PyTree) -> dict[str, str]:
    """The paths of the leaves of ``tree`` that lie in a field of
    :data:`~functional_fp16.update.state.ADDED_FIELDS` of an ``FP16State``, with the field."""
    is_state = lambda x: isinstance(x, FP16State)  # noqa: E731
    nodes = optree.tree_leaves(tree, is_leaf=is_state, namespace=NAMESPACE)
    prefixes = [
        format_path(a) if a.codify("") else ""
        for a in optree.tree_accessors(tree, is_leaf=is_state, namespace=NAMESPACE)
    ]
    out = {}
    for prefix, node in zip(prefixes, nodes):
        if is_state(node):
            for field in ADDED_FIELDS:
                for path in tree_paths(getattr(node, field)):
                    out[prefix + f".{field}" + ("" if path == "<root>" else path)] = field
    return out
