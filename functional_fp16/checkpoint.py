"""Checkpoints: atomic, self-checking files of plain tensors and numbers.

``save_checkpoint(path, tree)`` stores an :class:`~functional_fp16.FP16State`,
or any tree (dicts, lists, tuples, NamedTuples) holding FP16 states, loss
scales, tensors, numbers, strings and ``None``. ``load_checkpoint(path, like)``
reads it back, checks it against the template ``like`` and rebuilds it in
``like``'s types.

File format (version 1): one ``torch.save`` of a dict made only of tensors,
numbers, strings, lists and dicts, so ``torch.load(path, weights_only=True)``
opens it without running any pickled code::

    {
      "format": "functional_fp16.checkpoint",
      "version": 1,
      "tree": NODE,                   # the structure; see below
      "tensors": [Tensor, ...],       # every tensor leaf, on CPU, in tree order
      "tensor_info": [{"path": "['state'].master['w']", "dtype": "torch.float32",
                       "shape": [3, 4], "device": "cuda:0"}, ...],
      "checksum": "<sha256 hex>",     # over version, tree, tensor_info and tensor bytes
    }

A ``NODE`` is a dict with a ``"kind"``:

* ``{"kind": "tensor", "index": i}`` — ``tensors[i]``;
* ``{"kind": "value", "value": v}`` — ``v`` a bool, int, float, str or None;
* ``{"kind": "list" | "tuple", "items": [NODE, ...]}``;
* ``{"kind": "dict", "keys": [k, ...], "values": [NODE, ...]}`` (insertion order);
* ``{"kind": "namedtuple", "name": "TraceState", "fields": [...], "items": [NODE, ...]}``;
* ``{"kind": "FP16State", "fields": {"params": NODE, "master": NODE, ...}}`` — the
  six fields of :class:`~functional_fp16.FP16State`; its ``tx`` (Python
  functions) is not stored;
* ``{"kind": "DynamicLossScale" | "StaticLossScale" | "NoOpLossScale",
  "config": {"growth_factor": 2.0, ...}, "fields": {"loss_scale": NODE, ...}}``.

Tensors are stored bitwise (the FP32 master, the momentum, the loss scale and
its int32 counters come back exactly) and detached from autograd.

Writes are atomic: the file is written to a temporary file in the same
directory, flushed and fsynced, renamed over ``path`` with :func:`os.replace`,
and the directory is fsynced. A crash at any point leaves either the previous
checkpoint or the new one, never a mixture. A writer killed mid-write leaves a
``.NAME.HOST.PID.*.tmp`` file beside the checkpoint; it is never read, and the
next save of the same checkpoint on that host deletes it once that process is
gone.

Loading checks, in order: the file opens with ``weights_only=True`` (else it is
truncated or not ours), the format marker and version, the SHA-256 checksum
(any changed tensor byte or metadata), and, with a template ``like``, the tree
structure, NamedTuple types, dict keys, tensor shapes and dtypes and every
loss-scale configuration value. Each failure names the file and the leaf path.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from collections import OrderedDict, defaultdict
from typing import Any, Union

import optree
import torch

from functional_fp16 import _deprecation as deprecation
from functional_fp16._tree import PyTree, describe_tensor
from functional_fp16.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from functional_fp16.update import _FIELDS as _STATE_FIELDS
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
]

FORMAT = "functional_fp16.checkpoint"
"""The value of the file's ``"format"`` entry."""

VERSION = 1
"""The format version written by :func:`save_checkpoint`."""

PathLike = Union[str, "os.PathLike[str]"]

# kind: (class, tensor fields, configuration fields in config() order)
_LOSS_SCALES: dict[str, tuple[type, tuple[str, ...], tuple[str, ...]]] = {
    cls.__name__: (cls, cls.TENSOR_FIELDS, cls.CONFIG_FIELDS)
    for cls in (DynamicLossScale, StaticLossScale, NoOpLossScale)
}
_VALUE_TYPES = (bool, int, float, str, type(None))


class CheckpointError(ValueError):
    """A checkpoint cannot be written or loaded."""


class CheckpointCorruptError(CheckpointError):
    """The file is truncated, tampered with, or not a checkpoint of this library."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is intact but does not match the template ``like``."""


# -- saving ---------------------------------------------------------------


def _key_path(key: Any) -> str:
    return f"[{key!r}]"


