"""The training loop of ``gpt_functional.py`` and what a run writes and reads back.

:func:`fit` threads a :class:`Loop` (everything that changes: the state, the
step count, the metrics so far) through :func:`train_segment` and
:func:`end_segment`, one segment per ``--eval-interval`` steps; what stays
fixed for the run is a :class:`Fixed`. The loop only draws the batches,
calls the pure step, reads metrics back every ``--log-every`` steps, asks
the stuck-scale monitor, and after each segment evaluates and writes a
checkpoint.

* Checkpoints (``checkpoint_step_NNNNNN.pt``, the newest
  ``--keep-checkpoints`` kept) hold everything a resumed run needs to end
  bit-identical to an uninterrupted one: the state, the batch generator's
  state and the metrics so far (so that a run resumed into another
  ``--out-dir`` still writes the whole run's metrics and summary);
  :func:`load_resume` reads one back and checks that it belongs to this
  run's settings.
* ``metrics.jsonl``: one line per step (step, loss, loss_scale, skipped,
  lr) and one per evaluation (step, val_loss).
* The plot (``training.png``): train and validation loss, loss scale, learning rate.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gpt_data
import torch

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16.policy import Policy

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


HISTORY_COLUMNS = ("step", "loss", "loss_scale", "skipped", "lr")


def history_tensor(rows: list[dict]) -> torch.Tensor:
    """The per-step metrics so far as a float64 ``(steps, 5)`` tensor (for checkpoints)."""
    values = [[float(r[c]) for c in HISTORY_COLUMNS] for r in rows]
    return torch.tensor(values, dtype=torch.float64).reshape(len(rows), len(HISTORY_COLUMNS))


def history_rows(history: torch.Tensor) -> list[dict]:
    """The inverse of :func:`history_tensor`: metrics rows as written to ``metrics.jsonl``."""
    rows = []
    for values in history.tolist():
        row = dict(zip(HISTORY_COLUMNS, values))
        row["step"], row["skipped"] = int(row["step"]), bool(row["skipped"])
        rows.append(row)
    return rows


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
        "history": history_tensor(rows),
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
    if not os.path.isfile(path):
        raise SystemExit(f"error: --resume {path}: no such file")
    try:
        plain = ff.load_checkpoint(path, map_location="cpu")
    except ff.CheckpointError as err:
        raise SystemExit(f"error: --resume: {err}") from None
    if not isinstance(plain, dict) or any(k not in plain for k in CHECKPOINT_KEYS):
        raise SystemExit(f"error: --resume {path}: not a checkpoint written by this example")
    stored = plain["config"] if isinstance(plain["config"], dict) else {}
    for key in RESUME_KEYS:
        if stored.get(key) != config[key]:
            raise SystemExit(
                f"error: --resume {path}: the checkpoint was written with {key}={stored.get(key)!r}, "
                f"this run has {key}={config[key]!r}; a resumed run must use the same settings"
            )
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
    try:
        ckpt = ff.load_checkpoint(path, like=like)
    except ff.CheckpointError as err:
        raise SystemExit(f"error: --resume: {err}") from None
    torch.set_rng_state(ckpt["torch_rng"])
    if ckpt["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt["cuda_rng"])
    ckpt["rows"] = history_rows(ckpt["history"])
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
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    ax = axes[0]
    ax.plot(steps, losses, lw=0.5, alpha=0.4, label="train, per step")
    w = max(1, len(losses) // 50)
    if w > 1:
        smooth = [
            sum(losses[max(0, i - w + 1) : i + 1]) / min(w, i + 1) for i in range(len(losses))
        ]
        ax.plot(steps, smooth, lw=1.5, label=f"train, mean of {w}")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], marker="o", label="validation")
    ax.set(xlabel="step", ylabel="loss (nats/character)", title="loss")
    ax.legend()
    ax = axes[1]
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
    ax = axes[2]
    ax.plot(steps, [r["lr"] for r in rows], lw=1.0)
    ax.set(xlabel="step", ylabel="learning rate", title="learning rate")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the loop ----------------------------------------------------------------------------


@torch.no_grad()
def evaluate(eval_step, params, windows, batch_size: int, max_batches: int) -> float:
    """Mean cross-entropy over the validation windows (nats/character); one sync at the end.

    Under ``--distributed`` each rank evaluates every ``WORLD_SIZE``-th batch
    and the sums are added, so every rank gets the loss of the whole split.
    """
    inputs, targets = windows
    n = inputs.shape[0]
    if max_batches:
        n = min(n, max_batches * batch_size)
    rank, world = ffd.get_rank(), ffd.get_world_size()
    total = torch.zeros((), dtype=torch.float64, device=inputs.device)
    for start in range(rank * batch_size, n, world * batch_size):
        sl = slice(start, min(start + batch_size, n))
        total = total + eval_step(params, inputs[sl], targets[sl]).double()
    if world > 1:
        torch.distributed.all_reduce(total)
    return total.item() / (n * inputs.shape[1])


def synchronize(device: torch.device) -> None:
    """Waits for ``device``'s queued work (CUDA), so that a timer measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Loop(NamedTuple):
    """Everything the training loop changes, threaded through it explicitly."""

    state: ff.FP16State
    step: int  # optimiser steps completed
    rows: list[dict]  # per-step metrics so far (rank 0 only)
    evals: list[tuple[int, float]]  # (step, validation loss) of each evaluation so far
    speeds: list[tuple[int, float]]  # (tokens, seconds) of each segment of this process


