"""The command-line flags the examples share: precision, loss scaling, the device, the outputs.

``cifar10_cli.py`` and ``gpt_cli.py`` build their "precision and device" and
"output" groups from these functions, in their own order and with their own
flags in between; where the two jobs say different things (what ``--compile``
compiles, which checkpoints ``--keep-checkpoints`` counts) the text is an
argument.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
"""The ``--precision`` and ``--compute-dtype`` names and their dtypes."""


def add_dtype_flags(m: argparse._ArgumentGroup, cpu: str) -> None:
    """``--precision`` and ``--compute-dtype``; ``cpu`` names the CPU in the help (``"CPU"``, ``"a CPU"``)."""
    m.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="fp16",
        help="parameter dtype (an FP32 master copy is always kept)",
    )
    m.add_argument(
        "--compute-dtype",
        choices=["auto", *sorted(PRECISIONS)],
        default="auto",
        help=f"dtype of the forward/backward pass; auto: the parameter dtype on CUDA; on {cpu} "
        "(no fast FP16) fp16 parameters compute in bf16 if the CPU has native BF16, else fp32",
    )


MOMENT_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "e4m3": "e4m3", "int8": "e4m3"}
"""``--moments`` -> the optimiser's ``mu_dtype``/``nu_dtype``/``accumulator_dtype``."""


def add_moments_flag(t: argparse._ArgumentGroup, what: str) -> None:
    """``--moments fp32|bf16|e4m3`` (``int8``: the former name of ``e4m3``): how the optimiser stores ``what`` (see MOMENT_DTYPES)."""
    t.add_argument(
        "--moments",
        choices=sorted(MOMENT_DTYPES),
        default="fp32",
        help=f"how {what} stored: FP32, BF16, or 8-bit E4M3 block codes (int8: an alias) "
        "(functional_fp16.precision.moment_storage); the arithmetic is FP32 in every case",
    )


def add_master_flag(t: argparse._ArgumentGroup) -> None:
    """``--master float32|split``: how the FP32 master is held (``fp16_init``'s ``master``)."""
    t.add_argument(
        "--master",
        choices=["float32", "split"],
        default="float32",
        help="how the FP32 master is held: a float32 copy (4 B/param), or split: FP16 params "
        "plus an int16 residual per parameter that hold it exactly (2 B/param; "
        "functional_fp16.precision.master_split)",
    )


def moment_dtype(args: argparse.Namespace) -> torch.dtype | str | None:
    """The dtype ``--moments`` names (``None``: FP32, the optimiser's default)."""
    return MOMENT_DTYPES[getattr(args, "moments", "fp32")]


def add_loss_scale_flags(m: argparse._ArgumentGroup) -> None:
    """``--loss-scale`` (which kind) and ``--init-scale`` (where a dynamic scale starts)."""
    m.add_argument(
        "--loss-scale",
        choices=["auto", "dynamic", "none"],
        default="auto",
        help="auto: dynamic when the policy involves float16, none otherwise",
    )
    m.add_argument("--init-scale", type=float, default=2.0**16)


def add_stuck_patience_flag(m: argparse._ArgumentGroup) -> None:
    """``--stuck-patience``: when the stuck-scale monitor ends the run."""
    m.add_argument(
        "--stuck-patience",
        type=int,
        default=20,
        help="stop with an error after N consecutive skipped steps at the minimum loss scale "
        "or with a non-finite loss, checked when metrics are logged (0: never)",
    )


def add_system_flags(
    m: argparse._ArgumentGroup, *, tune_malloc_help: str, deterministic_help: str, compile_help: str
) -> None:
    """``--device``, ``--no-tune-malloc``, ``--deterministic``, ``--compile``, ``--distributed``.

    The three help texts are the job's own: how much each says about the
    malloc thresholds and determinism, and what the job compiles.
    """
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    m.add_argument("--no-tune-malloc", action="store_true", help=tune_malloc_help)
    m.add_argument("--deterministic", action="store_true", help=deterministic_help)
    m.add_argument("--compile", action="store_true", help=compile_help)
    m.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel over the processes started by torchrun (gloo on CPU, NCCL on CUDA)",
    )


def add_output_flags(
    o: argparse._ArgumentGroup,
    *,
    out_dir: str,
    resume_help: str,
    keep_help: str,
    job_flags: Callable[[argparse._ArgumentGroup], None] | None = None,
) -> None:
    """The output folder, ``--resume``, checkpoint pruning, logging, progress and plot.

    ``out_dir`` is the default ``--out-dir``; ``resume_help`` and ``keep_help``
    say which checkpoints the job writes; ``job_flags`` adds the job's own
    output flags, listed after ``--log-every``.
    """
    o.add_argument("--out-dir", default=out_dir)
    o.add_argument("--resume", default=None, metavar="PATH", help=resume_help)
    o.add_argument("--keep-checkpoints", type=int, default=3, help=keep_help)
    o.add_argument(
        "--log-every",
        type=int,
        default=25,
        help="read metrics back from the device every N steps (no per-step sync)",
    )
    if job_flags is not None:
        job_flags(o)
    o.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")
    o.add_argument("--no-plot", action="store_true", help="do not write training.png")
