"""The marker of a sharded checkpoint: how each leaf is stored, the marker written, read and checked, and the directory kept tidy.

A sharded checkpoint (:mod:`functional_fp16.distributed.sharded_checkpoints`)
is a directory holding DCP folders ``step-<32 hex>`` and this marker,
``checkpoint.json``, which names the current folder and describes what it
holds. The marker is JSON: ``{"format": "functional_fp16.sharded_checkpoint",
"version": 1, "folder": "step-...", "world_size": N, "bucket_bytes": B,
"leaves": [LEAF, ...], "structure": [[path, description], ...], "config":
[[path, description], ...], "checksum": "<sha256 hex>"}``. A ``LEAF`` is
``{"path": p, "kind": "flat" | "tensor", "dtype": "torch.float32", "shape":
[...]}`` (``shape`` the leaf's full, logical shape) or ``{"path": p, "kind":
"value", "value": v}``. ``structure`` describes every node (type, a loss
scale's settings) and ``config`` the same plus every state's ``tx.spec``
(:func:`~functional_fp16.distributed.fingerprint.describe_tree`); the
checksum covers the rest of the marker.

Whoever can write the marker can compute its checksum, so :func:`read_marker`
checks every field's type and range, and every text taken from the file
reaches a message escaped and cut (:func:`~functional_fp16.checkpoint.format.show`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from typing import Any, BinaryIO, NamedTuple

import optree
import torch

from functional_fp16._util.tree import NAMESPACE, PyTree, describe_tensor, tree_flatten, tree_paths
from functional_fp16.checkpoint.atomic_file import atomic_write
from functional_fp16.checkpoint.format import (
    SHOWN_PATH_CHARS,
    CheckpointCorruptError,
    CheckpointMismatchError,
    show,
)
from functional_fp16.distributed.fingerprint import describe_leaf
from functional_fp16.distributed.process_group import ProcessGroup
from functional_fp16.distributed.shard_layout import owners
from functional_fp16.distributed.sharding import check_layout
from functional_fp16.update import FP16State

__all__ = [
    "MARKER",
    "Slot",
    "slots",
    "record",
    "commit_marker",
    "remove_old",
    "read_marker",
    "compare",
]

MARKER = "checkpoint.json"
"""The name of the marker file inside a sharded checkpoint's directory."""

FORMAT = "functional_fp16.sharded_checkpoint"
VERSION = 1
FOLDER = re.compile(r"step-[0-9a-f]{32}")
"""The name of a DCP folder in a checkpoint's directory."""
MARKER_TEMP = re.compile(r"\.checkpoint\.json\..*\.tmp")
"""The temporary files of the marker's atomic writes."""
CHUNKS_PER_BUCKET = 4  # a stored chunk is a quarter of bucket_bytes (see sharded_checkpoints)
_MAX_MARKER_BYTES = 1 << 28
_MAX_WORLD_SIZE = 1 << 24
_MAX_BUCKET_BYTES = 1 << 62
_VALUES = (bool, int, float, str)
DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
"""Every torch dtype by its name (``"torch.float32"``)."""


# -- which leaf is stored how -------------------------------------------------------


class Slot(NamedTuple):
    """How one leaf of a tree is stored, and which of its elements this rank holds."""

    path: str  # the leaf's path: its DCP key and its name in messages
    kind: str  # "flat" (a per-parameter tensor, stored 1-D), "tensor" or "value"
    shape: tuple[int, ...]  # a tensor's full (logical) shape
    held: tuple[int, int]  # flat: the elements [lo, hi) of the flattened leaf held here
    write: tuple[int, int]  # flat: the elements this rank writes
    ndim: int  # flat: the parameter's number of dimensions (a piece keeps it)
    piece: bool  # flat: whether this rank holds a piece of the leaf rather than all of it


def _state_roles(state: FP16State, group: ProcessGroup, what: str) -> list[Any]:
    """For every leaf of ``state`` in flattening order: ``(parameter, is_piece_when_sharded)`` or ``None``."""
    if state.shard is not None:
        check_layout(state, group, what)
    n = len(tree_flatten(state.params)[0])
    roles: list[Any] = [(i, False) for i in range(n)] + [(i, True) for i in range(n)]
    roles += [None if i is None else (i, True) for i in owners(state)]
    roles += [None] * (len(tree_flatten(state.loss_scale)[0]) + 2)  # + step, grads_finite
    return roles


