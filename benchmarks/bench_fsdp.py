"""A step of the FSDP2 recipe, ours against stock FSDP2, on gloo ranks of this machine.

Both sides train the GPT example's model (``examples/gpt_model.py``) on the
same global batch, sharded with ``fully_shard`` per block and at the root,
with clip + AdamW (weight decay on the weight matrices) + warmup-cosine:

* ``ours``: the model in FP16 (FSDP2 all-gathers FP16), the state from
  ``fp16_init(dict(model.named_parameters()), tx)`` (FP32 master DTensors),
  ``backward`` of the scaled loss, ``fp16_update`` on the DTensor state and
  ``write_params`` (``examples/gpt_fsdp.py``);
* ``stock``: an FP32 model with ``MixedPrecisionPolicy(param_dtype=float16)``
  (FSDP2 keeps FP32 shards and all-gathers FP16 copies),
  ``torch.amp.GradScaler`` (``found_inf`` reduced across the mesh),
  ``clip_grad_norm_`` and ``torch.optim.AdamW(fused=True)`` (its fused
  kernel takes DTensor parameters) with two parameter groups and a
  ``LambdaLR`` warmup-cosine.

Each rank times whole steps (forward, backward, update), the sides
interleaved, ``--rounds`` rounds of ``--steps``; the report is the median
over rounds of the slowest rank's mean step, the ratio ours / stock, and
each side's FP32 bytes per rank (master and optimiser state) and bytes of
one all-gather of the parameters.

Usage::

    python benchmarks/bench_fsdp.py [--world 2] [--rounds 5] [--steps 10] [--width 128]
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


def _local_bytes(tensors) -> int:
    total = 0
    for x in tensors:
        x = x.to_local() if hasattr(x, "to_local") else x
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype == torch.float32:
            total += x.numel() * x.element_size()
    return total


def _worker(rank: int, world: int, port: int, args, out) -> None:
    init_gloo_rank(rank, world, port)
    import gpt_fsdp
    import optree
    from gpt_model import GPTConfig, build_model, decay_mask
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import functional_fp16 as ff

    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig(vocab_size=65, context=args.context, layers=args.layers, heads=4,
                    width=args.width, dropout=0.0)  # fmt: skip
    total_steps = args.rounds * args.steps + 1
    schedule = ff.warmup_cosine_decay_schedule(1e-4, 1e-3, 2, total_steps, 1e-4)

    # ours
    model = build_model(cfg, 0)
    mask = decay_mask(model)
    gpt_fsdp.shard_model(model, mesh, torch.float16)
    tx = ff.chain(ff.clip_by_global_norm(1.0),
                  ff.adamw(schedule, b2=0.95, weight_decay=0.1, mask=mask))  # fmt: skip
    state = ff.fp16_init(dict(model.named_parameters()), tx, ff.DynamicLossScale(2.0**16))

    # stock
    stock = build_model(cfg, 0)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16)
    for block in stock.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(stock, mesh=mesh, mp_policy=policy)
    named = dict(stock.named_parameters())
    groups = [
        {"params": [p for n, p in named.items() if mask[n]], "weight_decay": 0.1},
        {"params": [p for n, p in named.items() if not mask[n]], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), fused=True)

    def lr_at(step: int) -> float:
        if step < 2:
            return 0.1 + 0.9 * step / 2
        t = (step - 2) / max(1, total_steps - 2)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    g = torch.Generator().manual_seed(0)
    share = args.batch // world

    def batch():
        x = torch.randint(0, 65, (args.batch, args.context + 1), generator=g)
        x = x[rank * share : (rank + 1) * share]
        return x[None, :, :-1], x[None, :, 1:]

    def step_ours():
        nonlocal state
        x, y = batch()
        state, _ = gpt_fsdp.fsdp_step(model, state, x, y)

    def step_stock():
        x, y = batch()
        logits = stock(x[0]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), y[0].flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(stock.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)

    for fn in (step_ours, step_stock):  # warm-up: lazy init, optimiser state
        fn()
        fn()
    times = time_step_rounds({"ours": step_ours, "stock": step_stock}, args.rounds, args.steps)
    opt_tensors = [v for s in opt.state.values() for v in s.values()]
    ours_fp32 = _local_bytes(
        optree.tree_leaves((state.master, state.opt_state), namespace=ff.NAMESPACE)
    )
    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "times": times,
        "ours_fp32_bytes": ours_fp32,
        "stock_fp32_bytes": _local_bytes(list(stock.parameters()) + opt_tensors),
        "params": n_params,
        "ours_gather_dtype": str(next(model.parameters()).dtype),
        "stock_gather_dtype": str(policy.param_dtype),
    }
    gather_to_parent(result, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    add_step_flags(p)
    args = p.parse_args()
    ranks = run_ranks(_worker, args.world, args)
    ours, stock = slowest_rank_medians(ranks, ("ours", "stock"), args.rounds).values()
    r0 = ranks[0]
    print(machine_line())
    print(f"{args.world} gloo ranks; "
          f"{r0['params']:,} parameters (width {args.width}, {args.layers} layers), "
          f"global batch {args.batch} x {args.context}")  # fmt: skip
    print(f"step, median of {args.rounds} rounds x {args.steps} steps (slowest rank):")
    print(f"  ours  (FP16 module + fp16_update)                    {1e3 * ours:8.2f} ms")
    print(f"  stock (MixedPrecisionPolicy + GradScaler + fused AdamW){1e3 * stock:8.2f} ms")
    print(f"  ours / stock                                         {ours / stock:8.3f}x")
    print("FP32 bytes per rank (master / FP32 params and optimiser state):")
    for r, res in enumerate(ranks):
        print(f"  rank {r}: ours {res['ours_fp32_bytes']:,}  stock {res['stock_fp32_bytes']:,}")
    whole = 12 * r0["params"]  # FP32 master (or params) + two FP32 moments, unsharded
    print(f"  unsharded: {whole:,} (1/{args.world} = {whole // args.world:,})")
    print(f"all-gathered parameter dtype: ours {r0['ours_gather_dtype']}, "
          f"stock {r0['stock_gather_dtype']} ({2 * r0['params']:,} bytes per full gather, "
          f"FP32 would be {4 * r0['params']:,})")  # fmt: skip


if __name__ == "__main__":
    main()
