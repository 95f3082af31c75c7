"""A step of the GPT example on a 2 x 2 mesh (tensor parallel inside, FSDP2 across), ours
against the stock way, on 4 gloo ranks of this machine; and the collectives per update.

Both sides train the GPT example's model (``examples/gpt_model.py``) on the
same global batch, laid out alike: torchtitan's plan (``examples/gpt_tp.py``)
over ``mesh["tp"]``, then ``fully_shard`` per block and at the root over
``mesh["dp"]``; each data-parallel pair takes its half of the batch. The
optimiser is clip + AdamW (weight decay on the weight matrices) +
warmup-cosine:

* ``ours``: the model in FP16, ``fp16_init`` of its DTensor parameters (FP32
  master), ``backward`` of the scaled loss, ``fp16_update`` and
  ``write_params`` (``examples/gpt_fsdp.py``'s step);
* ``stock``: an FP32 model with ``MixedPrecisionPolicy(param_dtype=bfloat16)``
  (no loss scaling), ``torch.nn.utils.clip_grad_norm_`` on the DTensor
  gradients, ``torch.optim.AdamW`` with two parameter groups and a
  ``LambdaLR`` warmup-cosine (``fused=True`` where it takes these DTensors,
  else ``foreach``: the report says which).

Each rank times whole steps (forward, backward, update), the sides
interleaved, ``--rounds`` rounds of ``--steps``; the report is the median
over rounds of the slowest rank's mean step and the ratio ours / stock. Then
one update of each side runs under ``CommDebugMode`` (DTensor's collective
counter, which sees ``torch.distributed``'s collectives too): the
collectives of the update alone, by kind.

Usage::

    python benchmarks/bench_tp.py [--rounds 5] [--steps 10] [--width 128]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from _common import (  # noqa: E402
    add_step_flags,
    gather_to_parent,
    init_gloo_rank,
    machine_line,
    run_ranks,
    slowest_rank_medians,
    time_step_rounds,
)

WORLD = 4


def _count(fn) -> dict[str, int]:
    """The collectives ``fn()`` runs, by op name (DTensor's ``CommDebugMode``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn()
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def _layout(model, mesh, policy=None):
    import gpt_tp
    from torch.distributed.fsdp import fully_shard

    gpt_tp.parallelize(model, mesh["tp"])
    extra = {} if policy is None else {"mp_policy": policy}
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"], **extra)
    fully_shard(model, mesh=mesh["dp"], **extra)
    return model


def _worker(rank: int, world: int, port: int, args, out) -> None:
    init_gloo_rank(rank, world, port)
    from gpt_model import GPTConfig, build_model, decay_mask
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import functional_fp16 as ff

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = GPTConfig(vocab_size=64, context=args.context, layers=args.layers, heads=4,
                    width=args.width, dropout=0.0)  # fmt: skip
    total_steps = args.rounds * args.steps + 8
    schedule = ff.warmup_cosine_decay_schedule(1e-4, 1e-3, 2, total_steps, 1e-4)

    # ours
    model = build_model(cfg, 0)
    mask = decay_mask(model)
    _layout(model.half(), mesh)
    tx = ff.chain(ff.clip_by_global_norm(1.0),
                  ff.adamw(schedule, b2=0.95, weight_decay=0.1, mask=mask))  # fmt: skip
    state = ff.fp16_init(dict(model.named_parameters()), tx, ff.DynamicLossScale(2.0**16))

    # stock
    stock = _layout(build_model(cfg, 0), mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    named = dict(stock.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if mask[n]], "weight_decay": 0.1},
        {"params": [p for n, p in named.items() if not mask[n]], "weight_decay": 0.0},
    ]

    def lr_at(step: int) -> float:
        if step < 2:
            return 0.1 + 0.9 * step / 2
        t = (step - 2) / max(1, total_steps - 2)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    g = torch.Generator().manual_seed(0)
    dp = mesh.get_coordinate()[0]
    share = args.batch // 2

    def batch():
        x = torch.randint(0, 64, (args.batch, args.context + 1), generator=g)
        x = x[dp * share : (dp + 1) * share]
        return x[:, :-1], x[:, 1:]

    def loss_of(m, x, y):
        return F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())

    def update_ours():
        nonlocal state
        state = ff.fp16_update(state, {n: p.grad for n, p in model.named_parameters()})

    def step_ours():
        x, y = batch()
        state.loss_scale.scale(loss_of(model, x, y)).backward()
        update_ours()
        ff.write_params(model, state.params)
        model.zero_grad(set_to_none=True)

    opt, kind = None, "fused"

    def update_stock():
        torch.nn.utils.clip_grad_norm_(stock.parameters(), 1.0)
        opt.step()
        sched.step()

    def step_stock():
        x, y = batch()
        loss_of(stock, x, y).backward()
        update_stock()
        opt.zero_grad(set_to_none=True)

    try:  # torch's fused AdamW, where it takes these DTensors
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        step_stock()
    except (RuntimeError, NotImplementedError, TypeError):
        kind = "foreach"
        stock.zero_grad(set_to_none=True)
        opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), foreach=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    for fn in (step_ours, step_stock):  # warm-up: lazy init, optimiser state, plans
        fn()
        fn()
    times = time_step_rounds({"ours": step_ours, "stock": step_stock}, args.rounds, args.steps)
    # The collectives of one update each, the gradients of one backward in place.
    x, y = batch()
    state.loss_scale.scale(loss_of(model, x, y)).backward()
    loss_of(stock, x, y).backward()
    collectives = {"ours": _count(update_ours), "stock": _count(update_stock)}
    meshes = {
        (p.device_mesh.mesh_dim_names, str(p.device_mesh.mesh.tolist())) for p in model.parameters()
    }
    result = {
        "times": times,
        "collectives": collectives,
        "stock_kind": kind,
        "params": sum(p.numel() for p in model.parameters()),
        "leaves": len(list(model.parameters())),
        "meshes": len(meshes),
        "placements": sorted({str(tuple(p.placements)) for p in model.parameters()}),
        "finite": bool(state.grads_finite),
    }
    gather_to_parent(result, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_flags(p)
    args = p.parse_args()
    ranks = run_ranks(_worker, WORLD, args)
    ours, stock = slowest_rank_medians(ranks, ("ours", "stock"), args.rounds).values()
    r0 = ranks[0]
    print(machine_line())
    print(f"2 x 2 gloo mesh (dp, tp); {r0['params']:,} parameters in {r0['leaves']} leaves "
          f"(width {args.width}, {args.layers} layers) on {r0['meshes']} mesh(es), "
          f"global batch {args.batch} x {args.context}")  # fmt: skip
    print("placements: " + "; ".join(r0["placements"]))
    print(f"step, median of {args.rounds} rounds x {args.steps} steps (slowest rank):")
    print(f"  ours  (FP16 module + fp16_update)                       {1e3 * ours:8.2f} ms")
    print(f"  stock (BF16 MixedPrecisionPolicy + {r0['stock_kind']:7s} AdamW)      "
          f"{1e3 * stock:8.2f} ms")  # fmt: skip
    print(f"  ours / stock                                            {ours / stock:8.3f}x")
    print("collectives in one update (rank 0, by op):")
    for side in ("ours", "stock"):
        counts = r0["collectives"][side]
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        print(f"  {side:5s} {sum(counts.values()):3d}: {shown}")
    if not all(r["finite"] for r in ranks):
        print("note: the counted update of ours was skipped (non-finite gradients)")


if __name__ == "__main__":
    main()
