"""Worker side of ``tests/test_sharding.py``: one process per rank, started by the test.

Run as ``python -m tests._shard_workers OUT_DIR`` (from the repository) with the ``torchrun``
variables set, for 2 or 3 ranks. Every scenario runs in turn in one process
group and writes ``OUT_DIR/<scenario>_rank<r>.pt`` or ``.err``. With
``FF_SHARD_CKPT_DIR`` set, the checkpoint scenario writes
``sharded_n<N>.ckpt`` (one file, rank 0) and ``dcp_n<N>`` (DCP, every rank its
shards) there, and with ``FF_SHARD_RESUME`` (the world size of another run) it
also resumes from both of that run's checkpoints and continues.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16.distributed import row_shards
from tests._launch import error_of, exit_now, run_scenarios

# Odd sizes, and leaves smaller than 3 ranks: 35 + 5 + 15 + 2 + 1 = 58 elements,
# which neither 2 nor 3 ranks divide into whole leaves (3 does not divide 58).
SHAPES = {"w1": (7, 5), "b1": (5,), "w2": (5, 3), "b2": (2,), "c": (1,)}
STEPS = 8
INJECT_STEP = 3  # the last rank's gradients get an inf here
RESUME_AFTER = 3  # steps before the checkpoint
CONTINUE_STEPS = 3  # steps after resuming
DECAY_MASK = {"w1": True, "b1": False, "w2": True, "b2": False, "c": False}


def make_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) * 0.5 for k, shape in SHAPES.items()}


def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    p = {k: v.float() for k, v in p.items()}
    h = torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return (h**2).mean() + (p["b2"] ** 2).sum() * p["c"].sum()


def batch(step: int, rank: int) -> torch.Tensor:
    """Rows of inputs for ``step``, different on every rank."""
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))


def grads_of(state: ff.FP16State, x: torch.Tensor) -> dict[str, torch.Tensor]:
    return torch.func.grad(lambda p: state.loss_scale.scale(loss_fn(p, x)))(state.params)


def make_tx(name: str) -> ff.GradientTransformation:
    if name == "sgd":
        return ff.sgd(0.05, momentum=0.9)
    if name == "sgd_nesterov_decay":
        return ff.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)
    if name == "adamw_masked":
        return ff.adamw(1e-2, weight_decay=0.1, mask=DECAY_MASK)
    if name == "clip_sgd":  # a norm over the whole tree, summed across the shards
        return ff.chain(ff.clip_by_global_norm(0.05), ff.sgd(0.05, momentum=0.9))
    if name == "clip_adamw":
        return ff.chain(ff.clip_by_global_norm(0.05), ff.adamw(1e-2, mask=ndim_mask))
    if name == "adamw_ndim_mask":  # a mask function: decay the weights, not the biases
        return ff.adamw(1e-2, weight_decay=0.1, mask=ndim_mask)
    if name == "multisteps":
        return ff.MultiSteps(ff.sgd(0.05, momentum=0.9), 2)
    raise ValueError(name)


def ndim_mask(params: Any) -> Any:
    return optree.tree_map(lambda x: x.ndim > 1, params, namespace=ff.NAMESPACE)


def make_state(tx_name: str, seed: int) -> ff.FP16State:
    scale = ff.DynamicLossScale(init_scale=2.0**10, growth_interval=2)
    return ff.fp16_init(make_params(seed), make_tx(tx_name), scale)


def full_snapshot(state: ff.FP16State) -> dict[str, Any]:
    """Every tensor of an unsharded state, cloned: params, master, optimiser state, counters."""
    leaves = optree.tree_leaves(state.opt_state, namespace=ff.NAMESPACE)
    return {
        "params": {k: v.clone() for k, v in state.params.items()},
        "master": {k: v.clone() for k, v in state.master.items()},
        "opt_state": [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves],
        "loss_scale": state.loss_scale.loss_scale.clone(),
        "step": state.step.clone(),
        "grads_finite": state.grads_finite.clone(),
        "leaf_finite": state.leaf_finite.clone(),
        "nonfinite": ff.nonfinite_leaves(state),
    }


def with_inf(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    w1 = grads["w1"].clone()
    w1[1, 2] = float("inf")
    return {**grads, "w1": w1}


# -- scenarios ---------------------------------------------------------------

# (optimiser, implementation, bucket bytes, reduction): 16 or 64 bytes cut
# every collective into rounds of a few elements; "reduce-scatter" makes the
# CPU take the reduce-scatter that CUDA tensors take (NCCL's path) instead of
# gloo's in-place all-reduce.
RUNS = [
    ("sgd", "auto", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("sgd", "reference", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("sgd", "auto", 16, "default"),
    ("sgd", "auto", 16, "reduce-scatter"),
    ("sgd_nesterov_decay", "auto", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("adamw_masked", "auto", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("adamw_ndim_mask", "auto", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("multisteps", "auto", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("clip_sgd", "auto", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("clip_sgd", "reference", ffd.DEFAULT_BUCKET_BYTES, "default"),
    ("clip_adamw", "auto", 64, "reduce-scatter"),
]


@contextlib.contextmanager
def reduction(kind: str):
    """Within the block, CPU gradients take ``kind``'s path in sharded_update."""
    saved = row_shards.reduces_in_place
    if kind == "reduce-scatter":
        row_shards.reduces_in_place = lambda device: False
    try:
        yield
    finally:
        row_shards.reduces_in_place = saved


