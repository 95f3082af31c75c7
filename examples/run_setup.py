"""What the examples share about setting up a run: the device, the process, data parallelism, the loss-scale plot.

Imported by ``cifar10_functional.py`` and ``gpt_functional.py`` (and their
siblings) from the ``examples`` folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

import functional_fp16 as ff
from functional_fp16 import distributed as ffd


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


def plot_loss_scale(ax: Any, rows: list[dict]) -> None:
    """The loss scale per step on a log-2 axis, skipped steps marked with red crosses."""
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss_scale"] for r in rows], lw=1.0)
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        ax.scatter(
            [r["step"] for r in skipped],
            [r["loss_scale"] for r in skipped],
            color="red",
            marker="x",
            s=20,
            label=f"skipped ({len(skipped)})",
            zorder=3,
        )
        ax.legend()
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale", title="loss scale")


def read_for_resume(
    path: str, config: dict, checkpoint_keys: tuple[str, ...], resume_keys: tuple[str, ...]
) -> dict:
    """The checkpoint at ``path`` read without a template, after checking it is one of
    this example's (``checkpoint_keys`` present) written with this run's settings (equal
    ``resume_keys`` in its ``config``). Every failure ends the program with one line."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --resume {path}: no such file")
    try:
        plain = ff.load_checkpoint(path, map_location="cpu")
    except ff.CheckpointError as err:
        raise SystemExit(f"error: --resume: {err}") from None
    if not isinstance(plain, dict) or any(k not in plain for k in checkpoint_keys):
        raise SystemExit(f"error: --resume {path}: not a checkpoint written by this example")
    stored = plain["config"] if isinstance(plain["config"], dict) else {}
    for key in resume_keys:
        if stored.get(key) != config[key]:
            raise SystemExit(
                f"error: --resume {path}: the checkpoint was written with {key}={stored.get(key)!r}, "
                f"this run has {key}={config[key]!r}; a resumed run must use the same settings"
            )
    return plain
