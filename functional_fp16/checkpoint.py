"""Checkpoints: a pytree's leaves and structure, in one atomic, self-checking file.

``save_checkpoint(path, tree)`` stores any pytree the library can flatten (an
:class:`~functional_fp16.FP16State`, or dicts, lists, tuples and NamedTuples
holding states, loss scales, tensors, numbers, strings and ``None``).
``load_checkpoint(path, like)`` reads it back, checks it against the template
``like`` and rebuilds it with ``optree.tree_unflatten(tree_structure(like),
leaves)``: the registered node types rebuild themselves, and static
configuration that is not data (an ``FP16State``'s ``tx``) comes from ``like``.

File format (version 2): one ``torch.save`` of a dict made only of tensors,
numbers, strings, lists and dicts, so ``torch.load(path, weights_only=True)``
opens it without running pickled code::

    {
      "format": "functional_fp16.checkpoint",
      "version": 2,
      "structure": NODE,              # the tree's optree structure, see below
      "leaves": [LEAF, ...],          # one per optree leaf (dicts in insertion order)
      "tensors": [Tensor, ...],       # the tensor leaves' data: on CPU, compact
      "checksum": "<sha256 hex>",     # over everything above, tensor bytes included
    }

A ``LEAF`` is ``{"path": "['state'].master['w']", "tensor": i, "dtype":
"torch.float32", "shape": [3, 4], "device": "cuda:0"}`` or ``{"path": ...,
"value": v}`` with ``v`` a bool, int, float or str. A ``NODE`` is ``{"leaf":
i}`` or ``{"type": "FP16State", "kind": "CUSTOM", "entries": [...],
"children": [NODE, ...]}``: the class name, optree's node kind, the child
keys (dict keys, field names or indices), and, for a registered node whose
static metadata is plain data (a loss scale's configuration), ``"meta"``.

Tensors are stored bitwise and come back detached, each with storage of its
own, whatever the pickled tensor records say about autograd or sharing. The
checksum covers the format, version, structure, leaf table, and every
tensor's dtype, shape and bytes: everything a load restores.

Writes are atomic (:mod:`functional_fp16.atomic_file`). A tree nests at most
:data:`MAX_DEPTH` levels deep.

Loading checks, in order, and never walks anything recursively before its
size and depth are known to be bounded by the file's size:

1. the zip container, before ``torch.load`` reads it: records stored
   uncompressed, adding up to no more than the file;
2. the file opens with ``weights_only=True`` (else it is truncated or not
   ours);
3. what it holds is a tree (no shared or cyclic nodes) of dicts, lists,
   plain values and tensors, no deeper than a saved tree can be; each tensor
   dense, on CPU, owning exactly its bytes, shared with no other;
4. the format marker and version, the checksum;
5. the tables: well-formed nodes, unique keys, each leaf record and each
   tensor used once, records that agree with their tensors, no stored device
   ``meta``;
6. with ``like``: the structure, class names, keys, static configuration,
   tensor shapes and dtypes and value types.

The checksum finds damage; it proves nothing about who wrote the file, since
anyone who can write the file can compute it. That is why steps 1, 3 and 5
hold for files whose checksum is right. Each failure is a
:class:`CheckpointError` that names the file and the path, with control
characters escaped. A stored device is used only if neither ``like`` nor
``map_location`` gives one, and only if this torch build has it. Files of
format version 1 load through :mod:`functional_fp16._checkpoint_v1`.
"""

from __future__ import annotations

import collections
import os
from typing import Any

import optree
import torch

from functional_fp16._checkpoint_format import (
    _KEYS,
    _SHOWN_PATH_CHARS,
    _VALUES,
    FORMAT,
    MAX_DEPTH,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    _check_archive,
    _check_objects,
    _check_payload,
    _checksum,
    _corrupt,
    _show,
)
from functional_fp16._tree import NAMESPACE, PyTree, child_steps, describe_tensor
from functional_fp16.atomic_file import PathLike, atomic_torch_save, remove_stale_temporaries
from functional_fp16.update import FP16State

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "atomic_torch_save",
    "remove_stale_temporaries",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "FORMAT",
    "VERSION",
    "MAX_DEPTH",
]

