"""Command-line flags of ``cifar10_functional.py``: one function per group of flags.

:func:`parse_args` builds the parser from the four groups (data, training,
precision and device, output), parses, and rejects values the run cannot
use with argparse's usual one-line error (exit status 2). The flags the
GPT example has too come from ``run_cli.py``.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

import cifar10_data
import run_cli

from functional_fp16.precision.policy import get_policy


def add_data_flags(d: argparse._ArgumentGroup) -> None:
    """Where the images come from: ``--dataset``, ``--data-dir``, decoding and caching."""
    d.add_argument(
        "--dataset",
        choices=cifar10_data.DATASETS,
        default="auto",
        help="auto: real CIFAR-10 if --data-dir holds it, else synthetic data (said so)",
    )
    d.add_argument(
        "--data-dir",
        default="data",
        help="torchvision CIFAR10 root, or an ImageFolder tree with train/ and test/",
    )
    d.add_argument(
        "--download",
        action="store_true",
        help="download CIFAR-10 into --data-dir if it is missing (needs network)",
    )
    d.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="DataLoader workers for the one-time ImageFolder decode",
    )
    d.add_argument(
        "--no-cache", action="store_true", help="do not read or write the decoded-ImageFolder cache"
    )
    d.add_argument(
        "--cache-dir",
        default=None,
        help="where decoded ImageFolder tensors are cached (default DATA_DIR/.decoded)",
    )
    d.add_argument("--fake-train-size", type=int, default=50000)
    d.add_argument("--fake-test-size", type=int, default=10000)


def add_training_flags(t: argparse._ArgumentGroup) -> None:
    """The recipe: epochs, batch sizes, SGD's learning rate and momentum, the seed."""
    t.add_argument("--epochs", type=int, default=10)
    t.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="the global batch; with --distributed each rank takes batch-size / WORLD_SIZE of it",
    )
    t.add_argument("--eval-batch-size", type=int, default=1000)
    t.add_argument("--lr", type=float, default=0.001)
    t.add_argument("--momentum", type=float, default=0.9)
    run_cli.add_moments_flag(t, "SGD's momentum buffers (accumulator_dtype) are")
    run_cli.add_master_flag(t)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--max-steps-per-epoch",
        type=int,
        default=0,
        help="stop each epoch after this many steps (0: the whole training set)",
    )


def add_precision_flags(m: argparse._ArgumentGroup) -> None:
    """Dtypes, loss scaling, the device and how the step runs there."""
    run_cli.add_dtype_flags(m, cpu="CPU")
    m.add_argument(
        "--policy",
        default=None,
        help="a full policy string such as 'p=f16,c=f16,o=f32'; overrides "
        "--precision and --compute-dtype",
    )
    run_cli.add_loss_scale_flags(m)
    run_cli.add_stuck_patience_flag(m)
    m.add_argument("--growth-interval", type=int, default=2000)
    run_cli.add_system_flags(
        m,
        tune_malloc_help="on CPU, keep glibc's malloc thresholds (by default they are raised with "
        "ff.tune_malloc() so that freed activations are reused instead of page-faulted anew)",
        deterministic_help="use deterministic kernels (needed on CUDA for a resumed run to end "
        "bit-identical to an uninterrupted one; CPU runs are deterministic anyway)",
        compile_help="wrap the whole train step in torch.compile(fullgraph=True). Pays off on "
        "CUDA, where this small network's eager step is bound by kernel launches; on a CPU the "
        "compiled step runs at about eager speed after a cold compile of ~30 s, so it does not "
        "pay off there",
    )
    m.add_argument(
        "--shard-master",
        action="store_true",
        help="with --distributed: each rank keeps only its 1/WORLD_SIZE slice of the FP32 master "
        "weights and momentum (ZeRO-1; functional_fp16.distributed.shard_state and "
        "sharded_update); checkpoints still hold the full state",
    )


def add_output_flags(o: argparse._ArgumentGroup) -> None:
    """What the run writes and shows: the output folder, checkpoints, metrics, progress."""
    run_cli.add_output_flags(
        o,
        out_dir="runs/cifar10",
        resume_help="continue from a checkpoint written by this script",
        keep_help="keep only the newest N epoch checkpoints (0: keep all)",
    )


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rejects, through ``p.error``, values that parse but that the run cannot use."""
    for name in ("epochs", "batch_size", "eval_batch_size", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_steps_per_epoch", "keep_checkpoints", "workers", "stuck_patience"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        p.error(f"--lr must be finite and >= 0, got {args.lr}")
    if not (math.isfinite(args.momentum) and args.momentum >= 0):
        p.error(f"--momentum must be finite and >= 0, got {args.momentum}")
    if args.shard_master and not args.distributed:
        p.error("--shard-master needs --distributed (it shards the state across the ranks)")
    if args.distributed and args.compile:
        p.error("--compile is not supported together with --distributed")
    if args.policy is not None:
        try:
            get_policy(args.policy)
        except (TypeError, ValueError) as err:
            p.error(f"--policy: {err}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's settings from ``argv`` (``sys.argv[1:]`` when ``None``); ``--help`` lists them."""
    p = argparse.ArgumentParser(
        description="Train a small CNN on CIFAR-10 with functional FP16 mixed precision.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_data_flags(p.add_argument_group("data"))
    add_training_flags(p.add_argument_group("training"))
    add_precision_flags(p.add_argument_group("precision and device"))
    add_output_flags(p.add_argument_group("output"))
    args = p.parse_args(argv)
    check_args(p, args)
    return args