class Fixed(NamedTuple):
    """What stays the same for the whole run: settings, data, step functions, outputs."""

    args: argparse.Namespace
    train_step: Callable[..., Any]
    eval_step: Callable[..., Any]
    train: torch.Tensor  # the training tokens, on the device
    val: tuple[torch.Tensor, torch.Tensor]  # the validation windows, on the device
    device: torch.device
    config: dict
    data_rng: torch.Generator  # draws the batches
    label: str  # "synthetic " for generated text, else ""
    main_rank: bool  # rank 0 prints and writes files
    metrics_file: Any  # metrics.jsonl (rank 0) or /dev/null
    monitor: ff.StuckScaleMonitor | None
    bar: Any  # the tqdm progress bar, or None


def draw_step_batch(fx: Fixed) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of one optimiser step's ``--grad-accum`` micro-batches: ``(k, b, T)``."""
    args = fx.args
    pairs = [
        gpt_data.sample_batch(fx.train, fx.data_rng, args.batch_size, args.context)
        for _ in range(args.grad_accum)
    ]
    rank, world = ffd.get_rank(), ffd.get_world_size()
    share = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
    inputs = torch.stack([x[share] for x, _ in pairs])
    targets = torch.stack([y[share] for _, y in pairs])
    return inputs, targets


def log_pending(fx: Fixed, pending: list, last_step: int) -> list[dict]:
    """Writes the pending steps' metrics (rank 0) and runs the stuck-scale check."""
    if not fx.main_rank or not pending:
        return []
    stacked = torch.stack(
        [torch.stack([m.loss, m.loss_scale, m.skipped.float(), m.lr]).float() for m in pending]
    ).cpu()
    first = last_step - len(pending) + 1
    rows = [
        {"step": first + i, "loss": loss, "loss_scale": scale, "skipped": bool(skip), "lr": lr}
        for i, (loss, scale, skip, lr) in enumerate(stacked.tolist())
    ]
    fx.metrics_file.writelines(metrics_lines(rows, []))
    fx.metrics_file.flush()
    if fx.monitor is not None:
        try:
            fx.monitor.check()
        except ff.StuckScaleError as err:
            fx.metrics_file.close()
            raise SystemExit(f"error: {err}") from None
    return rows


def train_segment(fx: Fixed, loop: Loop, until: int) -> tuple[Loop, list[dict]]:
    """Steps ``loop.step + 1`` to ``until``: ``loop`` in, ``loop`` out, plus the segment's rows."""
    args = fx.args
    state, step = loop.state, loop.step
    tokens_per_step = args.batch_size * args.grad_accum * args.context
    pending: list = []
    segment_rows: list[dict] = []
    synchronize(fx.device)
    t0 = time.perf_counter()
    first = step
    while step < until:
        inputs, targets = draw_step_batch(fx)
        state, m = fx.train_step(state, inputs, targets)
        if fx.monitor is not None:
            fx.monitor.observe(state, m.loss)  # sync-free; checked when logging
        step += 1
        pending.append(m)
        if len(pending) >= args.log_every or step == until:
            new_rows = log_pending(fx, pending, step)
            segment_rows += new_rows
            if fx.bar is not None:
                fx.bar.update(len(pending))
                if new_rows:
                    seconds = max(time.perf_counter() - t0, 1e-9)
                    fx.bar.set_postfix(
                        loss=f"{new_rows[-1]['loss']:.3f}",
                        scale=f"{new_rows[-1]['loss_scale']:g}",
                        lr=f"{new_rows[-1]['lr']:.2e}",
                        tok_s=f"{(step - first) * tokens_per_step / seconds:.0f}",
                    )
            pending = []
    synchronize(fx.device)
    seconds = time.perf_counter() - t0
    loop = loop._replace(
        state=state,
        step=step,
        rows=loop.rows + segment_rows,
        speeds=loop.speeds + [((step - first) * tokens_per_step, seconds)],
    )
    return loop, segment_rows