VERSION = 2
"""The format version written by :func:`save_checkpoint`."""


# -- the structure, as plain data -------------------------------------------------


def _one_level(tree: Any) -> tuple[list[Any], Any, list[Any], list[str]]:
    """``(children, metadata, entries, paths)`` of one optree node.

    NamedTuples are keyed by field name; ``paths`` are the children's steps as
    :func:`~functional_fp16._tree.tree_paths` writes them (``['k']``, ``[0]``, ``.name``).
    """
    out = optree.tree_flatten_one_level(tree, namespace=NAMESPACE)
    entries = list(type(tree)._fields) if optree.is_namedtuple(tree) else list(out.entries)
    return list(out.children), out.metadata, entries, child_steps(tree)


def _kind(tree: Any) -> str:
    """How a plain load rebuilds the node: NONE, DICT, LIST, TUPLE, NAMEDTUPLE or CUSTOM."""
    if optree.is_namedtuple(tree):
        return "NAMEDTUPLE"
    if tree is None:
        return "NONE"
    for kind, types in (("DICT", dict), ("LIST", (list, collections.deque)), ("TUPLE", tuple)):
        if isinstance(tree, types):
            return kind
    return "CUSTOM"


def _plain_meta(tree: Any, meta: Any) -> Any:
    """A custom node's metadata as plain data (a NamedTuple by field), or ``None`` if it is not."""
    if _kind(tree) != "CUSTOM":
        return None
    if optree.is_namedtuple(meta) and all(type(v) in _KEYS for v in meta):
        return dict(meta._asdict())
    return None


# -- saving ---------------------------------------------------------------------


class _Writer:
    def __init__(self) -> None:
        self.leaves: list[dict[str, Any]] = []
        self.tensors: list[torch.Tensor] = []
        self.storages: set[int] = set()

    def leaf(self, x: Any, path: str) -> dict[str, Any]:
        shown = path or "<root>"
        if type(x) in _VALUES:
            self.leaves.append({"path": shown, "value": x})
        elif isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_meta or x.is_quantized:
                raise TypeError(f"tree{path}: cannot store {describe_tensor(x)} ({x.layout})")
            data = x.detach().resolve_conj().resolve_neg().to("cpu")
            compact = (
                data.is_contiguous()
                and data.storage_offset() == 0
                and data.untyped_storage().nbytes() == data.numel() * data.element_size()
            )
            if not compact or data.untyped_storage().data_ptr() in self.storages:
                # A view would drag its whole storage into the file; a storage
                # shared by two leaves is stored twice, as two values.
                data = data.clone(memory_format=torch.contiguous_format)
            self.storages.add(data.untyped_storage().data_ptr())
            self.leaves.append(
                {
                    "path": shown,
                    "tensor": len(self.tensors),
                    "dtype": str(data.dtype),
                    "shape": list(data.shape),
                    "device": str(x.device),
                }
            )
            self.tensors.append(data)
        else:
            raise TypeError(
                f"tree{path}: cannot store {describe_tensor(x)}; a checkpoint holds pytrees "
                "(dicts, lists, tuples, NamedTuples, the library's states) of tensors, "
                "bool, int, float, str and None"
            )
        return {"leaf": len(self.leaves) - 1}

    def node(self, tree: Any, path: str, depth: int = 0) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise ValueError(
                f"tree{path}: nested deeper than {MAX_DEPTH} levels, more than a checkpoint holds"
            )
        if optree.tree_is_leaf(tree, namespace=NAMESPACE):
            return self.leaf(tree, path)
        if isinstance(tree, FP16State) and tree.shard is not None:
            raise TypeError(
                f"tree{path} is shard {tree.shard.rank} of {tree.shard.world_size} of a sharded "
                "state: save it with functional_fp16.distributed.save_checkpoint_rank0, called "
                "on every rank, which gathers the full state and writes one file"
            )
        children, meta, entries, steps = _one_level(tree)
        if isinstance(tree, dict):
            for key in entries:
                if type(key) not in _KEYS:
                    raise TypeError(
                        f"tree{path}: dict key {key!r} of type {type(key).__name__} cannot be "
                        "stored; use str, int, float, bool or None keys"
                    )
            # Stored in insertion order, so a plain load gives the dict back as it was.
            order = [entries.index(k) for k in tree]
            children, entries, steps = ([xs[i] for i in order] for xs in (children, entries, steps))
        node = {"type": type(tree).__name__, "kind": _kind(tree), "entries": entries}
        plain = _plain_meta(tree, meta)
        if plain is not None:
            node["meta"] = plain
        node["children"] = [
            self.node(child, path + step, depth + 1)
            for child, step in zip(children, steps, strict=True)
        ]
        return node


