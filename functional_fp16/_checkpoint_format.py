"""The checkpoint file's integrity: its format marker, errors, checksum and structural checks.

Shared by the current format (:mod:`functional_fp16.checkpoint`) and the
reader of format version 1 (:mod:`functional_fp16._checkpoint_v1`). A file
whose checksum matches may still be forged (whoever can write the file can
compute it), so what a file holds is checked in three steps, each bounded by
the file's size and none recursive:

1. :func:`_check_archive`, before ``torch.load``: the zip container holds
   uncompressed records whose sizes add up to no more than the file, so
   nothing the loader reads can be larger than the file.
2. :func:`_check_objects`, on what ``torch.load(weights_only=True)`` returns:
   a tree (no container reached twice, so no shared or cyclic nodes) of
   dicts, lists, plain values and tensors, nested at most
   :data:`MAX_CONTAINER_DEPTH` deep, with no more objects than the pickle
   has bytes; every tensor a plain dense CPU tensor that owns exactly its
   bytes (contiguous, offset 0, a storage of ``numel * itemsize`` bytes that
   no other tensor shares), so that restoring it copies what the file holds
   and nothing more.
3. :func:`_check_payload`, on the format's tables: every structure node well
   formed, dict keys unique, each leaf record used by exactly one node and
   each tensor by exactly one leaf record, records that agree with their
   tensors, and no stored device ``meta``.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from typing import Any

import torch

FORMAT = "functional_fp16.checkpoint"
"""The value of the file's ``"format"`` entry."""

_VALUES = (bool, int, float, str)
_KEYS = _VALUES + (type(None),)

MAX_DEPTH = 100
"""How deeply a stored tree may nest: levels of nodes below the root."""

MAX_CONTAINER_DEPTH = 2 * MAX_DEPTH + 3
"""How deeply the dicts and lists of a file may nest (two per tree level, and the tables)."""

_KINDS = ("NONE", "DICT", "LIST", "TUPLE", "NAMEDTUPLE", "CUSTOM")
_NODE_KEYS = {"type", "kind", "entries", "children"}
_VALUE_LEAF_KEYS = {"path", "value"}
_TENSOR_LEAF_KEYS = {"path", "tensor", "dtype", "shape", "device"}
_SHOWN_CHARS = 120
_SHOWN_PATH_CHARS = 400


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


def _show(x: Any, limit: int = _SHOWN_CHARS, quoted: bool = False) -> str:
    """``x`` for an error message: a str as it is (``quoted``: as its repr), anything else as its repr.

    Characters that are not printable (newlines, terminal escapes, bidirectional
    controls) are written as Python escapes (``\\n``, ``\\x1b``), and texts
    longer than ``limit`` are cut, so that what a file holds can neither forge
    nor flood a message.
    """
    if type(x) is str and not quoted:
        text = x
    else:
        try:
            text = repr(x)
        except ValueError:  # an int too long to convert to decimal
            return f"<{type(x).__name__} of {x.bit_length()} bits>" if type(x) is int else "<?>"
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return shown + ("..." if len(text) > limit else "")


# -- 1. the zip container ------------------------------------------------------------


def _check_archive(path: Any, file: str) -> int:
    """Checks the zip container ``torch.load`` will read; returns its pickle's size in bytes.

    The file must be in ``torch.save``'s zip format (the older format declares
    its storages' sizes itself, so it is refused), with one ``data.pkl``
    record, every record stored uncompressed under its own name, and the
    records' sizes adding up to no more than the file's: a record compressed
    1000:1, or two directory entries for the same bytes, would make the loader
    read more than the file holds.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      CheckpointCorruptError: the container is not one ``save_checkpoint`` writes.
    """
    opened = isinstance(path, (str, bytes, os.PathLike))
    f = None
    try:
        f = open(path, "rb") if opened else path  # noqa: SIM115 - closed below
        start = f.tell()
        magic = f.read(4)
        f.seek(0, os.SEEK_END)
        size = f.tell() - start
        f.seek(start)
        if magic != b"PK\x03\x04":
            raise _corrupt(
                file,
                "not a readable checkpoint (truncated, corrupted, or not written by "
                "save_checkpoint): not a zip archive of torch.save",
            )
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
        f.seek(start)
    except CheckpointCorruptError:
        raise
    except (OSError, zipfile.BadZipFile, ValueError, EOFError, AttributeError) as err:
        if opened and isinstance(err, FileNotFoundError):
            raise
        raise _corrupt(
            file,
            "not a readable checkpoint (truncated, corrupted, or not written by "
            f"save_checkpoint): {type(err).__name__}: {_show(str(err))}",
        ) from None
    finally:
        if opened and f is not None:
            f.close()
    names = [r.filename for r in records]
    pickles = [r for r in records if r.filename.endswith("/data.pkl")]
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.compress_size != r.file_size:
            raise _corrupt(
                file,
                f"record {_show(r.filename)} is compressed; checkpoints store records as they are",
            )
        if r.flag_bits & 0x1:
            raise _corrupt(file, f"record {_show(r.filename)} is encrypted")
    if len(set(names)) != len(names) or len(pickles) != 1:
        raise _corrupt(
            file,
            "the archive's records are not those of one torch.save (a name twice, or not one data.pkl)",
        )
    declared = sum(r.file_size for r in records)
    if declared > size:
        raise _corrupt(
            file, f"the archive's records declare {declared} bytes, more than the file's {size}"
        )
    return pickles[0].file_size