def _check_key(key: Any, path: str) -> Any:
    if type(key) not in _VALUE_TYPES:
        raise TypeError(
            f"tree{path}: dict key {key!r} of type {type(key).__name__} cannot be stored; "
            "use str, int, float, bool or None keys"
        )
    return key


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.info: list[dict[str, Any]] = []
        self.storages: set[int] = set()

    def tensor(self, x: torch.Tensor, path: str) -> dict[str, Any]:
        if x.layout != torch.strided:
            raise TypeError(f"tree{path}: only dense tensors can be stored, got layout {x.layout}")
        if x.is_meta:
            raise TypeError(f"tree{path}: a meta tensor has no data to store")
        if x.is_quantized:
            raise TypeError(f"tree{path}: quantized tensors cannot be stored")
        data = x.detach().resolve_conj().resolve_neg().to("cpu")
        compact = (
            data.is_contiguous()
            and data.storage_offset() == 0
            and data.untyped_storage().nbytes() == data.numel() * data.element_size()
        )
        if not compact or data.untyped_storage().data_ptr() in self.storages:
            # A view would drag its whole storage into the file, and two leaves
            # sharing memory would come back aliased: store a compact copy.
            data = data.clone(memory_format=torch.contiguous_format)
        self.storages.add(data.untyped_storage().data_ptr())
        self.info.append(
            {
                "path": path or "<root>",
                "dtype": str(data.dtype),
                "shape": list(data.shape),
                "device": str(x.device),
            }
        )
        self.tensors.append(data)
        return {"kind": "tensor", "index": len(self.tensors) - 1}

    def encode(self, tree: Any, path: str) -> dict[str, Any]:
        if isinstance(tree, torch.Tensor):
            return self.tensor(tree, path)
        if isinstance(tree, FP16State):
            return {
                "kind": "FP16State",
                "fields": {n: self.encode(getattr(tree, n), f"{path}.{n}") for n in _STATE_FIELDS},
            }
        for kind, (cls, fields, config_names) in _LOSS_SCALES.items():
            if type(tree) is cls:
                config = dict(zip(config_names, tree.config(), strict=True))
                return {
                    "kind": kind,
                    "config": config,
                    "fields": {n: self.encode(getattr(tree, n), f"{path}.{n}") for n in fields},
                }
        if isinstance(tree, bool):
            return {"kind": "value", "value": bool(tree)}
        if isinstance(tree, int):
            return {"kind": "value", "value": int(tree)}
        if isinstance(tree, float):
            return {"kind": "value", "value": float(tree)}
        if isinstance(tree, str):
            return {"kind": "value", "value": str(tree)}
        if tree is None:
            return {"kind": "value", "value": None}
        if optree.is_namedtuple(tree):
            fields = list(type(tree)._fields)
            return {
                "kind": "namedtuple",
                "name": type(tree).__name__,
                "fields": fields,
                "items": [self.encode(v, f"{path}.{f}") for f, v in zip(fields, tree, strict=True)],
            }
        if isinstance(tree, (list, tuple)) and (type(tree) in (list, tuple)):
            return {
                "kind": type(tree).__name__,
                "items": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(tree)],
            }
        if isinstance(tree, dict):
            keys = [_check_key(k, path) for k in tree]
            return {
                "kind": "dict",
                "keys": keys,
                "values": [self.encode(tree[k], path + _key_path(k)) for k in keys],
            }
        raise TypeError(
            f"tree{path or ''}: cannot store {type(tree).__name__} "
            f"({describe_tensor(tree)}); a checkpoint holds tensors, FP16 states, loss scales, "
            "dicts, lists, tuples, NamedTuples, bool, int, float, str and None"
        )


def _tensor_bytes(x: torch.Tensor) -> Any:
    """The raw bytes of a contiguous CPU tensor, without a copy where possible."""
    flat = x.reshape(-1).view(torch.uint8)
    try:
        return flat.numpy()  # supports the buffer protocol
    except (ImportError, RuntimeError):  # torch built without numpy
        return bytes(flat.tolist())


