"""Do stored moments follow their averages? Each format against FP32 moments, case by case.

A moving average with ``b2 = 0.999`` changes by about 0.1 % a step; a stored
format that rounds to nearest loses every change smaller than half its code
step there, so its moment can stop moving while the FP32 one goes on. Each case
steps ``tx.update`` directly (no loss scaling, no master) on a 64 x 256 matrix:
each row is one block of the E4M3 codes, whose first element holds the block's
largest moment (a constant gradient of 4) and whose other 255 elements are the
elements under test (their gradients apart by at most 2^-10, relative, so that
each holds bits of its own), so the table's figures are means over 16,320
elements (an unbiased rounding is judged by its mean, not by one element):

* **adam, constant**: gradient 1 for 3000 steps; the update's size at the end
  (FP32: the learning rate, 1e-3);
* **adam, drop to 0.3 / 0.5**: gradient 1 for 1000 steps, then 0.3 (or 0.5) for
  2800; the update's size at the end (the element sits at a quarter of its
  block's largest moment before the drop);
* **lion, flip**: ``lion(b2=0.99)``, gradient +1 for 1000 steps, then -1; the steps
  until the update's sign reverses (FP32: 58; "never" past 1000).

Every figure is also given as the ratio to FP32's. Formats: ``float32`` (the
reference), ``bfloat16``, ``float16`` (second moments with a per-tensor
power-of-two scale) and ``e4m3`` (block codes), for both moments of Adam and for
Lion's, each rounded to nearest and stochastically (``moment_rounding``).

Usage::

    python benchmarks/bench_moment_fidelity.py [--out FILE.md] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402

import functional_fp16 as ff  # noqa: E402

ROWS, ROW = 64, 256
LR = 1e-3
FORMATS = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "e4m3": "e4m3"}
ROUNDINGS = ("nearest", "stochastic")


_SPREAD = 1.0 + 2.0**-10 * torch.linspace(0.0, 1.0, ROWS * ROW).reshape(ROWS, ROW)


def _gradient(value: float) -> torch.Tensor:
    """The block's largest element at 4, every other element at ``value`` times a factor in
    ``[1, 1 + 2^-10]`` of its own, so that no two elements hold the same bits (a rounding
    drawn per element is judged by its mean, not by one draw shared by all)."""
    g = value * _SPREAD
    g[:, 0] = 4.0
    return g


def _run(tx, schedule: list[tuple[int, float]]):
    """Steps ``tx.update`` through ``schedule`` (``(steps, gradient)`` pairs); yields the
    update of the elements under test after each step."""
    params = torch.zeros(ROWS, ROW)
    state = tx.init(params)
    for steps, value in schedule:
        g = _gradient(value)
        for _ in range(steps):
            u, state = tx.update(g, state, params)
            yield u[:, 1:]


def _final_size(tx, schedule) -> float:
    *_, last = _run(tx, schedule)
    return float(last.abs().mean())


def _adam(fmt, rounding="nearest"):
    if fmt is None:
        return ff.adam(LR)
    scale = {"nu_scale": "tensor"} if fmt is torch.float16 else {}
    return ff.adam(LR, mu_dtype=fmt, nu_dtype=fmt, moment_rounding=rounding, **scale)


def _lion(fmt, rounding="nearest"):
    mu = None if fmt in (None, torch.float16) else fmt  # signed: Lion takes no scaled FP16
    if mu is None:
        return ff.lion(LR, b2=0.99)
    return ff.lion(LR, b2=0.99, mu_dtype=mu, moment_rounding=rounding)


def _reversal(tx, before: int, limit: int) -> float | None:
    """Mean over the elements of the steps after the flip until each one's update changes
    sign; ``None`` if some element never does within ``limit`` steps."""
    first = torch.full((ROWS, ROW - 1), -1, dtype=torch.long)
    for i, u in enumerate(_run(tx, [(before, 1.0), (limit, -1.0)])):
        if i < before:
            continue
        flipped = (u > 0) & (first < 0)  # the update was negative (descending +1)
        first[flipped] = i - before + 1
    return None if bool((first < 0).any()) else float(first.float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--smoke", action="store_true", help="tiny step counts, for tests")
    args = parser.parse_args()
    k = 50 if args.smoke else 1
    constant = [(3000 // k, 1.0)]
    drops = {
        "0.3": [(1000 // k, 1.0), (2800 // k, 0.3)],
        "0.5": [(1000 // k, 1.0), (2800 // k, 0.5)],
    }
    limit = 1000 // k
    rows = []
    ref = {}
    for name, fmt in FORMATS.items():
        for rounding in ("nearest",) if fmt is None else ROUNDINGS:
            row = {"adam, constant 1": _final_size(_adam(fmt, rounding), constant)}
            for drop, schedule in drops.items():
                row[f"adam, 1 -> {drop}"] = _final_size(_adam(fmt, rounding), schedule)
            row["lion, +1 -> -1 (steps)"] = _reversal(_lion(fmt, rounding), 1000 // k, limit)
            if fmt is None:
                ref = row
            rows.append((name if fmt is None else f"{name}, {rounding}", row))
    header = list(ref)
    md = [
        C.machine_line(),
        "",
        "Update sizes at the end (mean over 16,320 elements), and Lion's steps to reverse, "
        "with the ratio to FP32 moments' in brackets",
        "",
        "| moments | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(header),
    ]
    for name, row in rows:
        cells = []
        for key in header:
            value, want = row[key], ref[key]
            if value is None:
                cells.append("never")
            elif key.startswith("lion"):
                cells.append(f"{value:.1f} ({value / want:.2f}x)")
            else:
                cells.append(f"{value:.3e} ({value / want:.2f}x)")
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    C.print_report(md, args.out)


if __name__ == "__main__":
    main()
