"""The FP16 AdamW step, side by side with GradScaler + torch.optim.AdamW.

For each parameter tree (the example CNN and one flat 10M tensor) every row
performs one AdamW step (lr 1e-3, weight decay 1e-2) from the same parameters
and the same scaled FP16 gradients:

============================  =====================================================
row                           what one step does
============================  =====================================================
fp16_update(adamw) pure       ``fp16_update(state, grads)``: the fused kernel, new state
fp16_update(adamw) donated    the same with ``donate=True`` (in place)
fp16_update(adamw) foreach    ``impl="foreach"``: the multi-tensor path
GradScaler+AdamW(fused)       FP32 params and grads, ``AdamW(fused=True)``, ``GradScaler``
GradScaler+AdamW(foreach)     FP32 params and grads, ``AdamW(foreach=True)``, ``GradScaler``
============================  =====================================================

Bytes per parameter, the least each algorithm must move: the fused step reads
the FP16 gradient twice (the all-finite check, then the update) and master,
two moments and the working copy's old value never (a pure step writes fresh
buffers): 2 + 2 + 12 in, 12 + 2 out = 30 B; GradScaler's path reads the FP32
gradient for its inf check and the unscale, then the fused AdamW kernel reads
gradient, parameter and two moments and writes three: 4 + 4 + 16 + 12 = 36 B
(plus the FP16 cast a user's model needs, not counted).

Rows take turns call by call; the table gives medians and the ratio to
GradScaler + AdamW(fused). Before timing, every row runs three steps and an
overflowing fourth and its master is compared with ``impl="reference"``.

Usage::

    python benchmarks/bench_adam.py [--threads 1] [--reps 15] [--out FILE.md]
    python benchmarks/bench_adam.py --smoke    # seconds: agreement checks only
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_update import GradScalerSGD, Row, make_inputs, trees  # noqa: E402

import functional_fp16 as ff  # noqa: E402

LR = 1e-3
WD = 1e-2
SCALE = 2.0**10
RTOL = 1e-5  # master after 3 steps + 1 overflow, relative to its largest magnitude


class FP16AdamW(Row):
    bytes_per_param = 30

    def __init__(self, p0, grads, *, impl="auto", donate=False, name=""):
        self.name, self.grads, self.keys = name, grads, list(p0)
        self.impl, self.donate = impl, donate
        tx = ff.adamw(LR, weight_decay=WD)
        self.state = ff.fp16_init(p0, tx, ff.DynamicLossScale(SCALE, growth_interval=10**6))

    def step(self, i):
        self.state = ff.fp16_update(self.state, self.grads[i], impl=self.impl, donate=self.donate)

    def master(self):
        return [self.state.master[k] for k in self.keys]


class GradScalerAdamW(GradScalerSGD):
    """``GradScaler`` + ``torch.optim.AdamW`` on FP32 parameters and gradients."""

    bytes_per_param = 36

    def optimizer(self, params, **kw):
        return torch.optim.AdamW(params, lr=LR, weight_decay=WD, **kw)


def rows():
    return [
        lambda p, g: FP16AdamW(p, g, name="fp16_update(adamw) pure"),
        lambda p, g: FP16AdamW(p, g, donate=True, name="fp16_update(adamw) donated"),
        lambda p, g: FP16AdamW(p, g, impl="foreach", name="fp16_update(adamw) foreach"),
        lambda p, g: GradScalerAdamW(p, g, fused=True, name="GradScaler+AdamW(fused)"),
        lambda p, g: GradScalerAdamW(p, g, fused=False, name="GradScaler+AdamW(foreach)"),
    ]


def agreement(shapes) -> list[tuple[str, bool, float]]:
    """Every row through 3 finite steps and one overflow, against the reference."""
    p0, grads = make_inputs(shapes)
    ref = FP16AdamW(p0, grads, impl="reference")
    for i in range(4):
        ref.step(i)
    out = []
    for make in rows():
        row = make(p0, grads)
        for i in range(4):
            row.prepare(i)
            row.step(i)
        worst = max(
            float((a - b).abs().max()) / (float(b.abs().max()) or 1.0)
            for a, b in zip(row.master(), ref.master())
        )
        out.append((row.name, worst <= RTOL, worst))
    return out


def bench(shapes, reps, warmup):
    p0, grads = make_inputs(shapes, steps=3)
    made = [make(p0, grads) for make in rows()]
    counters = {r.name: 0 for r in made}

    def call(r):
        return lambda: r.step(counters[r.name] % len(grads))

    def prep(r):
        def run():
            counters[r.name] += 1
            r.prepare(counters[r.name] % len(grads))

        return run

    for r in made:  # first calls (kernel loading, lazy state) stay out of the timings
        r.prepare(0)
        r.step(0)
    times = C.time_interleaved(
        {r.name: call(r) for r in made},
        reps=reps,
        warmup=warmup,
        prepare={r.name: prep(r) for r in made},
    )
    return [(r.name, C.median(times[r.name]), r.bytes_per_param) for r in made]


def table(label, shapes, results) -> str:
    n = sum(math.prod(s) for s in shapes.values())
    ref = next(t for name, t, _ in results if name == "GradScaler+AdamW(fused)")
    lines = [
        f"### {label}: {n:,} parameters in {len(shapes)} tensors",
        "",
        "| row | ms | time vs GradScaler + AdamW(fused) | GB/s at its bytes/param |",
        "|---|---:|---:|---:|",
    ]
    for name, t, bpp in results:
        lines.append(
            f"| {name} | {t * 1e3:.2f} | {t / ref:.2f}x | {bpp * n / t / 1e9:.1f} ({bpp} B) |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny trees, agreement checks only")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    C.set_threads(args.threads)
    all_trees = trees(args.smoke)
    all_trees = {
        k: v for k, v in all_trees.items() if k in ("example CNN", "flat 10M", "small tree")
    }
    md = ["## AdamW step", ""]
    md.append(C.machine_line())
    md.append(f"torch threads: {args.threads}")
    md.append("")
    failed = False
    for label, shapes in all_trees.items():
        if label in ("example CNN", "small tree"):
            md.append(f"Agreement with `impl='reference'` on {label} (limit {RTOL:g}):")
            md.append("")
            for name, ok, err in agreement(shapes):
                md.append(f"- {'PASS' if ok else 'FAIL'} {name}: {err:.2e}")
                failed |= not ok
            md.append("")
        if args.smoke:
            continue
        print(f"[bench] {label} ...", file=sys.stderr, flush=True)
        md += [table(label, shapes, bench(shapes, args.reps, args.warmup)), ""]
    C.print_report(md, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
