"""The GPT example's training run written with stock PyTorch, for the comparison.

The same model as ``examples/gpt_functional.py`` (its ``GPT`` ``nn.Module``,
built with the same initialisation from the same seed), the same text,
batches (the same windows in the same order: ``gpt_data.sample_batch`` from
a generator seeded alike), schedule and validation windows, trained the way
a PyTorch user writes it:

* FP32 parameters, ``torch.optim.AdamW(fused=True)`` with two parameter
  groups, weight decay on the linear layers' weight matrices and none on
  biases, LayerNorms and embeddings (the example's ``decay_mask``);
* the learning rate set on the groups before each step from the same
  warmup-cosine formula (:func:`lr_at`);
* ``--precision fp16``: ``torch.autocast(float16)`` + ``GradScaler``
  (``unscale_`` before clipping), CUDA's recipe; ``bf16``:
  ``torch.autocast(bfloat16)``, a CPU's; ``fp32``: no autocast; ``auto``
  (the default): fp16 on CUDA, bf16 on a CPU;
* ``clip_grad_norm_(1.0)``; with ``--grad-accum k``, ``(loss / k).backward()``
  on each micro-batch, one optimiser step per ``k``.

Under ``GradScaler`` a skipped step still advances the schedule (the
optimiser step count), where the example's schedule counts applied steps.

    python benchmarks/stock_gpt.py --text ../shared/data/tinyshakespeare.txt --precision fp32
    python benchmarks/stock_gpt.py --synthetic --max-steps 20 --out-dir /tmp/stock

It prints the validation loss every ``--eval-interval`` steps and writes
``metrics.jsonl`` (step, loss, lr; step, val_loss) and ``summary.json``
(``val_loss``, ``train_tokens_per_s``, ``parameters``, ...) to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, ROOT)

import gpt_cli  # noqa: E402
import gpt_data  # noqa: E402
import gpt_functional as example  # noqa: E402
import gpt_model  # noqa: E402
import gpt_outputs  # noqa: E402

PRECISIONS = ("auto", "fp32", "bf16", "fp16")


def lr_at(step: int, args: argparse.Namespace) -> float:
    r"""The learning rate of optimiser step ``step`` (0-based): warmup, then cosine decay.

    .. math::
        \eta_t = \begin{cases}
          \eta_0 + (\eta - \eta_0)\, t / W & t < W, \quad \eta_0 = \eta / W \\
          \eta_{min} + (\eta - \eta_{min})\,\tfrac12\big(1 + \cos\tfrac{\pi \min(t - W, S - W)}{S - W}\big)
            & t \ge W
        \end{cases}
    """
    peak, warmup, total = args.lr, args.warmup_steps, args.max_steps
    if step < warmup:
        start = peak / warmup
        return start + (peak - start) * step / warmup
    t = min(step - warmup, total - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * t / (total - warmup)))
    alpha = args.min_lr / peak if peak > 0 else 0.0
    return peak * ((1.0 - alpha) * cosine + alpha)


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto``: fp16 (autocast + GradScaler) on CUDA, bf16 autocast on a CPU."""
    if precision == "auto":
        return "fp16" if device.type == "cuda" else "bf16"
    return precision


