"""The GPT example sharded with FSDP2: ``torchrun --nproc-per-node 2 examples/gpt_functional.py --fsdp``.

The same model, data, optimiser (``clip_by_global_norm`` + AdamW with the
weight-decay mask and the warmup-cosine schedule) and loss scaling as the
single-process run, on PyTorch's own engine:

* the model is cast to FP16 and sharded with ``fully_shard`` per block and
  at the root, so each rank holds ``1/N`` of every FP16 parameter (a DTensor,
  ``Shard(0)``) and FSDP2 all-gathers FP16 for the forward and backward
  passes (half the bytes of FP32 parameters);
* ``ff.fp16_init(dict(model.named_parameters()), tx)`` builds the state from
  those DTensors: the FP32 master and AdamW's moments are DTensors with the
  same placements (``1/N`` per rank);
* each micro-batch runs the module itself and ``backward`` of the scaled
  loss; FSDP2 reduce-scatters the FP16 gradients into ``p.grad`` (summed over
  the micro-batches);
* ``ff.fp16_update(state, grads)`` steps the local shards, agrees on the
  overflow decision and clips by the whole model's norm over the mesh, and
  ``ff.write_params(model, state.params)`` copies the new FP16 rows into the
  module's shards (FSDP2 re-pads a parameter whose rows the ranks do not
  divide evenly, here the 65-row embedding, into storage of its own, so the
  module's shards are not the tensors the state was built from);
* every ``--eval-interval`` steps and at the end ``ffd.save_dcp_state``
  writes the state through ``torch.distributed.checkpoint`` (each rank its
  shards), and ``--resume`` of such a directory continues at any world size.

With ``--tp N`` the ranks form a 2-D ``("dp", "tp")`` mesh: ``gpt_tp.py``
applies torchtitan's tensor-parallel plan over each group of ``N`` ranks
(heads, MLP columns and vocabulary sharded, norms replicated, the residual
stream sharded along the sequence) before ``fully_shard`` over ``"dp"``, so
a parameter is sharded over both dimensions, over one, or replicated; the
state takes every such layout, and each data-parallel group takes its share
of the batch.

The whole forward pass runs in FP16 here (FSDP2 gathers one dtype per
group), where the single-process run keeps LayerNorm, attention softmax and
the head in FP32 through its module policies. gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import functional_fp16 as ff
from functional_fp16 import distributed as ffd

__all__ = ["shard_model", "fsdp_step", "run_fsdp"]


def shard_model(model: torch.nn.Module, mesh: Any, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype``, ``fully_shard`` per block and at the root (in place)."""
    from torch.distributed.fsdp import fully_shard

    model.to(dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp_step(model, state: ff.FP16State, inputs: torch.Tensor, targets: torch.Tensor):
    r"""One optimiser step over the ``(k, b, T)`` micro-batches of this rank.

    .. math::
        g = \sum_{j<k} \nabla_p\, s \cdot \tfrac1k\, \mathrm{CE}_j, \qquad
        \text{state}' = \text{fp16\_update}(\text{state}, g)

    with :math:`s` the loss scale; FSDP2 averages each backward's gradients over
    the ranks. Returns ``(state', mean loss over the micro-batches and ranks)``.
    """
    k = inputs.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=inputs.device)
    for x, y in zip(inputs.unbind(0), targets.unbind(0)):
        logits = model(x).float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / k
        state.loss_scale.scale(loss).backward()
        total = total + loss.detach()
    grads = {n: p.grad for n, p in model.named_parameters()}
    state = ff.fp16_update(state, grads, loss=total)
    ff.write_params(model, state.params)  # each rank copies its new FP16 rows into the module
    model.zero_grad(set_to_none=True)
    dist.all_reduce(total)
    return state, total / dist.get_world_size()


def _evaluate(model, windows, batch_size: int, max_batches: int) -> float:
    """Mean validation cross-entropy (every rank evaluates the same windows: FSDP2's
    forward is collective)."""
    inputs, targets = windows
    n = inputs.shape[0] if not max_batches else min(inputs.shape[0], max_batches * batch_size)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, n, batch_size):
            x, y = inputs[start : start + batch_size], targets[start : start + batch_size]
            logits = model(x).float()
            total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
    return total / max(count, 1)


