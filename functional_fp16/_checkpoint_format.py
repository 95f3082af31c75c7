"""The checkpoint file's integrity: its format marker, errors, checksum and structural checks.

Shared by the current format (:mod:`functional_fp16.checkpoint`) and the
reader of format version 1 (:mod:`functional_fp16._checkpoint_v1`). A file
whose checksum matches may still be forged, so a loaded structure and leaf
table are validated before anything walks them.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

FORMAT = "functional_fp16.checkpoint"
"""The value of the file's ``"format"`` entry."""

_VALUES = (bool, int, float, str)
_KEYS = _VALUES + (type(None),)


class CheckpointError(ValueError):
    """A checkpoint cannot be written or loaded."""


class CheckpointCorruptError(CheckpointError):
    """The file is truncated, tampered with, or not a checkpoint of this library."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is intact but does not match the template ``like``."""


def _tensor_bytes(x: torch.Tensor) -> Any:
    """The raw bytes of a CPU tensor in row-major order, without a copy where possible."""
    flat = x.reshape(-1).view(torch.uint8)
    try:
        return flat.numpy()  # supports the buffer protocol
    except (ImportError, RuntimeError):  # torch built without numpy
        return bytes(flat.tolist())


def _checksum(header: tuple, tensors: list[torch.Tensor]) -> str:
    """SHA-256 over ``repr(header)`` and each tensor's dtype, shape and bytes."""
    h = hashlib.sha256()
    h.update(repr(header).encode("utf-8"))
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _corrupt(path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: {what}")


def _check_node(node: Any, n_leaves: int, file: str) -> None:
    """Validates a stored structure (a forged file can pass the checksum)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            raise _corrupt(file, f"malformed structure node {node!r}")
        if "leaf" in node:
            if type(node["leaf"]) is not int or not 0 <= node["leaf"] < n_leaves:
                raise _corrupt(file, f"leaf index {node['leaf']!r} out of range")
            continue
        entries, children = node.get("entries"), node.get("children")
        if (
            not isinstance(node.get("type"), str)
            or not isinstance(node.get("kind"), str)
            or not isinstance(entries, list)
            or not isinstance(children, list)
            or len(entries) != len(children)
        ):
            raise _corrupt(file, f"malformed structure node of type {node.get('type')!r}")
        stack.extend(children)


def _check_leaves(leaves: Any, tensors: Any, file: str) -> None:
    if not isinstance(leaves, list) or not isinstance(tensors, list):
        raise _corrupt(file, "the leaf table is malformed")
    for leaf in leaves:
        if not isinstance(leaf, dict) or not isinstance(leaf.get("path"), str):
            raise _corrupt(file, f"malformed leaf record {leaf!r}")
        if "tensor" not in leaf:
            if type(leaf.get("value")) not in _VALUES:
                raise _corrupt(file, f"leaf {leaf['path']}: malformed value record")
            continue
        i = leaf["tensor"]
        if type(i) is not int or not 0 <= i < len(tensors):
            raise _corrupt(file, f"leaf {leaf['path']}: tensor index {i!r} out of range")
        t = tensors[i]
        if (
            not isinstance(t, torch.Tensor)
            or leaf.get("dtype") != str(t.dtype)
            or leaf.get("shape") != list(t.shape)
        ):
            raise _corrupt(file, f"leaf {leaf['path']}: the tensor disagrees with its record")
