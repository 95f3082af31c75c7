"""Lion against AdamW per call of ``fp16_update``, both on the fused kernel.

Lion keeps one FP32 state per parameter where AdamW keeps two, and needs no
bias corrections, so its fused step moves fewer bytes and computes fewer
per-call scalars: per parameter with FP16 gradients and working copies, a
pure Lion step reads 2 (gradient) + 4 (master) + 4 (momentum) and writes
4 + 4 + 2 bytes (20 B, with the op's own all-finite check 22 B); AdamW 30 B.

Trees: GPT-2 small's parameter structure at width 32 (148 leaves, where the
per-call Python and the op's argument handling dominate) and one flat tensor
of 10.3M parameters (memory bandwidth). Rows: ``lion`` and ``adamw`` (learning
rate 1e-3, weight decay 0.1), pure and donated, taking turns call by call; the
table gives median milliseconds per call and each Lion row's ratio to the
AdamW row of the same kind. Before timing, both optimisers' fused states are
checked to be on the fused path.

Usage::

    python benchmarks/bench_lion.py [--reps 60] [--threads N] [--out FILE.md]
    python benchmarks/bench_lion.py --smoke    # seconds: a tiny run of every row
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_recipe import gpt2_tree  # noqa: E402

import functional_fp16 as ff  # noqa: E402

OPTIMISERS = {
    "lion": lambda: ff.lion(1e-3, weight_decay=0.1),
    "adamw": lambda: ff.adamw(1e-3, weight_decay=0.1),
}


def trees(smoke: bool) -> dict[str, dict[str, torch.Tensor]]:
    if smoke:
        return {
            "GPT-2, 2 layers": gpt2_tree(layers=2),
            "flat 10k": {"w": torch.zeros(10_000).half()},
        }
    g = torch.Generator().manual_seed(0)
    flat = (torch.randn(10_300_000, generator=g) * 0.02).half()
    return {"GPT-2 small's 148 leaves at width 32": gpt2_tree(), "flat 10.3M": {"w": flat}}


def rows(params: dict[str, torch.Tensor]) -> dict[str, object]:
    """One callable per row; each keeps its own state and steps it on every call."""
    g = torch.Generator().manual_seed(1)
    grads = {k: (torch.randn(v.shape, generator=g) * 2.0**8).half() for k, v in params.items()}
    fns = {}
    for name, make in OPTIMISERS.items():
        for donate in (False, True):
            state = ff.fp16_init(params, make())
            path = ff.update_path(state)
            if path != "fused":
                raise RuntimeError(f"{name} runs {path!r}, not the fused path")
            box = [state]

            def step(box=box, donate=donate):
                box[0] = ff.fp16_update(box[0], grads, donate=donate)

            fns[f"{name} {'donated' if donate else 'pure'}"] = step
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.threads:
        C.set_threads(args.threads)
    reps, warmup = (3, 1) if args.smoke else (args.reps, 10)
    md = [f"# Lion and AdamW per call, fused ({reps} calls per row, medians)", ""]
    md += [C.machine_line(), ""]
    for title, params in trees(args.smoke).items():
        n = sum(p.numel() for p in params.values())
        times = C.time_interleaved(rows(params), reps, warmup)
        med = {k: C.median(v) for k, v in times.items()}
        md += [f"## {title} ({len(params)} leaves, {n:,} parameters)", ""]
        md += ["| row | ms per call | lion / adamw |", "|---|---|---|"]
        for name, t in med.items():
            kind = name.split(" ", 1)[1]
            ratio = f"{t / med['adamw ' + kind]:.3f}" if name.startswith("lion") else ""
            md.append(f"| {name} | {t * 1e3:.3f} | {ratio} |")
        md.append("")
    C.print_report(md, args.out)


if __name__ == "__main__":
    main()