class StockGPT:
    """``step(inputs, targets)`` and ``evaluate(windows)`` of the imperative recipe."""

    def __init__(
        self, cfg: gpt_model.GPTConfig, args: argparse.Namespace, device, precision: str
    ) -> None:
        self.args = args
        self.device = device
        self.model = gpt_model.build_model(cfg, args.seed).to(device)
        decays = gpt_model.decay_mask(self.model)
        named = dict(self.model.named_parameters())
        groups = [
            {
                "params": [p for n, p in named.items() if decays[n]],
                "weight_decay": args.weight_decay,
            },
            {"params": [p for n, p in named.items() if not decays[n]], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(
            groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, fused=True
        )
        self.autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
            precision
        ]
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.steps = 0

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One optimiser step on ``(k, batch, T)`` micro-batches; returns the mean loss."""
        lr = lr_at(self.steps, self.args)
        for group in self.opt.param_groups:
            group["lr"] = lr
        k = inputs.shape[0]
        total = torch.zeros((), device=self.device)
        for x, y in zip(inputs, targets):
            with self.autocast():
                logits = self.model(x)
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
            scaled = loss / k
            (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            total += scaled.detach().float()
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        if self.args.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        return total

    @torch.no_grad()
    def evaluate(self, windows, batch_size: int, max_batches: int = 0) -> float:
        """Mean cross-entropy over the validation windows, as the example computes it."""
        inputs, targets = windows
        n = inputs.shape[0] if not max_batches else min(inputs.shape[0], max_batches * batch_size)
        self.model.eval()
        total = 0.0
        for start in range(0, n, batch_size):
            with self.autocast():
                logits = self.model(inputs[start : start + batch_size])
            total += float(
                F.cross_entropy(
                    logits.float().flatten(0, 1),
                    targets[start : start + batch_size].flatten(),
                    reduction="sum",
                )
            )
        self.model.train()
        return total / (n * inputs.shape[1])


def parse_args(argv=None) -> argparse.Namespace:
    p = gpt_cli.build_parser(__doc__.split("\n\n")[0])
    s = p.add_argument_group("stock recipe")
    s.add_argument("--precision", choices=PRECISIONS, default="auto")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--out-dir", default=None, help="default runs/stock_gpt_<precision>")
    s.add_argument("--log-every", type=int, default=25)
    return gpt_cli.finish(p, argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = example.resolve_device(args.device)
    precision = resolve_precision(args.precision, device)
    try:
        data = gpt_data.load_text(
            text=args.text,
            data_dir=args.data_dir,
            download=args.download,
            synthetic=args.synthetic,
            synthetic_chars=args.synthetic_chars,
            val_fraction=args.val_fraction,
            context=args.context,
        )
    except gpt_data.DataError as err:
        raise SystemExit(f"error: {err}") from None
    out_dir = Path(args.out_dir or f"runs/stock_gpt_{precision}")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = gpt_model.model_config(args, data.vocab_size)
    recipe = StockGPT(cfg, args, device, precision)
    n_params = sum(p.numel() for p in recipe.model.parameters())
    print(
        f"stock {precision} on {device}: {data.describe()}, {n_params} parameters, "
        f"batch {args.batch_size} x {args.grad_accum}",
        flush=True,
    )
    train = data.train.to(device)
    windows = tuple(t.to(device) for t in gpt_data.val_windows(data.val, args.context))
    rng = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.grad_accum * args.context
    rows, evals, speeds = [], [], []
    step = 0
    metrics = open(out_dir / "metrics.jsonl", "w")
    while step < args.max_steps:
        until = min(args.max_steps, (step // args.eval_interval + 1) * args.eval_interval)
        pending, first = [], step
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while step < until:
            pairs = [
                gpt_data.sample_batch(train, rng, args.batch_size, args.context)
                for _ in range(args.grad_accum)
            ]
            inputs = torch.stack([x for x, _ in pairs])
            targets = torch.stack([y for _, y in pairs])
            lr = lr_at(step, args)
            pending.append((recipe.step(inputs, targets), lr))
            step += 1
            if len(pending) >= args.log_every or step == until:
                losses = torch.stack([loss for loss, _ in pending]).tolist()
                for i, (loss, (_, lr_i)) in enumerate(zip(losses, pending)):
                    rows.append({"step": step - len(pending) + i + 1, "loss": loss, "lr": lr_i})
                    metrics.write(json.dumps(rows[-1]) + "\n")
                pending = []
        if device.type == "cuda":
            torch.cuda.synchronize()
        speeds.append(((step - first) * tokens_per_step, time.perf_counter() - t0))
        val_loss = recipe.evaluate(windows, args.batch_size, args.eval_batches)
        evals.append((step, val_loss))
        metrics.write(json.dumps({"step": step, "val_loss": val_loss}) + "\n")
        metrics.flush()
        print(
            f"step {step}/{args.max_steps}: train loss {rows[-1]['loss']:.4f}, val loss "
            f"{val_loss:.4f}, {speeds[-1][0] / speeds[-1][1]:.0f} tokens/s",
            flush=True,
        )
    metrics.close()
    measured = speeds[1:] if len(speeds) > 1 else speeds
    tokens_per_s = sum(k for k, _ in measured) / sum(s for _, s in measured)
    summary = {
        "recipe": f"stock {precision}",
        "dataset": data.source,
        "synthetic": data.synthetic,
        "device": str(device),
        "precision": precision,
        "parameters": n_params,
        "steps": step,
        "val_loss": evals[-1][1],
        "val_losses": [list(e) for e in evals],
        "train_tokens_per_s": tokens_per_s,
        "final_loss_scale": recipe.scaler.get_scale() if recipe.scaler is not None else None,
        "peak_memory_mib": gpt_outputs.peak_memory(device)[0] / 2**20,
        "peak_memory_kind": gpt_outputs.peak_memory(device)[1],
    }
    with open(out_dir / "summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(
        f"stock {precision}: validation loss on {data.describe()} after {step} steps: "
        f"{evals[-1][1]:.4f} nats/character, {tokens_per_s:.0f} tokens/s, peak memory "
        f"{summary['peak_memory_mib']:.0f} MiB ({summary['peak_memory_kind']})",
        flush=True,
    )
    return summary


if __name__ == "__main__":
    main()
