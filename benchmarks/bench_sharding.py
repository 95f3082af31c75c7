"""Sharded FP32 state (ZeRO-1) on gloo: bytes per rank, and the step against the replicated one.

For each world size in ``--worlds`` this starts that many CPU processes on
127.0.0.1 (gloo), builds the same ``--params``-element tree of FP16
parameters on each (leaves of odd sizes), and reports from rank 0:

* **bytes per rank** of the FP32 master and the optimiser state, replicated
  (``fp16_init``) and sharded (``shard_state``), counted from the tensors
  themselves, for SGD with momentum and for AdamW; and the largest and
  smallest rank's share, so padding would show;
* **the step**, timed on every rank (the slowest rank's time is the step's):
  ``replicated`` = ``tree_all_reduce_mean`` of the FP16 gradients +
  ``fp16_update(agree=agree_finite)`` (SGD-momentum, the fused kernel), and
  ``sharded`` = ``sharded_update`` (reduce-scatter, the same kernel on this
  rank's slice, all-gather of the FP16 parameters). The two take turns, one
  step each per repetition, after a barrier; medians over ``--reps``.

With more processes than cores the step times measure oversubscription as
much as the update; compare the two rows of one world size only.

Usage::

    python benchmarks/bench_sharding.py [--params 100000000] [--worlds 1,2,4] [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import optree
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import (  # noqa: E402
    init_gloo_rank,
    machine_description,
    release_free_memory,
    spawn_ranks,
)

import functional_fp16 as ff  # noqa: E402
from functional_fp16 import distributed as ffd  # noqa: E402


def make_params(total: int) -> dict[str, torch.Tensor]:
    """About ``total`` FP32 parameters: square-ish weights with odd sizes, biases, a tiny leaf."""
    side = max(1, int((total / 25) ** 0.5))
    params, n, i = {}, 0, 0
    g = torch.Generator().manual_seed(0)
    while n < total:
        rows = min(side + i % 7, max(1, (total - n) // side))
        params[f"layer{i:02d}.weight"] = torch.randn(rows, side, generator=g) * 0.02
        params[f"layer{i:02d}.bias"] = torch.zeros(rows + 1 if i % 2 else rows)
        n += rows * side + params[f"layer{i:02d}.bias"].numel()
        i += 1
    params["scale"] = torch.ones(3)
    return params


def nbytes(tree) -> int:
    leaves = optree.tree_leaves(tree, namespace=ff.NAMESPACE)
    leaves = [x.to_local() if hasattr(x, "to_local") else x for x in leaves]  # DTensor: its rows
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def fp16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two FP16 tensors in units in the last place."""
    ia, ib = (x.view(torch.int16).long() for x in (a, b))
    ia, ib = (torch.where(x < 0, -(2**15) - x, x) for x in (ia, ib))
    return int((ia - ib).abs().max()) if a.numel() else 0


def _gather_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _gather_min(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return float(t)


def _memory(params, tx) -> dict[str, float]:
    full = ff.fp16_init(params, tx)
    sharded = ffd.shard_state(full)
    mine = nbytes(sharded.master) + nbytes(sharded.opt_state)
    return {
        "replicated": nbytes(full.master) + nbytes(full.opt_state),
        "sharded_max": _gather_max(mine),
        "sharded_min": _gather_min(mine),
        "params": nbytes(full.params),
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    init_gloo_rank(rank, world, port)
    try:
        params = make_params(args.params)
        result = {
            "numel": sum(p.numel() for p in params.values()),
            "leaves": len(params),
            "sgd": _memory(params, ff.sgd(1e-3, momentum=0.9)),
            "adamw": _memory(params, ff.adamw(1e-3)),
        }
        release_free_memory()
        tx = ff.sgd(1e-3, momentum=0.9)
        replicated = ff.fp16_init(params, tx)
        del params
        sharded = ffd.shard_state(replicated)
        g = torch.Generator().manual_seed(rank)
        grads = {
            k: torch.randn(v.shape, generator=g).to(torch.float16)
            for k, v in replicated.params.items()
        }

        def step_replicated():
            mean = ffd.tree_all_reduce_mean(grads)
            return ff.fp16_update(replicated, mean, agree=ffd.agree_finite)

        def step_sharded():
            return ffd.sharded_update(sharded, grads)

        # The two paths agree (one step from the same state): the same decision, and
        # FP16 params within the ulps that summing in another order can move them.
        a, b = step_replicated(), ffd.unshard_state(step_sharded())
        result["same_decision"] = bool(a.grads_finite == b.grads_finite)
        result["param_ulps"] = max(fp16_ulps(a.params[k], b.params[k]) for k in a.params)
        del a, b
        times: dict[str, list[float]] = {"replicated": [], "sharded": []}
        for rep in range(args.warmup + args.reps):
            for name, fn in (("replicated", step_replicated), ("sharded", step_sharded)):
                dist.barrier()
                t0 = time.perf_counter()
                new = fn()
                seconds = _gather_max(time.perf_counter() - t0)  # the slowest rank's step
                del new
                if rep >= args.warmup:
                    times[name].append(seconds)
        result["times"] = times
    finally:
        ffd.shutdown()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def _run(world: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn_ranks(_worker, world, args, out)
        with open(out) as f:
            return json.load(f)


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--worlds", default="1,2,4", help="comma-separated world sizes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    for key, value in machine_description().items():
        print(f"{key}: {value}")
    rows = {w: _run(w, args) for w in worlds}
    first = rows[worlds[0]]
    print(
        f"\n{first['numel']:,} parameters in {first['leaves']} leaves, FP16 working copy "
        f"{_mib(first['sgd']['params']).strip()} MiB on every rank; gloo on 127.0.0.1"
    )
    print("\nFP32 master + optimiser state per rank (MiB; sharded: the largest and smallest rank)")
    print(
        f"{'ranks':>5s} {'optimiser':>10s} {'replicated':>11s} {'sharded':>9s} {'smallest':>9s} {'ratio':>6s}"
    )
    for w, r in rows.items():
        for opt in ("sgd", "adamw"):
            m = r[opt]
            print(
                f"{w:5d} {opt:>10s} {_mib(m['replicated']):>11s} {_mib(m['sharded_max'])} "
                f"{_mib(m['sharded_min'])} {m['sharded_max'] / m['replicated']:6.3f}"
            )
    print("\nOne SGD-momentum step, the slowest rank (median s, min-max in brackets)")
    print(
        f"{'ranks':>5s} {'replicated':>22s} {'sharded':>22s} {'sharded/replicated':>19s} {'param ulps':>11s}"
    )
    for w, r in rows.items():
        cells = []
        for name in ("replicated", "sharded"):
            t = sorted(r["times"][name])
            cells.append(f"{statistics.median(t):7.3f} [{t[0]:.3f}-{t[-1]:.3f}]")
        ratio = statistics.median(r["times"]["sharded"]) / statistics.median(
            r["times"]["replicated"]
        )
        ulps = str(r["param_ulps"]) + ("" if r["same_decision"] else " (decision differs!)")
        print(f"{w:5d} {cells[0]:>22s} {cells[1]:>22s} {ratio:19.2f} {ulps:>11s}")


if __name__ == "__main__":
    main()