def save_checkpoint(path: PathLike, tree: PyTree) -> None:
    """Writes ``tree`` to ``path`` atomically, in the documented plain format.

    Args:
      path: the file to write; its directory must exist. An existing file is
        replaced only once the new one is completely on disk.
      tree: an :class:`~functional_fp16.FP16State`, or any pytree (dicts with
        str, int, float, bool or None keys, lists, tuples, NamedTuples, the
        library's states and loss scales) of tensors, bool, int, float, str
        and None.

    Raises:
      TypeError: a part of ``tree`` cannot be stored; the message names its path.
      ValueError: ``tree`` nests deeper than :data:`MAX_DEPTH` levels.
    """
    writer = _Writer()
    structure = writer.node(tree, "")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "structure": structure,
        "leaves": writer.leaves,
        "tensors": writer.tensors,
        "checksum": _checksum((FORMAT, VERSION, structure, writer.leaves), writer.tensors),
    }
    atomic_torch_save(path, payload)


# -- loading --------------------------------------------------------------------


def _unreadable(name: str, err: BaseException) -> CheckpointCorruptError:
    return _corrupt(
        name,
        "not a readable checkpoint (truncated, corrupted, or not written by "
        f"save_checkpoint): {type(err).__name__}: {_show(str(err))}",
    )


def _read(path: Any, name: str) -> dict[str, Any]:
    """Opens, bounds, version-checks and checksum-verifies a file; v1 files come back converted.

    Everything that could make a later step allocate or walk without bound
    is checked first: the zip container before ``torch.load``, then the
    objects it returned, without recursion (see
    :mod:`functional_fp16._checkpoint_format`).
    """
    pickle_bytes = _check_archive(path, name)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # zip, pickle and weights-only errors alike
        raise _unreadable(name, err) from None
    _check_objects(payload, pickle_bytes, name)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise _corrupt(name, "not a functional_fp16 checkpoint (no format marker)")
    version = payload.get("version")
    if version == 1 and type(version) is int:
        from functional_fp16 import _checkpoint_v1

        return _checkpoint_v1.convert(payload, name)
    if version != VERSION or type(version) is not int:
        raise _corrupt(
            name,
            f"checkpoint format version {_show(version)} is not supported "
            f"(this library reads versions 1 and {VERSION})",
        )
    missing = [k for k in ("structure", "leaves", "tensors", "checksum") if k not in payload]
    if missing:
        raise _corrupt(name, f"checkpoint lacks the entries {missing}")
    if type(payload["tensors"]) is not list:
        raise _corrupt(name, "the tensor table is malformed")
    try:
        header = (FORMAT, VERSION, payload["structure"], payload["leaves"])
        expected = _checksum(header, payload["tensors"])
    except Exception as err:
        raise _corrupt(name, f"cannot checksum the contents: {_show(str(err))}") from None
    if expected != payload["checksum"]:
        raise _corrupt(
            name,
            "checksum mismatch, the file was modified or damaged after it was written "
            f"(stored {_show(payload['checksum'], 16)}, computed {expected[:16]}...)",
        )
    _check_payload(payload["structure"], payload["leaves"], payload["tensors"], name)
    return payload


