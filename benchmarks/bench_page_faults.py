"""Page faults per step of the pure update, in eager mode and compiled.

A pure update returns its new state in fresh memory every step. Where that
memory comes from decides whether each step page-faults it in anew (glibc
``mmap``-s large blocks and unmaps them on ``free``). This script counts the
minor page faults (``getrusage``) of 20 steps of ``fp16_update(state, grads)``
on one flat tree and reports the median per step, for:

* eager: ``fp16_update`` as users call it;
* eager, plain allocation: the same with the output pool switched off
  (``torch.empty_like`` for every output: the public fallback);
* compiled: ``torch.compile(fp16_update, fullgraph=True)``.

Usage::

    python benchmarks/bench_page_faults.py [--params 10000000] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402

import functional_fp16 as ff  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(update, state, grads, steps: int) -> tuple[float, float]:
    """(median faults per step, median ms per step) over ``steps`` steps after 3 warm-up steps."""
    for _ in range(3):
        state = update(state, grads)
    faults, times = [], []
    for _ in range(steps):
        f0, t0 = _faults(), time.perf_counter()
        state = update(state, grads)
        times.append(time.perf_counter() - t0)
        faults.append(_faults() - f0)
    return statistics.median(faults), statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=10_000_000)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(args.params, generator=g) * 0.05}
    grads = {"w": (torch.randn(args.params, generator=g) * 10).half()}
    state = ff.fp16_init(params, ff.sgd(0.05, momentum=0.9))
    rows = {"eager (default)": ff.fp16_update}
    rows["compiled"] = torch.compile(ff.fp16_update, fullgraph=True)
    results = {name: measure(fn, state, grads, args.steps) for name, fn in rows.items()}
    try:
        from functional_fp16._fused import memory
    except ImportError:
        memory = None
    if memory is not None:
        real = memory._POOL.empty_like
        memory._POOL.empty_like = lambda ts, ds: [
            torch.empty_like(t, dtype=d) for t, d in zip(ts, ds)
        ]
        try:
            results["eager, plain allocation"] = measure(ff.fp16_update, state, grads, args.steps)
        finally:
            memory._POOL.empty_like = real
    info = C.machine_description()
    print(f"# Page faults per pure update step, {args.params:,} parameters (SGD momentum)\n")
    print(", ".join(f"{k}: {v}" for k, v in info.items()))
    print("\n| update | minor faults per step (median) | ms per step (median) |")
    print("|---|---:|---:|")
    for name, (faults, ms) in results.items():
        print(f"| {name} | {faults:,.0f} | {ms:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
