"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP): each rank writes and reads its slice.

:func:`save_checkpoint_sharded` writes every rank's part of a tree holding
sharded (ZeRO-1) states through DCP, the format torchtitan and FSDP2 use, and
:func:`load_checkpoint_sharded` reads it back at any world size. No rank ever
gathers the whole FP32 state: a rank writes the elements it owns, and reads
the elements it will own, in chunks of a quarter of a bucket.

**The DCP content.** One DCP entry per tensor leaf of the tree, keyed by the
leaf's path (``"['state'].master['fc.weight']"``, as
:func:`~functional_fp16._tree.tree_paths` writes it):

* the *per-parameter* tensors of every :class:`~functional_fp16.FP16State`
  (``params``, ``master``, and the optimiser-state tensors that ``tx.init``
  derives from a parameter) are stored as 1-D tensors of :math:`n` elements,
  the leaf flattened in row-major order. In a sharded state rank :math:`r`
  writes the elements :math:`[lo_r, hi_r)` that its
  :class:`~functional_fp16.distributed.ShardLayout` gives it (of ``params``
  too, which every rank holds whole, so each element is written once); a
  replicated state's tensors are offered whole by every rank and written
  once. Each rank's part is cut into chunks of at most ``bucket_bytes / 4``,
  each a DCP chunk at its global offset (DCP's reader holds up to three
  stored chunks at once: the bytes it read, the tensor made of them, and the
  previous chunk's tensor, so a quarter keeps a load's overhead within one
  bucket);
* every other tensor (the loss scale, counters, ``step``, tensors outside a
  state) is stored as it is, written once (DCP keeps one copy of an entry
  that every rank offers).

Numbers and strings in the tree (``{"state": ..., "epoch": 3}``) are kept in
the marker.

**The directory.** ``path`` is a directory::

    path/checkpoint.json     the marker: which folder is current, and what it holds
    path/step-<32 hex>/      one DCP checkpoint (FileSystemWriter): .metadata, __<r>_<k>.distcp

