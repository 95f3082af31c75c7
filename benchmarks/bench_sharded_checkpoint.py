"""Peak memory of sharded checkpoints (DCP) against the whole-file rank-0 path, per rank, on gloo.

Starts ``--world`` CPU processes on 127.0.0.1 (gloo). Each builds the same
``--params``-element tree of FP16 parameters (the leaves of
``bench_sharding.py``), initialises SGD with momentum and shards the state
(``shard_state``), so each rank holds the whole FP16 working copy and its
``1/N`` of the FP32 master and momentum. Then, one after the other, on every
rank:

* ``save_dcp_state`` (each rank writes its own ``Shard(0)`` rows through
  ``torch.distributed.checkpoint``, DCP's own DTensor support);
* ``load_dcp_state`` into a template of the same world size (the state
  itself: only the result is new);
* ``save_checkpoint_rank0`` (``unshard_state`` on every rank, then rank 0
  writes one file);
* ``load_checkpoint_broadcast`` (rank 0 reads the file, every rank receives
  the whole state, then shards it).

For each call: the peak extra resident memory of every rank, measured as
``VmHWM`` (reset through ``/proc/self/clear_refs`` before the call) minus
the resident size before it, after returning freed heap pages to the system;
what the call returns is freed before the next one. Also the wall time of
the slowest rank. Compare the extra memory with the rank's FP32 shard, its
whole sharded state (+ the FP16 working copy) and one bucket.

Usage::

    python benchmarks/bench_sharded_checkpoint.py [--params 100000000] [--world 2]
        [--bucket-bytes 26214400] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
    peak_rss_bytes,
    release_free_memory,
    reset_peak_rss,
    rss_bytes,
    spawn_ranks,
)
from bench_sharding import make_params, nbytes  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16 import distributed as ffd  # noqa: E402

CALLS = (
    "save_dcp_state",
    "load_dcp_state",
    "save_checkpoint_rank0",
    "load_checkpoint_broadcast",
)


def _measure(fn) -> tuple[int, float]:
    """(peak extra resident bytes, seconds) of ``fn()``; its result is dropped before returning."""
    release_free_memory()
    dist.barrier()
    before = rss_bytes()
    if before is None or not reset_peak_rss():
        raise RuntimeError("needs Linux /proc (VmHWM and clear_refs)")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    del result
    dist.barrier()
    return peak - before, seconds


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    init_gloo_rank(rank, world, port)
    try:
        params = make_params(args.params)
        numel, leaves = sum(p.numel() for p in params.values()), len(params)
        state = ffd.shard_state(ff.fp16_init(params, ff.sgd(1e-3, momentum=0.9)))
        del params
        tree = {"state": state, "epoch": 1}
        sharded_dir = os.path.join(args.dir, "sharded")
        full_file = os.path.join(args.dir, "full.ckpt")
        calls = {
            "save_dcp_state": lambda: ffd.save_dcp_state(state, sharded_dir),
            "load_dcp_state": lambda: ffd.load_dcp_state(state, sharded_dir),
            "save_checkpoint_rank0": lambda: ffd.save_checkpoint_rank0(full_file, tree),
            "load_checkpoint_broadcast": lambda: ffd.load_checkpoint_broadcast(full_file, tree),
        }
        mine = {
            "shard_fp32": nbytes(state.master) + nbytes(state.opt_state),
            "params": nbytes(state.params),
            "calls": {name: _measure(fn) for name, fn in calls.items()},
        }
        # The sharded load is bitwise the state it was saved from.
        again = ffd.load_dcp_state(state, sharded_dir)
        same = all(
            torch.equal(a, b)
            for a, b in zip(
                optree.tree_leaves(ffd.unshard_state(again), namespace=ff.NAMESPACE),
                optree.tree_leaves(ffd.unshard_state(state), namespace=ff.NAMESPACE),
                strict=True,
            )
        )
        mine["roundtrip_bitwise"] = same
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
    finally:
        ffd.shutdown()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"numel": numel, "leaves": leaves, "ranks": everyone}, f)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--bucket-bytes", type=int, default=ffd.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = parser.parse_args()
    for key, value in machine_description().items():
        print(f"{key}: {value}")
    own_dir = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="bench_sharded_checkpoint.")
    try:
        out = os.path.join(args.dir, "result.json")
        spawn_ranks(_worker, args.world, args, out)
        with open(out) as f:
            result = json.load(f)
    finally:
        if own_dir:
            shutil.rmtree(args.dir, ignore_errors=True)
    ranks = result["ranks"]
    print(
        f"\n{result['numel']:,} parameters in {result['leaves']} leaves, SGD with momentum, "
        f"{args.world} ranks (gloo), bucket {_mib(args.bucket_bytes)} MiB"
    )
    for r, mine in enumerate(ranks):
        print(
            f"rank {r}: FP32 shard (master + momentum) {_mib(mine['shard_fp32'])} MiB, "
            f"FP16 params {_mib(mine['params'])} MiB, sharded state "
            f"{_mib(mine['shard_fp32'] + mine['params'])} MiB"
        )
    print("\npeak extra resident memory per rank (MiB) and wall time (s, slowest rank)")
    header = f"{'call':<27s}" + "".join(f"{f'rank {r}':>10s}" for r in range(len(ranks)))
    print(header + f"{'seconds':>9s}")
    for name in CALLS:
        extras = [mine["calls"][name][0] for mine in ranks]
        seconds = max(mine["calls"][name][1] for mine in ranks)
        print(f"{name:<27s}" + "".join(f"{_mib(x):>10s}" for x in extras) + f"{seconds:9.2f}")
    print(
        f"\nsharded round trip bitwise on every rank: {all(m['roundtrip_bitwise'] for m in ranks)}"
    )


if __name__ == "__main__":
    main()
