"""Command-line flags of ``gpt_functional.py``: one function per group of flags.

:func:`parse_args` builds the parser from the groups (data, model, training,
precision and device, output), parses, fills the model and batch settings
left unset from ``--preset``, and rejects values the run cannot use with
argparse's usual one-line error (exit status 2). ``benchmarks/stock_gpt.py``
builds its parser from the same data, model and training groups, so both
sides of the comparison take the same settings. The flags the CIFAR-10
example has too come from ``run_cli.py``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import run_cli

PRESETS = {
    # Runs on a 2-core CPU in about five minutes at 2,000 steps.
    "default": {
        "layers": 4,
        "heads": 4,
        "width": 128,
        "context": 128,
        "batch_size": 32,
        "max_steps": 2000,
        "vocab_size": 0,
    },
    # GPT-2 small (124M parameters with GPT-2's vocabulary of 50,257): one
    # step, to see that it runs and what memory it takes. Meant for a GPU.
    "gpt2": {
        "layers": 12,
        "heads": 12,
        "width": 768,
        "context": 1024,
        "batch_size": 8,
        "max_steps": 1,
        "vocab_size": 50257,
    },
}
"""Model size, batch and run length of each ``--preset``; flags given explicitly win."""


def add_data_flags(d: argparse._ArgumentGroup) -> None:
    """Where the text comes from: ``--text``, ``--data-dir``/``--download``, ``--synthetic``."""
    d.add_argument("--text", default=None, metavar="PATH", help="train on this UTF-8 text file")
    d.add_argument(
        "--data-dir",
        default="data",
        help="where Tiny Shakespeare is kept (tinyshakespeare.txt) and --download puts it",
    )
    d.add_argument(
        "--download",
        action="store_true",
        help="fetch Tiny Shakespeare into --data-dir if it is not there (needs network)",
    )
    d.add_argument(
        "--synthetic",
        action="store_true",
        help="train on generated play-like text (what a run without any text falls back to)",
    )
    d.add_argument(
        "--synthetic-chars",
        type=int,
        default=1_115_394,
        help="length of the synthetic text (default: Tiny Shakespeare's)",
    )
    d.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="the last fraction of the text, held out for validation",
    )


def add_model_flags(m: argparse._ArgumentGroup) -> None:
    """The transformer's size; unset ones come from ``--preset``."""
    m.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="default",
        help="default: 4 layers, 4 heads, width 128, context 128, batch 32, 2000 steps; gpt2: "
        "GPT-2 small (12 layers, 12 heads, width 768, context 1024, vocabulary 50257, "
        "124M parameters), batch 8, one step, reporting its memory (meant for a GPU)",
    )
    m.add_argument("--layers", type=int, default=None, help="transformer blocks")
    m.add_argument("--heads", type=int, default=None, help="attention heads per block")
    m.add_argument("--width", type=int, default=None, help="embedding width (n_embd)")
    m.add_argument("--context", type=int, default=None, help="context length in characters")
    m.add_argument("--dropout", type=float, default=0.0)


def add_training_flags(t: argparse._ArgumentGroup) -> None:
    """The recipe: batch, steps, AdamW, the schedule, clipping, evaluation, the seed."""
    t.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="sequences per micro-batch (the global one; with --distributed each rank takes "
        "batch-size / WORLD_SIZE of it); from --preset when unset",
    )
    t.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimiser step (MultiSteps: one loss scale per window)",
    )
    t.add_argument("--max-steps", type=int, default=None, help="optimiser steps (from --preset)")
    t.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    t.add_argument("--min-lr", type=float, default=1e-4, help="learning rate at --max-steps")
    t.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear warmup steps (default: 100, or a tenth of --max-steps if that is fewer)",
    )
    t.add_argument("--beta1", type=float, default=0.9)
    t.add_argument("--beta2", type=float, default=0.99)
    t.add_argument("--eps", type=float, default=1e-8)
    t.add_argument(
        "--weight-decay",
        type=float,
        default=0.1,
        help="AdamW's decoupled decay, on the linear layers' weight matrices only",
    )
    run_cli.add_moments_flag(t, "AdamW's two moments are")
    run_cli.add_master_flag(t)
    t.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: none)")
    t.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    t.add_argument("--eval-interval", type=int, default=250, help="evaluate every N steps")
    t.add_argument(
        "--eval-batches",
        type=int,
        default=0,
        help="batches of validation windows per evaluation (0: the whole validation split)",
    )


