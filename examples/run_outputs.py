"""What the examples share about what a run writes, shows and reads back.

``metrics.jsonl`` and the stuck-scale check, checkpoints (written by rank 0,
read back for ``--resume``), the progress bar and the throughput, the plot's
figure and its loss-scale panel, and ``summary.json``. Imported by the
``cifar10_*`` and ``gpt_*`` siblings of the two example jobs.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import optree
import torch

import functional_fp16 as ff
from functional_fp16 import distributed as ffd

# -- metrics.jsonl and the stuck-scale check --------------------------------------------


def open_metrics(path: Path, lines: Iterable[str], main_rank: bool) -> Any:
    """``metrics.jsonl`` rewritten with ``lines`` (the run so far; a resumed run drops
    the steps after its checkpoint) and opened for appending; ``/dev/null`` on the
    ranks other than 0, which write no files."""
    if not main_rank:
        return open(os.devnull, "w")  # noqa: SIM115 - closed by the loop
    with open(path, "w") as f:
        f.writelines(lines)
    return open(path, "a")  # noqa: SIM115 - closed by the loop


def stuck_monitor(patience: int, state: ff.FP16State) -> ff.StuckScaleMonitor | None:
    """The ``--stuck-patience`` monitor, tracking from ``state`` (``None`` for patience 0)."""
    monitor = ff.StuckScaleMonitor(patience) if patience else None
    if monitor is not None:
        monitor.observe(state)  # starts the tracker from the state in force
    return monitor


def write_metrics(
    metrics_file: Any, lines: Iterable[str], monitor: ff.StuckScaleMonitor | None
) -> None:
    """Appends ``lines`` to ``metrics.jsonl``, then asks the stuck-scale monitor; a stuck
    scale ends the program with one line (the metrics up to it are on disk)."""
    metrics_file.writelines(lines)
    metrics_file.flush()
    if monitor is not None:
        try:
            monitor.check()
        except ff.StuckScaleError as err:
            metrics_file.close()
            raise SystemExit(f"error: {err}") from None


# -- progress and throughput ------------------------------------------------------------


def progress_bar(args: argparse.Namespace, **tqdm_args: Any) -> Any:
    """A tqdm bar made with ``tqdm_args``, or None (no tqdm, or ``--no-progress``)."""
    if args.no_progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are optional
        return None
    return tqdm(unit="step", dynamic_ncols=True, **tqdm_args)


def throughput(speeds: list[tuple[int, float]]) -> float:
    """Items per second over ``(items, seconds)`` pieces of this process's run.

    The first piece includes the warm-up (and compilation), so it is left out
    when there are others; ``nan`` when nothing was timed.
    """
    measured = speeds[1:] if len(speeds) > 1 else speeds
    items = sum(k for k, _ in measured)
    seconds = sum(s for _, s in measured)
    return items / seconds if seconds > 0 else float("nan")


# -- checkpoints ------------------------------------------------------------------------


def history_tensor(rows: list[dict], columns: tuple[str, ...]) -> torch.Tensor:
    """The per-step metrics rows so far as a float64 ``(steps, len(columns))`` tensor.

    Stored in every checkpoint, so that a run resumed into another ``--out-dir``
    still writes the whole run's ``metrics.jsonl`` and summary.
    """
    values = [[float(r[c]) for c in columns] for r in rows]
    return torch.tensor(values, dtype=torch.float64).reshape(len(rows), len(columns))


COUNTERS = ("skips", "growths", "backoffs", "since_skip")
"""The loss-scale counters (``ff.loss_scale_stats``) each ``metrics.jsonl`` row carries."""


def counters_of(state: ff.FP16State) -> torch.Tensor:
    """``state.scale_stats`` as one float32 vector (:data:`COUNTERS`' order), on the device:
    read back with the other metrics, no extra host transfer."""
    return torch.stack([getattr(state.scale_stats, c) for c in COUNTERS]).float()


NONFINITE = "nonfinite"
"""The key of a skipped step's ``metrics.jsonl`` row that lists the leaves whose gradients
held an inf or NaN (``ff.leaf_paths`` names; empty for a step skipped for its loss)."""


def name_nonfinite(rows: list[dict], flags: list[list[float]], names: list[str]) -> list[dict]:
    """``rows`` with :data:`NONFINITE` added to the skipped ones, from each step's
    ``state.leaf_finite`` (read back as numbers, one list per row) and the leaves' names."""
    for row, step_flags in zip(rows, flags, strict=True):
        if row["skipped"]:
            row[NONFINITE] = [n for n, ok in zip(names, step_flags, strict=True) if not ok]
    return rows


def overflow_record(rows: list[dict]) -> list[list]:
    """The skipped steps' :data:`NONFINITE` lists as ``[[step, names], ...]``, for a checkpoint
    (its ``history`` tensor holds numbers only)."""
    return [[row["step"], list(row[NONFINITE])] for row in rows if NONFINITE in row]


def restore_overflows(rows: list[dict], record: list[list]) -> list[dict]:
    """The inverse of :func:`overflow_record`, into the rows read back from ``history``."""
    by_step = {row["step"]: row for row in rows}
    for step, names in record:
        by_step[int(step)][NONFINITE] = list(names)
    return rows


def say(line: str) -> None:
    """Prints ``line`` above any tqdm progress bar (plainly without tqdm)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        print(line, flush=True)
        return
    tqdm.write(line)


class SkipReporter:
    """Prints one line per skipped step, at most ``burst`` of them per window of ``window``
    steps (steps ``0..window-1``, ``window..2*window-1``, ...).

    An overflow storm (many skips in a row while the loss scale backs off)
    would otherwise flood the output: the skips past ``burst`` in a window are
    counted, and one line reports them when the next window's first skip is
    printed or at :meth:`flush` (the loops call it at every evaluation).
    ``metrics.jsonl`` holds every skip's leaves either way.
    """

    def __init__(self, write: Callable[[str], None] = say, burst: int = 3, window: int = 100):
        self.write, self.burst, self.window = write, burst, window
        self.current, self.shown, self.held, self.first_held = -1, 0, 0, 0

    def __call__(self, rows: list[dict]) -> None:
        for row in rows:
            if not row["skipped"]:
                continue
            window = row["step"] // self.window
            if window != self.current:
                self.flush()
                self.current, self.shown = window, 0
            if self.shown < self.burst:
                self.write(skip_line(row))
                self.shown += 1
            else:
                self.first_held = self.first_held if self.held else row["step"]
                self.held += 1

    def flush(self) -> None:
        """Reports the skips held back so far, in one line."""
        if self.held:
            self.write(
                f"... {self.held} more skipped steps from step {self.first_held} "
                "(metrics.jsonl names their leaves)"
            )
            self.held = 0


def skip_line(row: dict, shown: int = 4) -> str:
    """One skipped step in one line: the scale it ran at and the leaves that overflowed."""
    names = row.get(NONFINITE, [])
    head = f"step {row['step']}: skipped at loss scale {row['loss_scale']:g}"
    if not names:
        return f"{head}: the loss was not finite (no gradient leaf overflowed)"
    more = f" (+{len(names) - shown} more)" if len(names) > shown else ""
    return f"{head}: non-finite gradients in {', '.join(names[:shown])}{more}"


def history_rows(
    history: torch.Tensor, columns: tuple[str, ...], counts: tuple[str, ...]
) -> list[dict]:
    """The inverse of :func:`history_tensor`: metrics rows as written to ``metrics.jsonl``,
    with the ``counts`` columns as ints and ``skipped`` as a bool."""
    rows = []
    for values in history.tolist():
        row = dict(zip(columns, values))
        for column in counts:
            row[column] = int(row[column])
        row["skipped"] = bool(row["skipped"])
        rows.append(row)
    return rows


def save_checkpoint(path: Path, tree: dict) -> None:
    """Writes ``tree`` to ``path``: under ``--distributed`` rank 0 writes (the full state)
    and every rank returns once the file is complete."""
    if ffd.is_initialized():
        ffd.save_checkpoint_rank0(path, tree)
    else:
        ff.save_checkpoint(path, tree)


def read_like(path: str, like: dict) -> dict:
    """The checkpoint at ``path`` read against the template ``like`` (which checks every
    tensor's shape and dtype and puts the state on this run's device), with the
    global torch and CUDA generators set to its ``torch_rng`` and ``cuda_rng``.
    A failure ends the program with one line."""
    try:
        ckpt = ff.load_checkpoint(path, like=like)
    except ff.CheckpointError as err:
        raise SystemExit(f"error: --resume: {err}") from None
    torch.set_rng_state(ckpt["torch_rng"])
    if ckpt["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt["cuda_rng"])
    return ckpt


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


# -- the plot and the summary ------------------------------------------------------------


def save_figure(path: Path, title: str, draw: Callable[[Any], None]) -> None:
    """A PNG of three panels side by side, drawn by ``draw(axes)``, titled ``title``.

    Without matplotlib it says so in one line and writes nothing.
    """
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    draw(axes)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def running_mean(values: list[float], w: int) -> list[float]:
    """The mean of each value and the up to ``w - 1`` before it (the smoothed loss curve)."""
    return [sum(values[max(0, i - w + 1) : i + 1]) / min(w, i + 1) for i in range(len(values))]


def summary_head(args: argparse.Namespace, data: Any, device: torch.device, policy: Any) -> dict:
    """The entries every example's ``summary.json`` starts with: the data, the device,
    the precision, ``--compile`` and the number of ranks."""
    return {
        "dataset": data.source,
        "synthetic": data.synthetic,
        "device": str(device),
        "policy": str(policy),
        "precision": args.precision,
        "compile": args.compile,
        "world_size": ffd.get_world_size(),
    }


def state_bytes(state: ff.FP16State) -> dict:
    """``ff.state_nbytes(state)`` for ``summary.json``: bytes of each part and per parameter
    (this rank's shards under FSDP); printed at start-up as one line."""
    counted = ff.state_nbytes(state)
    leaves = optree.tree_leaves(state.params, namespace=ff.NAMESPACE)
    n = sum(getattr(p, "_local_tensor", p).numel() for p in leaves)
    out = {**counted._asdict(), "per_param": counted.per_param(max(n, 1))}
    per = out["per_param"]
    if ffd.is_main_process():
        say(
            f"state: {counted.total / 2**20:.1f} MiB = params {per['params']:.2f} + master "
            f"{per['master']:.2f} + optimiser {per['opt_state']:.2f} B/param "
            f"({per['total']:.2f} B/param in all)"
        )
    return out


def write_summary(out_dir: Path, summary: dict) -> None:
    """``summary.json`` in ``out_dir``, written by rank 0 alone."""
    if ffd.is_main_process():
        with open(out_dir / "summary.json", "w") as f:
            json.dump(summary, f, indent=2)
