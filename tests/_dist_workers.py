"""Worker side of ``tests/test_distributed.py``: one process per rank, started by the test.

Run as ``python -m tests._dist_workers OUT_DIR`` (from the repository) with the
``torchrun`` variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) set.
Every scenario below runs in turn in the same process group; each writes
``OUT_DIR/<scenario>_rank<r>.pt`` (its results) or ``OUT_DIR/<scenario>_rank<r>.err``
(a traceback), and the test process checks them. The model, the data and the
single-process reference live here too, so both sides use the same code.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple

import torch

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16._util.tree import tree_leaves, tree_map, tree_paths
from tests._launch import error_of, exit_now, run_scenarios, thread_names

# -- the model, the data, the reference ------------------------------------

IN, HIDDEN, OUT = 8, 16, 4
BATCH = 16  # the global batch; each of the 2 ranks gets BATCH // 2 rows
STEPS = 6
INJECT_STEP = 2  # the step at which one rank's gradients get an inf
LR, MOMENTUM = 0.05, 0.9


def make_params(seed: int) -> dict[str, torch.Tensor]:
    """A small MLP's parameters as a dict."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(IN, HIDDEN, generator=g) * 0.5,
        "b1": torch.randn(HIDDEN, generator=g) * 0.1,
        "w2": torch.randn(HIDDEN, OUT, generator=g) * 0.5,
        "b2": torch.randn(OUT, generator=g) * 0.1,
    }


def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: BATCH rows of inputs and regression targets."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of the rows of ``x``."""
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of a tanh MLP, computed in FP32 from the working parameters."""
    p = {k: v.float() for k, v in params.items()}
    out = torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return ((out - y) ** 2).mean()


def make_loss_scale() -> ff.DynamicLossScale:
    # Grows every 2 finite steps, so the scale changes during the run.
    return ff.DynamicLossScale(init_scale=2.0**10, growth_interval=2)


def grads_of(state: ff.FP16State, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the scaled loss with respect to the working parameters."""
    return torch.func.grad(lambda p: state.loss_scale.scale(loss_fn(p, x, y)))(state.params)


def snapshot(state: ff.FP16State) -> dict[str, Any]:
    """The parts of a state the tests compare, cloned."""
    return {
        "params": {k: v.clone() for k, v in state.params.items()},
        "master": {k: v.clone() for k, v in state.master.items()},
        "loss_scale": state.loss_scale.loss_scale.clone(),
        "grads_finite": state.grads_finite.clone(),
        "step": state.step.clone(),
    }


def run_reference(param_dtype: torch.dtype, steps: int = STEPS) -> list[dict[str, Any]]:
    """One process, fed the whole batch every step."""
    state = ff.fp16_init(
        make_params(0), ff.sgd(LR, momentum=MOMENTUM), make_loss_scale(), param_dtype=param_dtype
    )
    history = []
    for step in range(steps):
        x, y = make_batch(step)
        state = ff.fp16_update(state, grads_of(state, x, y))
        history.append(snapshot(state))
    return history


def dp_init(path: str, param_dtype: torch.dtype, seed: int) -> ff.FP16State:
    """An initial state on this rank, then everyone takes rank 0's values."""
    tx = ff.sgd(LR, momentum=MOMENTUM)
    if path == "tx":
        tx = ff.chain(ffd.all_reduce_mean(), tx)
    state = ff.fp16_init(make_params(seed), tx, make_loss_scale(), param_dtype=param_dtype)
    return ffd.broadcast_state(state)


def dp_step(
    state: ff.FP16State,
    step: int,
    path: str,
    *,
    agree: bool = True,
    inject: bool = False,
) -> ff.FP16State:
    """One data-parallel step on this rank's half of the batch.

    ``path="raw"`` averages the scaled gradients before the update;
    ``path="tx"`` leaves it to ``all_reduce_mean`` inside the optimiser.
    """
    rank, world = ffd.get_rank(), ffd.get_world_size()
    x, y = make_batch(step)
    grads = grads_of(state, shard(x, rank, world), shard(y, rank, world))
    if inject:
        w1 = grads["w1"].clone()
        w1[0, 0] = float("inf")
        grads = {**grads, "w1": w1}
    if path == "raw":
        grads = ffd.tree_all_reduce_mean(grads)
    return ff.fp16_update(state, grads, agree=ffd.agree_finite if agree else None)


# -- scenarios ---------------------------------------------------------------


def scenario_env(rank: int, out: str) -> dict[str, Any]:
    info = _INFO
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "local_rank": info.local_rank,
        "backend": info.backend,
        "device": str(info.device),
        "is_main": info.is_main,
    }


