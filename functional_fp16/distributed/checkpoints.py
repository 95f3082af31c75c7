"""Checkpoints of a data-parallel run: one rank writes, every rank resumes."""

from __future__ import annotations

import os

import torch.distributed as dist

from functional_fp16._util.tree import PyTree
from functional_fp16.checkpoint.save_load import load_checkpoint, save_checkpoint
from functional_fp16.distributed.process_group import ProcessGroup, require_group
from functional_fp16.distributed.replicas import broadcast_state
from functional_fp16.distributed.sharding import full_like, map_sharded, shard_like, unshard_state

__all__ = ["save_checkpoint_rank0", "load_checkpoint_broadcast"]


def _agree_on_error(error: BaseException | None, src: int, group: ProcessGroup, what: str) -> None:
    """Sends ``src``'s error (or ``None``) to every rank; all raise together, none hangs."""
    message = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(message, src=src, group=group)
    if message[0] is not None:
        if error is not None:
            raise error
        raise RuntimeError(f"{what} failed on rank {src}: {message[0]}")


def save_checkpoint_rank0(
    path: str | os.PathLike, tree: PyTree, *, src: int = 0, group: ProcessGroup = None
) -> None:
    """Rank ``src`` writes ``tree`` with :func:`functional_fp16.checkpoint.save_load.save_checkpoint`.

    Every rank must call it; all return once the file is complete (so any rank
    may read it afterwards), or all raise if writing failed. Since every rank
    holds the same state, the one copy is the checkpoint of the whole run.

    Sharded states in ``tree`` (from :func:`shard_state`) are first gathered
    with :func:`unshard_state`, so the file always holds the full state and
    does not depend on the world size: :func:`load_checkpoint_broadcast`
    shards it again for whatever group loads it.
    """
    require_group("save_checkpoint_rank0")
    tree = map_sharded(unshard_state, tree)
    error = None
    if dist.get_rank() == src:
        try:
            save_checkpoint(path, tree)
        except Exception as err:  # reported to every rank below
            error = err
    _agree_on_error(error, src, group, f"writing checkpoint {os.fspath(path)!r}")


def load_checkpoint_broadcast(
    path: str | os.PathLike, like: PyTree, *, src: int = 0, group: ProcessGroup = None
) -> PyTree:
    """Resumes every rank from a checkpoint that only rank ``src`` reads.

    Rank ``src`` loads ``path`` with
    :func:`functional_fp16.checkpoint.save_load.load_checkpoint` (``like`` gives the
    structure and static configuration) and :func:`broadcast_state` sends its
    tensors to the others, so the file need only exist on ``src``'s machine.
    When every machine sees the file, ``load_checkpoint(path, like)`` on each
    rank does the same without communication.

    Sharded states in ``like`` are loaded whole (on every rank, for the
    moment of the load) and sharded for ``group``, whatever world size wrote
    the file.

    Args:
      path: the checkpoint, as written by :func:`save_checkpoint_rank0`.
      like: a tree of the same structure, shapes and dtypes on every rank,
        e.g. a freshly initialised :class:`~functional_fp16.FP16State`, full
        or sharded.
      src: the rank that reads the file.
      group: the process group (default: the default group).

    Returns:
      The checkpointed tree, bitwise the same on every rank.
    """
    require_group("load_checkpoint_broadcast")
    full = map_sharded(full_like, like)
    tree, error = full, None
    if dist.get_rank() == src:
        try:
            tree = load_checkpoint(path, like=full)
        except Exception as err:  # reported to every rank below
            error = err
    _agree_on_error(error, src, group, f"reading checkpoint {os.fspath(path)!r}")
    tree = broadcast_state(tree, src=src, group=group, name="checkpoint")
    return shard_like(tree, like)
