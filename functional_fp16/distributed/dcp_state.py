"""A state as ``torch.distributed.checkpoint`` saves it: DTensor leaves stay sharded.

:func:`state_to_dcp` lays a :class:`~functional_fp16.FP16State` out as the
nested dict of tensors DCP takes, with keys a plain PyTorch user can read:

====================  ====================================================================
key                   what
====================  ====================================================================
``params.<name>``     the working copies (FP16), one per parameter
``master.<name>``     the FP32 master, one per parameter (split: its int16 residuals)
``opt_state.<p>``     every tensor of the optimiser state, ``<p>`` its path in the state
``loss_scale.<f>``    the loss scale's tensors (``loss_scale``, its counters)
``step``              the number of updates
``grads_finite``      whether the last update was applied
``scale_stats.<c>``   the loss-scale counters (``loss_scale_stats``)
``leaf_finite``       per leaf, whether its gradient was finite at the last update
====================  ====================================================================

``<name>`` is the parameter's key where ``params`` is a flat dict with string
keys (``dict(model.named_parameters())``), else its path (``['a'][0]``).
DTensor leaves are saved by DCP shard by shard (no gather), plain tensors
once. So a plain DCP user loads the FP32 master into an unsharded module (of a state
with a float32 master; a split one's is ``ff.master_weights`` of the loaded state)::

    import torch.distributed.checkpoint as dcp
    sd = {"master": model.state_dict()}        # FP32 tensors to fill, in place
    dcp.load(sd, checkpoint_id="ckpt")         # model's parameters now hold the master

and :func:`load_dcp_state` resumes a state, resharded to the ``like`` state's
mesh and placements (another world size, or one process), bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.distributed.checkpoint import CheckpointException

from functional_fp16._util.tree import tree_flatten, tree_paths, tree_unflatten
from functional_fp16.checkpoint.atomic_file import new_temporary_directory, replace_directory
from functional_fp16.checkpoint.format import CheckpointCorruptError, CheckpointMismatchError, show
from functional_fp16.checkpoint.save_load import check_split_masters
from functional_fp16.distributed.dcp_reader import CheckedReader, check_entries, dcp_failure
from functional_fp16.update.state import (
    ADDED_FIELDS,
    FP16State,
    added_field_value,
    old_checkpoint_note,
)

__all__ = ["state_to_dcp", "save_dcp_state", "load_dcp_state"]


def _names(tree) -> list[str]:
    """Each leaf's key: the dict key of a flat ``{str: tensor}``, else its path."""
    if isinstance(tree, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tree.items()
    ):
        return [k for k, _ in sorted(tree.items())]  # optree's order: sorted keys
    return [p.lstrip(".") for p in tree_paths(tree)]


