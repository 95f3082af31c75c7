"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP): each rank writes and reads its slice.

:func:`save_checkpoint_sharded` writes every rank's part of a tree holding
sharded (ZeRO-1) states through DCP, the format torchtitan and FSDP2 use, and
:func:`load_checkpoint_sharded` reads it back at any world size. No rank ever
gathers the whole FP32 state: a rank writes the elements it owns, and reads
the elements it will own, in chunks of a quarter of a bucket.

**The DCP content.** One DCP entry per tensor leaf of the tree, keyed by the
leaf's path (``"['state'].master['fc.weight']"``, as
:func:`~functional_fp16._util.tree.tree_paths` writes it):

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

The marker (:mod:`~functional_fp16.distributed.sharded_format`) names the
current folder and describes the tree: each leaf's path, kind, dtype and
full shape, the values, the node types, each state's ``tx.spec``, and a
checksum.

**Crash safety.** A save writes a new ``step-<uuid>`` folder; only once every
rank's data and DCP's ``.metadata`` are written (and fsynced) does rank 0
replace the marker atomically (temporary file, fsync, ``os.replace``, fsync of
the directory), and only then remove the older folders. A save that dies at
any point leaves the previous marker, which names the previous, complete
folder; the next successful save removes the remains. One job writes a
checkpoint directory at a time.

**Loading files that may be forged.** Every rank checks the marker against
``like``, then reads DCP's ``.metadata`` itself with a restricted unpickler
and checks it against the marker and the data files
(:mod:`~functional_fp16.distributed.dcp_io`), all before the ranks' agreement;
DCP is handed only the checked metadata. A forged file raises
:class:`~functional_fp16.CheckpointCorruptError` and runs nothing.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from functional_fp16._util.tree import PyTree
from functional_fp16.checkpoint.atomic_file import fsync_dir
from functional_fp16.checkpoint.format import (
    SHOWN_PATH_CHARS,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    show,
)
from functional_fp16.distributed.all_reduce import DEFAULT_BUCKET_BYTES
from functional_fp16.distributed.dcp_io import AliasingSavePlanner, CheckedReader
from functional_fp16.distributed.fingerprint import digest, first_difference
from functional_fp16.distributed.process_group import ProcessGroup, require_group
from functional_fp16.distributed.sharded_format import (
    MARKER,
    commit_marker,
    remove_old,
)
from functional_fp16.distributed.sharded_plans import loaded_tree, plan_load, plan_save

__all__ = ["save_checkpoint_sharded", "load_checkpoint_sharded", "MARKER"]

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
_SHOWN_FAILURE_CHARS = 2000  # of one rank's error, when another rank reports it


# -- raising on every rank together ----------------------------------------------------------


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
        parts.append(f"rank {r}: {show(f'{type(exc).__name__}: {exc}', _SHOWN_FAILURE_CHARS)}")
    detail = "; ".join(parts) or show(f"{type(err).__name__}: {err}", _SHOWN_FAILURE_CHARS)
    cls = CheckpointCorruptError if kinds == {CheckpointCorruptError} else CheckpointError
    if kinds == {CheckpointMismatchError}:
        cls = CheckpointMismatchError
    return cls(f"{name}: {what} failed: {detail}")


# -- saving ----------------------------------------------------------------------------


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
    every rank can save (valid arguments, a leaf that can be stored, a state
    sharded for this group) and holds the same tree and configuration;
    otherwise every rank raises. The directory must be visible to every rank
    (a shared file system) for a load at another world size.

    Args:
      path: the checkpoint directory (created if needed).
      tree: a pytree of tensors, :class:`~functional_fp16.FP16State`\ s
        (sharded over ``group`` or replicated), loss scales, bool, int, float,
        str and ``None``, the same structure on every rank.
      group: the process group (default: the default group).
      bucket_bytes: four times the largest chunk, in bytes: what a load of
        the checkpoint needs beyond its result.

    Raises:
      TypeError, ValueError: an invalid ``path`` or ``bucket_bytes``, a leaf
        that cannot be stored, or a state that does not fit its layout
        (naming the path), on every rank.
      ValueError: the ranks hold different trees (naming the rank and path).
      NotADirectoryError: ``path`` is a file.
      CheckpointError: writing failed on some rank (every rank raises; the
        previous checkpoint stays).
    """
    require_group("save_checkpoint_sharded")
    rank = dist.get_rank(group)
    plan, error = None, None
    try:
        plan = plan_save(path, tree, group, bucket_bytes)
    except Exception as err:  # raised on every rank below
        error = err
    proposal = f"step-{uuid.uuid4().hex}" if rank == 0 else None
    folder = _together(
        error, None if plan is None else plan.entries, proposal, group, "save_checkpoint_sharded"
    )[0]
    assert plan is not None
    directory = plan.directory
    try:
        dcp.save(
            plan.state_dict,
            storage_writer=dcp.FileSystemWriter(os.path.join(directory, folder), sync_files=True),
            planner=AliasingSavePlanner(),
            process_group=group,
        )
    # DCP raises on every rank; its CheckpointException is a BaseException, not an Exception.
    except (CheckpointException, Exception) as err:
        raise _dcp_failure(err, show(directory, SHOWN_PATH_CHARS), f"writing {folder}") from err
    error = None
    if rank == 0:
        try:
            fsync_dir(os.path.join(directory, folder))  # the data files' and .metadata's entries
            commit_marker(directory, {**plan.body, "folder": folder})
        except Exception as err:  # reported to every rank below
            error = err
        else:
            remove_old(directory, keep=folder)
    what = f"committing {show(os.path.join(directory, MARKER), SHOWN_PATH_CHARS)}"
    _together(error, None, None, group, what)


# -- loading ---------------------------------------------------------------------------


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
    scale settings and, with ``check_tx``, every ``tx.spec``) and DCP's
    ``.metadata`` against the marker and the data files (dtypes, sizes,
    chunks that tile each tensor, byte ranges inside the files), and the
    ranks agree in one small all-gather that all of them can load and hold
    the same ``like``; otherwise every rank raises. The ``.metadata`` pickle
    is read with an unpickler that allows only DCP's metadata classes, so a
    forged file is refused without running anything
    (:mod:`~functional_fp16.distributed.dcp_io`); DCP's data files carry no
    checksum, so their values are what the files hold.

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
      TypeError: ``path`` is not a str or an ``os.PathLike`` of one.
      CheckpointCorruptError: the marker, DCP's metadata or a data file is
        malformed or inconsistent.
      CheckpointError: a data file cannot be read.
      CheckpointMismatchError: the checkpoint differs from ``like``; the
        message names the path and what differs.
      ValueError: the ranks hold different ``like`` trees (naming the rank and path).
    """
    require_group("load_checkpoint_sharded")
    plan, error = None, None
    try:
        plan = plan_load(path, like, group, check_tx)
    except Exception as err:  # raised on every rank below
        error = err
    what = "load_checkpoint_sharded"
    if plan is not None:
        what = f"load_checkpoint_sharded({show(plan.directory, SHOWN_PATH_CHARS, quoted=True)})"
    _together(error, None if plan is None else plan.entries, None, group, what)
    assert plan is not None
    folder = os.path.join(plan.directory, plan.folder)
    try:
        dcp.load(
            plan.state_dict,
            storage_reader=CheckedReader(folder, plan.metadata),
            planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            process_group=group,
        )
    except (CheckpointException, Exception) as err:  # raised on every rank (see above)
        name = show(plan.directory, SHOWN_PATH_CHARS)
        raise _dcp_failure(err, name, f"reading {plan.folder}") from err
    return loaded_tree(plan)
