"""Data-parallel training on ``torch.distributed``: the same pure update on every rank.

Each process (rank) computes gradients on its own shard of the batch; the
gradients are averaged across the process group, and every rank then runs the
same :func:`~functional_fp16.fp16_update` on bitwise identical inputs, so every
rank holds bitwise identical parameters after every step. ``torch.distributed``
is the engine (gloo on CPU, NCCL on CUDA); this module only arranges the calls.

Two places to average, pick one:

* **Before the update, on the raw gradients** (:func:`tree_all_reduce_mean`):
  the scaled FP16 gradients are averaged, in FP16 by default, which halves the
  bytes sent compared with FP32. Each value is divided by the world size
  *before* the sum (``predivide_factor``), so the sum of finite values stays
  within the FP16 range (up to the rounding of ``max / N`` when ``N`` is not
  a power of two: a sum of values all at the FP16 maximum can still round to
  inf, which only skips that step). This is the usual data-parallel path
  (DeepSpeed in FP16 mode reduces the FP16 gradients the same way, with its
  ``gradient_predivide_factor``). The
  averaged tree is identical on every rank, so every rank also reaches the
  same finite/non-finite decision.
* **Inside the optimiser** (:func:`all_reduce_mean` in ``chain``): the
  transform sees the *unscaled* FP32 gradients, so the average is formed in
  FP32 (twice the bytes, no range or rounding concern). The finite check of
  :func:`~functional_fp16.fp16_update` runs before the optimiser on the local
  gradients, so this path **needs** ``agree=agree_finite``: otherwise a rank
  whose own gradients were finite would apply an update that another rank's
  inf has poisoned.

Passing ``agree=agree_finite`` is right on either path, and required whenever
the decision can differ between ranks (the local ``loss=`` check, gradients
clipped or reduced differently). It all-reduces the local "not finite" flag
with MAX, the rule Megatron-LM and DeepSpeed use, without reading the flag on
the host.

A training step on ``N`` ranks, each fed ``B / N`` examples::

    info = init_from_env()                               # under torchrun
    state = broadcast_state(fp16_init(params, sgd(0.1, momentum=0.9)))
    for x, y in shard:                                   # B / N per rank
        grads = grad_fn(state.params, x, y)              # scaled FP16 grads
        grads = tree_all_reduce_mean(grads)              # mean over ranks
        state = fp16_update(state, grads, agree=agree_finite)
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functional_fp16._deprecation import keyword_only
from functional_fp16._tree import (
    PyTree,
    describe_tensor,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.base import EmptyState, GradientTransformation
from functional_fp16.checkpoint import load_checkpoint, save_checkpoint

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DistInfo",
    "backend_for",
    "init_from_env",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "tree_all_reduce_mean",
    "all_reduce_mean",
    "agree_finite",
    "check_same_tree",
    "broadcast_state",
    "save_checkpoint_rank0",
    "load_checkpoint_broadcast",
]

ProcessGroup = Any  # a ``torch.distributed.ProcessGroup``, or ``None`` for the default group

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""Largest bucket one collective sends, in bytes (DDP's default ``bucket_cap_mb``)."""

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class DistInfo(NamedTuple):
    """Where this process sits in the process group (static, host-side values)."""

    rank: int  # global rank, 0 .. world_size - 1
    world_size: int  # number of processes in the default group
    local_rank: int  # rank on this machine, the CUDA device index under torchrun
    device: torch.device  # the device this rank computes on
    backend: str  # "gloo" or "nccl"

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that writes logs, plots and checkpoints."""
        return self.rank == 0


# -- process group setup ---------------------------------------------------


def backend_for(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend for tensors on ``device``: NCCL for CUDA, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_from_env(
    device: torch.device | str | None = None,
    *,
    backend: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
) -> DistInfo:
    """Initialises the default process group from the ``torchrun`` environment.

    ``torchrun`` (and other launchers) set ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; all five must be
    present. If the default group already exists it is reused.

    Args:
      device: the device this rank computes on. Default: ``cuda:LOCAL_RANK``
        when CUDA is available, else the CPU. A CUDA device becomes the current
        device.
      backend: default :func:`backend_for` the device (NCCL for CUDA, gloo for CPU).
      timeout: how long collectives wait for the other ranks before failing.

    Returns:
      A :class:`DistInfo`.

    Raises:
      RuntimeError: when a variable is missing (the script was not started by
        ``torchrun``) or ``torch.distributed`` is unavailable.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"environment variable(s) {', '.join(missing)} not set: start the script with "
            "`torchrun --nproc-per-node N script.py` (or set RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT yourself)"
        )
    rank, world_size, local_rank = (_env_int(n) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} must lie in [0, WORLD_SIZE={world_size})")
    if device is None:
        device = (
            torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        )
    device = torch.device(device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = backend or backend_for(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout
        )
    return DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=str(dist.get_backend()),
    )