def run_fsdp(args: argparse.Namespace, data, info, device, out_dir: Path, build) -> dict:
    """Trains ``--max-steps`` steps with FSDP2; ``build`` gives ``(model, tx, loss scale)``.

    Rank 0 prints a line per ``--log-every`` steps and writes ``metrics.jsonl``
    and ``summary.json``; every rank writes its shards of the state every
    ``--eval-interval`` steps to ``out_dir/dcp_step_NNNNNN`` and at the end to
    ``out_dir/dcp_final``. A ``--resume`` of one of them continues the run as
    if it had not stopped (the batches it would have drawn are drawn and dropped).
    """
    import gpt_tp
    from gpt_data import sample_batch, val_windows
    from run_outputs import NONFINITE, SkipReporter, state_bytes

    if info is None:
        raise SystemExit("--fsdp needs torchrun (or one process with the torchrun variables)")
    world, rank, tp = dist.get_world_size(), dist.get_rank(), args.tp
    if world % tp:
        raise SystemExit(f"--tp {tp} must divide the {world} ranks")
    dp = world // tp
    if args.batch_size % dp:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {dp} data shares")
    model, tx, loss_scale = build()
    if tp > 1:  # a 2-D mesh: tensor parallelism inside each group of tp ranks, FSDP2 across
        mesh2d = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        gpt_tp.parallelize(model.to(device).to(torch.float16), mesh2d["tp"])
        mesh, share_index = mesh2d["dp"], mesh2d.get_coordinate()[0]
    else:
        mesh, share_index = init_device_mesh(device.type, (world,)), rank
    shard_model(model.to(device), mesh, torch.float16)
    state = ff.fp16_init(dict(model.named_parameters()), tx, loss_scale)
    if getattr(args, "resume", None):
        state = ffd.load_dcp_state(state, args.resume)  # resharded for this world size by DCP
        ff.write_params(model, state.params)
    shard = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in state.master.values()
    )
    stored_bytes = state_bytes(state)
    if rank == 0:
        layout = f"{dp} x {tp} mesh (FSDP2 x tensor parallel)" if tp > 1 else f"{world} ranks"
        print(
            f"FSDP2 over {layout} ({dist.get_backend()}): FP16 parameters sharded per "
            f"block; this rank's FP32 master {shard / 2**20:.2f} MiB; update path "
            f"{ff.update_path(state)}",
            flush=True,
        )
    rng = torch.Generator().manual_seed(args.seed)
    share = slice(share_index * args.batch_size // dp, (share_index + 1) * args.batch_size // dp)
    rows, start, skips = [], int(state.step), SkipReporter()
    for _ in range(start * args.grad_accum):  # a resumed run draws the batches it would have
        sample_batch(data.train, rng, args.batch_size, args.context)
    tokens = args.batch_size * args.grad_accum * args.context
    t0 = time.perf_counter()
    for step in range(start, args.max_steps):
        batches = [
            sample_batch(data.train, rng, args.batch_size, args.context)
            for _ in range(args.grad_accum)
        ]
        inputs = torch.stack([x[share] for x, _ in batches]).to(device)
        targets = torch.stack([y[share] for _, y in batches]).to(device)
        scale = float(state.loss_scale.loss_scale)
        state, loss = fsdp_step(model, state, inputs, targets)
        row = {"step": step + 1, "loss": float(loss), "loss_scale": scale,
               "skipped": not bool(state.grads_finite)}  # fmt: skip
        if row["skipped"]:  # the leaves that overflowed on any rank (one more read, on a skip)
            row[NONFINITE] = ff.nonfinite_leaves(state)
            if rank == 0:
                skips([row])
        rows.append(row)
        if (step + 1) % args.eval_interval == 0 and step + 1 < args.max_steps:
            ffd.save_dcp_state(state, out_dir / f"dcp_step_{step + 1:06d}")  # every rank its shards
        if rank == 0 and ((step + 1) % args.log_every == 0 or step + 1 == args.max_steps):
            rate = tokens * len(rows) / (time.perf_counter() - t0)
            print(
                f"step {step + 1:5d} loss {row['loss']:.4f} scale {scale:g}"
                f"{' SKIPPED' if row['skipped'] else ''} {rate:,.0f} tokens/s",
                flush=True,
            )
    skips.flush()
    seconds = time.perf_counter() - t0
    val = _evaluate(model, val_windows(data.val, args.context), args.batch_size, args.eval_batches)
    ffd.save_dcp_state(state, out_dir / "dcp_final")
    summary = {
        "fsdp": True,
        "world_size": world,
        "tp": tp,
        "steps": args.max_steps,
        "final_train_loss": rows[-1]["loss"] if rows else math.nan,
        "val_loss": val,
        "skipped_steps": [r["step"] for r in rows if r["skipped"]],
        "tokens_per_s": tokens * len(rows) / seconds if rows else 0.0,
        "fp32_master_bytes_per_rank": shard,
        "moments": getattr(args, "moments", "fp32"),
        "state_bytes": stored_bytes,
        "checkpoint": str(out_dir / "dcp_final"),
    }
    if rank == 0:
        with open(out_dir / "metrics.jsonl", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"validation loss {val:.4f}; checkpoint {out_dir / 'dcp_final'}", flush=True)
    return summary
