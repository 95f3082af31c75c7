"""What a run of ``gpt_functional.py`` writes and reads back.

* Checkpoints: one per evaluation (``checkpoint_step_NNNNNN.pt``, the newest
  ``--keep-checkpoints`` kept), holding everything a resumed run needs to
  end bit-identical to an uninterrupted one: the state, the batch
  generator's and the global generator's states, and the metrics so far (so
  that a run resumed into another ``--out-dir`` still writes the whole
  run's metrics and summary); :func:`load_resume` reads one back and checks
  that it belongs to this run's settings.
* ``metrics.jsonl``: one line per step (step, loss, loss_scale, skipped,
  lr) and one per evaluation (step, val_loss), see :func:`metrics_lines`.
* The plot (``training.png``): train and validation loss, loss scale, learning rate.
* :func:`peak_memory`: what the run's summary reports as its memory.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import gpt_data
import torch
from run_outputs import (
    COUNTERS,
    history_rows,
    history_tensor,
    overflow_record,
    plot_loss_scale,
    read_for_resume,
    read_like,
    restore_overflows,
    running_mean,
    save_figure,
)

import functional_fp16 as ff
from functional_fp16.precision.policy import Policy

CHECKPOINT_PATTERN = "checkpoint_step_{:06d}.pt"

# -- checkpoints and the metrics history ------------------------------------------------

RESUME_KEYS = (
    "seed",
    "batch_size",
    "grad_accum",
    "max_steps",
    "lr",
    "min_lr",
    "warmup_steps",
    "betas",
    "weight_decay",
    "clip",
    "policy",
    "model",
    "text",
)


def run_config(args: argparse.Namespace, policy: Policy, data: gpt_data.TextData, cfg) -> dict:
    """The settings a resumed run must share with the run that wrote the checkpoint."""
    return {
        "seed": args.seed,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "max_steps": args.max_steps,
        "lr": float(args.lr),
        "min_lr": float(args.min_lr),
        "warmup_steps": args.warmup_steps,
        "betas": f"{args.beta1},{args.beta2},{args.eps}",
        "weight_decay": float(args.weight_decay),
        "clip": float(args.clip),
        "policy": str(policy),
        "model": ",".join(f"{k}={v}" for k, v in cfg._asdict().items()),
        "text": f"{data.source}:{data.digest[:16]}:{data.val.numel()}",
    }


HISTORY_COLUMNS = ("step", "loss", "loss_scale", "skipped", "lr", *COUNTERS)
"""The columns of a checkpoint's ``history`` tensor; ``step`` is a count."""


def metrics_lines(rows: list[dict], evals: list[tuple[int, float]]) -> list[str]:
    """``metrics.jsonl``'s lines: each step's row, an evaluation's row after its step's."""
    by_step: dict[int, list[float]] = {}
    for step, loss in evals:
        by_step.setdefault(step, []).append(loss)
    lines = []
    for row in rows:
        lines.append(json.dumps(row) + "\n")
        for loss in by_step.pop(row["step"], []):
            lines.append(json.dumps({"step": row["step"], "val_loss": loss}) + "\n")
    return lines


def checkpoint_tree(state, step, data_rng, rows, evals, config) -> dict:
    """Everything needed to continue bit-identically, as plain tensors and numbers."""
    return {
        "history": history_tensor(rows, HISTORY_COLUMNS),
        "overflows": overflow_record(rows),  # each skipped step's non-finite leaves
        "evals": torch.tensor(evals, dtype=torch.float64).reshape(len(evals), 2),
        "state": state,
        "step": step,  # optimiser steps completed
        "data_rng": data_rng.get_state(),  # draws the batches
        "torch_rng": torch.get_rng_state(),  # dropout
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "config": config,
    }


CHECKPOINT_KEYS = (
    "history",
    "evals",
    "state",
    "step",
    "data_rng",
    "torch_rng",
    "cuda_rng",
    "config",
)


def load_resume(path: str, state: ff.FP16State, config: dict) -> dict:
    """Reads a checkpoint, checks it belongs to this run's settings, restores the RNG states.

    The file is read twice: once without a template to learn its sizes and
    settings, then against a template built from this run's fresh state,
    which checks every tensor's shape and dtype and puts the state on this
    run's device. Returns the tree with ``rows`` and ``evals`` decoded.
    """
    plain = read_for_resume(path, config, CHECKPOINT_KEYS, RESUME_KEYS)
    like = {
        "history": torch.empty_like(plain["history"]),
        "evals": torch.empty_like(plain["evals"]),
        "state": state,
        "step": 0,
        "data_rng": torch.empty_like(plain["data_rng"]),
        "torch_rng": torch.empty_like(plain["torch_rng"]),
        "cuda_rng": None if plain["cuda_rng"] is None else torch.empty_like(plain["cuda_rng"]),
        "config": config,
    }
    if "overflows" in plain:  # (absent from checkpoints written before it was kept)
        like["overflows"] = plain["overflows"]
    ckpt = read_like(path, like)
    ckpt["rows"] = history_rows(ckpt["history"], HISTORY_COLUMNS, ("step", *COUNTERS))
    ckpt["rows"] = restore_overflows(ckpt["rows"], ckpt.get("overflows", []))
    ckpt["evals"] = [(int(s), v) for s, v in ckpt["evals"].tolist()]
    return ckpt


def prune_checkpoints(out_dir: Path, keep: int) -> None:
    """Deletes all but the newest ``keep`` step checkpoints (``keep <= 0``: none)."""
    if keep <= 0:
        return
    pattern = re.compile(r"checkpoint_step_(\d{6,})\.pt")
    found = sorted(
        (int(m.group(1)), p) for p in out_dir.iterdir() if (m := pattern.fullmatch(p.name))
    )
    for _, path in found[:-keep]:
        path.unlink(missing_ok=True)


# -- memory and the plot ---------------------------------------------------------------


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak bytes and what they measure: CUDA's allocated memory, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocated"
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024, "process peak RSS"
    except (OSError, ValueError):
        pass
    return 0, "unknown"


def plot_metrics(path: Path, rows: list[dict], evals: list[tuple[int, float]], title: str) -> None:
    """PNG with train and validation loss, the loss scale and the learning rate per step."""

    def draw(axes) -> None:
        steps = [r["step"] for r in rows]
        losses = [r["loss"] for r in rows]
        ax = axes[0]
        ax.plot(steps, losses, lw=0.5, alpha=0.4, label="train, per step")
        w = max(1, len(losses) // 50)
        if w > 1:
            ax.plot(steps, running_mean(losses, w), lw=1.5, label=f"train, mean of {w}")
        if evals:
            ax.plot([s for s, _ in evals], [v for _, v in evals], marker="o", label="validation")
        ax.set(xlabel="step", ylabel="loss (nats/character)", title="loss")
        ax.legend()
        plot_loss_scale(axes[1], rows)
        ax = axes[2]
        ax.plot(steps, [r["lr"] for r in rows], lw=1.0)
        ax.set(xlabel="step", ylabel="learning rate", title="learning rate")

    save_figure(path, title, draw)