# -- 2. the objects torch.load returned ----------------------------------------------


def _check_tensor(t: Any, storages: set[int], file: str) -> None:
    """A plain dense CPU tensor that owns exactly its bytes, shared with no other tensor."""
    if (
        type(t) is not torch.Tensor
        or t.layout != torch.strided
        or t.is_quantized
        or t.is_nested
        or t.device.type != "cpu"
        or t.is_conj()
        or t.is_neg()
    ):
        what = type(t).__name__ if type(t) is not torch.Tensor else f"{t.layout} {t.dtype} tensor"
        raise _corrupt(file, f"holds a {what}; a checkpoint holds plain dense tensors only")
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if not t.is_contiguous() or t.storage_offset() != 0 or storage.nbytes() != nbytes:
        raise _corrupt(
            file,
            f"holds a tensor of shape {_show(list(t.shape))} and strides {_show(list(t.stride()))} "
            f"at offset {t.storage_offset()} of a {storage.nbytes()}-byte storage; each stored "
            f"tensor must own exactly its {nbytes} bytes (contiguous, offset 0, nothing more)",
        )
    if nbytes:
        if storage.data_ptr() in storages:
            raise _corrupt(file, "two stored tensors share one storage; each must own its bytes")
        storages.add(storage.data_ptr())


