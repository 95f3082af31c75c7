"""Reading a checkpoint: the checks of a file, then the tree, with or without a template.

:func:`read` opens the file once and checks it in the order that
:mod:`functional_fp16.checkpoint.save_load` describes, before anything large is
allocated or walked; :class:`Reader` then rebuilds the tree from the
checked tables. :func:`functional_fp16.checkpoint.save_load.load_checkpoint` is the
public entry point; this module is package-private.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import optree
import torch

from functional_fp16._util.tree import NAMESPACE, PyTree, describe_tensor
from functional_fp16.checkpoint.archive import check_archive
from functional_fp16.checkpoint.format import (
    FORMAT,
    SHOWN_PATH_CHARS,
    VALUES,
    VERSION,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    check_objects,
    check_payload,
    checksum,
    corrupt,
    one_level,
    plain_meta,
    show,
)
from functional_fp16.update.state import (
    ADDED_FIELDS,
    FP16State,
    added_field_value,
    old_checkpoint_note,
)


def _unreadable(name: str, err: BaseException) -> CheckpointCorruptError:
    return corrupt(
        name,
        "not a readable checkpoint (truncated, corrupted, or not written by "
        f"save_checkpoint): {type(err).__name__}: {show(str(err))}",
    )


def read(path: Any, name: str) -> dict[str, Any]:
    """Opens, bounds, version-checks and checksum-verifies a file; v1 files come back converted.

    The file is opened once, and that one handle is checked
    (:func:`~functional_fp16.checkpoint.archive.check_archive`) and then
    given to ``torch.load``: a file renamed over ``path`` meanwhile is not
    read. Everything that could make a later step allocate or walk without
    bound is checked first: the zip container and the pickle's opcodes before
    ``torch.load``, then the objects it returned, without recursion, before
    the checksum writes them out (see :mod:`functional_fp16.checkpoint.format`).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      CheckpointCorruptError: see :func:`~functional_fp16.checkpoint.save_load.load_checkpoint`.
    """
    opened = isinstance(path, (str, bytes, os.PathLike))
    try:
        f = open(path, "rb") if opened else path  # noqa: SIM115 - closed below
    except FileNotFoundError:
        raise
    except OSError as err:
        raise _unreadable(name, err) from None
    try:
        pickle_bytes = check_archive(f, name)
        try:
            payload = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # zip, pickle and weights-only errors alike
            raise _unreadable(name, err) from None
    finally:
        if opened:
            f.close()
    marker = payload.get("format") if type(payload) is dict else None  # one lookup
    if type(marker) is not str or marker != FORMAT:
        raise corrupt(name, "not a functional_fp16 checkpoint (no format marker)")
    check_objects(payload, pickle_bytes, name)
    version = payload.get("version")
    if version == 1 and type(version) is int:
        from functional_fp16.checkpoint import _v1

        return _v1.convert(payload, name)
    if version != VERSION or type(version) is not int:
        raise corrupt(
            name,
            f"checkpoint format version {show(version)} is not supported "
            f"(this library reads versions 1 and {VERSION})",
        )
    missing = [k for k in ("structure", "leaves", "tensors", "checksum") if k not in payload]
    if missing:
        raise corrupt(name, f"checkpoint lacks the entries {missing}")
    if type(payload["tensors"]) is not list:
        raise corrupt(name, "the tensor table is malformed")
    try:
        header = (FORMAT, VERSION, payload["structure"], payload["leaves"])
        expected = checksum(header, payload["tensors"])
    except Exception as err:
        raise corrupt(name, f"cannot checksum the contents: {show(str(err))}") from None
    if expected != payload["checksum"]:
        raise corrupt(
            name,
            "checksum mismatch, the file was modified or damaged after it was written "
            f"(stored {show(payload['checksum'], 16)}, computed {expected[:16]}...)",
        )
    check_payload(payload["structure"], payload["leaves"], payload["tensors"], name)
    return payload


def device_types() -> set[str]:
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


class Reader:
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
            usable = device.type in device_types()
        except (RuntimeError, ValueError, TypeError):
            usable = False
        if not usable:
            raise CheckpointError(
                f"{self.file}: checkpoint{show(leaf['path'], SHOWN_PATH_CHARS)} was saved on "
                f"{show(leaf['device'])}, a device this torch build does not have; pass "
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
                f"{self.file}: checkpoint{show(leaf['path'], SHOWN_PATH_CHARS)} was saved on "
                f"{show(leaf['device'])} and cannot be placed on {device} "
                f"({show(str(err))}); pass map_location= or a like= on an available device"
            ) from None

    def what(self, node: dict) -> str:
        if "leaf" not in node:
            return f"a {show(node['type'])}"
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
        children, meta, entries, steps = one_level(like)
        stored_children = node["children"]
        filled: list[Any] = []
        added = _fields_missing(like, node["entries"], entries)
        if added:
            # Written before these fields of FP16State existed: they start afresh.
            warnings.warn(old_checkpoint_note(str(self.file), added), stacklevel=5)
            for field, child in zip(added, children[-len(added) :]):
                leaves = optree.tree_leaves(child, namespace=NAMESPACE)
                filled += [added_field_value(field, x) for x in leaves]
            n = len(entries) - len(added)
            children, entries, steps = children[:n], entries[:n], steps[:n]
        if isinstance(like, dict):  # keys in any order
            by_key = dict(zip(node["entries"], stored_children, strict=True))
            missing = [k for k in entries if k not in by_key]
            extra = [k for k in by_key if k not in entries]
            if missing or extra:
                raise self.mismatch(
                    path,
                    f"keys missing from the checkpoint {show(missing)}, "
                    f"unexpected keys {show(extra)}",
                )
            stored_children = [by_key[k] for k in entries]
        elif node["entries"] != entries:
            if len(node["entries"]) != len(entries):
                raise self.mismatch(path, f"length {len(node['entries'])} != {len(entries)}")
            raise self.mismatch(path, f"fields {show(node['entries'])} != {show(list(entries))}")
        stored, wanted = node.get("meta"), plain_meta(like, meta)
        if stored != wanted:
            for name in sorted(set(stored or {}) | set(wanted or {})):
                a, b = (stored or {}).get(name), (wanted or {}).get(name)
                if a != b or type(a) is not type(b):
                    raise self.mismatch(
                        f"{path}.{show(name)}",
                        f"static configuration {show(name)}={show(a)} in the checkpoint, "
                        f"{show(name)}={show(b)} in like",
                    )
        for stored, child, step in zip(stored_children, children, steps, strict=True):
            self.leaves_like(stored, child, path + step, out)
        out.extend(filled)

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
        if type(like) not in VALUES:
            raise TypeError(f"like{path}: cannot be a checkpoint template: {describe_tensor(like)}")
        leaf = self.leaves[node["leaf"]] if "leaf" in node else {}
        if "value" not in leaf or type(leaf["value"]) is not type(like):
            got = f"{self.what(node)} {show(leaf['value'])}" if "value" in leaf else self.what(node)
            raise self.mismatch(
                path, f"expected a {type(like).__name__}, the checkpoint holds {got}"
            )
        out.append(leaf["value"])


def _fields_missing(like: Any, stored: list, entries) -> list[str]:
    """The fields of :data:`~functional_fp16.update.state.ADDED_FIELDS` that the checkpoint's
    node lacks, where ``like`` is an ``FP16State`` and the node the same one without its last
    fields (a checkpoint written before they existed); else ``[]``."""
    entries = list(entries)
    if not isinstance(like, FP16State) or list(stored) == entries:
        return []
    added = list(ADDED_FIELDS)
    for n in range(1, len(added) + 1):
        if entries[-n:] == added[-n:] and list(stored) == entries[:-n]:
            return entries[-n:]
    return []


def load(path: Any, like: PyTree | None, map_location: Any) -> PyTree:
    """:func:`functional_fp16.checkpoint.save_load.load_checkpoint`, which documents it."""
    # The file's name as messages show it: control characters escaped.
    name = show(os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path), 4096)
    if map_location is not None:
        try:
            map_location = torch.device(map_location)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"map_location={map_location!r} is not a device: {err}") from None
    payload = read(path, name)
    reader = Reader(name, payload, map_location)
    if like is None:
        return reader.plain(payload["structure"])
    leaves: list[Any] = []
    reader.leaves_like(payload["structure"], like, "", leaves)
    return optree.tree_unflatten(optree.tree_structure(like, namespace=NAMESPACE), leaves)
