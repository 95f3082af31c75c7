"""All-reduce bucketing on gloo: one flat buffer versus one call per tensor.

Starts ``--procs`` CPU processes on 127.0.0.1 and times, on rank 0:

* ``flat``: one ``all_reduce`` of a single ``--numel``-element buffer;
* ``separate``: ``--tensors`` ``all_reduce`` calls on tensors that together
  hold ``--numel`` elements, each waited on before the next (a per-tensor loop);
* ``separate-async``: the same calls all launched, then all waited on;
* ``tree_all_reduce_mean``: the library's bucketed mean of the same
  ``--tensors``-leaf tree, copies into and out of the bucket included.

Each call starts after a barrier; the cases take turns, one call each per
repetition, so that load from other programs affects them alike. The median
and the 10th/90th percentiles over ``--reps`` repetitions are printed, per dtype.

Usage::

    python benchmarks/bench_allreduce.py [--procs 2] [--numel 900000] [--tensors 8] [--reps 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

from functional_fp16 import distributed as ffd  # noqa: E402


def _time(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, result_file: str) -> None:
    C.init_gloo_rank(rank, world, port)
    rows = []
    try:
        for dtype in (torch.float32, torch.float16):
            flat = torch.randn(args.numel).to(dtype)
            sizes = [args.numel // args.tensors] * args.tensors
            sizes[-1] += args.numel - sum(sizes)
            parts = [torch.randn(n).to(dtype) for n in sizes]
            tree = {f"t{i}": p for i, p in enumerate(parts)}

            def one_flat():
                dist.all_reduce(flat)

            def separate():
                for p in parts:
                    dist.all_reduce(p)

            def separate_async():
                for w in [dist.all_reduce(p, async_op=True) for p in parts]:
                    w.wait()

            def bucketed():
                ffd.tree_all_reduce_mean(tree)

            cases = [
                ("flat", one_flat),
                ("separate", separate),
                ("separate-async", separate_async),
                ("tree_all_reduce_mean", bucketed),
            ]
            for _, fn in cases:
                _time(fn, args.warmup)
            # Interleaved, so that a change in the machine's load affects every case alike.
            times: dict[str, list[float]] = {name: [] for name, _ in cases}
            for _ in range(args.reps):
                for name, fn in cases:
                    times[name] += _time(fn, 1)
            for name, _ in cases:
                q = statistics.quantiles(times[name], n=10)
                med = statistics.median(times[name])
                rows.append((str(dtype).replace("torch.", ""), name, med, q[0], q[-1]))
    finally:
        ffd.shutdown()
    if rank == 0:
        with open(result_file, "w") as f:
            for row in rows:
                f.write("\t".join(str(x) for x in row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--numel", type=int, default=900_000)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "result.tsv")
        C.spawn_ranks(_worker, args.procs, args, result_file)
        with open(result_file) as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
    print(
        f"gloo, {args.procs} processes on 127.0.0.1, {args.numel} elements "
        f"({args.tensors} tensors for the per-tensor cases), {args.reps} reps, torch {torch.__version__}"
    )
    print(f"{'dtype':8s} {'case':22s} {'median ms':>10s} {'p10':>8s} {'p90':>8s}")
    for dtype, name, med, p10, p90 in rows:
        print(f"{dtype:8s} {name:22s} {float(med):10.2f} {float(p10):8.2f} {float(p90):8.2f}")


if __name__ == "__main__":
    main()