The marker is JSON: ``{"format": "functional_fp16.sharded_checkpoint",
"version": 1, "folder": "step-...", "world_size": N, "bucket_bytes": B,
"leaves": [LEAF, ...], "structure": [[path, description], ...], "config":
[[path, description], ...], "checksum": "<sha256 hex>"}``. A ``LEAF`` is
``{"path": p, "kind": "flat" | "tensor", "dtype": "torch.float32", "shape":
[...]}`` (``shape`` the leaf's full, logical shape) or ``{"path": p, "kind":
"value", "value": v}``. ``structure`` describes every node (type, a loss
scale's settings) and ``config`` the same plus every state's ``tx.spec``
(:func:`~functional_fp16.distributed.fingerprint.describe_tree`); the
checksum covers the rest of the marker.

**Crash safety.** A save writes a new ``step-<uuid>`` folder; only once every
rank's data and DCP's ``.metadata`` are written (and fsynced) does rank 0
replace the marker atomically (temporary file, fsync, ``os.replace``, fsync of
the directory), and only then remove the older folders. A save that dies at
any point leaves the previous marker, which names the previous, complete
folder; the next successful save removes the remains. One job writes a
checkpoint directory at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from functional_fp16._checkpoint_format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from functional_fp16._tree import NAMESPACE, PyTree, describe_tensor, tree_flatten, tree_paths
from functional_fp16.atomic_file import file_mode, fsync_dir
from functional_fp16.distributed.all_reduce import DEFAULT_BUCKET_BYTES, _check_bucket_bytes
from functional_fp16.distributed.fingerprint import (
    describe_arguments,
    describe_leaf,
    describe_tree,
    digest,
    first_difference,
)
from functional_fp16.distributed.process_group import ProcessGroup, _require_group
from functional_fp16.distributed.shard_layout import piece_shape
from functional_fp16.distributed.sharding import check_layout, owners
from functional_fp16.update import FP16State

__all__ = ["save_checkpoint_sharded", "load_checkpoint_sharded", "MARKER"]

MARKER = "checkpoint.json"
"""The name of the marker file inside a sharded checkpoint's directory."""

FORMAT = "functional_fp16.sharded_checkpoint"
VERSION = 1
_FOLDER = re.compile(r"step-[0-9a-f]{32}")
_MARKER_TEMP = re.compile(r"\.checkpoint\.json\..*\.tmp")
_MAX_MARKER_BYTES = 1 << 28
_CHUNKS_PER_BUCKET = 4  # a stored chunk is a quarter of bucket_bytes (see the module docstring)
_VALUES = (bool, int, float, str)
_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_ERRORS = {
    cls.__name__: cls
    for cls in (
        CheckpointMismatchError,
        CheckpointCorruptError,
        CheckpointError,
        FileNotFoundError,
        NotADirectoryError,
        TypeError,
        ValueError,
        OSError,
    )
}


# -- which leaf is stored how -------------------------------------------------------


class _Slot(NamedTuple):
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


def _slots(tree: PyTree, group: ProcessGroup, what: str) -> tuple[list[_Slot], list[Any], Any]:
    """The slots of ``tree``'s leaves, its leaves and its tree structure (flattening order)."""
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
    slots = []
    for path, x, role, (layout, p) in zip(paths, leaves, roles, params, strict=True):
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_meta or x.is_quantized:
                raise TypeError(f"tree{path}: cannot store {describe_tensor(x)} ({x.layout})")
            if role is None:
                shape = tuple(x.shape)
                slots.append(_Slot(path, "tensor", shape, (0, 0), (0, 0), x.ndim, False))
                continue
            i, piece = role
            total = p.numel()
            if layout is None or not piece:
                if x.shape != p.shape:
                    raise ValueError(
                        f"tree{path}: expected the shape {tuple(p.shape)} of its parameter, "
                        f"got {describe_tensor(x)}"
                    )
                held = (0, total)
            else:
                held = layout.piece(i)
                if x.numel() != held[1] - held[0]:
                    raise ValueError(
                        f"tree{path}: shard {layout.rank} of {layout.world_size} holds "
                        f"{held[1] - held[0]} elements of this leaf, got {describe_tensor(x)}"
                    )
            write = held if layout is None or piece else layout.piece(i)
            sharded = layout is not None and piece
            slots.append(_Slot(path, "flat", tuple(p.shape), held, write, p.ndim, sharded))
        elif type(x) in _VALUES:
            slots.append(_Slot(path, "value", (), (0, 0), (0, 0), 0, False))
        else:
            raise TypeError(
                f"tree{path}: cannot store {describe_tensor(x)}; a sharded checkpoint holds "
                "pytrees of tensors, the library's states, bool, int, float, str and None"
            )
    return slots, leaves, spec


def _record(slot: _Slot, x: Any) -> dict[str, Any]:
    """A leaf's entry in the marker."""
    if slot.kind == "value":
        return {"path": slot.path, "kind": "value", "value": x}
    return {"path": slot.path, "kind": slot.kind, "dtype": str(x.dtype), "shape": list(slot.shape)}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _chunked(flat: torch.Tensor, total: int, start: int, chunk: int) -> torch.Tensor:
    """``flat`` (elements ``start ..`` of a ``total``-element tensor) as a DCP
    CheckpointableTensor cut into chunks of at most ``chunk`` elements."""
    n = flat.numel()
    cuts = range(0, n, chunk)
    flat.global_shape = (total,)
    flat.global_offsets = tuple((start + s,) for s in cuts)
    flat.local_offsets = tuple((s,) for s in cuts)
    flat.local_sizes = tuple((min(chunk, n - s),) for s in cuts)
    return flat


class _AliasingSavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner, handing the writer each CPU chunk as a tensor whose
    storage is exactly the chunk's bytes, aliasing the piece (no copy).

    DCP's writer copies a tensor whose storage is larger than the tensor (a
    chunk of a piece, a slice of ``params``) so as not to write the whole
    storage, and keeps the last tensor of every entry until the rank's file is
    complete; with copies, that would hold one chunk per leaf. An alias of the
    chunk's bytes is written as it is and holds no memory of its own.
    """

    def __init__(self) -> None:
        super().__init__(
            flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=True
        )

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if (
            isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and data.is_contiguous()
            and data.untyped_storage().nbytes() != data.nbytes
        ):
            start = data.storage_offset() * data.element_size()
            storage = data.untyped_storage()[start : start + data.nbytes]
            data = torch.empty(0, dtype=data.dtype).set_(storage, 0, data.shape, data.stride())
        return data


# -- agreeing before DCP's collectives ---------------------------------------------------


def _together(
    error: BaseException | None,
    entries: list[tuple[str, str]] | None,
    extra: Any,
    group: ProcessGroup,
    what: str,
) -> list[Any]:
    """One all-gather of (this rank's error, the digest of its description, ``extra``).

    Every rank raises if any rank failed (the failing rank its own error, the
    others the same type naming that rank) or if the descriptions differ (a
    second gather then names the first difference). Returns every rank's ``extra``.
    """
    world = dist.get_world_size(group)
    mine = (
        None if error is None else (type(error).__name__, str(error)),
        None if entries is None else digest(entries),
        extra,
    )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    failed = [(r, g[0]) for r, g in enumerate(gathered) if g[0] is not None]
    if failed:
        if error is not None:
            raise error
        r, (kind, message) = failed[0]
        raise _ERRORS.get(kind, RuntimeError)(f"{what} failed on rank {r}: {message}")
    digests = [g[1] for g in gathered]
    if any(d != digests[0] for d in digests):
        described: list[Any] = [None] * world
        dist.all_gather_object(described, entries, group=group)
        r = next(r for r in range(world) if digests[r] != digests[0])
        raise ValueError(
            f"{what}: the ranks disagree: "
            + first_difference("tree", described[0], 0, described[r], r)
        )
    return [g[2] for g in gathered]


def _dcp_failure(err: BaseException, name: str, what: str) -> CheckpointError:
    """A library error for DCP's :class:`CheckpointException` (raised on every rank)."""
    failures = getattr(err, "failures", None) or {}
    parts, kinds = [], set()
    for r, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        kinds.add(type(exc))
        parts.append(f"rank {r}: {type(exc).__name__}: {exc}")
    detail = "; ".join(parts) or f"{type(err).__name__}: {err}"
    cls = CheckpointCorruptError if kinds == {CheckpointCorruptError} else CheckpointError
    if kinds == {CheckpointMismatchError}:
        cls = CheckpointMismatchError
    return cls(f"{name}: {what} failed: {detail}")


# -- saving ----------------------------------------------------------------------------


def _canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _commit(directory: str, body: dict[str, Any]) -> None:
    """Writes the marker atomically: temporary file, fsync, ``os.replace``, fsync of the directory."""
    body = dict(body)
    body["checksum"] = hashlib.sha256(_canonical(body).encode()).hexdigest()
    fd, tmp = tempfile.mkstemp(prefix=f".{MARKER}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            if hasattr(os, "fchmod"):  # mkstemp creates the file private (0600)
                os.fchmod(f.fileno(), file_mode(os.path.join(directory, MARKER)))
            f.write(json.dumps(body))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(directory, MARKER))
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def _remove_old(directory: str, keep: str) -> None:
    """Removes the step folders other than ``keep`` and leftover marker temporaries (best effort)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        full = os.path.join(directory, name)
        if _FOLDER.fullmatch(name) and name != keep:
            shutil.rmtree(full, ignore_errors=True)
        elif _MARKER_TEMP.fullmatch(name):
            try:
                os.unlink(full)
            except OSError:
                pass


class _SavePlan(NamedTuple):
    body: dict[str, Any]  # the marker, less folder and checksum
    state_dict: dict[str, torch.Tensor]  # what DCP writes from this rank
    entries: list[tuple[str, str]]  # the tree's description, which every rank must share


def _plan_save(directory: str, tree: PyTree, group: ProcessGroup, bucket_bytes: int) -> _SavePlan:
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(
            f"{directory}: is a file; a sharded checkpoint is a directory (whole-file "
            "checkpoints are written by save_checkpoint_rank0)"
        )
    slots, leaves, _ = _slots(tree, group, "save_checkpoint_sharded")
    state_dict: dict[str, torch.Tensor] = {}
    for slot, x in zip(slots, leaves, strict=True):
        if slot.kind == "tensor" and x.numel() > 0:
            state_dict[slot.path] = x.detach()
        elif slot.kind == "flat":
            lo, hi = slot.write
            if hi == lo:
                continue
            flat = x.detach().reshape(-1)  # a copy only for a leaf that is not contiguous
            if not slot.piece:
                flat = flat[lo:hi]
            chunk = max(1, bucket_bytes // (_CHUNKS_PER_BUCKET * x.element_size()))
            state_dict[slot.path] = _chunked(flat.view(-1), _numel(slot.shape), lo, chunk)
    body = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": dist.get_world_size(group),
        "bucket_bytes": bucket_bytes,
        "leaves": [_record(s, x) for s, x in zip(slots, leaves, strict=True)],
        "structure": [list(e) for e in describe_tree(tree, leaves=False, layouts=False, tx=False)],
        "config": [list(e) for e in describe_tree(tree, leaves=False, layouts=False)],
    }
    entries = describe_tree(tree) + describe_arguments(
        dist.get_world_size(group), bucket_bytes=bucket_bytes
    )
    return _SavePlan(body, state_dict, entries)


def save_checkpoint_sharded(
    path: str | os.PathLike,
    tree: PyTree,
    *,
    group: ProcessGroup = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    r"""Writes ``tree`` (sharded states included) as a DCP checkpoint, each rank its own part.

    Called on every rank of ``group``. Each rank writes, through
    ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter``, the
    elements of every per-parameter tensor that its shard layout gives it,
    :math:`[lo_r, hi_r)` of the leaf flattened, in chunks of at most
    ``bucket_bytes / 4``; the other tensors are written once. No rank gathers
    or copies anything on the CPU (each chunk goes to DCP as an alias of its
    bytes), so a save needs next to no memory beyond the state; from CUDA,
    DCP copies each chunk to the host and keeps the last chunk of every leaf
    until the rank's file is complete. See the
    module docstring for the format. Any world size can load the checkpoint
    with :func:`load_checkpoint_sharded`.

    The data go to a new folder ``path/step-<uuid>``; rank 0 then replaces the
    marker ``path/checkpoint.json`` atomically and removes the older folders,
    so a save that dies part-way leaves the previous checkpoint loadable.
    Before anything is written the ranks check, in one small all-gather, that
    every rank can save (a leaf that cannot be stored, a state sharded for
    another group) and holds the same tree and configuration; otherwise every
    rank raises. The directory must be visible to every rank (a shared file
    system) for a load at another world size.

    Args:
      path: the checkpoint directory (created if needed).
      tree: a pytree of tensors, :class:`~functional_fp16.FP16State`\ s
        (sharded over ``group`` or replicated), loss scales, bool, int, float,
        str and ``None``, the same structure on every rank.
      group: the process group (default: the default group).
      bucket_bytes: four times the largest chunk, in bytes: what a load of
        the checkpoint needs beyond its result.

    Raises:
      TypeError, ValueError: a leaf that cannot be stored, or a state that
        does not fit its layout (naming the path), on every rank.
      ValueError: the ranks hold different trees (naming the rank and path).
      NotADirectoryError: ``path`` is a file.
      CheckpointError: writing failed on some rank (every rank raises; the
        previous checkpoint stays).
    """
    _require_group("save_checkpoint_sharded")
    bucket_bytes = _check_bucket_bytes(bucket_bytes)
    directory = os.fspath(path)
    rank = dist.get_rank(group)
    plan, error = None, None
    try:
        plan = _plan_save(directory, tree, group, bucket_bytes)
    except Exception as err:  # raised on every rank below
        error = err
    proposal = f"step-{uuid.uuid4().hex}" if rank == 0 else None
    folder = _together(
        error, None if plan is None else plan.entries, proposal, group, "save_checkpoint_sharded"
    )[0]
    assert plan is not None
    try:
        dcp.save(
            plan.state_dict,
            storage_writer=dcp.FileSystemWriter(os.path.join(directory, folder), sync_files=True),
            planner=_AliasingSavePlanner(),
            process_group=group,
        )
    except (CheckpointException, Exception) as err:  # DCP raises on every rank
        raise _dcp_failure(err, directory, f"writing {folder}") from err
    error = None
    if rank == 0:
        try:
            fsync_dir(os.path.join(directory, folder))  # the data files' and .metadata's entries
            _commit(directory, {**plan.body, "folder": folder})
        except Exception as err:  # reported to every rank below
            error = err
        else:
            _remove_old(directory, keep=folder)
    _together(error, None, None, group, f"committing {os.path.join(directory, MARKER)}")


# -- loading ---------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})}")
    return dict(pairs)


def _read_marker(directory: str) -> dict[str, Any]:
    """The marker, parsed and validated (:class:`CheckpointCorruptError` if malformed)."""
    name = os.path.join(directory, MARKER)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory}: no sharded checkpoint here (not a directory)")
    try:
        with open(name, "rb") as f:
            raw = f.read(_MAX_MARKER_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{directory}: no sharded checkpoint here ({MARKER} missing)"
        ) from None
    if len(raw) > _MAX_MARKER_BYTES:
        raise CheckpointCorruptError(f"{name}: larger than {_MAX_MARKER_BYTES} bytes")
    try:
        body = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(f"{name}: not a readable marker ({err})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{name}: not a sharded checkpoint of this library")
    if body.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{name}: format version {body.get('version')!r}; this library reads {VERSION}"
        )
    stored = body.pop("checksum", None)
    if stored != hashlib.sha256(_canonical(body).encode()).hexdigest():
        raise CheckpointCorruptError(f"{name}: checksum mismatch, the marker was modified")
    folder = body.get("folder")
    if not isinstance(folder, str) or not _FOLDER.fullmatch(folder):
        raise CheckpointCorruptError(f"{name}: malformed folder name {folder!r}")
    leaves = body.get("leaves")
    if not isinstance(leaves, list):
        raise CheckpointCorruptError(f"{name}: malformed leaf table")
    seen = set()
    for leaf in leaves:
        ok = isinstance(leaf, dict) and isinstance(leaf.get("path"), str)
        if ok and leaf.get("kind") == "value":
            ok = type(leaf.get("value")) in _VALUES
        elif ok:
            shape = leaf.get("shape")
            ok = (
                leaf.get("kind") in ("flat", "tensor")
                and leaf.get("dtype") in _DTYPES
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
            )
        if not ok:
            raise CheckpointCorruptError(f"{name}: malformed leaf record {str(leaf)[:200]!r}")
        if leaf["path"] in seen:
            raise CheckpointCorruptError(f"{name}: leaf {leaf['path']} appears twice")
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


def _describe_record(rec: dict[str, Any]) -> str:
    if rec["kind"] == "value":
        return f"{describe_leaf(rec['value'])} {rec['value']!r}"
    stored = "per-parameter tensor" if rec["kind"] == "flat" else "tensor"
    return f"a {rec['dtype']} {stored} of shape {tuple(rec['shape'])}"


def _compare(directory: str, marker: dict, wanted: list[dict], config: list, key: str) -> None:
    """Raises :class:`CheckpointMismatchError` at the first leaf or setting where ``like`` differs."""

    def mismatch(path: str, what: str) -> CheckpointMismatchError:
        return CheckpointMismatchError(
            f"{directory}: checkpoint{path} does not match like{path}: {what}"
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
            got = ours.get(path, "nothing")
            raise mismatch(path, f"{got} in the checkpoint, {desc} in like")
    extra = set(ours) - {p for p, _ in config}
    if extra:
        path = min(extra)
        raise mismatch(path, f"{ours[path]} in the checkpoint, nothing in like")


class _LoadPlan(NamedTuple):
    folder: str
    state_dict: dict[str, torch.Tensor]  # the tensors DCP fills on this rank
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # every DCP entry's dtype and size
    slots: list[_Slot]
    values: dict[str, Any]  # host values from the marker
    spec: Any  # like's tree structure
    like_leaves: list[Any]
    checksum: str


def _plan_load(directory: str, like: PyTree, group: ProcessGroup, check_tx: bool) -> _LoadPlan:
    marker = _read_marker(directory)
    slots, like_leaves, spec = _slots(like, group, "load_checkpoint_sharded")
    wanted = [_record(s, x) for s, x in zip(slots, like_leaves, strict=True)]
    key = "config" if check_tx else "structure"
    config = describe_tree(like, leaves=False, layouts=False, tx=check_tx)
    _compare(directory, marker, wanted, [list(e) for e in config], key)
    state_dict: dict[str, torch.Tensor] = {}
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for slot, x in zip(slots, like_leaves, strict=True):
        if slot.kind == "tensor":
            if x.numel() > 0:
                expected[slot.path] = (x.dtype, slot.shape)
                state_dict[slot.path] = torch.empty_like(x, memory_format=torch.contiguous_format)
        elif slot.kind == "flat":
            total = _numel(slot.shape)
            if total > 0:
                expected[slot.path] = (x.dtype, (total,))
            lo, hi = slot.held
            if hi > lo:
                dest = torch.empty(hi - lo, dtype=x.dtype, device=x.device)
                state_dict[slot.path] = _chunked(dest, total, lo, hi - lo)
    values = {r["path"]: r["value"] for r in marker["leaves"] if r["kind"] == "value"}
    return _LoadPlan(
        marker["folder"],
        state_dict,
        expected,
        slots,
        values,
        spec,
        like_leaves,
        marker["checksum"],
    )


class _CheckedLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, after checking the stored metadata against the marker.

    Every entry must exist with the dtype and size the marker promises, and
    its chunks must tile it exactly (no gaps, no overlaps), so that every
    element of every destination is written by the load.
    """

    def __init__(self, expected: dict[str, tuple[torch.dtype, tuple[int, ...]]], name: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.expected = expected
        self.name = name

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        stored = getattr(metadata, "state_dict_metadata", None) or {}
        for fqn, (dtype, size) in self.expected.items():
            md = stored.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointCorruptError(f"{self.name}: DCP holds no tensor {fqn}")
            if md.properties.dtype != dtype or tuple(md.size) != size:
                raise CheckpointCorruptError(
                    f"{self.name}: DCP holds {fqn} as {md.properties.dtype} of shape "
                    f"{tuple(md.size)}, the marker says {dtype} of shape {size}"
                )
            if not _tiles(md, size):
                raise CheckpointCorruptError(f"{self.name}: the chunks of {fqn} do not tile it")
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _tiles(md: TensorStorageMetadata, size: tuple[int, ...]) -> bool:
    """Whether the stored chunks cover the tensor exactly (one whole chunk, or 1-D chunks end to end)."""
    chunks = md.chunks
    if len(size) != 1:
        return len(chunks) == 1 and tuple(chunks[0].sizes) == size and not any(chunks[0].offsets)
    at = 0
    for c in sorted(chunks, key=lambda c: tuple(c.offsets)):
        if len(c.offsets) != 1 or c.offsets[0] != at or c.sizes[0] < 1:
            return False
        at += c.sizes[0]
    return at == size[0]


def load_checkpoint_sharded(
    path: str | os.PathLike,
    like: PyTree,
    *,
    group: ProcessGroup = None,
    check_tx: bool = True,
) -> PyTree:
    r"""Reads a checkpoint of :func:`save_checkpoint_sharded` at this world size, each rank its part.

    Called on every rank of ``group``. ``like`` gives the structure, the
    static configuration (each state's ``tx`` and shard layout) and the
    devices: typically the freshly initialised tree, with its states sharded
    for this group by :func:`shard_state`. For a sharded state each rank
    reads, through ``torch.distributed.checkpoint.load``, the elements
    :math:`[lo_r, hi_r)` of every per-parameter tensor that its layout in
    ``like`` gives it (any world size may have written them: DCP reads the
    stored chunks that overlap) and the whole ``params``; for a replicated
    state, every tensor whole. The result is bitwise the tree that
    ``shard_state(unshard_state(saved))`` would give on this group. Beyond
    the result, a load holds at most three stored chunks at once (each a
    quarter of the writer's ``bucket_bytes``), never the whole FP32 state.

    Before any data are read, every rank checks the marker against ``like``
    (leaf paths, kinds, dtypes and full shapes, value types, node types, loss
    scale settings and, with ``check_tx``, every ``tx.spec``), and the ranks
    agree in one small all-gather that all of them can load and hold the same
    ``like``; otherwise every rank raises. DCP's stored metadata is then
    checked against the marker (dtypes, sizes, chunks that tile each tensor).
    The DCP ``.metadata`` file is a pickle, as in every DCP checkpoint: load
    only checkpoints you trust.

    Args:
      path: the checkpoint directory.
      like: the template tree, the same structure on every rank.
      group: the process group (default: the default group).
      check_tx: compare every state's ``tx.spec`` with the one saved (pass
        ``False`` to resume with deliberately changed hyperparameters; the
        optimiser state must still have the same structure).

    Returns:
      The stored tree in ``like``'s structure, every tensor fresh (``like``
      is not written to), on the device of ``like``'s tensor at its path.

    Raises:
      FileNotFoundError: ``path`` holds no sharded checkpoint.
      CheckpointCorruptError: the marker or DCP's metadata is malformed or
        inconsistent, or a data file cannot be read.
      CheckpointMismatchError: the checkpoint differs from ``like``; the
        message names the path and what differs.
      ValueError: the ranks hold different ``like`` trees (naming the rank and path).
    """
    _require_group("load_checkpoint_sharded")
    directory = os.fspath(path)
    plan, error = None, None
    try:
        plan = _plan_load(directory, like, group, check_tx)
    except Exception as err:  # raised on every rank below
        error = err
    entries = None
    if plan is not None:
        entries = describe_tree(like) + [("the marker's checksum", plan.checksum)]
    _together(error, entries, None, group, f"load_checkpoint_sharded({directory!r})")
    assert plan is not None
    folder = os.path.join(directory, plan.folder)
    try:
        dcp.load(
            plan.state_dict,
            storage_reader=dcp.FileSystemReader(folder),
            planner=_CheckedLoadPlanner(plan.expected, folder),
            process_group=group,
        )
    except (CheckpointException, Exception) as err:  # DCP raises on every rank
        raise _dcp_failure(err, directory, f"reading {plan.folder}") from err
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