def state_to_dcp(state: FP16State) -> dict[str, Any]:
    """The nested dict of tensors DCP saves for ``state`` (see the module docstring).

    The values are the state's own tensors (no copy), so ``dcp.load`` into it
    writes them in place.
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    out: dict[str, Any] = {}
    for field in ("params", "master", "opt_state", "loss_scale"):
        part = getattr(state, field)
        leaves = tree_flatten(part)[0]
        names = _names(part)
        for name, leaf in zip(names, leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"state.{field}{name}: {type(leaf).__name__}; DCP saves tensors only"
                )
        out[field] = dict(zip(names, leaves))
    out["step"] = state.step
    out["grads_finite"] = state.grads_finite
    out["scale_stats"] = state.scale_stats._asdict()
    out["leaf_finite"] = state.leaf_finite
    return out


def save_dcp_state(state: FP16State, checkpoint_id: str | os.PathLike) -> None:
    """Saves ``state`` with ``torch.distributed.checkpoint.save`` (every rank calls it), atomically.

    Each rank writes its own shards of the DTensor leaves; nothing is
    gathered. ``checkpoint_id`` is the checkpoint's directory. DCP writes
    into a new sibling ``.NAME.HOST.PID.RANDOM.tmp`` (rank 0 makes it and
    tells the others its name), and once every rank has finished, rank 0
    swaps it into place (:func:`~functional_fp16.checkpoint.atomic_file.replace_directory`)
    and every rank waits for that. A save killed at any point leaves the
    previous checkpoint loadable at ``checkpoint_id``; its temporary is
    removed by the next save beside it (the single-file checkpoints' rule:
    temporaries of dead writers on this host).

    Raises:
      TypeError: ``checkpoint_id`` is not a path.
      NotADirectoryError: it names something that is not a directory.
      RuntimeError: DCP failed on some rank (the original chained); the
        previous checkpoint is kept and the temporary removed.
    """
    import torch.distributed.checkpoint as dcp

    path = _path(checkpoint_id)
    plain = state_to_dcp(state)
    first = _rank() == 0
    tmp = new_temporary_directory(path) if first else None
    tmp = _from_rank_0(tmp)
    try:
        with one_process_is_intended():
            dcp.save(plain, checkpoint_id=tmp, no_dist=not _distributed())
    except (Exception, CheckpointException) as err:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"saving {show(path)} failed: {dcp_failure(err)}") from err
    if first:
        replace_directory(tmp, path)
    if _distributed():
        torch.distributed.barrier()


def load_dcp_state(
    like: FP16State, checkpoint_id: str | os.PathLike, *, in_place: bool = False
) -> FP16State:
    """The state saved at ``checkpoint_id``, laid out like ``like`` (its tree, dtypes,
    mesh and placements; DCP reshards).

    ``like`` is the state the run would start from (``fp16_init`` of the
    parameters at this world size): its configuration (``tx``, the loss
    scale's settings) is kept, every tensor is read from the checkpoint. By
    default ``like`` is left untouched (the values go into new tensors); with
    ``in_place=True`` they are read into ``like``'s own tensors, which keeps
    what they share: a state built with ``fp16_init(..., copy_master=False)``
    from an FSDP2 module's FP32 shards then still has the module's shards as
    its master (and the module holds the loaded weights).

    The directory is read without trusting it
    (:class:`~functional_fp16.distributed.dcp_reader.CheckedReader`: nothing
    in ``.metadata`` runs, every size is checked against the files before
    anything is allocated). Every rank checks it before DCP's collectives
    start, and the ranks agree: if one rank's files are damaged, every rank
    raises.

    Raises:
      CheckpointCorruptError: the directory is not a checkpoint DCP wrote, or
        is damaged (DCP's own ``CheckpointException`` and unpickling errors
        are chained to it); nothing of ``like`` has changed unless a data
        file failed to read with ``in_place=True``.
      CheckpointMismatchError: an entry's dtype or shape differs from
        ``like``'s, or ``like`` has an entry the checkpoint lacks.
    """
    import torch.distributed.checkpoint as dcp

    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
    path = _path(checkpoint_id)
    expected = _entries(state_to_dcp(like))  # checks like before anything is read
    leaves, spec = tree_flatten(like)
    reader = CheckedReader(path)

    def checked() -> list[str]:
        """The fields the checkpoint predates, after checking it holds every other entry."""
        metadata = reader.read_metadata()
        keys = metadata.state_dict_metadata
        missing = [
            f for f in ADDED_FIELDS if not any(k == f or k.startswith(f + ".") for k in keys)
        ]
        held = {k: v for k, v in expected.items() if k.split(".", 1)[0] not in missing}
        check_entries(held, metadata, show(path))
        return missing

    missing = _agreed(checked)  # one agreement: every rank read and checked the directory
    if in_place:
        target = like
    else:
        fresh = [torch.empty_like(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        target = tree_unflatten(spec, fresh)
    wanted = state_to_dcp(target)
    if missing:  # written before these fields existed: they start afresh
        warnings.warn(old_checkpoint_note(str(checkpoint_id), missing), stacklevel=2)
        for field in missing:
            del wanted[field]
            value = optree.tree_map(
                lambda x, f=field: added_field_value(f, x), getattr(target, field)
            )
            target = target.replace(**{field: value})
    try:
        with one_process_is_intended():
            dcp.load(wanted, storage_reader=reader, no_dist=not _distributed())
    except (Exception, CheckpointException) as err:
        raise CheckpointCorruptError(
            f"{show(path)}: DCP could not read it ({dcp_failure(err)})"
        ) from err
    _agreed(lambda: check_split_masters(show(path), target))
    return target


def _path(checkpoint_id: Any) -> str:
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_id must be a directory path, got {type(checkpoint_id).__name__}"
        )
    return os.fspath(checkpoint_id)


def _entries(wanted: dict[str, Any]) -> dict[str, torch.Tensor]:
    """DCP's flat names of the nested dict :func:`state_to_dcp` gives (keys joined by ``.``)."""
    out = {}
    for key, value in wanted.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _agreed(read: Callable[[], Any]) -> Any:
    """``read()`` on every rank; if it raises on any rank, every rank raises (the first
    failing rank's error), so no rank goes on into a collective the others never join."""
    error: Exception | None = None
    result = None
    try:
        result = read()
    except Exception as err:  # noqa: BLE001 - each rank's error is reported to all
        error = err
    if _distributed():
        import torch.distributed as dist

        mine = None if error is None else (isinstance(error, CheckpointMismatchError), str(error))
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        failed = [(r, e) for r, e in enumerate(every) if e is not None]
        if failed and error is None:
            rank, (mismatch, text) = failed[0]
            kind = CheckpointMismatchError if mismatch else CheckpointCorruptError
            raise kind(f"rank {rank}: {text}")
    if error is not None:
        raise error
    return result


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _distributed() else 0


def _from_rank_0(value: Any) -> Any:
    """``value`` as rank 0 has it (every rank calls this)."""
    if not _distributed():
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def one_process_is_intended():
    """Without a process group the library runs DCP in one process on purpose: DCP's
    warning that it assumes so is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _distributed() -> bool:
    """Whether a process group exists (without one DCP runs in this process alone)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