def slots(tree: PyTree, group: ProcessGroup, what: str) -> tuple[list[Slot], list[Any], Any]:
    """The slots of ``tree``'s leaves, its leaves and its tree structure (flattening order).

    Raises:
      TypeError, ValueError: a leaf that cannot be stored, or a state that
        does not fit its layout, naming the leaf's path.
    """
    leaves, spec = tree_flatten(tree)
    paths = tree_paths(tree)
    outer = optree.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, FP16State), namespace=NAMESPACE
    )
    roles: list[Any] = []
    params: list[tuple[Any, torch.Tensor]] = []  # (layout, parameter) of every role
    for node in outer:
        if isinstance(node, FP16State):
            p_leaves = tree_flatten(node.params)[0]
            for role in _state_roles(node, group, what):
                roles.append(role)
                params.append((node.shard, None if role is None else p_leaves[role[0]]))
        else:
            roles.append(None)
            params.append((None, None))
    out = []
    for path, x, role, (layout, p) in zip(paths, leaves, roles, params, strict=True):
        where = f"tree{show(path, SHOWN_PATH_CHARS)}"
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_meta or x.is_quantized:
                raise TypeError(f"{where}: cannot store {describe_tensor(x)} ({x.layout})")
            if role is None:
                shape = tuple(x.shape)
                out.append(Slot(path, "tensor", shape, (0, 0), (0, 0), x.ndim, False))
                continue
            i, piece = role
            total = p.numel()
            if layout is None or not piece:
                if x.shape != p.shape:
                    raise ValueError(
                        f"{where}: expected the shape {tuple(p.shape)} of its parameter, "
                        f"got {describe_tensor(x)}"
                    )
                held = (0, total)
            else:
                held = layout.piece(i)
                if x.numel() != held[1] - held[0]:
                    raise ValueError(
                        f"{where}: shard {layout.rank} of {layout.world_size} holds "
                        f"{held[1] - held[0]} elements of this leaf, got {describe_tensor(x)}"
                    )
            write = held if layout is None or piece else layout.piece(i)
            sharded = layout is not None and piece
            out.append(Slot(path, "flat", tuple(p.shape), held, write, p.ndim, sharded))
        elif type(x) in _VALUES:
            out.append(Slot(path, "value", (), (0, 0), (0, 0), 0, False))
        else:
            raise TypeError(
                f"{where}: cannot store {describe_tensor(x)}; a sharded checkpoint holds "
                "pytrees of tensors, the library's states, bool, int, float, str and None"
            )
    return out, leaves, spec


def record(slot: Slot, x: Any) -> dict[str, Any]:
    """A leaf's entry in the marker."""
    if slot.kind == "value":
        return {"path": slot.path, "kind": "value", "value": x}
    return {"path": slot.path, "kind": slot.kind, "dtype": str(x.dtype), "shape": list(slot.shape)}


def numel(shape: tuple[int, ...]) -> int:
    """The number of elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n


def chunk_elements(bucket_bytes: int, itemsize: int) -> int:
    """The most elements of one stored chunk: a quarter of ``bucket_bytes``, at least one."""
    return max(1, bucket_bytes // (CHUNKS_PER_BUCKET * itemsize))


# -- writing and reading the marker ------------------------------------------------------


def _canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def commit_marker(directory: str, body: dict[str, Any]) -> None:
    """Writes the marker with its checksum atomically (:func:`~functional_fp16.checkpoint.atomic_file.atomic_write`)."""
    body = dict(body)
    body["checksum"] = hashlib.sha256(_canonical(body).encode()).hexdigest()
    text = json.dumps(body).encode("utf-8")
    atomic_write(os.path.join(directory, MARKER), lambda f: f.write(text))


def remove_old(directory: str, keep: str) -> None:
    """Removes the step folders other than ``keep`` and leftover marker temporaries (best effort)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        full = os.path.join(directory, name)
        if FOLDER.fullmatch(name) and name != keep:
            shutil.rmtree(full, ignore_errors=True)
        elif MARKER_TEMP.fullmatch(name):
            try:
                os.unlink(full)
            except OSError:
                pass


def open_regular(name: str) -> BinaryIO:
    """``open(name, "rb")``, refusing anything but a regular file (a FIFO would block the read).

    Raises:
      FileNotFoundError: ``name`` does not exist.
      CheckpointCorruptError: ``name`` is not a regular file.
    """
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointCorruptError(f"{show(name, SHOWN_PATH_CHARS)}: not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {show(twice, quoted=True)} appears twice in one object")
    return out


def _scalar(x: Any) -> str:
    """A marker field for a message: a plain value shown (escaped, cut), anything else by its type."""
    return show(x, quoted=True) if type(x) in (*_VALUES, type(None)) else f"a {type(x).__name__}"


def _is_int(x: Any, lo: int, hi: int) -> bool:
    return type(x) is int and lo <= x <= hi


def _leaf_ok(leaf: Any) -> bool:
    if not isinstance(leaf, dict) or not isinstance(leaf.get("path"), str):
        return False
    if leaf.get("kind") == "value":
        return set(leaf) == {"path", "kind", "value"} and type(leaf["value"]) in _VALUES
    shape = leaf.get("shape")
    return (
        leaf.get("kind") in ("flat", "tensor")
        and isinstance(leaf.get("dtype"), str)
        and leaf["dtype"] in DTYPES
        and isinstance(shape, list)
        and all(_is_int(d, 0, 1 << 62) for d in shape)
    )