def scenario_equivalence(rank: int, out: str) -> dict[Any, Any]:
    """The sharded run next to the replicated one, each fed the same per-rank batches."""
    world = ffd.get_world_size()
    # The sum of two values does not depend on the order, of three it does, and the
    # order is the collective's: gloo's ring sums an element in an order set by its
    # position in the buffer, which the all-reduce lays out by leaves and the
    # reduce-scatter by rank blocks. At 3 ranks an FP16 mean may then differ by an
    # FP16 ulp, which an SGD step carries into the master as lr * 2**-11 |g|: both
    # sides send FP32 there, whose differences stay within the contract's FP32 ulps.
    wire = torch.float16 if world == 2 else torch.float32
    result = {}
    for tx_name, impl, bucket, kind in RUNS:
        rep = ffd.broadcast_state(make_state(tx_name, seed=rank))  # rank 0's values everywhere
        sharded = ffd.shard_state(rep)
        history = []
        for step in range(STEPS):
            x = batch(step, rank)
            g_rep, g_sh = grads_of(rep, x), grads_of(sharded, x)
            if step == INJECT_STEP and rank == world - 1:
                g_rep, g_sh = with_inf(g_rep), with_inf(g_sh)
            rep = ff.fp16_update(
                rep, ffd.tree_all_reduce_mean(g_rep, comm_dtype=wire), agree=ffd.agree_finite,
                impl=impl,
            )  # fmt: skip
            with reduction(kind):
                sharded = ffd.sharded_update(
                    sharded, g_sh, impl=impl, bucket_bytes=bucket, comm_dtype=wire
                )
            history.append((full_snapshot(rep), full_snapshot(ffd.unshard_state(sharded))))
        result[(tx_name, impl, bucket, kind)] = history
    return result


def awkward_state(tx_name: str) -> ff.FP16State:
    """Two dtype groups (an FP32 working leaf), a channels-last 4-D leaf and an empty leaf."""
    params = make_params(0)
    g = torch.Generator().manual_seed(7)
    params["k"] = (torch.randn(3, 2, 3, 3, generator=g) * 0.5).to(memory_format=torch.channels_last)
    params["z"] = torch.zeros(0)
    params["s"] = torch.randn(4, generator=g)
    state = ff.fp16_init(params, make_tx(tx_name), ff.DynamicLossScale(2.0**10, growth_interval=2))
    return state.replace(params={**state.params, "s": state.master["s"].clone()})


