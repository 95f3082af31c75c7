"""A state as ``torch.distributed.checkpoint`` saves it: DTensor leaves stay sharded.

:func:`state_to_dcp` lays a :class:`~functional_fp16.FP16State` out as the
nested dict of tensors DCP takes, with keys a plain PyTorch user can read:

====================  ====================================================================
key                   what
====================  ====================================================================
``params.<name>``     the working copies (FP16), one per parameter
``master.<name>``     the FP32 master, one per parameter
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
once. So a plain DCP user loads the FP32 master into an unsharded module::

    import torch.distributed.checkpoint as dcp
    sd = {"master": model.state_dict()}        # FP32 tensors to fill, in place
    dcp.load(sd, checkpoint_id="ckpt")         # model's parameters now hold the master

and :func:`load_dcp_state` resumes a state, resharded to the ``like`` state's
mesh and placements (another world size, or one process), bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import optree
import torch

from functional_fp16._util.tree import tree_flatten, tree_paths, tree_unflatten
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


def save_dcp_state(state: FP16State, checkpoint_id) -> None:
    """Saves ``state`` with ``torch.distributed.checkpoint.save`` (every rank calls it).

    Each rank writes its own shards of the DTensor leaves; nothing is
    gathered. ``checkpoint_id`` is DCP's (a directory path).
    """
    import torch.distributed.checkpoint as dcp

    with one_process_is_intended():
        dcp.save(state_to_dcp(state), checkpoint_id=checkpoint_id, no_dist=not _distributed())


def load_dcp_state(like: FP16State, checkpoint_id, *, in_place: bool = False) -> FP16State:
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
    """
    import torch.distributed.checkpoint as dcp

    if not isinstance(in_place, bool):
        raise TypeError(f"in_place must be a bool, got {type(in_place).__name__}")
    leaves, spec = tree_flatten(like)
    if in_place:
        target = like
    else:
        fresh = [torch.empty_like(x) if isinstance(x, torch.Tensor) else x for x in leaves]
        target = tree_unflatten(spec, fresh)
    wanted = state_to_dcp(target)
    missing = _fields_missing(checkpoint_id)
    if missing:  # written before these fields existed: they start afresh
        warnings.warn(old_checkpoint_note(str(checkpoint_id), missing), stacklevel=2)
        for field in missing:
            del wanted[field]
            value = optree.tree_map(
                lambda x, f=field: added_field_value(f, x), getattr(target, field)
            )
            target = target.replace(**{field: value})
    with one_process_is_intended():
        dcp.load(wanted, checkpoint_id=checkpoint_id, no_dist=not _distributed())
    return target


def _fields_missing(checkpoint_id) -> list[str]:
    """The fields of :data:`~functional_fp16.update.state.ADDED_FIELDS` the DCP checkpoint
    does not hold (a directory's metadata says; another kind of storage is assumed current)."""
    import torch.distributed.checkpoint as dcp

    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return []
    keys = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    return [f for f in ADDED_FIELDS if not any(k == f or k.startswith(f + ".") for k in keys)]


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
