"""The training loop of ``cifar10_functional.py``: epochs of pure steps, then evaluation.

:func:`fit` threads a :class:`Loop` (everything that changes: the state, the
buffers, the step count, the metrics so far) through :func:`train_epoch` and
:func:`end_epoch`; what stays fixed for the run is a :class:`Fixed`. The step
functions come from the example's ``make_train_step`` and ``make_eval_step``;
the loop only calls them, reads metrics back every ``--log-every`` steps, asks
the stuck-scale monitor, evaluates and writes a checkpoint after each epoch.
Under ``--distributed`` every rank runs this loop on its share of each batch;
rank 0 alone writes files.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import cifar10_data
import torch
from cifar10_outputs import (
    CHECKPOINT_PATTERN,
    checkpoint_tree,
    prune_checkpoints,
    run_config,
)
from run_outputs import (
    COUNTERS,
    SkipReporter,
    name_nonfinite,
    open_metrics,
    progress_bar,
    save_checkpoint,
    stuck_monitor,
    throughput,
    write_metrics,
)
from run_setup import synchronize

import functional_fp16 as ff
from functional_fp16 import distributed as ffd

if TYPE_CHECKING:
    from cifar10_functional import StepMetrics


@torch.no_grad()
def evaluate(eval_step, params, buffers, split: cifar10_data.Split, batch_size: int) -> float:
    """Test accuracy in percent; one host synchronisation at the end.

    Under ``--distributed`` each rank evaluates every ``WORLD_SIZE``-th batch and
    the counts are summed, so every rank gets the accuracy of the whole split.
    """
    n = split.labels.shape[0]
    rank, world = ffd.get_rank(), ffd.get_world_size()
    correct = torch.zeros((), dtype=torch.int64, device=split.labels.device)
    for start in range(rank * batch_size, n, world * batch_size):
        sl = slice(start, start + batch_size)
        correct = correct + eval_step(params, buffers, split.images[sl], split.labels[sl])
    if world > 1:
        torch.distributed.all_reduce(correct)
    return 100.0 * correct.item() / n


def epoch_order(data_rng: torch.Generator, n: int, batch_size: int, max_steps: int) -> torch.Tensor:
    """This epoch's shuffled indices, trimmed to whole batches (and to ``max_steps``)."""
    order = torch.randperm(n, generator=data_rng)
    steps = n // batch_size
    if max_steps:
        steps = min(steps, max_steps)
    return order[: steps * batch_size]


class Loop(NamedTuple):
    """Everything the training loop changes, threaded through it explicitly."""

    state: ff.FP16State
    buffers: dict[str, torch.Tensor]
    global_step: int  # training steps completed
    accuracies: list[float]  # test accuracy after each completed epoch
    rows: list[dict]  # per-step metrics so far (rank 0 only; the other ranks keep none)
    speeds: list[tuple[int, float]]  # (images, seconds) of each epoch of this process


class Fixed(NamedTuple):
    """What stays the same for the whole run: settings, data, step functions, outputs."""

    args: argparse.Namespace
    train_step: Callable[..., Any]
    eval_step: Callable[..., Any]
    train: cifar10_data.Split
    test: cifar10_data.Split
    device: torch.device
    config: dict
    data_rng: torch.Generator  # draws each epoch's shuffle
    label: str  # "synthetic " for generated data, else ""
    main_rank: bool  # rank 0 prints and writes files
    metrics_file: Any  # metrics.jsonl (rank 0) or /dev/null
    monitor: ff.StuckScaleMonitor | None
    leaf_names: list[str]  # the parameters' paths, as ff.nonfinite_leaves names them
    skips: SkipReporter  # one line per skipped step, rate-limited


def metrics_rows(
    pending: list[StepMetrics], last_step: int, epoch: int, lr: float, leaf_names: list[str]
) -> list[dict]:
    """The ``metrics.jsonl`` rows of the pending steps, read back in one host transfer; a
    skipped step's row names the leaves whose gradients overflowed."""
    if not pending:
        return []
    stacked = torch.stack(
        [
            torch.cat(
                [
                    torch.stack([m.loss.float(), m.loss_scale.float(), m.skipped.float()]),
                    m.counters,
                    m.leaf_finite.float(),
                ]
            )
            for m in pending
        ]
    ).cpu()
    first, k = last_step - len(pending) + 1, 3 + len(COUNTERS)
    values = stacked.tolist()
    rows = []
    for i, row in enumerate(values):
        loss, scale, skipped = row[:3]
        rows.append(
            {
                "step": first + i,
                "epoch": epoch,
                "loss": loss,
                "loss_scale": scale,
                "skipped": bool(skipped),
                "lr": lr,
                **{name: int(v) for name, v in zip(COUNTERS, row[3:k])},
            }
        )
    return name_nonfinite(rows, [row[k:] for row in values], leaf_names)


def log_pending(fx: Fixed, pending: list[StepMetrics], last_step: int, epoch: int) -> list[dict]:
    """Writes the pending steps' metrics (rank 0) and runs the stuck-scale check."""
    if not fx.main_rank:  # the other ranks never read their metrics back
        return []
    rows = metrics_rows(pending, last_step, epoch, float(fx.args.lr), fx.leaf_names)
    write_metrics(fx.metrics_file, (json.dumps(row) + "\n" for row in rows), fx.monitor)
    fx.skips(rows)
    return rows