def _check_objects(payload: Any, budget: int, file: str) -> None:
    """Checks, without recursion, that ``payload`` is a bounded tree of plain data and tensors.

    Walks the objects with an explicit stack and a set of the containers
    seen: a container reached twice (a shared node, or a cycle) is refused at
    its second visit, so the walk visits each object once, and there can be
    no more objects than the ``budget`` (the pickle's size in bytes: every
    object, and every reference to one, costs the pickle at least a byte).

    Raises:
      CheckpointCorruptError: anything else, naming what it found.
    """
    seen: set[int] = set()
    storages: set[int] = set()
    stack: list[tuple[Any, int]] = [(payload, 1)]
    count = 0
    while stack:
        x, depth = stack.pop()
        count += 1
        if count > budget:
            raise _corrupt(file, f"holds more objects than its {budget}-byte pickle can hold")
        kind = type(x)
        if kind in _KEYS:
            continue
        if kind is dict or kind is list:
            if id(x) in seen:
                raise _corrupt(
                    file,
                    "the stored structure is not a tree: a node is reached twice "
                    "(shared by two parents, or part of a cycle)",
                )
            seen.add(id(x))
            if depth > MAX_CONTAINER_DEPTH:
                raise _corrupt(
                    file,
                    f"the stored structure nests deeper than {MAX_DEPTH} levels, "
                    "more than save_checkpoint writes",
                )
            if kind is dict:
                for key, value in x.items():
                    if type(key) not in _KEYS:
                        raise _corrupt(file, f"holds a dict key of type {type(key).__name__}")
                    stack.append((value, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in x)
        elif isinstance(x, torch.Tensor):
            _check_tensor(x, storages, file)
        else:
            raise _corrupt(
                file, f"holds a {_show(kind.__name__)}, which save_checkpoint never writes"
            )


# -- 3. the format's tables ------------------------------------------------------------


def _step(node: dict, i: int) -> str:
    """The path step to a node's child ``i``, as :func:`~functional_fp16._tree.tree_paths` writes it."""
    key = node["entries"][i]
    if node["kind"] in ("LIST", "TUPLE"):
        return f"[{i}]"
    if node["kind"] in ("NAMEDTUPLE", "CUSTOM") and type(key) is str:
        return f".{_show(key)}"
    return f"[{_show(key, quoted=True)}]"


def _check_leaf(leaf: Any, tensors: list, used: bytearray, file: str) -> None:
    """One leaf record; ``used`` marks the tensors already claimed by a record."""
    if type(leaf) is not dict or type(leaf.get("path")) is not str:
        raise _corrupt(file, "a leaf record is malformed (not a dict with a str path)")
    shown = _show(leaf["path"], _SHOWN_PATH_CHARS)
    if set(leaf) == _VALUE_LEAF_KEYS:
        if type(leaf["value"]) not in _VALUES:
            raise _corrupt(file, f"leaf {shown}: malformed value record")
        return
    if set(leaf) != _TENSOR_LEAF_KEYS:
        raise _corrupt(file, f"leaf {shown}: malformed record")
    i = leaf["tensor"]
    if type(i) is not int or not 0 <= i < len(tensors):
        raise _corrupt(file, f"leaf {shown}: tensor index {_show(i)} out of range")
    if used[i]:
        raise _corrupt(file, f"leaf {shown}: tensor {i} belongs to two leaves")
    used[i] = 1
    t, shape = tensors[i], leaf["shape"]
    if (
        not isinstance(t, torch.Tensor)
        or leaf["dtype"] != str(t.dtype)
        or type(shape) is not list
        or any(type(n) is not int for n in shape)
        or shape != list(t.shape)
    ):
        raise _corrupt(file, f"leaf {shown}: the tensor disagrees with its record")
    device = leaf["device"]
    if type(device) is not str:
        raise _corrupt(file, f"leaf {shown}: device {_show(device)} is not a device name")
    try:
        meta = torch.device(device).type == "meta"
    except (RuntimeError, ValueError, TypeError):
        meta = False  # checked where it is used: map_location= or like= may override it
    if meta:
        raise _corrupt(file, f"leaf {shown}: stored on device 'meta', which holds no data")


def _node_problem(node: Any, n_leaves: int, used: bytearray) -> str | None:
    """What is wrong with one structure node, or ``None``; marks a leaf node's record in ``used``."""
    if type(node) is not dict:
        return f"malformed structure node (a {type(node).__name__})"
    if "leaf" in node:
        i = node["leaf"]
        if set(node) != {"leaf"} or type(i) is not int or not 0 <= i < n_leaves:
            return f"leaf index {_show(i)} out of range"
        if used[i]:
            return f"leaf record {i} is used by two nodes"
        used[i] = 1
        return None
    kind, entries, children = node.get("kind"), node.get("entries"), node.get("children")
    if (
        not _NODE_KEYS <= set(node) <= _NODE_KEYS | {"meta"}
        or type(node["type"]) is not str
        or kind not in _KINDS
        or type(entries) is not list
        or type(children) is not list
        or len(entries) != len(children)
    ):
        return f"malformed structure node of type {_show(node.get('type'))}"
    for key in entries:
        if type(key) not in _KEYS:
            return f"the key {_show(key, quoted=True)} of type {type(key).__name__} is not a plain value"
    if kind in ("LIST", "TUPLE"):
        if any(type(k) is not int for k in entries) or entries != list(range(len(entries))):
            return f"a {kind.lower()} whose entries are not 0, 1, 2, ..."
    elif len(set(entries)) != len(entries):
        seen: set[Any] = set()
        for key in entries:
            if key in seen:
                return f"the key {_show(key, quoted=True)} is stored twice"
            seen.add(key)
    if kind == "NONE" and entries:
        return "None with children"
    if "meta" in node:
        meta = node["meta"]
        if (
            kind != "CUSTOM"
            or type(meta) is not dict
            or any(type(k) is not str or type(v) not in _KEYS for k, v in meta.items())
        ):
            return "malformed static configuration (must be a dict of str to plain values)"
    return None


def _check_payload(structure: Any, leaves: Any, tensors: Any, file: str) -> None:
    """Validates the structure and the leaf table, without recursion.

    Every leaf record is used by exactly one structure node and every tensor
    by exactly one leaf record, so restoring the tree copies each stored
    byte once. A message names the node's path, with control characters
    escaped.

    Raises:
      CheckpointCorruptError: the first thing found wrong.
    """
    if type(leaves) is not list or type(tensors) is not list:
        raise _corrupt(file, "the leaf table is malformed")
    used_tensors = bytearray(len(tensors))
    for leaf in leaves:
        _check_leaf(leaf, tensors, used_tensors, file)
    if not all(used_tensors):
        raise _corrupt(file, f"tensor {used_tensors.index(0)} belongs to no leaf")
    used_leaves = bytearray(len(leaves))
    # Each entry: (node, its parent's index in ``seen``, the step from the parent).
    # A path is spelt out only for a message, so that a long key is not copied
    # into the path of every node below it.
    seen: list[tuple[Any, int, str]] = []
    stack: list[tuple[Any, int, str]] = [(structure, -1, "")]
    while stack:
        node, parent, step = stack.pop()
        seen.append((node, parent, step))
        problem = _node_problem(node, len(leaves), used_leaves)
        if problem is not None:
            steps = []
            at = len(seen) - 1
            while at >= 0:
                steps.append(seen[at][2])
                at = seen[at][1]
            where = "".join(reversed(steps)) or " root"
            raise _corrupt(file, f"checkpoint{where}: {problem}")
        if "leaf" not in node:
            me = len(seen) - 1
            children = node["children"]
            stack.extend((children[i], me, _step(node, i)) for i in reversed(range(len(children))))
    if not all(used_leaves):
        raise _corrupt(file, f"leaf record {used_leaves.index(0)} belongs to no node")
