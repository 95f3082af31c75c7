"""The checkpoint file's integrity: its format marker, errors, checksum and structural checks.

Shared by the writer (:mod:`functional_fp16.checkpoint.save_load`), the reader
(:mod:`functional_fp16.checkpoint._read`) and the reader of format version 1
(:mod:`functional_fp16.checkpoint._v1`); package-public, not part of the API.
A file whose checksum matches may still be forged (whoever can write the file
can compute it), so what a file holds is checked in three steps, each bounded
by the file's size and none recursive:

1. :func:`functional_fp16.checkpoint.archive.check_archive`, before
   ``torch.load``: the zip container and the opcodes of its pickle.
2. :func:`check_objects`, on what ``torch.load(weights_only=True)`` returns:
   a tree (no container or tensor reached twice, so no shared or cyclic
   nodes) of dicts, lists, plain values and tensors, nested at most
   :data:`MAX_CONTAINER_DEPTH` deep, with no more objects than the pickle
   has bytes, and no more text than :func:`text_budget` allows for the
   pickle's size, counting a string at every reference to it (a pickle
   stores a string once and refers to it in a few bytes, but the checksum's
   ``repr`` writes it out at each reference); tensors only in the tensor
   table, each a plain dense CPU tensor that owns exactly its bytes
   (contiguous, offset 0, a storage of ``numel * itemsize`` bytes that no
   other tensor shares), so that restoring it copies what the file holds and
   nothing more.
3. :func:`check_payload`, on the format's tables: every structure node well
   formed, dict keys unique, each leaf record used by exactly one node and
   each tensor by exactly one leaf record, records that agree with their
   tensors, and no stored device ``meta``.

It also holds how a tree's structure is written as plain data
(:func:`one_level`, :func:`node_kind`, :func:`plain_meta`), which the writer
and the reader share.
"""

from __future__ import annotations

import collections
import hashlib
import math
from typing import Any

import optree
import torch

from functional_fp16._util.tree import NAMESPACE, child_steps

FORMAT = "functional_fp16.checkpoint"
"""The value of the file's ``"format"`` entry."""

VERSION = 2
"""The format version :func:`functional_fp16.checkpoint.save_load.save_checkpoint` writes."""

VALUES = (bool, int, float, str)
"""The types of a value leaf."""
KEYS = VALUES + (type(None),)
"""The types of a dict key, and of a loss scale's static configuration."""

MAX_DEPTH = 100
"""How deeply a stored tree may nest, in levels of nodes below the root."""

MAX_CONTAINER_DEPTH = 2 * MAX_DEPTH + 3
"""How deeply the dicts and lists of a file may nest (two per tree level, and the tables)."""

_KINDS = ("NONE", "DICT", "LIST", "TUPLE", "NAMEDTUPLE", "CUSTOM")
_NODE_KEYS = {"type", "kind", "entries", "children"}
_VALUE_LEAF_KEYS = {"path", "value"}
_TENSOR_LEAF_KEYS = {"path", "tensor", "dtype", "shape", "device"}
_SHOWN_CHARS = 120
SHOWN_PATH_CHARS = 400
"""How much of a stored leaf path an error message shows."""
TEXT_PER_PICKLE_BYTE = 16
"""Characters of ``repr`` a byte of pickle may stand for (see :func:`check_objects`)."""
TEXT_ALLOWANCE = 1 << 20
"""Characters of ``repr`` any pickle may stand for, whatever its size."""


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