def _device_types() -> set[str]:
    """The device types this torch build has (whether or not one is present)."""
    types = {"cpu"}
    if torch.backends.cuda.is_built():
        types.add("cuda")
    if torch.backends.mps.is_built():
        types.add("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        types.add("xpu")
    try:  # a backend that registered itself renames the private-use device type
        private = torch._C._get_privateuse1_backend_name()
    except AttributeError:
        private = "privateuseone"
    if private != "privateuseone":
        types.add(private)
    return types


class _Reader:
    def __init__(self, name: str, payload: dict, map_location: torch.device | None) -> None:
        self.file = name
        self.leaves = payload["leaves"]
        self.tensors = payload["tensors"]
        self.map_location = map_location

    def mismatch(self, path: str, what: str) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"{self.file}: checkpoint{path} does not match like{path}: {what}"
        )

    def stored_device(self, leaf: dict) -> torch.device:
        """The device a leaf was saved from, if this torch build has it."""
        try:
            device = torch.device(leaf["device"])
            usable = device.type in _device_types()
        except (RuntimeError, ValueError, TypeError):
            usable = False
        if not usable:
            raise CheckpointError(
                f"{self.file}: checkpoint{_show(leaf['path'], _SHOWN_PATH_CHARS)} was saved on "
                f"{_show(leaf['device'])}, a device this torch build does not have; pass "
                "map_location= or a like= on an available device"
            )
        return device

    def restore(self, index: int, device: torch.device | None) -> Any:
        leaf = self.leaves[index]
        if "tensor" not in leaf:
            return leaf["value"]
        device = self.map_location or device or self.stored_device(leaf)
        try:
            # A detached copy with storage of its own: only the checksummed
            # bytes, dtype and shape of the file's tensor are used.
            return self.tensors[leaf["tensor"]].detach().to(device, copy=True)
        except (RuntimeError, AssertionError, TypeError, ImportError) as err:
            raise CheckpointError(
                f"{self.file}: checkpoint{_show(leaf['path'], _SHOWN_PATH_CHARS)} was saved on "
                f"{_show(leaf['device'])} and cannot be placed on {device} "
                f"({_show(str(err))}); pass map_location= or a like= on an available device"
            ) from None

    def what(self, node: dict) -> str:
        if "leaf" not in node:
            return f"a {_show(node['type'])}"
        leaf = self.leaves[node["leaf"]]
        return "a tensor" if "tensor" in leaf else f"a {type(leaf['value']).__name__}"

    # Without a template: builtin containers; other nodes as dicts of their children.
    def plain(self, node: dict) -> Any:
        if "leaf" in node:
            return self.restore(node["leaf"], None)
        children = [self.plain(c) for c in node["children"]]
        kind = node["kind"]
        if kind == "NONE":
            return None
        if kind == "LIST":
            return children
        if kind == "TUPLE":
            return tuple(children)
        return dict(zip(node["entries"], children, strict=True))

    # With a template: the leaves in like's flattening order, after checking the structure.
    def leaves_like(self, node: dict, like: Any, path: str, out: list[Any]) -> None:
        if optree.tree_is_leaf(like, namespace=NAMESPACE):
            self.leaf_like(node, like, path, out)
            return
        if "leaf" in node or node["type"] != type(like).__name__:
            raise self.mismatch(
                path, f"expected a {type(like).__name__}, the checkpoint holds {self.what(node)}"
            )
        children, meta, entries, steps = _one_level(like)
        stored_children = node["children"]
        if isinstance(like, dict):  # keys in any order
            by_key = dict(zip(node["entries"], stored_children, strict=True))
            missing = [k for k in entries if k not in by_key]
            extra = [k for k in by_key if k not in entries]
            if missing or extra:
                raise self.mismatch(
                    path,
                    f"keys missing from the checkpoint {_show(missing)}, "
                    f"unexpected keys {_show(extra)}",
                )
            stored_children = [by_key[k] for k in entries]
        elif node["entries"] != entries:
            if len(node["entries"]) != len(entries):
                raise self.mismatch(path, f"length {len(node['entries'])} != {len(entries)}")
            raise self.mismatch(path, f"fields {_show(node['entries'])} != {_show(list(entries))}")
        stored, wanted = node.get("meta"), _plain_meta(like, meta)
        if stored != wanted:
            for name in sorted(set(stored or {}) | set(wanted or {})):
                a, b = (stored or {}).get(name), (wanted or {}).get(name)
                if a != b or type(a) is not type(b):
                    raise self.mismatch(
                        f"{path}.{_show(name)}",
                        f"static configuration {_show(name)}={_show(a)} in the checkpoint, "
                        f"{_show(name)}={_show(b)} in like",
                    )
        for stored, child, step in zip(stored_children, children, steps, strict=True):
            self.leaves_like(stored, child, path + step, out)

    def leaf_like(self, node: dict, like: Any, path: str, out: list[Any]) -> None:
        if isinstance(like, torch.Tensor):
            leaf = self.leaves[node["leaf"]] if "leaf" in node else {}
            if "tensor" not in leaf:
                raise self.mismatch(
                    path, f"expected a tensor, the checkpoint holds {self.what(node)}"
                )
            if leaf["dtype"] != str(like.dtype):
                raise self.mismatch(path, f"dtype {leaf['dtype']} != {like.dtype}")
            if leaf["shape"] != list(like.shape):
                raise self.mismatch(path, f"shape {tuple(leaf['shape'])} != {tuple(like.shape)}")
            out.append(self.restore(node["leaf"], like.device))
            return
        if type(like) not in _VALUES:
            raise TypeError(f"like{path}: cannot be a checkpoint template: {describe_tensor(like)}")
        leaf = self.leaves[node["leaf"]] if "leaf" in node else {}
        if "value" not in leaf or type(leaf["value"]) is not type(like):
            got = (
                f"{self.what(node)} {_show(leaf['value'])}" if "value" in leaf else self.what(node)
            )
            raise self.mismatch(
                path, f"expected a {type(like).__name__}, the checkpoint holds {got}"
            )
        out.append(leaf["value"])


