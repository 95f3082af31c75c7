"""``vmap(fp16_update)`` over K stacked states against the two ways to do without it.

K members of the example CNN (SGD-momentum, each with its own dynamic loss
scale), three rows, one SGD step each from the same parameters and gradients:

=====================  ======================================================
row                    what one call does
=====================  ======================================================
vmap(fp16_update)      ``torch.func.vmap(fp16_update)`` on the stacked states
                       (``tree_stack``): the fused op batches inside itself
members one by one     ``fp16_update`` on each of the K states in turn
one Kx tree            ``fp16_update`` on one state whose leaves hold K times
                       the elements (the same bytes as the stacked states)
=====================  ======================================================

Rows take turns call by call (``time_interleaved``) and the table gives
medians. A second phase times the Kx tree on its own, to show whether the
vmapped update slows the other updates of the process (the cross-talk row).
Every row is checked first: the vmapped members are bitwise the members
updated one by one.

Usage::

    python benchmarks/bench_vmap.py [--members 8] [--reps 30] [--donate]
"""

from __future__ import annotations

import argparse
import os
import sys

import optree
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_update import _example_cnn_shapes  # noqa: E402

import functional_fp16 as ff  # noqa: E402


def tree_leaves(tree):
    """The leaves of a tree of the library's containers."""
    return optree.tree_leaves(tree, namespace=ff.NAMESPACE)


TX = ff.sgd(0.05, momentum=0.9)


def _inputs(shapes, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    params = {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}
    grads = {n: (torch.randn(s, generator=g) * 10).half() for n, s in shapes.items()}
    return params, grads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--donate", action="store_true", help="donated updates in every row")
    ap.add_argument("--smoke", action="store_true", help="2 members, 3 reps: a check it runs")
    args = ap.parse_args(argv)
    k = 2 if args.smoke else args.members
    reps, warmup = (3, 1) if args.smoke else (args.reps, args.warmup)
    shapes = _example_cnn_shapes()
    inputs = [_inputs(shapes, k, seed) for seed in range(k)]
    members = [ff.fp16_init(p, TX) for p, _ in inputs]
    grads = [g for _, g in inputs]
    stacked = ff.tree_stack(members)
    stacked_grads = ff.tree_stack(grads)
    big_shapes = {n: (k, *s) for n, s in shapes.items()}
    big_params, big_grads = _inputs(big_shapes, 1, 100)
    big = ff.fp16_init(big_params, TX)
    donate = args.donate
    vmapped = torch.func.vmap(lambda s, g: ff.fp16_update(s, g, donate=donate))

    # Check: the vmapped members are bitwise the members updated alone.
    together = ff.tree_unstack(vmapped(ff.tree_stack(members), stacked_grads))
    for alone, mine in zip([ff.fp16_update(m, g) for m, g in zip(members, grads)], together):
        for a, b in zip(tree_leaves(alone), tree_leaves(mine)):
            assert torch.equal(a, b), "vmapped members differ from members updated alone"

    box = {"stacked": stacked, "members": members, "big": big}

    def run_vmap():
        box["stacked"] = vmapped(box["stacked"], stacked_grads)

    def run_members():
        box["members"] = [
            ff.fp16_update(m, g, donate=donate) for m, g in zip(box["members"], grads)
        ]

    def run_big():
        box["big"] = ff.fp16_update(box["big"], big_grads, donate=donate)

    together_times = C.time_interleaved(
        {"vmap(fp16_update)": run_vmap, "members one by one": run_members, "one Kx tree": run_big},
        reps,
        warmup,
    )
    alone_times = C.time_interleaved({"one Kx tree (alone)": run_big}, reps, warmup)
    med = {n: C.median(t) * 1e3 for n, t in {**together_times, **alone_times}.items()}
    info = C.machine_description()
    n_params = sum(x.numel() for x in tree_leaves(members[0].params))
    print(f"# vmap(fp16_update), K={k} members of the example CNN ({n_params:,} params each)")
    print()
    print(", ".join(f"{a}: {b}" for a, b in info.items()))
    print(f"\nrows alternate call by call, {reps} reps, medians; donate={donate}\n")
    print("| row | median ms | vs members one by one | vs one Kx tree |")
    print("|---|---:|---:|---:|")
    for name, ms in med.items():
        print(
            f"| {name} | {ms:.2f} | {ms / med['members one by one']:.2f}x "
            f"| {ms / med['one Kx tree']:.2f}x |"
        )
    print(
        f"\ncross-talk: the Kx tree takes {med['one Kx tree']:.2f} ms alternating with the "
        f"vmapped update and {med['one Kx tree (alone)']:.2f} ms alone"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