def checksum(header: tuple, tensors: list[torch.Tensor]) -> str:
    """SHA-256 over ``repr(header)`` and each tensor's dtype, shape and bytes."""
    h = hashlib.sha256()
    h.update(repr(header).encode("utf-8"))
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def corrupt(path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: {what}")


def show(x: Any, limit: int = _SHOWN_CHARS, quoted: bool = False) -> str:
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


# -- the structure, as plain data --------------------------------------------------


def one_level(tree: Any) -> tuple[list[Any], Any, list[Any], list[str]]:
    """``(children, metadata, entries, paths)`` of one optree node.

    NamedTuples are keyed by field name; ``paths`` are the children's steps as
    :func:`~functional_fp16._util.tree.tree_paths` writes them (``['k']``, ``[0]``, ``.name``).
    """
    out = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    entries = list(type(tree)._fields) if optree.is_namedtuple(tree) else list(out.entries)
    return list(out.children), out.metadata, entries, child_steps(tree)


def node_kind(tree: Any) -> str:
    """How a plain load rebuilds the node: NONE, DICT, LIST, TUPLE, NAMEDTUPLE or CUSTOM."""
    if optree.is_namedtuple(tree):
        return "NAMEDTUPLE"
    if tree is None:
        return "NONE"
    for kind, types in (("DICT", dict), ("LIST", (list, collections.deque)), ("TUPLE", tuple)):
        if isinstance(tree, types):
            return kind
    return "CUSTOM"


def plain_meta(tree: Any, meta: Any) -> Any:
    """A custom node's metadata as plain data (a NamedTuple by field), or ``None`` if it is not."""
    if node_kind(tree) != "CUSTOM":
        return None
    if optree.is_namedtuple(meta) and all(type(v) in KEYS for v in meta):
        return dict(meta._asdict())
    return None


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
        raise corrupt(file, f"holds a {what}; a checkpoint holds plain dense tensors only")
    storage = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    if not t.is_contiguous() or t.storage_offset() != 0 or storage.nbytes() != nbytes:
        raise corrupt(
            file,
            f"holds a tensor of shape {show(list(t.shape))} and strides {show(list(t.stride()))} "
            f"at offset {t.storage_offset()} of a {storage.nbytes()}-byte storage; each stored "
            f"tensor must own exactly its {nbytes} bytes (contiguous, offset 0, nothing more)",
        )
    if nbytes:
        if storage.data_ptr() in storages:
            raise corrupt(file, "two stored tensors share one storage; each must own its bytes")
        storages.add(storage.data_ptr())


def text_budget(pickle_bytes: int) -> int:
    """How much text a pickle of ``pickle_bytes`` may stand for: see :func:`check_objects`."""
    return TEXT_PER_PICKLE_BYTE * pickle_bytes + TEXT_ALLOWANCE


def text_cost(x: Any) -> int:
    """A bound on what ``repr`` writes for a plain value, with a separator (UTF-8 bytes)."""
    kind = type(x)
    if kind is str:
        if x.isascii():  # an escape (\n, \x1b) takes up to 4 characters
            return (1 if x.isprintable() else 4) * len(x) + 4
        return (4 if x.isprintable() else 10) * len(x) + 4  # UTF-8, or \U0001f600
    if kind is int:
        return x.bit_length() // 3 + 4  # decimal digits and a sign
    return 26  # a float, a bool, None


def check_objects(payload: Any, pickle_bytes: int, file: str) -> None:
    """Checks, without recursion, that ``payload`` is a bounded tree of plain data and tensors.

    Walks the objects with an explicit stack and a set of the containers and
    tensors seen: one reached twice (a shared node, or a cycle) is refused at
    its second visit, so the walk visits each container once, and there can
    be no more objects than the pickle has bytes (every object, and every
    reference to one, costs the pickle at least a byte).

    Strings and numbers, on the other hand, may be shared: the pickle stores
    one once and refers to it again in a few bytes, but ``repr`` (which the
    checksum takes of the whole header) writes it out at every reference. So
    each visit of a plain value or a dict key is charged what ``repr`` writes
    for it, and the total may not pass :func:`text_budget` of the pickle's
    size: :data:`TEXT_PER_PICKLE_BYTE` characters per byte, plus
    :data:`TEXT_ALLOWANCE`. This is checked before the checksum (or anything
    else) writes any text out. :func:`functional_fp16.checkpoint.save_load.save_checkpoint`
    stores long strings once per reference, so the files it writes stay well
    inside it.

    Tensors may be only items of the tensor table ``payload["tensors"]``,
    which no ``repr`` writes out.

    Raises:
      CheckpointCorruptError: anything else, naming what it found.
    """
    budget = text_budget(pickle_bytes)
    table = payload.get("tensors") if type(payload) is dict else None
    seen: set[int] = set()  # the containers and tensors visited
    storages: set[int] = set()
    # (object, its depth, whether its parent is the tensor table)
    stack: list[tuple[Any, int, bool]] = [(payload, 1, False)]
    count = text = 0
    while stack:
        x, depth, in_table = stack.pop()
        count += 1
        if count > pickle_bytes:
            raise corrupt(file, f"holds more objects than its {pickle_bytes}-byte pickle can hold")
        kind = type(x)
        if kind in KEYS:
            text += text_cost(x)
        elif kind is dict or kind is list:
            if id(x) in seen:
                raise corrupt(
                    file,
                    "the stored structure is not a tree: a node is reached twice "
                    "(shared by two parents, or part of a cycle)",
                )
            seen.add(id(x))
            if depth > MAX_CONTAINER_DEPTH:
                raise corrupt(
                    file,
                    f"the stored structure nests deeper than {MAX_DEPTH} levels, "
                    "more than save_checkpoint writes",
                )
            text += 4  # brackets, and a separator
            if kind is list:
                stack.extend((item, depth + 1, x is table) for item in x)
            else:
                for key, value in x.items():
                    if type(key) not in KEYS:
                        raise corrupt(file, f"holds a dict key of type {type(key).__name__}")
                    text += text_cost(key)
                    stack.append((value, depth + 1, False))
        elif isinstance(x, torch.Tensor):
            if id(x) in seen:
                raise corrupt(file, "two stored tensors share one storage; each must own its bytes")
            seen.add(id(x))
            if not in_table:  # where a repr of the header would write it out
                raise corrupt(
                    file,
                    "holds a tensor outside its tensor table, where save_checkpoint never puts one",
                )
            _check_tensor(x, storages, file)
        else:
            raise corrupt(
                file, f"holds a {show(kind.__name__)}, which save_checkpoint never writes"
            )
        if text > budget:
            raise corrupt(
                file,
                f"its {pickle_bytes}-byte pickle stands for more than {budget} characters of "
                "text, counting each reference to a shared string or number; save_checkpoint "
                "never writes that",
            )


# -- 3. the format's tables ------------------------------------------------------------


def _step(node: dict, i: int) -> str:
    """The path step to a node's child ``i``, as :func:`~functional_fp16._util.tree.tree_paths` writes it."""
    key = node["entries"][i]
    if node["kind"] in ("LIST", "TUPLE"):
        return f"[{i}]"
    if node["kind"] in ("NAMEDTUPLE", "CUSTOM") and type(key) is str:
        return f".{show(key)}"
    return f"[{show(key, quoted=True)}]"


def _check_leaf(leaf: Any, tensors: list, used: bytearray, file: str) -> None:
    """One leaf record; ``used`` marks the tensors already claimed by a record."""
    if type(leaf) is not dict or type(leaf.get("path")) is not str:
        raise corrupt(file, "a leaf record is malformed (not a dict with a str path)")
    shown = show(leaf["path"], SHOWN_PATH_CHARS)
    if set(leaf) == _VALUE_LEAF_KEYS:
        if type(leaf["value"]) not in VALUES:
            raise corrupt(file, f"leaf {shown}: malformed value record")
        return
    if set(leaf) != _TENSOR_LEAF_KEYS:
        raise corrupt(file, f"leaf {shown}: malformed record")
    i = leaf["tensor"]
    if type(i) is not int or not 0 <= i < len(tensors):
        raise corrupt(file, f"leaf {shown}: tensor index {show(i)} out of range")
    if used[i]:
        raise corrupt(file, f"leaf {shown}: tensor {i} belongs to two leaves")
    used[i] = 1
    t, shape = tensors[i], leaf["shape"]
    if (
        not isinstance(t, torch.Tensor)
        or leaf["dtype"] != str(t.dtype)
        or type(shape) is not list
        or any(type(n) is not int for n in shape)
        or shape != list(t.shape)
    ):
        raise corrupt(file, f"leaf {shown}: the tensor disagrees with its record")
    device = leaf["device"]
    if type(device) is not str:
        raise corrupt(file, f"leaf {shown}: device {show(device)} is not a device name")
    try:
        meta = torch.device(device).type == "meta"
    except (RuntimeError, ValueError, TypeError):
        meta = False  # checked where it is used: map_location= or like= may override it
    if meta:
        raise corrupt(file, f"leaf {shown}: stored on device 'meta', which holds no data")


def _node_problem(node: Any, n_leaves: int, used: bytearray) -> str | None:
    """What is wrong with one structure node, or ``None``; marks a leaf node's record in ``used``."""
    if type(node) is not dict:
        return f"malformed structure node (a {type(node).__name__})"
    if "leaf" in node:
        i = node["leaf"]
        if set(node) != {"leaf"} or type(i) is not int or not 0 <= i < n_leaves:
            return f"leaf index {show(i)} out of range"
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
        return f"malformed structure node of type {show(node.get('type'))}"
    for key in entries:
        if type(key) not in KEYS:
            return f"the key {show(key, quoted=True)} of type {type(key).__name__} is not a plain value"
    if kind in ("LIST", "TUPLE"):
        if any(type(k) is not int for k in entries) or entries != list(range(len(entries))):
            return f"a {kind.lower()} whose entries are not 0, 1, 2, ..."
    elif len(set(entries)) != len(entries):
        seen: set[Any] = set()
        for key in entries:
            if key in seen:
                return f"the key {show(key, quoted=True)} is stored twice"
            seen.add(key)
    if kind == "NONE" and entries:
        return "None with children"
    if "meta" in node:
        meta = node["meta"]
        if (
            kind != "CUSTOM"
            or type(meta) is not dict
            or any(type(k) is not str or type(v) not in KEYS for k, v in meta.items())
        ):
            return "malformed static configuration (must be a dict of str to plain values)"
    return None


def _codes_problem(node: Any, leaves: list) -> str | None:
    """What is wrong with the sizes of a stored ``BlockCodes`` (8-bit moments), or ``None``.

    Its uint8 codes of shape ``S`` need float32 scales of shape ``(S[0], k)`` (``(k,)``
    for a vector) with ``k = ceil(row / B)`` for some power of two ``B``, ``row`` the
    elements of a row (see :mod:`functional_fp16.precision.moment_storage`).
    """
    if type(node) is not dict or node.get("type") != "BlockCodes" or "leaf" in node:
        return None
    children = node.get("children")
    if node.get("entries") != ["codes", "scales"] or type(children) is not list:
        return "block codes stored without exactly their codes and scales"
    records = []
    for child in children:
        i = child.get("leaf") if type(child) is dict else None
        if type(i) is not int or not 0 <= i < len(leaves) or "shape" not in leaves[i]:
            return "block codes whose codes or scales are not tensors"
        records.append(leaves[i])
    codes, scales = records
    shape, got = list(codes["shape"]), list(scales["shape"])
    if codes["dtype"] != "torch.uint8" or scales["dtype"] != "torch.float32":
        return f"block codes of dtypes {show(codes['dtype'])} and {show(scales['dtype'])}"
    if not all(type(d) is int and d >= 0 for d in [*shape, *got]):
        return "block codes of malformed shapes"
    lead = shape[:1] if len(shape) >= 2 else []
    row = math.prod(shape[1:]) if len(shape) >= 2 else math.prod(shape)
    fits = len(got) == len(lead) + 1 and got[:-1] == lead
    if fits:
        k = got[-1]
        block = 1 << max(0, (-(-row // k) - 1).bit_length()) if k else 0
        fits = (k == 0) if row == 0 else (k >= 1 and -(-row // block) == k)
    if not fits:
        return (
            f"block scales of shape {show(got)} do not fit codes of shape {show(shape)} "
            "(one scale per block of a power-of-two size along each row)"
        )
    return None


def check_payload(structure: Any, leaves: Any, tensors: Any, file: str) -> None:
    """Validates the structure and the leaf table, without recursion.

    Every leaf record is used by exactly one structure node and every tensor
    by exactly one leaf record, so restoring the tree copies each stored
    byte once. A message names the node's path, with control characters
    escaped.

    Raises:
      CheckpointCorruptError: the first thing found wrong.
    """
    if type(leaves) is not list or type(tensors) is not list:
        raise corrupt(file, "the leaf table is malformed")
    used_tensors = bytearray(len(tensors))
    for leaf in leaves:
        _check_leaf(leaf, tensors, used_tensors, file)
    if not all(used_tensors):
        raise corrupt(file, f"tensor {used_tensors.index(0)} belongs to no leaf")
    used_leaves = bytearray(len(leaves))
    # Each entry: (node, its parent's index in ``seen``, the step from the parent).
    # A path is spelt out only for a message, so that a long key is not copied
    # into the path of every node below it.
    seen: list[tuple[Any, int, str]] = []
    stack: list[tuple[Any, int, str]] = [(structure, -1, "")]
    while stack:
        node, parent, step = stack.pop()
        seen.append((node, parent, step))
        problem = _node_problem(node, len(leaves), used_leaves) or _codes_problem(node, leaves)
        if problem is not None:
            steps = []
            at = len(seen) - 1
            while at >= 0:
                steps.append(seen[at][2])
                at = seen[at][1]
            where = "".join(reversed(steps)) or " root"
            raise corrupt(file, f"checkpoint{where}: {problem}")
        if "leaf" not in node:
            me = len(seen) - 1
            children = node["children"]
            stack.extend((children[i], me, _step(node, i)) for i in reversed(range(len(children))))
    if not all(used_leaves):
        raise corrupt(file, f"leaf record {used_leaves.index(0)} belongs to no node")