def add_precision_flags(m: argparse._ArgumentGroup) -> None:
    """Dtypes, loss scaling, the device and how the step runs there."""
    run_cli.add_dtype_flags(m, cpu="a CPU")
    run_cli.add_loss_scale_flags(m)
    m.add_argument("--growth-interval", type=int, default=2000)
    m.add_argument(
        "--hysteresis",
        type=int,
        default=2,
        help="overflows tolerated before the scale backs off (Megatron-LM's hysteresis; 1: "
        "every overflow backs off, as GradScaler does); overflowed steps are always skipped",
    )
    run_cli.add_stuck_patience_flag(m)
    run_cli.add_system_flags(
        m,
        tune_malloc_help="on a CPU, keep glibc's malloc thresholds (by default ff.tune_malloc() "
        "raises them)",
        deterministic_help="deterministic kernels (needed on CUDA for a resumed run to end "
        "bit-identical)",
        compile_help="compile the whole training step (every micro-batch's forward and "
        "backward pass and the update) as one torch.compile(fullgraph=True) graph",
    )


def add_sample_flags(o: argparse._ArgumentGroup) -> None:
    """What is sampled from the trained model at the end: ``--sample-chars``, ``--sample-seed``."""
    o.add_argument(
        "--sample-chars", type=int, default=300, help="characters sampled at the end (0: none)"
    )
    o.add_argument("--sample-seed", type=int, default=0, help="the sampling generator's fixed seed")


def add_output_flags(o: argparse._ArgumentGroup) -> None:
    """What the run writes and shows: the output folder, checkpoints, metrics, progress."""
    run_cli.add_output_flags(
        o,
        out_dir="runs/gpt",
        resume_help="continue from a checkpoint of this script",
        keep_help="keep only the newest N checkpoints (0: keep all)",
        job_flags=add_sample_flags,
    )


def apply_preset(args: argparse.Namespace) -> None:
    """Fills the model size, batch and step count not given on the command line from the preset."""
    preset = PRESETS[args.preset]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.vocab_size = preset["vocab_size"]  # 0: the text's own vocabulary
    if args.warmup_steps is None:
        args.warmup_steps = min(100, args.max_steps // 10)


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rejects, through ``p.error``, values that parse but that the run cannot use."""
    positive = ("layers", "heads", "width", "context", "batch_size", "grad_accum", "max_steps")
    for name in (*positive, "eval_interval", "log_every", "synthetic_chars"):
        if getattr(args, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup_steps", "eval_batches", "keep_checkpoints", "stuck_patience"):
        if getattr(args, name, 0) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if getattr(args, "sample_chars", 0) < 0:
        p.error(f"--sample-chars must be >= 0, got {args.sample_chars}")
    if args.width % args.heads:
        p.error(f"--width {args.width} must be divisible by --heads {args.heads}")
    if args.warmup_steps >= args.max_steps:
        p.error(f"--warmup-steps {args.warmup_steps} must be below --max-steps {args.max_steps}")
    for name in ("lr", "min_lr", "weight_decay", "clip", "eps"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            p.error(f"--{name.replace('_', '-')} must be finite and >= 0, got {value}")
    if args.min_lr > args.lr:
        p.error(f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")
    for name in ("beta1", "beta2", "dropout"):
        if not 0.0 <= getattr(args, name) < 1.0:
            p.error(f"--{name} must be in [0, 1), got {getattr(args, name)}")
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if getattr(args, "distributed", False) and getattr(args, "compile", False):
        p.error("--compile is not supported together with --distributed")


def build_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the data, model and training groups (what both sides of the comparison share)."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_data_flags(p.add_argument_group("data"))
    add_model_flags(p.add_argument_group("model"))
    add_training_flags(p.add_argument_group("training"))
    return p


def finish(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv``, applies the preset and checks the values."""
    args = p.parse_args(argv)
    apply_preset(args)
    check_args(p, args)
    return args


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The example's settings from ``argv`` (``sys.argv[1:]`` when ``None``); ``--help`` lists them."""
    p = build_parser("Train a character-level GPT with functional FP16 mixed precision.")
    add_precision_flags(p.add_argument_group("precision and device"))
    add_output_flags(p.add_argument_group("output"))
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the FP16 model with FSDP2 (fully_shard per block) over the processes "
        "torchrun starts, step the DTensor state with fp16_update; --resume then takes the "
        "DCP directory a --fsdp run wrote (its dcp_final)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="with --fsdp: tensor parallelism over groups of N ranks (torchtitan's plan, "
        "examples/gpt_tp.py) inside, FSDP2 over the (ranks / N) groups: a 2-D mesh",
    )
    args = finish(p, argv)
    if args.tp < 1:
        p.error(f"--tp must be at least 1, got {args.tp}")
    if args.tp > 1 and not args.fsdp:
        p.error("--tp needs --fsdp (the 2-D mesh's other dimension)")
    if args.fsdp:
        if args.compile:
            p.error("--compile is not supported together with --fsdp")
        args.distributed = True  # the process group of torchrun, as --distributed starts it
    return args