def train_epoch(fx: Fixed, loop: Loop, epoch: int) -> tuple[Loop, list[dict]]:
    """One epoch of steps: ``loop`` in, ``loop`` out, plus this epoch's metrics rows."""
    args = fx.args
    n = fx.train.labels.shape[0]
    rank, world = ffd.get_rank(), ffd.get_world_size()
    per_rank = args.batch_size // world
    order = epoch_order(fx.data_rng, n, args.batch_size, args.max_steps_per_epoch).to(fx.device)
    steps = order.shape[0] // args.batch_size
    bar = progress_bar(args, total=steps, desc=f"epoch {epoch}/{args.epochs}", leave=False)
    state, buffers, global_step = loop.state, loop.buffers, loop.global_step
    pending: list[StepMetrics] = []
    epoch_rows: list[dict] = []
    synchronize(fx.device)
    t0 = time.perf_counter()
    for i in range(steps):
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        idx = idx[rank * per_rank : (rank + 1) * per_rank]  # this rank's share
        state, buffers, m = fx.train_step(
            state, buffers, fx.train.images[idx], fx.train.labels[idx]
        )
        if fx.monitor is not None:
            fx.monitor.observe(state, m.loss)  # sync-free; checked when logging
        global_step += 1
        pending.append(m)
        if len(pending) >= args.log_every or i == steps - 1:
            new_rows = log_pending(fx, pending, global_step, epoch)
            epoch_rows += new_rows
            if bar is not None:
                bar.update(len(pending))
                if new_rows:
                    seconds = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(
                        loss=f"{new_rows[-1]['loss']:.3f}",
                        scale=f"{new_rows[-1]['loss_scale']:g}",
                        img_s=f"{len(epoch_rows) * args.batch_size / seconds:.0f}",
                    )
            pending = []
    synchronize(fx.device)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    loop = loop._replace(
        state=state,
        buffers=buffers,
        global_step=global_step,
        rows=loop.rows + epoch_rows,
        speeds=loop.speeds + [(steps * args.batch_size, seconds)],
    )
    return loop, epoch_rows


def end_epoch(fx: Fixed, loop: Loop, epoch: int, epoch_rows: list[dict]) -> Loop:
    """Test accuracy, the epoch's line of output, and its checkpoint."""
    args = fx.args
    fx.skips.flush()
    acc = evaluate(fx.eval_step, loop.state.params, loop.buffers, fx.test, args.eval_batch_size)
    loop = loop._replace(accuracies=loop.accuracies + [acc])
    if fx.main_rank:
        images, seconds = loop.speeds[-1]
        mean_loss = sum(r["loss"] for r in epoch_rows) / len(epoch_rows)
        skipped = sum(r["skipped"] for r in epoch_rows)
        print(
            f"epoch {epoch}/{args.epochs}: loss {mean_loss:.4f}, {fx.label}test accuracy "
            f"{acc:.2f} %, {images / seconds:.0f} images/s, loss scale "
            f"{epoch_rows[-1]['loss_scale']:g}, {skipped} skipped steps",
            flush=True,
        )
    tree = checkpoint_tree(
        loop.state,
        loop.buffers,
        epoch,
        loop.global_step,
        fx.data_rng,
        loop.accuracies,
        fx.config,
        loop.rows,
    )
    out_dir = Path(args.out_dir)
    save_checkpoint(out_dir / CHECKPOINT_PATTERN.format(epoch), tree)
    if fx.main_rank:
        prune_checkpoints(out_dir, args.keep_checkpoints, epoch)
    return loop


def fit(args, data, state, buffers, train_step, eval_step, device, policy, start) -> dict:
    """The training loop: threads a :class:`Loop` through ``train_epoch`` and ``end_epoch``.

    ``data``'s images and labels are already on ``device``; ``start`` says where
    to begin (epoch, step, accuracies and rows so far, the data generator).
    """
    main_rank = ffd.is_main_process()  # only rank 0 writes files
    metrics_path = Path(args.out_dir) / "metrics.jsonl"
    # The whole run's metrics so far (from the checkpoint when resuming), so
    # that metrics.jsonl and the summary describe the whole run in any --out-dir.
    rows = list(start.get("rows", [])) if main_rank else []
    metrics_file = open_metrics(metrics_path, (json.dumps(r) + "\n" for r in rows), main_rank)
    n = data.train.labels.shape[0]
    if n < args.batch_size:
        metrics_file.close()
        raise SystemExit(
            f"error: the training set has {n} images, fewer than --batch-size {args.batch_size}"
        )
    fx = Fixed(
        args=args,
        train_step=train_step,
        eval_step=eval_step,
        train=data.train,
        test=data.test,
        device=device,
        config=run_config(args, policy, data),
        data_rng=start["data_rng"],
        label="synthetic " if data.synthetic else "",
        main_rank=main_rank,
        metrics_file=metrics_file,
        monitor=stuck_monitor(args.stuck_patience, state),
        leaf_names=ff.leaf_paths(state.params),
        skips=SkipReporter(),
    )
    loop = Loop(state, buffers, start["global_step"], list(start["accuracies"]), rows, [])
    for epoch in range(start["epoch"] + 1, args.epochs + 1):
        loop, epoch_rows = train_epoch(fx, loop, epoch)
        loop = end_epoch(fx, loop, epoch, epoch_rows)
    fx.skips.flush()
    fx.metrics_file.close()

    return {
        "state": loop.state,
        "buffers": loop.buffers,
        "accuracies": loop.accuracies,
        "rows": loop.rows,
        "images_per_s": throughput(loop.speeds),  # over this run's epochs
        "global_step": loop.global_step,
    }