def load_checkpoint(
    path: PathLike, like: PyTree | None = None, *, map_location: Any = None
) -> PyTree:
    """Reads a checkpoint written by :func:`save_checkpoint` and verifies it.

    The file is opened with ``torch.load(weights_only=True)`` and its checksum
    verified before anything is returned.

    With ``like`` (a template tree, e.g. a freshly ``fp16_init``-ed state, or the
    whole ``{"state": ..., "epoch": 0, ...}`` dict) the checkpoint must have the
    template's structure: class names, dict keys and fields, static
    configuration (a loss scale's), tensor shapes and dtypes, and value types.
    The result is ``optree.tree_unflatten(tree_structure(like), leaves)``: built
    in the template's types, every :class:`~functional_fp16.FP16State` with the
    template's ``tx``, each tensor on the device of the template's tensor at the
    same path.

    Without ``like`` the plain structure comes back: dicts, lists, tuples and
    ``None`` as themselves, and every other node (an ``FP16State``, a loss
    scale, a NamedTuple) as a dict of its children keyed by field; tensors on
    the device they were saved from.

    Args:
      path: the file (or an open binary file object).
      like: the template, or ``None``.
      map_location: if given, every tensor goes to this device instead.

    Returns:
      The stored tree. Every tensor is detached and owns its storage.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      CheckpointCorruptError: the file is truncated, modified after writing,
        forged (its checksum proves nothing: see the module's description of
        what is checked, before anything large is allocated or walked), or not
        a checkpoint of this library.
      CheckpointError: a tensor's stored device is to be used (no ``like``, no
        ``map_location``) and this torch build lacks it, or it cannot be placed.
      CheckpointMismatchError: the file differs from ``like``; the message names
        the path and what differs.
      TypeError: ``like`` holds something that cannot be a template (its path is named).
    """
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)
    if map_location is not None:
        try:
            map_location = torch.device(map_location)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"map_location={map_location!r} is not a device: {err}") from None
    payload = _read(path, name)
    reader = _Reader(name, payload, map_location)
    if like is None:
        return reader.plain(payload["structure"])
    leaves: list[Any] = []
    reader.leaves_like(payload["structure"], like, "", leaves)
    return optree.tree_unflatten(optree.tree_structure(like, namespace=NAMESPACE), leaves)
