"""AdamW's moments in fewer bytes: state per parameter and time per call.

Tables:

* **state**: ``ff.state_nbytes`` of ``fp16_init(params, adamw(...))`` on GPT-2
  small's parameter shapes (124M parameters: ``wte`` 50257 x 768, 12 blocks, tied
  head), moments FP32 / BF16 / FP16 (scaled) / int8, in bytes per parameter;
  beside it the state of ``torchao.optim.AdamW8bit`` on FP32 parameters (where
  torchao installs), counted the same way.
* **time**: one update per call, rows taking turns call by call, medians:
  the recipe (clip + AdamW, mask, warmup-cosine) with each moment format,
  against the same recipe with FP32 moments (the fused op) and, where torchao
  installs, ``GradScaler`` + ``clip_grad_norm_`` + ``AdamW8bit`` on FP32
  parameters. Trees: GPT-2's 148 leaves at width 256 (matrices of 65k to 262k
  elements, so they are coded) and one 10.3M-parameter matrix (10,300 x 1000;
  vectors keep FP32 moments). The row "fp32 moments, as written" runs the FP32
  chain by ``impl="foreach"``, the route the stored formats take: the rest of their
  ratio is the coding itself.

Usage::

    python benchmarks/bench_moments.py [--reps 30] [--out FILE.md] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_recipe import Ours, _grads, gpt2_tree, is_matrix  # noqa: E402

import functional_fp16 as ff  # noqa: E402

FORMATS = {
    "fp32": {},
    "bf16": {"mu_dtype": torch.bfloat16, "nu_dtype": torch.bfloat16},
    "fp16 (scaled v)": {"mu_dtype": torch.float16, "nu_dtype": torch.float16, "nu_scale": "tensor"},
    "e4m3": {"mu_dtype": "e4m3", "nu_dtype": "e4m3"},
    "bf16, nearest": {
        "mu_dtype": torch.bfloat16,
        "nu_dtype": torch.bfloat16,
        "moment_rounding": "nearest",
    },
    "e4m3, nearest": {"mu_dtype": "e4m3", "nu_dtype": "e4m3", "moment_rounding": "nearest"},
}
"""Moment formats: stochastic rounding (the default) unless the name says nearest."""


def recipe(**moments) -> ff.GradientTransformation:
    schedule = ff.warmup_cosine_decay_schedule(0.0, 6e-4, 10, 100_000, 6e-5)
    adamw = ff.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=is_matrix, **moments)
    return ff.chain(ff.clip_by_global_norm(1.0), adamw)


def torchao_adamw8bit():
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        return None
    return AdamW8bit


def _numel(tree) -> int:
    return sum(v.numel() for v in tree.values())


def gpt2_small_shapes(meta: bool) -> dict[str, torch.Tensor]:
    """GPT-2 small's parameters (the head tied to ``wte``), FP16 zeros."""
    device = "meta" if meta else "cpu"
    tree = gpt2_tree(width=1, layers=12)  # names only
    w, vocab, ctx = 768, 50257, 1024
    shapes = {
        "wte": (vocab, w),
        "wpe": (ctx, w),
        "ln_f.weight": (w,),
        "ln_f.bias": (w,),
    }
    for name in tree:
        if name.startswith("h."):
            base = name.split(".", 2)[2]
            shapes[name] = {
                "ln_1.weight": (w,), "ln_1.bias": (w,), "ln_2.weight": (w,), "ln_2.bias": (w,),
                "attn.c_attn.weight": (3 * w, w), "attn.c_attn.bias": (3 * w,),
                "attn.c_proj.weight": (w, w), "attn.c_proj.bias": (w,),
                "mlp.c_fc.weight": (4 * w, w), "mlp.c_fc.bias": (4 * w,),
                "mlp.c_proj.weight": (w, 4 * w), "mlp.c_proj.bias": (w,),
            }[base]  # fmt: skip
    return {k: torch.zeros(s, dtype=torch.float16, device=device) for k, s in shapes.items()}


def state_table(smoke: bool) -> list[str]:
    params = gpt2_small_shapes(meta=False) if not smoke else gpt2_tree(width=64, layers=2)
    n = _numel(params)
    lines = [
        f"### State of AdamW on GPT-2 small's shapes ({n:,} parameters, {len(params)} leaves)",
        "",
        "| moments | params | master | moments (+count) | total | B/param total |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    master = {k: v.float() for k, v in params.items()}
    for name, kw in FORMATS.items():
        state = ff.fp16_init(master, recipe(**kw))
        b = ff.state_nbytes(state).per_param(n)
        lines.append(
            f"| {name} | {b['params']:.3f} | {b['master']:.3f} | {b['opt_state']:.3f} | "
            f"{b['total'] - b['other']:.3f} | {b['total']:.3f} |"
        )
        del state
    adamw8 = torchao_adamw8bit()
    if adamw8 is not None:
        fp32 = [torch.nn.Parameter(v) for v in master.values()]
        opt = adamw8(fp32, lr=6e-4)
        for p in fp32:
            p.grad = torch.zeros_like(p)
        opt.step()  # torchao allocates its state at the first step
        moments = sum(_subclass_bytes(t) for s in opt.state.values() for t in s.values())
        params_b = sum(p.numel() * 4 for p in fp32)
        lines.append(
            f"| torchao AdamW8bit (FP32 params, no master) | {params_b / n:.3f} | — | "
            f"{moments / n:.3f} | {(params_b + moments) / n:.3f} | (+ GradScaler's FP32 .grad) |"
        )
        del opt, fp32
    del master
    return lines


def _subclass_bytes(t) -> int:
    """Bytes of a tensor or of the plain tensors inside a tensor subclass (torchao's states)."""
    if not isinstance(t, torch.Tensor):
        return 0
    if type(t) is torch.Tensor:
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_subclass_bytes(getattr(t, n)) for n in names)