def read_marker(directory: str) -> dict[str, Any]:
    """The marker, parsed and validated.

    Raises:
      FileNotFoundError: ``directory`` holds no marker.
      CheckpointCorruptError: the marker is malformed, of another format or
        version, or its checksum does not match.
    """
    where = show(directory, SHOWN_PATH_CHARS)
    name = f"{where}/{MARKER}"
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{where}: no sharded checkpoint here (not a directory)")
    try:
        with open_regular(os.path.join(directory, MARKER)) as f:
            raw = f.read(_MAX_MARKER_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"{where}: no sharded checkpoint here ({MARKER} missing)") from None
    if len(raw) > _MAX_MARKER_BYTES:
        raise CheckpointCorruptError(f"{name}: larger than {_MAX_MARKER_BYTES} bytes")
    try:
        body = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise CheckpointCorruptError(f"{name}: not a readable marker ({show(str(err))})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{name}: not a sharded checkpoint of this library")
    if body.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{name}: format version {_scalar(body.get('version'))}; this library reads {VERSION}"
        )
    stored = body.pop("checksum", None)
    if stored != hashlib.sha256(_canonical(body).encode()).hexdigest():
        raise CheckpointCorruptError(f"{name}: checksum mismatch, the marker was modified")
    folder = body.get("folder")
    if not isinstance(folder, str) or not FOLDER.fullmatch(folder):
        raise CheckpointCorruptError(f"{name}: malformed folder name {_scalar(folder)}")
    for key, hi in (("world_size", _MAX_WORLD_SIZE), ("bucket_bytes", _MAX_BUCKET_BYTES)):
        if not _is_int(body.get(key), 1, hi):
            raise CheckpointCorruptError(f"{name}: malformed {key} {_scalar(body.get(key))}")
    leaves = body.get("leaves")
    if not isinstance(leaves, list):
        raise CheckpointCorruptError(f"{name}: malformed leaf table")
    seen = set()
    for i, leaf in enumerate(leaves):
        if not _leaf_ok(leaf):
            path = leaf.get("path") if isinstance(leaf, dict) else None
            raise CheckpointCorruptError(
                f"{name}: malformed leaf record {i}"
                + (
                    f" ({show(path, SHOWN_PATH_CHARS, quoted=True)})"
                    if isinstance(path, str)
                    else ""
                )
            )
        if leaf["path"] in seen:
            raise CheckpointCorruptError(
                f"{name}: leaf {show(leaf['path'], SHOWN_PATH_CHARS, quoted=True)} appears twice"
            )
        seen.add(leaf["path"])
    for key in ("structure", "config"):
        entries = body.get(key)
        if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 2 and all(isinstance(s, str) for s in e)
            for e in entries
        ):
            raise CheckpointCorruptError(f"{name}: malformed {key}")
    body["checksum"] = stored
    return body


# -- the marker against like -------------------------------------------------------------


def _describe_record(rec: dict[str, Any]) -> str:
    if rec["kind"] == "value":
        return f"{describe_leaf(rec['value'])} {show(rec['value'], quoted=True)}"
    stored = "per-parameter tensor" if rec["kind"] == "flat" else "tensor"
    return f"a {rec['dtype']} {stored} of shape {show(tuple(rec['shape']))}"


def compare(directory: str, marker: dict, wanted: list[dict], config: list, key: str) -> None:
    """Raises :class:`CheckpointMismatchError` at the first leaf or setting where ``like`` differs.

    ``wanted`` holds like's leaf records (:func:`record`), ``config`` its
    ``[path, description]`` entries, compared with the marker's entries under ``key``.
    """
    where = show(directory, SHOWN_PATH_CHARS)

    def mismatch(path: str, what: str) -> CheckpointMismatchError:
        shown = show(path, SHOWN_PATH_CHARS)
        return CheckpointMismatchError(
            f"{where}: checkpoint{shown} does not match like{shown}: {what}"
        )

    stored = {rec["path"]: rec for rec in marker["leaves"]}
    for rec in wanted:
        got = stored.get(rec["path"])
        if got is None:
            raise mismatch(rec["path"], f"like has {_describe_record(rec)}, the checkpoint none")
        same = got["kind"] == rec["kind"] and (
            type(got["value"]) is type(rec["value"])
            if rec["kind"] == "value"
            else (got["dtype"], got["shape"]) == (rec["dtype"], rec["shape"])
        )
        if not same:
            raise mismatch(
                rec["path"],
                f"the checkpoint holds {_describe_record(got)}, like {_describe_record(rec)}",
            )
    names = {rec["path"] for rec in wanted}
    for rec in marker["leaves"]:
        if rec["path"] not in names:
            raise mismatch(rec["path"], f"the checkpoint holds {_describe_record(rec)}, like none")
    ours = dict(marker[key])
    for path, desc in config:
        if ours.get(path) != desc:
            got = show(ours[path]) if path in ours else "nothing"
            raise mismatch(path, f"{got} in the checkpoint, {show(desc)} in like")
    extra = set(ours) - {p for p, _ in config}
    if extra:
        path = min(extra)
        raise mismatch(path, f"{show(ours[path])} in the checkpoint, nothing in like")