def awkward_grads(state: ff.FP16State, step: int, rank: int) -> dict[str, torch.Tensor]:
    """Integer-valued gradients, different on every rank, laid out as awkwardly as autograd may:
    channels-last for "k", an expanded (stride-0) tensor for "b2"."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    grads = {
        k: torch.randint(-64, 65, v.shape, generator=g).to(v.dtype) for k, v in state.params.items()
    }
    grads["k"] = grads["k"].to(memory_format=torch.channels_last)
    grads["b2"] = grads["b2"][:1].expand(2)
    return grads


def scenario_awkward(rank: int, out: str) -> dict[Any, Any]:
    """The layout's corners: FP32 and FP16 leaves, channels-last, an empty leaf, 32-byte rounds.

    The gradients' mean is exact in any summation order (integers, FP32 on the
    wire), so the sharded run must be bitwise the replicated one.
    """
    result = {}
    for tx_name in ("sgd", "clip_adamw"):
        rep = ffd.broadcast_state(awkward_state(tx_name))
        sharded = ffd.shard_state(rep)
        history = []
        for step in range(4):
            grads = awkward_grads(rep, step, rank)
            mean = ffd.tree_all_reduce_mean(grads, comm_dtype=torch.float32)
            rep = ff.fp16_update(rep, mean, agree=ffd.agree_finite)
            sharded = ffd.sharded_update(sharded, grads, comm_dtype=torch.float32, bucket_bytes=32)
            full = ffd.unshard_state(sharded)
            history.append((full_snapshot(rep), full_snapshot(full)))
        result[tx_name] = {
            "history": history,
            "placements": sorted({str(tuple(m.placements)) for m in sharded.master.values()}),
            "master_types": sorted({type(m).__name__ for m in sharded.master.values()}),
            "channels_last": full.params["k"].is_contiguous(memory_format=torch.channels_last),
            "master_channels_last": full.master["k"].is_contiguous(
                memory_format=torch.channels_last
            ),
        }
    return result


def scenario_exact_sums(rank: int, out: str) -> dict[str, Any]:
    """Gradients whose mean is exact in any summation order: FP16 integers, FP32 on the wire."""
    result = {}
    for tx_name in ("sgd", "adamw_masked"):
        rep = ffd.broadcast_state(make_state(tx_name, seed=0))
        sharded = ffd.shard_state(rep)
        history = []
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            grads = {
                k: torch.randint(-64, 65, v.shape, generator=g).to(torch.float16)
                for k, v in rep.params.items()
            }
            mean = ffd.tree_all_reduce_mean(grads, comm_dtype=torch.float32)
            rep = ff.fp16_update(rep, mean, agree=ffd.agree_finite)
            sharded = ffd.sharded_update(sharded, grads, comm_dtype=torch.float32)
            history.append((full_snapshot(rep), full_snapshot(ffd.unshard_state(sharded))))
        result[tx_name] = history
    return result


def _bits(tree: Any) -> list[torch.Tensor]:
    leaves = optree.tree_leaves(tree, namespace=ff.NAMESPACE)
    leaves = [x.to_local() if isinstance(x, DTensor) else x for x in leaves]
    return [
        x.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
        for x in leaves
        if isinstance(x, torch.Tensor)
    ]


def scenario_purity(rank: int, out: str) -> dict[str, Any]:
    """sharded_update writes to none of its inputs (state and gradients, bit for bit)."""
    sharded = ffd.shard_state(ffd.broadcast_state(make_state("adamw_masked", seed=0)))
    sharded = ffd.sharded_update(sharded, grads_of(sharded, batch(0, rank)))  # moments non-zero
    grads = grads_of(sharded, batch(1, rank))
    before = (_bits(sharded), _bits(grads))
    ffd.sharded_update(sharded, grads)
    return {"before": before, "after": (_bits(sharded), _bits(grads))}


def _nbytes(tree: Any) -> int:
    leaves = optree.tree_leaves(tree, namespace=ff.NAMESPACE)
    leaves = [x.to_local() if isinstance(x, DTensor) else x for x in leaves]
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def scenario_memory(rank: int, out: str) -> dict[str, Any]:
    """Bytes of the master and optimiser state, full and on this rank."""
    result = {}
    for tx_name in ("sgd", "adamw_masked"):
        full = make_state(tx_name, seed=0)
        sharded = ffd.shard_state(full)
        result[tx_name] = {
            "full_master": _nbytes(full.master),
            "full_opt": _nbytes(full.opt_state),
            "master": _nbytes(sharded.master),
            "opt": _nbytes(sharded.opt_state),
            "params": _nbytes(sharded.params),
            "full_params": _nbytes(full.params),
            "local_shapes": {k: tuple(m.to_local().shape) for k, m in sharded.master.items()},
            # What DTensor itself gives each rank of the full tensors, as a check of the layout.
            "dtensor_shapes": {
                k: tuple(
                    distribute_tensor(
                        m, sharded.master[k].device_mesh, [Shard(0)], src_data_rank=None
                    )
                    .to_local()
                    .shape
                )
                for k, m in full.master.items()
            },
            "global_shapes": {k: tuple(m.shape) for k, m in sharded.master.items()},
        }
    return result


def scenario_errors(rank: int, out: str) -> dict[str, Any]:
    """Misuse raises on every rank, before any collective, naming what is wrong."""
    full = ffd.broadcast_state(make_state("sgd", seed=0))
    sharded = ffd.shard_state(full)
    grads = grads_of(sharded, batch(0, rank))
    mesh = sharded.master["b1"].device_mesh
    replicated = sharded.master["b1"].redistribute(mesh, [Replicate()])
    replicated = sharded.replace(master={**sharded.master, "b1": replicated})
    bad_grads = {**grads, "w2": grads["w2"][:, :2]}
    before = _bits(sharded)
    stale = sharded.replace(params={**sharded.params, "b1": torch.zeros(6, dtype=torch.float16)})
    averaged = ff.fp16_init(
        make_params(0), ff.chain(ffd.all_reduce_mean(), ff.sgd(0.1, momentum=0.9))
    )
    errors = {
        "shard_twice": error_of(lambda: ffd.shard_state(sharded)),
        "fp16_update_sharded": error_of(lambda: ff.fp16_update(sharded, grads)),
        "update_path_sharded": error_of(lambda: ff.update_path(sharded)),
        "sharded_update_full": error_of(lambda: ffd.sharded_update(full, grads)),
        "unshard_full": error_of(lambda: ffd.unshard_state(full)),
        "replicated_master": error_of(lambda: ffd.sharded_update(replicated, grads)),
        "bad_grads": error_of(lambda: ffd.sharded_update(sharded, bad_grads)),
        "mesh_2d": error_of(lambda: ffd.shard_state(full, mesh=_mesh_2d())),
        "plain_save": error_of(lambda: ff.save_checkpoint(os.path.join(out, "x.ckpt"), sharded)),
        "bad_loss": error_of(lambda: ffd.sharded_update(sharded, grads, loss=1.0)),
        "bad_impl": error_of(lambda: ffd.sharded_update(sharded, grads, impl="fast")),
        "stale_layout": error_of(
            lambda: ffd.sharded_update(stale, {**grads, "b1": stale.params["b1"]})
        ),
        "all_reduce_in_tx": error_of(lambda: ffd.shard_state(averaged)),
    }
    # The process group still works afterwards (no rank was left in a collective).
    ffd.sharded_update(sharded, grads)
    return {
        "errors": errors,
        "unchanged": [torch.equal(a, b) for a, b in zip(before, _bits(sharded))],
    }


def _mesh_2d():
    world = ffd.get_world_size()
    return torch.distributed.device_mesh.DeviceMesh("cpu", torch.arange(world).view(1, world))


def _same_grads_step(state: ff.FP16State, step: int) -> ff.FP16State:
    """A sharded step where every rank has the whole batch's gradients, averaged in FP32:
    the mean is exactly those gradients, whatever the world size."""
    grads = grads_of(state, batch(step, 0))
    return ffd.sharded_update(state, grads, comm_dtype=torch.float32)


def scenario_checkpoint(rank: int, out: str) -> dict[str, Any]:
    """Writes a sharded run's checkpoint; with FF_SHARD_RESUME, resumes another world size's."""
    ckpt_dir = os.environ["FF_SHARD_CKPT_DIR"]
    world = ffd.get_world_size()
    state = ffd.shard_state(ffd.broadcast_state(make_state("adamw_masked", seed=0)))
    for step in range(RESUME_AFTER):
        state = _same_grads_step(state, step)
    path = os.path.join(ckpt_dir, f"sharded_n{world}.ckpt")
    ffd.save_checkpoint_rank0(path, {"state": state, "epoch": RESUME_AFTER})
    ffd.save_dcp_state(state, os.path.join(ckpt_dir, f"dcp_n{world}"))
    result: dict[str, Any] = {"written": full_snapshot(ffd.unshard_state(state))}
    resume = os.environ.get("FF_SHARD_RESUME")
    if resume:
        like = {"state": ffd.shard_state(make_state("adamw_masked", seed=1)), "epoch": 0}
        loaded = ffd.load_checkpoint_broadcast(
            os.path.join(ckpt_dir, f"sharded_n{resume}.ckpt"), like
        )
        from_dcp = ffd.load_dcp_state(like["state"], os.path.join(ckpt_dir, f"dcp_n{resume}"))
        state = loaded["state"]
        result["resumed_mesh"] = state.master["w1"].device_mesh.size()
        result["resumed_placements"] = {k: tuple(m.placements) for k, m in state.master.items()}
        result["resumed_epoch"] = loaded["epoch"]
        result["resumed"] = full_snapshot(ffd.unshard_state(state))
        result["resumed_dcp"] = full_snapshot(ffd.unshard_state(from_dcp))
        result["dcp_placements"] = {k: tuple(m.placements) for k, m in from_dcp.master.items()}
        history = []
        for step in range(RESUME_AFTER, RESUME_AFTER + CONTINUE_STEPS):
            state = _same_grads_step(state, step)
            history.append(full_snapshot(ffd.unshard_state(state)))
        result["continued"] = history
    return result


def scenario_legacy(rank: int, out: str) -> dict[str, Any]:
    """A checkpoint of the retired sharded format (written at 2 ranks) loaded into a sharded like."""
    from tests.test_sharded_checkpoints import LEGACY, legacy_like, old_leaves

    loaded = ffd.load_checkpoint_sharded(
        LEGACY, {**legacy_like(), "state": ffd.shard_state(legacy_like()["state"])}
    )
    return {
        "epoch": loaded["epoch"],
        "sharded": ffd.is_sharded(loaded["state"]),
        "full": [x.clone() for x in old_leaves(ffd.unshard_state(loaded["state"]))],
    }


SCENARIOS = {
    "equivalence": scenario_equivalence,
    "awkward": scenario_awkward,
    "exact_sums": scenario_exact_sums,
    "purity": scenario_purity,
    "memory": scenario_memory,
    "errors": scenario_errors,
    "checkpoint": scenario_checkpoint,
    "legacy": scenario_legacy,
}


if __name__ == "__main__":
    exit_now(run_scenarios(SCENARIOS, sys.argv[1]))