def _checksum(tree: dict, info: list, tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(repr((FORMAT, VERSION, tree, info)).encode("utf-8"))
    for t in tensors:
        h.update(str(t.dtype).encode("utf-8"))
        h.update(repr(tuple(t.shape)).encode("utf-8"))
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _file_mode(path: str) -> int:
    """The mode for a new checkpoint: the replaced file's, else what ``open`` would give."""
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        pass
    umask = 0o022
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o666 & ~umask


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(path: PathLike, tree: PyTree) -> None:
    """Writes ``tree`` to ``path`` atomically, in the documented plain format.

    Args:
      path: the file to write; its directory must exist. An existing file is
        replaced only once the new one is completely on disk.
      tree: an :class:`~functional_fp16.FP16State`, or any nesting of dicts
        (keys: str, int, float, bool, None), lists, tuples and NamedTuples whose
        leaves are FP16 states, loss scales, tensors, bool, int, float, str or None.

    Raises:
      TypeError: a part of ``tree`` cannot be stored; the message names its path.
    """
    path = os.fspath(path)
    encoder = _Encoder()
    root = encoder.encode(tree, "")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "tree": root,
        "tensors": encoder.tensors,
        "tensor_info": encoder.info,
        "checksum": _checksum(root, encoder.info, encoder.tensors),
    }
    atomic_torch_save(path, payload)


