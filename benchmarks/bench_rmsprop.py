"""RMSProp per call of ``fp16_update``, against what a PyTorch user runs for it.

Rows, one optimiser step each from the same FP16 gradients, taking turns call by call:

==============================  =============================================================
row                             what one call does
==============================  =============================================================
fused pure / donated            ``fp16_update`` with ``rmsprop(1e-3, decay=0.99,
                                eps_in_sqrt=False, momentum=0.9)`` (torch's rule and
                                defaults): the fused step (the C kernel on the CPU)
multi-tensor pure / donated     the same with ``impl="foreach"``: the chain as written
                                (``scale_by_rms``, the learning rate, the trace)
GradScaler+RMSprop(foreach)     FP32 params, ``scaler.step(RMSprop(momentum=0.9,
                                foreach=True))`` + ``scaler.update()``
==============================  =============================================================

Trees: GPT-2 small's parameter structure at width 32 (148 leaves: the per-call
work) and one flat tensor of 10.3M parameters (memory bandwidth). Reports the
median of each row and its ratio to torch's row.

Usage::

    python benchmarks/bench_rmsprop.py [--reps 100] [--threads N] [--out FILE.md]
    python benchmarks/bench_rmsprop.py --smoke    # seconds: a tiny run of every row
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_lion import trees  # noqa: E402  (the same two trees as Lion's)

import functional_fp16 as ff  # noqa: E402

TORCH = "GradScaler+RMSprop(foreach)"


def rows(params: dict[str, torch.Tensor]) -> dict[str, object]:
    """One callable per row; each keeps its own state and steps it on every call."""
    g = torch.Generator().manual_seed(1)
    grads = {k: (torch.randn(v.shape, generator=g) * 1e-3).half() for k, v in params.items()}
    fns = {}
    for label, impl, path in (("fused", "auto", "fused"), ("multi-tensor", "foreach", "foreach")):
        for donate in (False, True):
            # init_scale 1: the gradients stay finite and every step applies
            tx = ff.rmsprop(1e-3, decay=0.99, eps_in_sqrt=False, momentum=0.9)
            state = ff.fp16_init(params, tx, ff.DynamicLossScale(1.0))
            if ff.update_path(state, impl) != path:
                raise RuntimeError(f"{label} runs {ff.update_path(state, impl)!r}, not {path!r}")
            box = [state]

            def step(box=box, donate=donate, impl=impl):
                box[0] = ff.fp16_update(box[0], grads, donate=donate, impl=impl)

            fns[f"{label} {'donated' if donate else 'pure'}"] = step
    p32 = [v.float().requires_grad_() for v in params.values()]
    for p, gr in zip(p32, grads.values()):
        p.grad = gr.float()
    opt = torch.optim.RMSprop(p32, lr=1e-3, momentum=0.9, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(torch.ones(()))

    def stock():
        scaler.step(opt)
        scaler.update()

    fns[TORCH] = stock
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.threads:
        C.set_threads(args.threads)
    md = ["# RMSProp per call against torch (medians)", "", C.machine_line(), ""]
    for title, params in trees(args.smoke).items():
        n = sum(p.numel() for p in params.values())
        reps = 3 if args.smoke else (args.reps if n < 1_000_000 else max(args.reps // 6, 5))
        times = C.time_interleaved(rows(params), reps, 1 if args.smoke else 3)
        med = {k: C.median(v) for k, v in times.items()}
        md += [f"## {title} ({len(params)} leaves, {n:,} parameters; {reps} calls a row)", ""]
        md += ["| row | ms per call | to torch |", "|---|---|---|"]
        for name, t in med.items():
            md.append(f"| {name} | {t * 1e3:.3f} | {t / med[TORCH]:.2f}x |")
        md.append("")
    C.print_report(md, args.out)


if __name__ == "__main__":
    main()
