"""The update of this checkout against the same update at an earlier commit, in one process.

Timings from separate processes on a shared 2-core machine move by 10-25 %
between runs, more than the changes worth measuring. This script exports the
package as it was at ``--commit`` (``git archive``) under another name
(``functional_fp16_at_<commit>``), imports both, and times the same steps
call by call, interleaved (the order reversed every other round, and each
row with its own copy of the gradients, so that no row finds another's data
in cache), with GradScaler + ``SGD(fused=True)`` as the yardstick:

* ``fp16_update`` pure and donated, eager, in both versions;
* optionally (``--compiled``) the same under ``torch.compile(fullgraph=True)``.

Every row starts from the same parameters and gradients (SGD momentum 0.9,
lr 0.05, loss scale 2^10). Medians of ``--reps`` calls; the ratios are read
within the run.

Usage::

    python benchmarks/bench_against_commit.py --commit ddf0d1b [--params 10000000] [--compiled]
"""

from __future__ import annotations

import argparse
import importlib
import io
import math
import os
import re
import resource
import subprocess
import sys
import tarfile
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_update import GradScalerSGD, _example_cnn_shapes, _resnet18_shapes  # noqa: E402

import functional_fp16 as ff  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_at(commit: str, into: str):
    """The package as it was at ``commit``, importable as ``functional_fp16_at_<commit>``."""
    name = "functional_fp16_at_" + re.sub(r"\W", "_", commit)
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", "--format=tar", commit, "functional_fp16"],
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    src = os.path.join(into, "functional_fp16")
    dst = os.path.join(into, name)
    os.rename(src, dst)
    for folder, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(re.sub(r"\bfunctional_fp16\b", name, text))
    sys.path.insert(0, into)
    return importlib.import_module(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--params", type=int, default=10_000_000, help="one flat tensor of this size")
    ap.add_argument(
        "--tree",
        choices=("flat", "resnet18", "cnn"),
        default="flat",
        help="flat (--params), the ResNet-18 shapes (62 tensors) or the example CNN's",
    )
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="also the compiled updates")
    args = ap.parse_args(argv)
    C.set_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="ff_at_")
    old = import_at(args.commit, tmp)

    g = torch.Generator().manual_seed(0)
    shapes = {
        "flat": lambda: {"w": (args.params,)},
        "resnet18": _resnet18_shapes,
        "cnn": _example_cnn_shapes,
    }[args.tree]()
    n = sum(math.prod(s) for s in shapes.values())
    p0 = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    grads = [
        {k: (torch.randn(s, generator=g) * 10).half() for k, s in shapes.items()} for _ in range(3)
    ]
    tx_new, tx_old = ff.sgd(0.05, momentum=0.9), old.sgd(0.05, momentum=0.9)
    rows = {
        "this checkout, pure": (ff, tx_new, False, False),
        f"{args.commit}, pure": (old, tx_old, False, False),
        "this checkout, donated": (ff, tx_new, True, False),
        f"{args.commit}, donated": (old, tx_old, True, False),
    }
    if args.compiled:
        rows.update(
            {
                "this checkout, compiled pure": (ff, tx_new, False, True),
                f"{args.commit}, compiled pure": (old, tx_old, False, True),
            }
        )
    states, fns, counter, own = {}, {}, {"i": 0}, {}
    for name, (lib, tx, donate, compiled) in rows.items():
        states[name] = lib.fp16_init(p0, tx, lib.DynamicLossScale(2.0**10))
        own[name] = [{k: v.clone() for k, v in gr.items()} for gr in grads]

        def update(state, gr, lib=lib, donate=donate):
            return lib.fp16_update(state, gr, donate=donate)

        fns[name] = torch.compile(update, fullgraph=True) if compiled else update

    def step(name):
        def run():
            states[name] = fns[name](states[name], own[name][counter["i"] % 3])

        return run

    stock = GradScalerSGD(p0, grads, fused=True, name="GradScaler + SGD(fused) FP32")
    timed = {name: step(name) for name in rows}
    timed[stock.name] = lambda: stock.step(counter["i"] % 3)

    def next_step():
        counter["i"] += 1
        stock.prepare(counter["i"] % 3)

    times: dict[str, list[float]] = {name: [] for name in timed}
    faults: dict[str, int] = {name: 0 for name in timed}
    for r in range(args.warmup + args.reps):
        next_step()
        for name in list(timed) if r % 2 else list(timed)[::-1]:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            timed[name]()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    med = {k: C.median(v) * 1e3 for k, v in times.items()}
    info = C.machine_description()
    print(
        f"# fp16_update: this checkout against {args.commit}, {n:,} parameters in "
        f"{len(shapes)} tensors\n"
    )
    print(", ".join(f"{k}: {v}" for k, v in info.items()))
    print(
        f"\nrows interleaved call by call, order reversed every other round, {args.reps} reps, "
        "medians\n"
    )
    print("| row | ms | vs GradScaler + SGD(fused) | page faults per call |")
    print("|---|---:|---:|---:|")
    for name, ms in med.items():
        print(
            f"| {name} | {ms:.2f} | {ms / med['GradScaler + SGD(fused) FP32']:.2f}x "
            f"| {faults[name] / args.reps:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
