"""What the examples share about setting up a run: the device, the process, data
parallelism, the precision policy and loss scale, the data and the output folder.

Imported by ``cifar10_functional.py`` and ``gpt_functional.py`` (and their
siblings) from the ``examples`` folder; the flags these read are
``run_cli.py``'s, and what a run writes is ``run_outputs.py``'s.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from run_cli import PRECISIONS

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16.precision.policy import Policy, default_loss_scale

T = TypeVar("T")


def resolve_device(name: str) -> torch.device:
    """The device ``--device`` names (``auto``: CUDA if there is one, else the CPU)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available on this machine")
    return torch.device(name)


def configure_process(args: argparse.Namespace, device: torch.device, quiet: bool = False) -> None:
    """Process-wide settings for fast CPU training, each said once.

    The forward and backward passes allocate and free tens of megabytes of
    activations per step; glibc returns such blocks to the system and
    page-faults them back in on the next step (about 9,000 faults per step
    here). ``ff.tune_malloc()`` keeps them in the heap instead.
    """
    if device.type != "cpu" or args.no_tune_malloc:
        return
    if ff.tune_malloc() and not quiet:
        print(
            "note: glibc malloc thresholds raised (ff.tune_malloc; --no-tune-malloc to keep them)"
        )


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), so BF16 beats FP32."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:  # a private probe: never let it break the example
        return False


def start_distributed(args: argparse.Namespace, device: torch.device) -> tuple[Any, torch.device]:
    """``(info, device)`` of a ``--distributed`` run under ``torchrun`` (``(None, device)``
    otherwise). ``--batch-size`` is the global batch, so it must split evenly over the
    ranks; every rank but 0 stays silent (no output, no progress bar)."""
    if not args.distributed:
        return None, device
    info = ffd.init_from_env(device if device.type == "cpu" else None)
    if args.batch_size % info.world_size:
        raise SystemExit(
            f"error: --batch-size {args.batch_size} must be divisible by WORLD_SIZE "
            f"{info.world_size} (it is the global batch)"
        )
    if not info.is_main:  # rank 0 alone prints, shows progress and writes files
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
        args.no_progress = True
    return info, info.device


def end_process() -> None:
    """Ends a process ``torchrun`` started, once its run is done (files written and
    closed, its process group destroyed), without Python's finalisation.

    PyTorch's C++ threads that outlive a run (gloo's, a finished collective's
    leftovers) can take the GIL while the interpreter is being torn down; a thread
    that does so is ended mid-call and the process aborts ("terminate called
    without an active exception") after a run that succeeded. A process started
    otherwise ends normally; an error raised before this propagates as usual.
    """
    if "LOCAL_RANK" in os.environ:  # set by torchrun
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def use_deterministic_kernels() -> None:
    """What ``--deterministic`` does: deterministic torch kernels, no cuDNN autotuning.

    ``CUBLAS_WORKSPACE_CONFIG`` is set (unless already set) before cuBLAS starts.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def start_run(args: argparse.Namespace) -> tuple[Any, torch.device]:
    """``(info, device)`` of this process: the ``--device``, ``--distributed``
    (see :func:`start_distributed`), ``--deterministic`` and the process settings
    of :func:`configure_process`, in that order."""
    device = resolve_device(args.device)
    info, device = start_distributed(args, device)
    if args.deterministic:
        use_deterministic_kernels()
    configure_process(args, device)
    return info, device


def auto_policy(
    args: argparse.Namespace, device: torch.device, fast_bf16: Callable[[], bool]
) -> Policy:
    """The policy of ``--precision`` and ``--compute-dtype`` (``auto``: see below).

    On CUDA the computation runs in the parameter dtype. A CPU has no fast
    FP16 arithmetic, so there FP16 parameters compute in BF16 when
    ``fast_bf16()`` says the CPU has native BF16 and in FP32 otherwise (they
    still get FP16 gradients, so loss scaling is exercised). Outputs are FP32.
    """
    param = PRECISIONS[args.precision]
    if args.compute_dtype != "auto":
        compute = PRECISIONS[args.compute_dtype]
    elif device.type == "cpu" and param == torch.float16:
        compute = torch.bfloat16 if fast_bf16() else torch.float32
    else:
        compute = param
    return Policy(param, compute, torch.float32)


def loss_scale_from_flags(args: argparse.Namespace, policy: Policy, **dynamic: Any) -> ff.LossScale:
    """The loss scale ``--loss-scale`` asks for (``auto``: the policy's default kind).

    A dynamic one starts at ``--init-scale`` and grows every
    ``--growth-interval`` steps; ``dynamic`` holds the job's further
    ``DynamicLossScale`` settings (the GPT example's ``hysteresis``).
    """
    kind = args.loss_scale
    if kind == "auto":
        kind = "dynamic" if isinstance(default_loss_scale(policy), ff.DynamicLossScale) else "none"
    if kind == "none":
        return ff.NoOpLossScale()
    return ff.DynamicLossScale(
        init_scale=args.init_scale, growth_interval=args.growth_interval, **dynamic
    )


def load_data_once(info: Any, download: bool, load: Callable[[], T], error: type[Exception]) -> T:
    """``load()`` on every rank, rank 0 first when it may download (``--download``
    under ``--distributed``), so the other ranks find the files it fetched. An
    ``error`` from ``load`` ends the program with one line."""
    if info is not None and download and not info.is_main:
        torch.distributed.barrier()  # rank 0 downloads first
    try:
        data = load()
    except error as err:
        raise SystemExit(f"error: {err}") from None
    if info is not None and download and info.is_main:
        torch.distributed.barrier()
    return data


def make_out_dir(path: str) -> Path:
    """``--out-dir`` as a path, created by rank 0 (the one rank that writes files)."""
    out_dir = Path(path)
    if ffd.is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir


def print_distributed(info: Any, batch_size: int) -> None:
    """The line saying how a ``--distributed`` run splits the global batch (none otherwise)."""
    if info is not None:
        print(
            f"distributed: {info.world_size} ranks ({info.backend}), global batch "
            f"{batch_size} = {batch_size // info.world_size} per rank",
            flush=True,
        )


def synchronize(device: torch.device) -> None:
    """Waits for ``device``'s queued work (CUDA), so that a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