def end_segment(fx: Fixed, loop: Loop, segment_rows: list[dict]) -> Loop:
    """Validation loss, the segment's line of output, and its checkpoint."""
    args = fx.args
    val_loss = evaluate(fx.eval_step, loop.state.params, fx.val, args.batch_size, args.eval_batches)
    loop = loop._replace(evals=loop.evals + [(loop.step, val_loss)])
    if fx.main_rank:
        fx.metrics_file.write(json.dumps({"step": loop.step, "val_loss": val_loss}) + "\n")
        fx.metrics_file.flush()
        tokens, seconds = loop.speeds[-1]
        mean_loss = sum(r["loss"] for r in segment_rows) / max(1, len(segment_rows))
        skipped = sum(r["skipped"] for r in segment_rows)
        total_skipped = sum(r["skipped"] for r in loop.rows)
        line = (
            f"step {loop.step}/{args.max_steps}: train loss {mean_loss:.4f}, {fx.label}val loss "
            f"{val_loss:.4f}, {tokens / max(seconds, 1e-9):.0f} tokens/s, loss scale "
            f"{segment_rows[-1]['loss_scale'] if segment_rows else float('nan'):g}, "
            f"{skipped} skipped steps ({total_skipped} in all)"
        )
        if fx.bar is not None:
            fx.bar.write(line)
        else:
            print(line, flush=True)
    tree = checkpoint_tree(loop.state, loop.step, fx.data_rng, loop.rows, loop.evals, fx.config)
    out_dir = Path(args.out_dir)
    path = out_dir / CHECKPOINT_PATTERN.format(loop.step)
    if ffd.is_initialized():  # rank 0 writes; every rank returns once the file is complete
        ffd.save_checkpoint_rank0(path, tree)
    else:
        ff.save_checkpoint(path, tree)
    if fx.main_rank:
        prune_checkpoints(out_dir, args.keep_checkpoints)
    return loop


def progress_bar(args: argparse.Namespace, start: int):
    """A tqdm bar over the run's steps, or None (no tqdm, or --no-progress)."""
    if args.no_progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are optional
        return None
    return tqdm(
        total=args.max_steps, initial=start, desc="training", unit="step", dynamic_ncols=True
    )


def fit(args, data, state, train_step, eval_step, device, config, data_rng, start) -> dict:
    """The training loop: threads a :class:`Loop` through ``train_segment`` and ``end_segment``.

    ``start`` says where to begin: the step, and the rows and evaluations
    so far (from the checkpoint when resuming).
    """
    main_rank = ffd.is_main_process()
    metrics_path = Path(args.out_dir) / "metrics.jsonl"
    rows = list(start["rows"]) if main_rank else []
    if main_rank:  # rewrite: drops steps after the resumed checkpoint
        with open(metrics_path, "w") as f:
            f.writelines(metrics_lines(rows, start["evals"]))
    monitor = ff.StuckScaleMonitor(args.stuck_patience) if args.stuck_patience else None
    if monitor is not None:
        monitor.observe(state)  # starts the tracker from the state in force
    fx = Fixed(
        args=args,
        train_step=train_step,
        eval_step=eval_step,
        train=data.train.to(device),
        val=tuple(t.to(device) for t in gpt_data.val_windows(data.val, args.context)),
        device=device,
        config=config,
        data_rng=data_rng,
        label="synthetic " if data.synthetic else "",
        main_rank=main_rank,
        metrics_file=open(metrics_path, "a") if main_rank else open(os.devnull, "w"),
        monitor=monitor,
        bar=progress_bar(args, start["step"]),
    )
    loop = Loop(state, start["step"], rows, list(start["evals"]), [])
    while loop.step < args.max_steps:
        until = min(args.max_steps, (loop.step // args.eval_interval + 1) * args.eval_interval)
        loop, segment_rows = train_segment(fx, loop, until)
        loop = end_segment(fx, loop, segment_rows)
    fx.metrics_file.close()
    if fx.bar is not None:
        fx.bar.close()

    # Throughput over this process's segments; the first one includes the
    # warm-up (and compilation), so it is left out when there are others.
    measured = loop.speeds[1:] if len(loop.speeds) > 1 else loop.speeds
    tokens = sum(k for k, _ in measured)
    seconds = sum(s for _, s in measured)
    return {
        "state": loop.state,
        "rows": loop.rows,
        "evals": loop.evals,
        "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
        "step": loop.step,
    }
