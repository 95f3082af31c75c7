"""The update of this checkout against the same update at an earlier commit, process by process.

The package at ``--commit`` is exported (``git archive``) into a temporary
folder; each version then runs in a process of its own (two versions cannot
share one: each registers the ``functional_fp16`` op namespaces with
PyTorch). Timings from separate processes on a shared 2-core machine move by
10-25 % between runs, more than the changes worth measuring, so the two
alternate for ``--rounds`` rounds (the order reversed every other round) and
each is read against a yardstick timed in the same process, call by call
interleaved: ``GradScaler`` + ``SGD(fused=True)`` on FP32 parameters. A
round's figure is a row's median over ``--reps`` calls divided by the
yardstick's; the report gives the median over rounds, and the ratio of this
checkout's to the commit's.

Rows: ``fp16_update`` pure and donated, eager; optionally (``--compiled``)
the pure update under ``torch.compile(fullgraph=True)``. Every row starts
from the same parameters and gradients (loss scale 2^10) and the same
optimiser (``--tx``: SGD momentum 0.9 at lr 0.05, AdamW, the transformer
recipe: clip + AdamW with a warmup-cosine schedule and a decay mask, Lion, or
RMSProp with momentum 0.9). Trees
(``--tree``): one flat tensor of ``--params``, the ResNet-18 shapes, the
example CNN's, or GPT-2 small's 148 leaves at width 32.

Usage::

    python benchmarks/bench_against_commit.py --commit ddf0d1b [--params 10000000] [--compiled]
    python benchmarks/bench_against_commit.py --commit ddf0d1b --tree gpt2 --tx recipe
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YARDSTICK = "GradScaler + SGD(fused) FP32"


def export_at(commit: str, into: str) -> str:
    """The package as it was at ``commit``, exported under ``into``; returns ``into``."""
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", "--format=tar", commit, "functional_fp16"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _recipe(ff):
    decay = lambda p: {k: v.ndim >= 2 for k, v in p.items()}  # noqa: E731
    schedule = ff.warmup_cosine_decay_schedule(0.0, 6e-4, 10, 1000, 6e-5)
    return ff.chain(
        ff.clip_by_global_norm(1.0),
        ff.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay),
    )


OPTIMISERS = {
    "sgd": lambda ff: ff.sgd(0.05, momentum=0.9),
    "adamw": lambda ff: ff.adamw(1e-3, weight_decay=0.1),
    "recipe": _recipe,
    "lion": lambda ff: ff.lion(1e-3, weight_decay=0.1),
    "rmsprop": lambda ff: ff.rmsprop(1e-3, momentum=0.9),
}


def shapes_of(args) -> dict[str, tuple[int, ...]]:
    from bench_recipe import gpt2_tree
    from bench_update import _example_cnn_shapes, _resnet18_shapes

    return {
        "flat": lambda: {"w": (args.params,)},
        "resnet18": _resnet18_shapes,
        "cnn": _example_cnn_shapes,
        "gpt2": lambda: {k: tuple(v.shape) for k, v in gpt2_tree().items()},
    }[args.tree]()


def worker(args) -> dict:
    """One version's rows and the yardstick, interleaved call by call: medians in ms (and
    where the package was imported from)."""
    import functional_fp16 as ff  # first: from $PYTHONPATH, before bench_update adds the checkout

    C.set_threads(args.threads)
    from bench_update import GradScalerSGD  # after a statement: import sorting keeps it here

    shapes = shapes_of(args)
    g = torch.Generator().manual_seed(0)
    p0 = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    grads = [
        {k: (torch.randn(s, generator=g) * 10).half() for k, s in shapes.items()} for _ in range(3)
    ]
    rows = {"pure": (False, False), "donated": (True, False)}
    if args.compiled:
        rows["compiled pure"] = (False, True)
    states, fns, own, counter = {}, {}, {}, {"i": 0}
    for name, (donate, compiled) in rows.items():
        states[name] = ff.fp16_init(p0, OPTIMISERS[args.tx](ff), ff.DynamicLossScale(2.0**10))
        own[name] = [{k: v.clone() for k, v in gr.items()} for gr in grads]

        def update(state, gr, donate=donate):
            return ff.fp16_update(state, gr, donate=donate)

        fns[name] = torch.compile(update, fullgraph=True) if compiled else update

    def step(name):
        def run():
            states[name] = fns[name](states[name], own[name][counter["i"] % 3])

        return run

    stock = GradScalerSGD(p0, grads, fused=True, name=YARDSTICK)
    timed = {name: step(name) for name in rows}
    timed[YARDSTICK] = lambda: stock.step(counter["i"] % 3)
    times: dict[str, list[float]] = {name: [] for name in timed}
    for r in range(args.warmup + args.reps):
        counter["i"] += 1
        stock.prepare(counter["i"] % 3)
        for name in list(timed) if r % 2 else list(timed)[::-1]:
            t0 = time.perf_counter()
            timed[name]()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    out = {name: C.median(v) * 1e3 for name, v in times.items()}
    return {**out, "package": os.path.dirname(os.path.dirname(os.path.abspath(ff.__file__)))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", help="the earlier commit (required unless --worker)")
    ap.add_argument("--params", type=int, default=10_000_000, help="one flat tensor of this size")
    ap.add_argument(
        "--tree",
        choices=("flat", "resnet18", "cnn", "gpt2"),
        default="flat",
        help="flat (--params), the ResNet-18 shapes (62 tensors), the example CNN's or GPT-2 "
        "small's 148 leaves at width 32",
    )
    ap.add_argument("--tx", choices=tuple(OPTIMISERS), default="sgd")
    ap.add_argument("--rounds", type=int, default=6, help="processes per version")
    ap.add_argument("--reps", type=int, default=25, help="timed calls per process")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="also the compiled pure update")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    if not args.commit:
        ap.error("--commit is required")
    tmp = export_at(args.commit, tempfile.mkdtemp(prefix="ff_at_"))
    here = os.path.abspath(__file__)
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    sides = {"this checkout": ROOT, args.commit: tmp}
    per_round: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            env = {**os.environ, "PYTHONPATH": sides[side]}
            line = C.run_worker([sys.executable, here, *passed, "--worker"], env=env)
            if line is None:
                return 1
            if os.path.realpath(line.pop("package")) != os.path.realpath(sides[side]):
                print(f"{side}: the worker imported another copy of the package", file=sys.stderr)
                return 1
            per_round[side].append(line)
            print(f"[round {r + 1}] {side}: {line}", file=sys.stderr)
    rows = [k for k in per_round["this checkout"][0] if k != YARDSTICK]
    n = sum(math.prod(s) for s in shapes_of(args).values())
    print(
        f"# fp16_update: this checkout against {args.commit}, {n:,} parameters in "
        f"{len(shapes_of(args))} tensors, optimiser {args.tx}\n"
    )
    print(", ".join(f"{k}: {v}" for k, v in C.machine_description().items()))
    print(
        f"\n{args.rounds} processes per version, alternating; in each, the rows interleaved "
        f"call by call with the yardstick ({YARDSTICK}), {args.reps} reps, medians\n"
    )
    print(f"| row | {args.commit} ms | this checkout ms | ratio (vs the yardstick) |")
    print("|---|---:|---:|---:|")
    for row in rows:

        def rel(side, row=row):
            return [d[row] / d[YARDSTICK] for d in per_round[side]]

        old_ms = C.median([d[row] for d in per_round[args.commit]])
        new_ms = C.median([d[row] for d in per_round["this checkout"]])
        ratio = C.median(rel("this checkout")) / C.median(rel(args.commit))
        print(f"| {row} | {old_ms:.3f} | {new_ms:.3f} | {ratio:.3f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
