"""The training loop of ``gpt_functional.py``: segments of pure steps, then evaluation.

:func:`fit` threads a :class:`Loop` (everything that changes: the state, the
step count, the metrics so far) through :func:`train_segment` and
:func:`end_segment`, one segment per ``--eval-interval`` steps; what stays
fixed for the run is a :class:`Fixed`. The loop only draws the batches,
calls the pure step, reads metrics back every ``--log-every`` steps, asks
the stuck-scale monitor, and after each segment evaluates and writes a
checkpoint (what it writes is ``gpt_outputs.py``'s). Under ``--distributed``
every rank runs this loop on its share of each micro-batch; rank 0 alone
writes files.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gpt_data
import torch
from gpt_outputs import CHECKPOINT_PATTERN, checkpoint_tree, metrics_lines, prune_checkpoints
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
    leaf_names: list[str]  # the parameters' paths, as ff.nonfinite_leaves names them
    skips: SkipReporter  # one line per skipped step, rate-limited


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
        [
            torch.cat(
                [
                    torch.stack([m.loss, m.loss_scale, m.skipped.float(), m.lr]),
                    m.counters,
                    m.leaf_finite.float(),
                ]
            )
            for m in pending
        ]
    ).cpu()  # one host transfer for every metric of the pending steps
    first, k = last_step - len(pending) + 1, 4 + len(COUNTERS)
    values = stacked.tolist()
    rows = []
    for i, row in enumerate(values):
        loss, scale, skip, lr = row[:4]
        rows.append(
            {
                "step": first + i,
                "loss": loss,
                "loss_scale": scale,
                "skipped": bool(skip),
                "lr": lr,
                **{name: int(v) for name, v in zip(COUNTERS, row[4:k])},
            }
        )
    rows = name_nonfinite(rows, [row[k:] for row in values], fx.leaf_names)
    write_metrics(fx.metrics_file, metrics_lines(rows, []), fx.monitor)
    fx.skips(rows)
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
    fx.skips.flush()
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
    save_checkpoint(path, tree)
    if fx.main_rank:
        prune_checkpoints(out_dir, args.keep_checkpoints)
    return loop


def fit(args, data, state, train_step, eval_step, device, config, data_rng, start) -> dict:
    """The training loop: threads a :class:`Loop` through ``train_segment`` and ``end_segment``.

    ``start`` says where to begin: the step, and the rows and evaluations
    so far (from the checkpoint when resuming).
    """
    main_rank = ffd.is_main_process()
    metrics_path = Path(args.out_dir) / "metrics.jsonl"
    rows = list(start["rows"]) if main_rank else []
    metrics_file = open_metrics(metrics_path, metrics_lines(rows, start["evals"]), main_rank)
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
        metrics_file=metrics_file,
        monitor=stuck_monitor(args.stuck_patience, state),
        bar=progress_bar(args, total=args.max_steps, initial=start["step"], desc="training"),
        leaf_names=ff.leaf_paths(state.params),
        skips=SkipReporter(),
    )
    loop = Loop(state, start["step"], rows, list(start["evals"]), [])
    while loop.step < args.max_steps:
        until = min(args.max_steps, (loop.step // args.eval_interval + 1) * args.eval_interval)
        loop, segment_rows = train_segment(fx, loop, until)
        loop = end_segment(fx, loop, segment_rows)
    fx.skips.flush()
    fx.metrics_file.close()
    if fx.bar is not None:
        fx.bar.close()

    return {
        "state": loop.state,
        "rows": loop.rows,
        "evals": loop.evals,
        "tokens_per_s": throughput(loop.speeds),  # over this process's segments
        "step": loop.step,
    }
