"""Process-group set-up for data parallelism: ``init_from_env`` under torchrun, rank queries."""

from __future__ import annotations

import datetime
import os
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "ProcessGroup",
    "DistInfo",
    "backend_for",
    "init_from_env",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "is_main_process",
]

if dist.is_available():
    # ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default
    # argument of its collectives when it is first imported, and torch imports
    # it lazily (the first meta-device op is enough). Imported after the default
    # group exists, those defaults keep the group alive past
    # ``destroy_process_group``: its gloo worker threads run on into interpreter
    # shutdown, where one that drops the last collective's tensors cannot take
    # the GIL and the process aborts ("terminate called without an active
    # exception"). Imported here, before any group exists, the defaults are None.
    import torch.distributed.nn.functional  # noqa: F401

ProcessGroup = Any
"""A ``torch.distributed.ProcessGroup``, or ``None`` for the default group."""

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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


def shutdown(*, wait_for_peers: bool = False) -> None:
    """Destroys the default process group if there is one (call at the end of every rank).

    The group's backend is freed here, not at interpreter exit: gloo's worker
    threads are joined before this returns, provided nothing else still holds
    the group (importing this module first keeps ``torch.distributed.nn`` from
    doing so).

    Args:
      wait_for_peers: first wait until every rank has reached this call (a barrier), so
        that no rank tears its connections down while another still has work queued
        on them (rank 0 writing its last files after a collective). For the normal
        end of a run, where every rank gets here; not for a rank that is leaving
        after an error.
    """
    if dist.is_available() and dist.is_initialized():
        if wait_for_peers:
            dist.barrier()
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


def require_group(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs a torch.distributed process group, but none is initialised: call "
            "functional_fp16.distributed.init_from_env() in a script started by torchrun "
            "(or torch.distributed.init_process_group) first"
        )