def shutdown() -> None:
    """Destroys the default process group if there is one (call at the end of every rank)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup = None) -> int:
    """This process's rank in ``group``; 0 when no process group exists."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: ProcessGroup = None) -> int:
    """The number of processes in ``group``; 1 when no process group exists."""
    return dist.get_world_size(group) if is_initialized() else 1


def is_main_process(group: ProcessGroup = None) -> bool:
    """Whether this is rank 0 of ``group`` (``True`` on a single process)."""
    return get_rank(group) == 0


def _require_group(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs a torch.distributed process group, but none is initialised: call "
            "functional_fp16.distributed.init_from_env() in a script started by torchrun "
            "(or torch.distributed.init_process_group) first"
        )


# -- bucketed collectives ----------------------------------------------------


def _float_leaves(tree: PyTree, name: str) -> tuple[list[torch.Tensor], Any, list[str]]:
    leaves, spec = tree_flatten(tree)
    paths = tree_paths(tree)
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(
                f"{name}{path}: expected a floating-point tensor, got {describe_tensor(leaf)}"
            )
    return leaves, spec, paths


def _buckets(
    leaves: list[torch.Tensor], dtypes: list[torch.dtype], bucket_bytes: int
) -> list[list[int]]:
    """Groups leaf indices by (device, communication dtype), then cuts each group
    into consecutive runs of at most ``bucket_bytes`` (a larger leaf goes alone)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (leaf, dtype) in enumerate(zip(leaves, dtypes, strict=True)):
        groups.setdefault((leaf.device, dtype), []).append(i)
    buckets: list[list[int]] = []
    for (_, dtype), indices in groups.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = leaves[i].numel() * itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def _pack(
    leaves: list[torch.Tensor], indices: list[int], dtype: torch.dtype, pre: float
) -> torch.Tensor:
    """One flat ``dtype`` buffer of ``fl(x / pre)``: divided in the leaf's dtype, then cast.

    Dividing before the cast keeps FP32 leaves that exceed the FP16 range but
    whose share ``x / pre`` fits from overflowing on the wire. ``torch.cat``
    always allocates, so the inputs are never written to.
    """
    if pre == 1.0:
        return torch.cat([leaves[i].reshape(-1).to(dtype) for i in indices])
    return torch.cat([(leaves[i].reshape(-1) / pre).to(dtype) for i in indices])


def _unpack(
    flat: torch.Tensor, like: list[torch.Tensor], indices: list[int], out: list[Any]
) -> None:
    offset = 0
    for i in indices:
        n = like[i].numel()
        out[i] = flat[offset : offset + n].view(like[i].shape).to(like[i].dtype)
        offset += n


def _check_bucket_bytes(bucket_bytes: int) -> int:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    return bucket_bytes


def _check_comm_dtype(comm_dtype: torch.dtype | None) -> torch.dtype | None:
    if comm_dtype is not None and (
        not isinstance(comm_dtype, torch.dtype) or not comm_dtype.is_floating_point
    ):
        raise TypeError(f"comm_dtype must be None or a floating torch.dtype, got {comm_dtype!r}")
    return comm_dtype


def _check_predivide(predivide_factor: float | None) -> float | None:
    if predivide_factor is None:
        return None
    if isinstance(predivide_factor, bool) or not isinstance(predivide_factor, (int, float)):
        raise TypeError(
            f"predivide_factor must be None or a real number, got {type(predivide_factor).__name__}"
        )
    value = float(predivide_factor)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"predivide_factor must be finite and > 0, got {predivide_factor}")
    return value


@keyword_only("group")
def tree_all_reduce_mean(
    tree: PyTree,
    *,
    group: ProcessGroup = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    comm_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> PyTree:
    r"""The mean of ``tree`` over the ranks of ``group``, in a few flat collectives.

    With :math:`N` ranks, pre-divide factor :math:`f` and :math:`x_r` a leaf on
    rank :math:`r`, cast to the communication dtype :math:`c`:

    .. math:: \bar x = \operatorname{fl}_c\Big(\sum_{r} \operatorname{fl}_c(x_r / f)\Big) \,/\, (N / f)

    Leaves are grouped by device and communication dtype and concatenated
    into buckets of at most ``bucket_bytes``; each bucket is one
    ``all_reduce(SUM)``, all launched before any is waited on. The result has
    the structure, shapes, dtypes and devices of ``tree``, is bitwise the same
    on every rank, and ``tree`` itself is never written to. Nothing is read
    back to the host.

    Args:
      tree: a pytree of floating-point tensors, the same structure and shapes
        on every rank.
      group: the process group (default: the default group).
      bucket_bytes: the largest bucket, in bytes of the communication dtype.
      comm_dtype: the dtype sent over the wire; default each leaf's own dtype.
        Leaves are cast to it and the result back to their dtype.
      predivide_factor: :math:`f`. Default :math:`N` for FP16/BF16
        communication (each term is at most ``fl(max / N)``, so a sum of
        finite values overflows only by rounding, when ``N`` is not a power
        of two and the values sit at the FP16 maximum; tiny values lose bits
        to underflow instead)
        and 1 otherwise (sum, then divide, as DDP does).

    Returns:
      The averaged tree.
    """
    _require_group("tree_all_reduce_mean")
    bucket_bytes = _check_bucket_bytes(bucket_bytes)
    comm_dtype = _check_comm_dtype(comm_dtype)
    predivide_factor = _check_predivide(predivide_factor)
    leaves, spec, _ = _float_leaves(tree, "tree")
    if not leaves:
        return tree
    world = dist.get_world_size(group)
    dtypes = [comm_dtype or leaf.dtype for leaf in leaves]
    pending = []
    for indices in _buckets(leaves, dtypes, bucket_bytes):
        dtype = dtypes[indices[0]]
        pre = predivide_factor or (float(world) if dtype in _LOW_PRECISION else 1.0)
        flat = _pack(leaves, indices, dtype, pre)
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((work, flat, indices, world / pre))
    out: list[Any] = [None] * len(leaves)
    for work, flat, indices, post in pending:
        work.wait()
        if post != 1.0:
            flat.div_(post)
        _unpack(flat, leaves, indices, out)
    return tree_unflatten(spec, out)


@keyword_only("group")
def all_reduce_mean(
    *,
    group: ProcessGroup = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    comm_dtype: torch.dtype | None = None,
    predivide_factor: float | None = None,
) -> GradientTransformation:
    r"""A transform that averages the updates over the ranks of ``group``.

    .. math:: u \mapsto \frac{1}{N} \sum_{r=1}^{N} u_r

    computed by :func:`tree_all_reduce_mean` (see it for the arguments). Put it
    first in the optimiser, e.g. ``chain(all_reduce_mean(), sgd(lr, 0.9))``.
    Inside :func:`~functional_fp16.fp16_update` it sees the unscaled FP32
    gradients, so the average is formed in FP32; pass
    ``agree=agree_finite`` to ``fp16_update`` so that every rank skips the same
    steps (its finite check runs before the optimiser, on local gradients).
    Since these gradients are unscaled, ``comm_dtype=torch.float16`` here would
    flush small ones to zero; to send FP16, average the scaled gradients with
    :func:`tree_all_reduce_mean` before the update instead.

    ``init`` needs the process group: it compares the parameter trees of all
    ranks with :func:`check_same_tree` (one small all-gather), so a rank with a
    differently shaped model fails there, naming the leaf, rather than in a
    mismatched collective later.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with an empty state.
    """
    bucket_bytes = _check_bucket_bytes(bucket_bytes)
    comm_dtype = _check_comm_dtype(comm_dtype)
    predivide_factor = _check_predivide(predivide_factor)

    def init(params: PyTree) -> EmptyState:
        _require_group("all_reduce_mean")
        check_same_tree(params, group, name="params")
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        del params
        _require_group("all_reduce_mean")
        mean = tree_all_reduce_mean(
            updates,
            group=group,
            bucket_bytes=bucket_bytes,
            comm_dtype=comm_dtype,
            predivide_factor=predivide_factor,
        )
        return mean, state

    return GradientTransformation(init, update)


@keyword_only("group")
def agree_finite(finite: torch.Tensor, *, group: ProcessGroup = None) -> torch.Tensor:
    r"""The finite flag every rank agrees on: true only if it is true on all ranks.

    .. math:: f = \neg \max_r (\neg f_r)

    One ``all_reduce(MAX)`` of a one-byte tensor on the flag's device (Megatron-LM
    and DeepSpeed reduce their overflow flag the same way); the flag is never
    read on the host. Pass it to :func:`~functional_fp16.fp16_update` as
    ``agree=agree_finite``, or ``agree=functools.partial(agree_finite, group=g)``.

    Args:
      finite: this rank's 0-d bool flag.
      group: the process group (default: the default group).

    Returns:
      A new 0-d bool tensor, the same on every rank.
    """
    _require_group("agree_finite")
    if not isinstance(finite, torch.Tensor) or finite.dtype != torch.bool or finite.ndim != 0:
        raise TypeError(f"finite must be a 0-d bool tensor, got {describe_tensor(finite)}")
    overflow = torch.logical_not(finite).to(torch.uint8).reshape(1)
    dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=group)
    return overflow.reshape(()) == 0


# -- identical trees on every rank ---------------------------------------------


def _fingerprint(tree: PyTree) -> list[tuple[str, str]]:
    leaves, _ = tree_flatten(tree)
    out = []
    for path, leaf in zip(tree_paths(tree), leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            # The device type, not the index: cuda:0 and cuda:1 are alike.
            out.append(
                (path, f"{leaf.dtype} tensor of shape {tuple(leaf.shape)} on {leaf.device.type}")
            )
        else:
            # Host values (an epoch counter, a name) may differ; their type may not.
            out.append((path, type(leaf).__name__))
    return out


def _first_difference(
    name: str, ref: list[tuple[str, str]], ref_rank: int, other: list[tuple[str, str]], rank: int
) -> str:
    ref_map, other_map = dict(ref), dict(other)
    for path, desc in ref:
        if path not in other_map:
            return f"{name}{path} ({desc}) exists on rank {ref_rank} but not on rank {rank}"
        if other_map[path] != desc:
            return f"{name}{path} is a {desc} on rank {ref_rank} but a {other_map[path]} on rank {rank}"
    for path, desc in other:
        if path not in ref_map:
            return f"{name}{path} ({desc}) exists on rank {rank} but not on rank {ref_rank}"
    return f"{name} flattens in a different leaf order on rank {rank} than on rank {ref_rank}"


def check_same_tree(tree: PyTree, group: ProcessGroup = None, *, name: str = "tree") -> None:
    """Checks that every rank holds a tree of the same structure, shapes and dtypes.

    Each rank hashes the list of (leaf path, dtype, shape, device type) and the
    hashes are all-gathered; only when they differ is the full list gathered
    to name the first differing leaf. Every rank raises the same error, so no
    rank is left waiting in a later collective. Values are never compared.

    Raises:
      ValueError: naming the first leaf path that differs and the two ranks.
    """
    _require_group("check_same_tree")
    meta = _fingerprint(tree)
    digest = hashlib.sha256(repr(meta).encode()).hexdigest()
    world = dist.get_world_size(group)
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest, group=group)
    if all(d == digests[0] for d in digests):
        return
    metas: list[Any] = [None] * world
    dist.all_gather_object(metas, meta, group=group)
    rank = next(r for r in range(world) if digests[r] != digests[0])
    raise ValueError(
        "ranks hold differently shaped trees: "
        + _first_difference(name, metas[0], 0, metas[rank], rank)
    )


@keyword_only("src", "group")
def broadcast_state(
    tree: PyTree, *, src: int = 0, group: ProcessGroup = None, name: str = "state"
) -> PyTree:
    """Every rank gets ``src``'s values of ``tree`` (e.g. the initial :class:`~functional_fp16.FP16State`).

    All tensor leaves are sent (for an ``FP16State``: parameters, master
    copies, optimiser state, loss scale and counters), grouped by device and
    dtype into one flat broadcast each; host values among the leaves (numbers,
    strings, as in a checkpoint's ``{"state": ..., "epoch": 3}``) follow in one
    ``broadcast_object_list``. Static configuration (the optimiser, the
    loss-scale settings) is not sent: each rank keeps its own, which should be
    built by the same code. The trees are first compared with
    :func:`check_same_tree`.

    Args:
      tree: this rank's tree; only its structure, shapes and dtypes are used on
        ranks other than ``src``.
      src: the rank whose values everyone receives (a rank of the default group).
      group: the process group (default: the default group).
      name: how the tree is named in error messages.

    Returns:
      A new tree with ``src``'s values; ``tree`` itself is never written to.
    """
    _require_group("broadcast_state")
    check_same_tree(tree, group, name=name)
    leaves, spec = tree_flatten(tree)
    if not leaves:
        return tree
    is_src = dist.get_rank() == src
    out: list[Any] = list(leaves)
    tensor_ids = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    tensors = [leaves[i] for i in tensor_ids]
    # bool travels as uint8, which every backend supports.
    dtypes = [torch.uint8 if t.dtype == torch.bool else t.dtype for t in tensors]
    received: list[Any] = [None] * len(tensors)
    for indices in _buckets(tensors, dtypes, 2**62):
        dtype, device = dtypes[indices[0]], tensors[indices[0]].device
        if is_src:
            flat = _pack(tensors, indices, dtype, 1.0)
        else:
            flat = torch.empty(sum(tensors[i].numel() for i in indices), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        _unpack(flat, tensors, indices, received)
    for i, t in zip(tensor_ids, received, strict=True):
        out[i] = t
    host_ids = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)]
    if host_ids:
        values = [leaves[i] for i in host_ids]
        dist.broadcast_object_list(values, src=src, group=group)
        for i, v in zip(host_ids, values, strict=True):
            out[i] = v
    return tree_unflatten(spec, out)


# -- checkpoints ---------------------------------------------------------------


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
    """Rank ``src`` writes ``tree`` with :func:`functional_fp16.checkpoint.save_checkpoint`.

    Every rank must call it; all return once the file is complete (so any rank
    may read it afterwards), or all raise if writing failed. Since every rank
    holds the same state, the one copy is the checkpoint of the whole run.
    """
    _require_group("save_checkpoint_rank0")
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
    :func:`functional_fp16.checkpoint.load_checkpoint` (``like`` gives the
    structure and static configuration) and :func:`broadcast_state` sends its
    tensors to the others, so the file need only exist on ``src``'s machine.
    When every machine sees the file, ``load_checkpoint(path, like)`` on each
    rank does the same without communication.

    Args:
      path: the checkpoint, as written by :func:`save_checkpoint_rank0`.
      like: a tree of the same structure, shapes and dtypes on every rank,
        e.g. a freshly initialised :class:`~functional_fp16.FP16State`.
      src: the rank that reads the file.
      group: the process group (default: the default group).

    Returns:
      The checkpointed tree, bitwise the same on every rank.
    """
    _require_group("load_checkpoint_broadcast")
    tree, error = like, None
    if dist.get_rank() == src:
        try:
            tree = load_checkpoint(path, like=like)
        except Exception as err:  # reported to every rank below
            error = err
    _agree_on_error(error, src, group, f"reading checkpoint {os.fspath(path)!r}")
    return broadcast_state(tree, src=src, group=group, name="checkpoint")