def scenario_parity(rank: int, out: str) -> dict[str, Any]:
    results = {}
    for dtype in (torch.float32, torch.float16):
        for path in ("raw", "tx"):
            # Each rank starts from different values; broadcast_state makes them rank 0's.
            state = dp_init(path, dtype, seed=rank)
            history = []
            for step in range(STEPS):
                state = dp_step(state, step, path)
                history.append(snapshot(state))
            results[(path, str(dtype))] = history
    return results


def scenario_overflow(rank: int, out: str) -> dict[str, Any]:
    results = {}
    for path, agree in (("tx", True), ("raw", True), ("tx", False)):
        state = dp_init(path, torch.float16, seed=0)
        history = []
        for step in range(STEPS):
            inject = rank == 1 and step == INJECT_STEP
            state = dp_step(state, step, path, agree=agree, inject=inject)
            history.append(snapshot(state))
        results[(path, agree)] = history
    return results


def scenario_resume(rank: int, out: str) -> dict[str, Any]:
    ckpt = os.path.join(out, "resume.ckpt")
    half = STEPS // 2
    state = dp_init("raw", torch.float16, seed=0)
    for step in range(STEPS):
        if step == half:
            ffd.save_checkpoint_rank0(ckpt, {"state": state, "epoch": half})
        state = dp_step(state, step, "raw")
    uninterrupted = snapshot(state)
    saved_exists_after_save = os.path.exists(ckpt)

    # A restart: fresh, different state on every rank, built by the same code.
    fresh = dp_init_no_broadcast(seed=100 + rank)
    # Only rank 0 reads the file; the other ranks could be on a machine without it.
    path = ckpt if rank == 0 else os.path.join(out, "not-on-this-machine.ckpt")
    loaded = ffd.load_checkpoint_broadcast(path, {"state": fresh, "epoch": 0})
    state = loaded["state"]
    resumed_at = snapshot(state)
    for step in range(loaded["epoch"], STEPS):
        state = dp_step(state, step, "raw")

    missing_error = None
    try:
        ffd.load_checkpoint_broadcast(os.path.join(out, "missing.ckpt"), {"state": fresh})
    except Exception as err:
        missing_error = f"{type(err).__name__}: {err}"
    return {
        "uninterrupted": uninterrupted,
        "resumed": snapshot(state),
        "resumed_at": resumed_at,
        "epoch": loaded["epoch"],
        "exists": saved_exists_after_save,
        "missing_error": missing_error,
    }


def dp_init_no_broadcast(seed: int) -> ff.FP16State:
    return ff.fp16_init(
        make_params(seed),
        ff.sgd(LR, momentum=MOMENTUM),
        make_loss_scale(),
        param_dtype=torch.float16,
    )


def scenario_mismatch(rank: int, out: str) -> dict[str, Any]:
    params = make_params(0)
    if rank == 1:
        params["w2"] = torch.zeros(HIDDEN, OUT + 1)
    shape_error = error_of(lambda: ffd.broadcast_state(ff.fp16_init(params, ff.sgd(LR))))
    init_error = error_of(lambda: ff.fp16_init(params, ff.chain(ffd.all_reduce_mean(), ff.sgd(LR))))

    extra = make_params(0)
    if rank == 1:
        extra["extra"] = torch.zeros(3)
    structure_error = error_of(lambda: ffd.check_same_tree(extra, name="params"))

    # The group still works afterwards: nobody was left inside a collective.
    alive = ffd.tree_all_reduce_mean({"x": torch.full((2,), float(rank))})["x"]
    return {
        "shape_error": shape_error,
        "init_error": init_error,
        "structure_error": structure_error,
        "alive": alive,
    }