class TorchAO:
    """FP32 parameters, ``GradScaler`` + ``clip_grad_norm_`` + torchao's ``AdamW8bit``."""

    def __init__(self, params, grads, adamw8):
        self.params = [v.float().requires_grad_() for v in params.values()]
        for p, g in zip(self.params, grads.values()):
            p.grad = g.float()
        decay = [p for p in self.params if p.ndim >= 2]
        other = [p for p in self.params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0}]
        self.opt = adamw8(groups, lr=6e-4, betas=(0.9, 0.95))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        self.scaler.scale(torch.ones(()))
        self.path = "torchao"

    def __call__(self):
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
        self.scaler.step(self.opt)
        self.scaler.update()


def time_table(title, params, reps, warmup) -> list[str]:
    grads = _grads(params)
    rows = {}
    for name, kw in FORMATS.items():
        rows[f"recipe, {name} moments"] = Ours(params, grads, recipe(**kw))
    rows["recipe, e4m3 moments, donated"] = Ours(
        params, grads, recipe(**FORMATS["e4m3"]), donate=True
    )
    rows["recipe, fp32 moments, donated"] = Ours(params, grads, recipe(), donate=True)
    # What the stored formats run: the chain as written (impl="foreach"), here on FP32.
    rows["recipe, fp32 moments, as written"] = Ours(params, grads, recipe(), impl="foreach")
    adamw8 = torchao_adamw8bit()
    if adamw8 is not None:
        rows["GradScaler + clip + torchao AdamW8bit"] = TorchAO(params, grads, adamw8)
    times = C.time_interleaved(rows, reps=reps, warmup=warmup)
    med = {k: C.median(v) for k, v in times.items()}
    base = med["recipe, fp32 moments"]
    base_d = med["recipe, fp32 moments, donated"]
    lines = [f"### {title}", "", "| row | path | median per call | ratio to FP32 moments |"]
    lines.append("|---|---|---:|---:|")
    for name, row in rows.items():
        peer = base_d if name.endswith("donated") else base
        lines.append(
            f"| {name} | {row.path} | {med[name] * 1e3:.2f} ms | {med[name] / peer:.2f}x |"
        )
    return lines


def report(heading: str, description: str, states, times, argv=None, small=False) -> int:
    """The report of a state-and-time benchmark: its command line (``--reps``, ``--warmup``,
    ``--threads``, ``--out``, ``--smoke``), the machine, ``states(smoke)``'s table and ``times``' tables
    on GPT-2's 148 leaves at width 256 and on one 10.3M-parameter matrix (``small``: also
    at width 32, where the per-call work around the kernels is most of the time)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="the kernels' threads (default 1)")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="small trees, a few calls")
    args = ap.parse_args(argv)
    C.set_threads(args.threads)
    ff.tune_malloc()  # as the examples run: large frees keep their pages
    reps, warmup = (3, 1) if args.smoke else (args.reps, args.warmup)
    md = [heading, "", C.machine_line(), f"Threads: {args.threads}.", ""]
    md += states(args.smoke) + [""]
    if small:
        leaves = gpt2_tree(width=32, layers=2 if args.smoke else 12)
        md += times(f"GPT-2's {len(leaves)} leaves at width 32", leaves, reps, warmup) + [""]
    leaves = gpt2_tree(width=64 if args.smoke else 256, layers=2 if args.smoke else 12)
    md += times(f"GPT-2's {len(leaves)} leaves at width 256", leaves, reps, warmup) + [""]
    rows = 100 if args.smoke else 10_300
    flat = {"w": (torch.randn(rows, 1000) * 0.02).half()}  # a matrix: vectors keep FP32
    md += times(f"{rows * 1000:,} parameters, one {rows} x 1000 matrix", flat, reps, warmup)
    C.print_report(md, args.out)
    return 0


def main(argv=None) -> int:
    heading = "## Moments in fewer bytes (`bench_moments.py`)"
    return report(heading, __doc__.split("\n\n")[0], state_table, time_table, argv)


if __name__ == "__main__":
    raise SystemExit(main())
