"""Worker side of ``tests/test_agreement.py``: one process per rank, started by the test.

Run as ``python -m tests._agreement_workers OUT_DIR`` with the ``torchrun`` variables set.
The last rank differs from the others in one thing at a time (a shape, a
dtype, the optimiser's configuration, the structure, an argument, a
DTensor's placements); every rank must raise promptly, naming the rank and
the difference, and nothing hangs.

The state has FP16 and FP32 working leaves, a channels-last 4-D leaf, an
empty leaf and leaves smaller than the number of ranks; the optimiser is
AdamW after a global-norm clip (two moments, counters).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from tests import _shard_workers as SW
from tests._launch import error_of, exit_now, run_scenarios

LR = 1e-2


def make_tx(lr: float = LR) -> ff.GradientTransformation:
    return ff.chain(ff.clip_by_global_norm(0.05), ff.adamw(lr, mask=SW.ndim_mask))


def make_state(*, lr: float = LR, w1_shape=(7, 5), s_dtype=torch.float32, extra: bool = False):
    """The awkward state of ``tests/_shard_workers.py``, with one thing changed on request."""
    params = SW.make_params(0)
    params["w1"] = torch.randn(w1_shape, generator=torch.Generator().manual_seed(3)) * 0.5
    g = torch.Generator().manual_seed(7)
    params["k"] = (torch.randn(3, 2, 3, 3, generator=g) * 0.5).to(memory_format=torch.channels_last)
    params["z"] = torch.zeros(0)
    params["s"] = torch.randn(4, generator=g)
    if extra:
        params["extra"] = torch.zeros(2)
    scale = ff.DynamicLossScale(2.0**10, growth_interval=2)
    state = ff.fp16_init(params, make_tx(lr), scale)
    return state.replace(params={**state.params, "s": state.master["s"].to(s_dtype)})


class _Counter:
    """Counts the calls of ``dist.all_gather_object`` while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = dist.all_gather_object

    def __enter__(self) -> _Counter:
        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_gather_object = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_object = self.original


def _timed(fn) -> tuple[str | None, float]:
    start = time.monotonic()
    error = error_of(fn)
    return error, time.monotonic() - start


def scenario_fingerprint(rank: int, out: str) -> dict[str, Any]:
    """One rank (the last) differs in one thing at a time: every rank raises, naming it."""
    odd = rank == dist.get_world_size() - 1
    base = dict(lr=LR, w1_shape=(7, 5), s_dtype=torch.float32, extra=False)
    variants = {
        "shape": {"w1_shape": (7, 6)},
        "dtype": {"s_dtype": torch.float16},
        "tx": {"lr": 2e-2},
        "structure": {"extra": True},
    }
    result: dict[str, Any] = {}
    for kind, change in variants.items():
        state = make_state(**{**base, **(change if odd else {})})
        result[("shard_state", kind)] = _timed(lambda: ffd.shard_state(state))
    grads = {k: v.to(torch.float16) for k, v in SW.awkward_grads(make_state(), 0, rank).items()}
    grad_variants = {
        "shape": ({**grads, "w2": torch.zeros(5, 4, dtype=torch.float16)}, {}),
        "dtype": ({**grads, "b1": grads["b1"].float()}, {}),
        "structure": ({**grads, "extra": torch.zeros(2, dtype=torch.float16)}, {}),
        "bucket_bytes": (grads, {"bucket_bytes": 1024}),
    }
    for kind, (variant, kwargs) in grad_variants.items():
        tree, kw = (variant, kwargs) if odd else (grads, {})
        result[("tree_all_reduce_mean", kind)] = _timed(
            lambda: ffd.tree_all_reduce_mean(tree, **kw)
        )
    sharded = ffd.shard_state(make_state())  # the same on every rank
    g = SW.awkward_grads(sharded, 0, rank)
    update_variants = {
        "tx": (sharded.replace(tx=make_tx(2e-2)), g, {}),
        "grads_dtype": (sharded, {**g, "b1": g["b1"].float()}, {}),
        "comm_dtype": (sharded, g, {"comm_dtype": torch.float32}),
        "bucket_bytes": (sharded, g, {"bucket_bytes": 64}),
        "placements": (
            sharded.replace(
                master={
                    **sharded.master,
                    "b1": sharded.master["b1"].redistribute(
                        sharded.master["b1"].device_mesh, [Replicate()]
                    ),
                }
            ),
            g,
            {},
        ),
    }
    for kind, (st, gr, kwargs) in update_variants.items():
        st, gr, kw = (st, gr, kwargs) if odd else (sharded, g, {})
        result[("sharded_update", kind)] = _timed(lambda: ffd.sharded_update(st, gr, **kw))
    # The agreed configuration runs; the first call agrees, the next ones communicate
    # nothing beyond the step's own collectives.
    with _Counter() as first:
        stepped = ffd.sharded_update(sharded, g)
    with _Counter() as later:
        for _ in range(3):
            stepped = ffd.sharded_update(stepped, g)
    with _Counter() as first_mean:
        ffd.tree_all_reduce_mean(grads)
    with _Counter() as later_mean:
        ffd.tree_all_reduce_mean(grads)
    result["calls"] = {
        "sharded_update_first": first.calls,
        "sharded_update_later": later.calls,
        "mean_first": first_mean.calls,
        "mean_later": later_mean.calls,
    }
    return result


SCENARIOS = {"fingerprint": scenario_fingerprint}


if __name__ == "__main__":
    exit_now(run_scenarios(SCENARIOS, sys.argv[1]))