def scenario_broadcast(rank: int, out: str) -> dict[str, Any]:
    # Rank 1's state differs in every kind of leaf: params, master, momentum,
    # loss scale and counters (one local step taken) and a host value.
    scale = ff.DynamicLossScale(init_scale=2.0 ** (10 if rank == 0 else 5), growth_interval=2)
    state = ff.fp16_init(make_params(rank), ff.sgd(LR, momentum=MOMENTUM), scale)
    if rank == 1:
        x, y = make_batch(0)
        state = ff.fp16_update(state, grads_of(state, x, y))
    tree = {"state": state, "epoch": 10 + rank}
    before = [t.clone() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    got = ffd.broadcast_state(tree)
    after = [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
    return {
        "leaves": _plain(got["state"]),
        "epoch": got["epoch"],
        "is_fp16_state": isinstance(got["state"], ff.FP16State) and got["state"].tx is state.tx,
        "input_unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


def bucket_tree(rank: int) -> dict[str, Any]:
    """A mixed-dtype tree whose values depend on the rank: x_r = base * (r + 1)."""
    g = torch.Generator().manual_seed(7)
    f = float(rank + 1)
    return {
        "pair": Pair(
            a=(torch.randn(3, 5, generator=g) * f).half(), b=torch.randn(7, generator=g) * f
        ),
        "c": (torch.randn(2, 2, 2, generator=g) * f).half(),
        "d": torch.randn(4, generator=g) * f,
        "e": torch.randn((), generator=g) * f,
    }


class _CountCalls:
    """Counts ``torch.distributed.all_reduce`` calls while active."""

    def __init__(self) -> None:
        self.calls = 0
        self._orig = None

    def __enter__(self) -> _CountCalls:
        self._orig = torch.distributed.all_reduce

        def counting(*args, **kwargs):
            self.calls += 1
            return self._orig(*args, **kwargs)

        torch.distributed.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        torch.distributed.all_reduce = self._orig


def _plain(tree: Any) -> dict[str, torch.Tensor]:
    """``{leaf path: leaf}``, which ``torch.load`` opens without the NamedTuple class."""
    return dict(zip(tree_paths(tree), tree_leaves(tree), strict=True))


def scenario_buckets(rank: int, out: str) -> dict[str, Any]:
    tree = bucket_tree(rank)
    before = tree_map(torch.clone, tree)
    with _CountCalls() as one:
        default = ffd.tree_all_reduce_mean(tree)
    with _CountCalls() as many:
        small = ffd.tree_all_reduce_mean(tree, bucket_bytes=16)
    half_comm = ffd.tree_all_reduce_mean(tree, comm_dtype=torch.float16)
    tx = ffd.all_reduce_mean()
    via_tx, _ = tx.update(tree, tx.init(tree))

    big = {"g": torch.full((4,), 40000.0, dtype=torch.float16)}
    big_default = ffd.tree_all_reduce_mean(big)["g"]
    big_no_predivide = ffd.tree_all_reduce_mean(big, predivide_factor=1.0)["g"]
    # FP32 values beyond the FP16 range whose halves fit: divided before the cast.
    wide = {"g": torch.full((4,), 100000.0 if rank == 0 else 30000.0)}
    wide_half_comm = ffd.tree_all_reduce_mean(wide, comm_dtype=torch.float16)["g"]
    return {
        "tree": _plain(tree),
        "before": _plain(before),
        "default": _plain(default),
        "small": _plain(small),
        "half_comm": _plain(half_comm),
        "via_tx": _plain(via_tx),
        "keeps_namedtuple": type(default["pair"]) is Pair and type(via_tx["pair"]) is Pair,
        "calls_default": one.calls,
        "calls_small": many.calls,
        "big_default": big_default,
        "big_no_predivide": big_no_predivide,
        "wide_half_comm": wide_half_comm,
    }


def scenario_agree(rank: int, out: str) -> dict[str, Any]:
    results = {}
    for flags in ((True, True), (True, False), (False, True), (False, False)):
        finite = torch.tensor(flags[rank])
        agreed = ffd.agree_finite(finite)
        results[flags] = (agreed.clone(), finite.clone())
    return results


def scenario_late_import(rank: int, out: str) -> dict[str, Any]:
    """What a training script does after joining the group: a meta-device op (the
    example sizes its model that way), which makes torch import
    ``torch.distributed.nn``, then a collective; the threads running now."""
    import torch.distributed.nn.functional as dist_nn_functional

    with torch.device("meta"):
        torch.nn.functional.max_pool2d(torch.empty(1, 1, 4, 4), 2)
    total = torch.tensor(float(rank + 1))
    torch.distributed.all_reduce(total)
    group_default = dist_nn_functional.all_reduce.__defaults__[-1]
    return {
        "total": total,
        "threads": thread_names(),
        "group_default_is_none": group_default is None,
    }


SCENARIOS = {
    "env": scenario_env,
    "parity": scenario_parity,
    "overflow": scenario_overflow,
    "broadcast": scenario_broadcast,
    "resume": scenario_resume,
    "mismatch": scenario_mismatch,
    "buckets": scenario_buckets,
    "agree": scenario_agree,
    "late_import": scenario_late_import,
}

_INFO: ffd.DistInfo


def _keep_info(info: ffd.DistInfo) -> None:
    global _INFO
    _INFO = info


if __name__ == "__main__":
    exit_now(run_scenarios(SCENARIOS, sys.argv[1], _keep_info))
