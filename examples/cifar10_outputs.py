"""What a run of ``cifar10_functional.py`` writes and reads back.

* Checkpoints: one per epoch (``checkpoint_epoch_NNN.pt``, the newest
  ``--keep-checkpoints`` kept), holding everything a resumed run needs to end
  bit-identical to an uninterrupted one; :func:`load_resume` reads one back and
  checks that it belongs to this run's settings.
* The metrics history: every step's ``metrics.jsonl`` row so far, stored in the
  checkpoint as one float64 tensor, so that a run resumed into another
  ``--out-dir`` still writes the whole run's metrics and summary.
* The plot (``training.png``): loss and loss scale per step, test accuracy per epoch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cifar10_data
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

from functional_fp16.precision.policy import Policy

CHECKPOINT_PATTERN = "checkpoint_epoch_{:03d}.pt"

# -- checkpoints ------------------------------------------------------------------------

RESUME_KEYS = ("seed", "batch_size", "lr", "momentum", "max_steps_per_epoch", "policy", "dataset")


def run_config(args: argparse.Namespace, policy: Policy, data: cifar10_data.Data) -> dict:
    """The settings a resumed run must share with the run that wrote the checkpoint."""
    return {
        "seed": args.seed,
        "batch_size": args.batch_size,
        "lr": float(args.lr),
        "momentum": float(args.momentum),
        "max_steps_per_epoch": args.max_steps_per_epoch,
        "policy": str(policy),
        "dataset": f"{data.source}:{data.train.labels.shape[0]}+{data.test.labels.shape[0]}",
    }


HISTORY_COLUMNS = ("step", "epoch", "loss", "loss_scale", "skipped", "lr", *COUNTERS)
"""The columns of a checkpoint's ``history`` tensor; ``step`` and ``epoch`` are counts."""


def checkpoint_tree(state, buffers, epoch, global_step, data_rng, accuracies, config, rows) -> dict:
    """Everything needed to continue bit-identically, as plain tensors and numbers.

    ``history`` holds every step's metrics so far, so that a run resumed into
    another ``--out-dir`` still writes the whole run's ``metrics.jsonl`` and summary.
    """
    return {
        "history": history_tensor(rows, HISTORY_COLUMNS),
        "overflows": overflow_record(rows),  # each skipped step's non-finite leaves
        "state": state,
        "buffers": buffers,
        "epoch": epoch,  # epochs completed
        "global_step": global_step,  # training steps completed
        "data_rng": data_rng.get_state(),  # draws each epoch's shuffle
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "test_accuracy": torch.tensor(accuracies, dtype=torch.float64),
        "config": config,
    }


CHECKPOINT_KEYS = (
    "history",
    "state",
    "buffers",
    "epoch",
    "global_step",
    "data_rng",
    "torch_rng",
    "cuda_rng",
    "test_accuracy",
    "config",
)


def load_resume(path: str, state, buffers, config: dict) -> dict:
    """Reads a checkpoint, checks it belongs to this run's settings, restores RNG states.

    The checkpoint is read twice: once without a template to learn its sizes
    and settings, then against a template built from this run's freshly
    initialised state, which checks every tensor's shape and dtype and puts
    the state on this run's device. Returns the tree with ``rows`` decoded.
    """
    plain = read_for_resume(path, config, CHECKPOINT_KEYS, RESUME_KEYS)
    like = {
        "history": torch.empty_like(plain["history"]),
        "state": state,
        "buffers": buffers,
        "epoch": 0,
        "global_step": 0,
        "data_rng": torch.empty_like(plain["data_rng"]),
        "torch_rng": torch.empty_like(plain["torch_rng"]),
        "cuda_rng": None if plain["cuda_rng"] is None else torch.empty_like(plain["cuda_rng"]),
        "test_accuracy": torch.empty_like(plain["test_accuracy"]),
        "config": config,
    }
    if "overflows" in plain:  # (absent from checkpoints written before it was kept)
        like["overflows"] = plain["overflows"]
    ckpt = read_like(path, like)
    ckpt["rows"] = history_rows(ckpt["history"], HISTORY_COLUMNS, ("step", "epoch", *COUNTERS))
    ckpt["rows"] = restore_overflows(ckpt["rows"], ckpt.get("overflows", []))
    return ckpt


def prune_checkpoints(out_dir: Path, keep: int, epoch: int) -> None:
    """Deletes the epoch checkpoints older than the newest ``keep`` (``keep <= 0``: none)."""
    if keep <= 0:
        return
    for old in range(1, epoch - keep + 1):
        path = out_dir / CHECKPOINT_PATTERN.format(old)
        if path.exists():
            path.unlink()


# -- the plot -------------------------------------------------------------------------


def plot_metrics(path: Path, rows: list[dict], accuracies: list[float], title: str) -> None:
    """PNG with the loss and the loss scale per step and the test accuracy per epoch."""

    def draw(axes) -> None:
        import matplotlib.ticker

        steps = [r["step"] for r in rows]
        losses = [r["loss"] for r in rows]
        ax = axes[0]
        ax.plot(steps, losses, lw=0.5, alpha=0.4, label="per step")
        if len(losses) >= 10:
            w = max(1, len(losses) // 50)
            ax.plot(steps, running_mean(losses, w), lw=1.5, label=f"mean of {w}")
        ax.set(xlabel="step", ylabel="training loss", title="loss")
        ax.legend()
        plot_loss_scale(axes[1], rows)
        ax = axes[2]
        ax.plot(range(1, len(accuracies) + 1), accuracies, marker="o")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")

    save_figure(path, title, draw)