def _temp_prefix(path: str) -> str:
    """``.NAME.HOST.`` : the temporary files of ``path``'s writers, named by host and pid."""
    host = socket.gethostname().replace(".", "_") or "host"
    return f".{os.path.basename(path)}.{host}."


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(path: PathLike) -> list[str]:
    """Deletes temporary files of ``path`` left by writers on this host that no longer run.

    A save killed before its rename (SIGKILL, power loss) leaves its
    ``.NAME.HOST.PID.*.tmp`` file behind. Files of live processes, and of
    other hosts (a shared file system), are left alone. Returns the removed paths.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    prefix = _temp_prefix(path)
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        pid_text = name[len(prefix) :].split(".", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except OSError:  # another cleaner got there first
            pass
    return removed


def _is_path(x: Any) -> bool:
    return isinstance(x, (str, bytes, os.PathLike))


def atomic_torch_save(path: PathLike, obj: Any) -> None:
    """``torch.save(obj, path)`` atomically: temp file, fsync, rename, fsync of the directory.

    A crash at any point leaves either the previous file at ``path`` or the new
    one, never a partial file. A writer killed before its rename leaves a
    ``.NAME.HOST.PID.*.tmp`` file beside ``path``; the next save of ``path``
    deletes those of dead processes on this host (see
    :func:`remove_stale_temporaries`).
    """
    if _is_path(obj) and not _is_path(path):
        deprecation.warn(
            "atomic_torch_save(obj, path) is deprecated; call atomic_torch_save(path, obj)"
        )
        path, obj = obj, path
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(
        prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=directory
    )
    try:
        with os.fdopen(fd, "wb") as f:
            if hasattr(os, "fchmod"):  # mkstemp creates the file private (0600)
                os.fchmod(f.fileno(), _file_mode(path))
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


# -- loading --------------------------------------------------------------


def _read(path: str) -> dict[str, Any]:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as err:  # zip, pickle and weights-only errors alike
        raise CheckpointCorruptError(
            f"{path}: not a readable checkpoint (truncated, corrupted, or not written by "
            f"save_checkpoint): {type(err).__name__}: {err}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path}: not a functional_fp16 checkpoint (no format marker)")
    if payload.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{path}: checkpoint format version {payload.get('version')!r} is not supported "
            f"(this library reads version {VERSION})"
        )
    missing = [k for k in ("tree", "tensors", "tensor_info", "checksum") if k not in payload]
    if missing:
        raise CheckpointCorruptError(f"{path}: checkpoint lacks the entries {missing}")
    tensors, info = payload["tensors"], payload["tensor_info"]
    if (
        not isinstance(tensors, list)
        or not isinstance(info, list)
        or len(tensors) != len(info)
        or not all(isinstance(t, torch.Tensor) for t in tensors)
    ):
        raise CheckpointCorruptError(f"{path}: the tensor table is malformed")
    try:
        expected = _checksum(payload["tree"], info, tensors)
    except Exception as err:
        raise CheckpointCorruptError(f"{path}: cannot checksum the contents: {err}") from None
    if expected != payload["checksum"]:
        raise CheckpointCorruptError(
            f"{path}: checksum mismatch, the file was modified or damaged after it was written "
            f"(stored {str(payload['checksum'])[:16]}..., computed {expected[:16]}...)"
        )
    return payload


class _Decoder:
    def __init__(self, path: str, payload: dict, map_location: Any) -> None:
        self.file = path
        self.tensors = payload["tensors"]
        self.info = payload["tensor_info"]
        self.map_location = map_location

    def corrupt(self, path: str, what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{self.file}: malformed entry at checkpoint{path}: {what}")

    def mismatch(self, path: str, what: str) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"{self.file}: checkpoint{path} does not match like{path}: {what}"
        )

    def _node(self, node: Any, path: str) -> str:
        if not isinstance(node, dict) or "kind" not in node:
            raise self.corrupt(path, "not a tree node")
        return node["kind"]

    def _tensor(self, node: dict, path: str, device: Any) -> torch.Tensor:
        index = node.get("index")
        if not isinstance(index, int) or not 0 <= index < len(self.tensors):
            raise self.corrupt(path, f"tensor index {index!r} out of range")
        t = self.tensors[index]
        if device is None:
            device = (
                self.map_location if self.map_location is not None else self.info[index]["device"]
            )
        try:
            # A copy of its own, detached: whatever the file's pickled metadata
            # says about autograd or shared storages, a restored tensor is a
            # plain, independent value (its bytes are what the checksum covers).
            return t.detach().to(device, copy=True)
        except (RuntimeError, AssertionError) as err:
            raise CheckpointError(
                f"{self.file}: checkpoint{path} was saved on {self.info[index]['device']} and "
                f"cannot be placed on {device} ({err}); pass map_location= or a like= on "
                "an available device"
            ) from None

    # Without a template: the plain structure.
    def plain(self, node: Any, path: str) -> Any:
        kind = self._node(node, path)
        if kind == "tensor":
            return self._tensor(node, path, None)
        if kind == "value":
            return node.get("value")
        if kind in ("list", "tuple"):
            items = [self.plain(v, f"{path}[{i}]") for i, v in enumerate(node["items"])]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            return {
                k: self.plain(v, path + _key_path(k))
                for k, v in zip(node["keys"], node["values"], strict=True)
            }
        if kind == "namedtuple":
            return {
                f: self.plain(v, f"{path}.{f}")
                for f, v in zip(node["fields"], node["items"], strict=True)
            }
        if kind == "FP16State":
            return {f: self.plain(v, f"{path}.{f}") for f, v in node["fields"].items()}
        if kind in _LOSS_SCALES:
            cls, fields, config_names = _LOSS_SCALES[kind]
            config = tuple(node["config"][n] for n in config_names)
            tensors = tuple(self.plain(node["fields"][n], f"{path}.{n}") for n in fields)
            return cls._from_parts(config, tensors)
        raise self.corrupt(path, f"unknown node kind {kind!r}")

    # With a template: check everything and rebuild in the template's types.
    def like(self, node: Any, like: Any, path: str) -> Any:
        kind = self._node(node, path)
        if isinstance(like, torch.Tensor):
            if kind != "tensor":
                raise self.mismatch(path, f"expected a tensor, the checkpoint holds a {kind}")
            index = node.get("index")
            if not isinstance(index, int) or not 0 <= index < len(self.tensors):
                raise self.corrupt(path, f"tensor index {index!r} out of range")
            stored = self.tensors[index]
            if stored.dtype != like.dtype:
                raise self.mismatch(path, f"dtype {stored.dtype} != {like.dtype}")
            if stored.shape != like.shape:
                raise self.mismatch(path, f"shape {tuple(stored.shape)} != {tuple(like.shape)}")
            device = self.map_location if self.map_location is not None else like.device
            return self._tensor(node, path, device)
        if isinstance(like, FP16State):
            if kind != "FP16State":
                raise self.mismatch(path, f"expected an FP16State, the checkpoint holds a {kind}")
            fields = node.get("fields")
            if not isinstance(fields, dict) or set(fields) != set(_STATE_FIELDS):
                raise self.corrupt(path, "FP16State fields are incomplete")
            children = {
                n: self.like(fields[n], getattr(like, n), f"{path}.{n}") for n in _STATE_FIELDS
            }
            return FP16State(**children, tx=like.tx)
        for name, (cls, fields, config_names) in _LOSS_SCALES.items():
            if type(like) is cls:
                if kind != name:
                    raise self.mismatch(path, f"expected a {name}, the checkpoint holds a {kind}")
                stored_config = node.get("config", {})
                for n, v in zip(config_names, like.config(), strict=True):
                    if stored_config.get(n) != v:
                        raise self.mismatch(
                            f"{path}.{n}",
                            f"loss-scale configuration {n}={stored_config.get(n)!r} in the "
                            f"checkpoint, {n}={v!r} in like",
                        )
                tensors = tuple(
                    self.like(node["fields"][n], getattr(like, n), f"{path}.{n}") for n in fields
                )
                return cls._from_parts(like.config(), tensors)
        if like is None or isinstance(like, (bool, int, float, str)):
            if kind != "value":
                raise self.mismatch(
                    path, f"expected a {type(like).__name__}, the checkpoint holds a {kind}"
                )
            value = node.get("value")
            if like is not None and type(value) is not type(like):
                raise self.mismatch(
                    path, f"expected a {type(like).__name__}, got {type(value).__name__} {value!r}"
                )
            if like is None and value is not None:
                raise self.mismatch(path, f"expected None, got {value!r}")
            return value
        if optree.is_namedtuple(like):
            fields = list(type(like)._fields)
            if (
                kind != "namedtuple"
                or node.get("name") != type(like).__name__
                or node.get("fields") != fields
            ):
                got = (
                    f"{node.get('name')}{tuple(node.get('fields', ()))}"
                    if kind == "namedtuple"
                    else kind
                )
                raise self.mismatch(
                    path, f"expected {type(like).__name__}{tuple(fields)}, got {got}"
                )
            items = [
                self.like(v, lv, f"{path}.{f}")
                for f, v, lv in zip(fields, node["items"], like, strict=True)
            ]
            return type(like)(*items)
        if type(like) in (list, tuple):
            if kind != type(like).__name__:
                raise self.mismatch(
                    path, f"expected a {type(like).__name__}, the checkpoint holds a {kind}"
                )
            items = node.get("items", [])
            if len(items) != len(like):
                raise self.mismatch(path, f"length {len(items)} != {len(like)}")
            return type(like)(
                self.like(v, lv, f"{path}[{i}]")
                for i, (v, lv) in enumerate(zip(items, like, strict=True))
            )
        if isinstance(like, dict):
            if kind != "dict":
                raise self.mismatch(path, f"expected a dict, the checkpoint holds a {kind}")
            stored = dict(zip(node.get("keys", []), node.get("values", []), strict=True))
            missing = [k for k in like if k not in stored]
            extra = [k for k in stored if k not in like]
            if missing or extra:
                raise self.mismatch(
                    path, f"keys missing from the checkpoint {missing}, unexpected keys {extra}"
                )
            pairs = [(k, self.like(stored[k], like[k], path + _key_path(k))) for k in like]
            if isinstance(like, defaultdict):
                return type(like)(like.default_factory, pairs)
            if isinstance(like, OrderedDict) or type(like) is not dict:
                return type(like)(pairs)
            return dict(pairs)
        raise TypeError(f"like{path}: cannot be a checkpoint template: {describe_tensor(like)}")


def load_checkpoint(
    path: PathLike, like: PyTree | None = None, *, map_location: Any = None
) -> PyTree:
    """Reads a checkpoint written by :func:`save_checkpoint` and verifies it.

    The file is opened with ``torch.load(weights_only=True)`` and its checksum
    verified before anything is returned.

    With ``like`` (a template tree, e.g. a freshly ``fp16_init``-ed state, or the
    whole ``{"state": ..., "epoch": 0, ...}`` dict) the checkpoint must have the
    template's structure, NamedTuple types, dict keys, tensor shapes and dtypes
    and loss-scale configuration; the result is built in the template's types,
    every :class:`~functional_fp16.FP16State` gets the template's ``tx``, and
    each tensor goes to the device of the template's tensor at the same path.

    Without ``like`` the plain structure comes back: an ``FP16State`` as a dict
    of its six fields (its ``tx`` is not in the file), a NamedTuple as a dict of
    its fields, loss scales as loss-scale objects, dicts, lists and tuples as
    themselves, and tensors on the device they were saved from.

    Args:
      path: the file.
      like: the template, or ``None``.
      map_location: if given, every tensor goes to this device instead.

    Returns:
      The stored tree.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      CheckpointCorruptError: the file is truncated, modified after writing, or
        not a checkpoint of this library.
      CheckpointMismatchError: the file differs from ``like``; the message names
        the path and what differs.
    """
    path = os.fspath(path)
    if map_location is not None:
        try:
            map_location = torch.device(map_location)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"map_location={map_location!r} is not a device: {err}") from None
    payload = _read(path)
    decoder = _Decoder(path, payload, map_location)
    try:
        if like is None:
            return decoder.plain(payload["tree"], "")
        return decoder.like(payload["tree"], like, "")
    except CheckpointError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        if isinstance(err, TypeError) and str(err).startswith("like"):
            raise
        raise CheckpointCorruptError(f"{path}: malformed checkpoint structure: {err!r}") from None
