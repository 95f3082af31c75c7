"""The transformer recipe per call, against what a PyTorch user runs for it.

Rows, one optimiser step each from the same FP16 gradients, taking turns call by call:

==============================  =============================================================
row                             what one call does
==============================  =============================================================
recipe pure                     ``fp16_update(state, grads)`` with
                                ``chain(clip_by_global_norm(1), adamw(warmup-cosine, b2=0.95,
                                weight_decay=0.1, mask=matrices))``
recipe donated                  the same with ``donate=True``
recipe compiled                 ``torch.compile(fp16_update, fullgraph=True)``, pure
recipe compiled, no size        the same with ``options={"size_asserts": False}``: Inductor
asserts                         then does not check each of the op's ~600 outputs per call
recipe pure / compiled, one     the recipe, eager and compiled, on the same parameters as one
tensor                          (1, n) tensor: what a compiled call adds beside the per-tensor
                                work (its frame, its guards on the state's static parts)
nanoGPT AdamW(fused)            FP32 params, ``scaler.unscale_`` + ``clip_grad_norm_(foreach)``
                                + ``AdamW(fused=True)`` with two param groups (decay / none),
                                the learning rate set per group + ``step`` + ``update``
sgd pure / donated              ``fp16_update`` with ``sgd(0.05, momentum=0.9)``
GradScaler+SGD(fused)           ``scaler.step(SGD(fused=True))`` + ``scaler.update()``
clip+sgd pure (10M only)        ``chain(clip_by_global_norm(1), sgd(...))``
unscale+clip+SGD(fused) (10M)   ``unscale_`` + ``clip_grad_norm_`` + fused SGD step + update
==============================  =============================================================

Trees: GPT-2 small's parameter structure (148 leaves: ``wte``, ``wpe``, 12
blocks of 12, ``ln_f``) at width 32 (the arithmetic is negligible, so the
rows measure the per-call work), and one 10.3M-parameter flat tensor.
Reports medians of interleaved calls and each row's ratio to its peer.

Usage::

    python benchmarks/bench_recipe.py [--reps 200] [--out FILE.md] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402

import functional_fp16 as ff  # noqa: E402


def gpt2_tree(width: int = 32, vocab: int = 256, block: int = 64, layers: int = 12):
    """GPT-2's parameter names and shapes at ``width`` (148 leaves at 12 layers), FP16."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).half()

    p = {"wte": t(vocab, width), "wpe": t(block, width)}
    for i in range(layers):
        h = f"h.{i}."
        for name, shape in [
            ("ln_1.weight", (width,)),
            ("ln_1.bias", (width,)),
            ("attn.c_attn.weight", (3 * width, width)),
            ("attn.c_attn.bias", (3 * width,)),
            ("attn.c_proj.weight", (width, width)),
            ("attn.c_proj.bias", (width,)),
            ("ln_2.weight", (width,)),
            ("ln_2.bias", (width,)),
            ("mlp.c_fc.weight", (4 * width, width)),
            ("mlp.c_fc.bias", (4 * width,)),
            ("mlp.c_proj.weight", (width, 4 * width)),
            ("mlp.c_proj.bias", (width,)),
        ]:
            p[h + name] = t(*shape)
    p["ln_f.weight"] = t(width)
    p["ln_f.bias"] = t(width)
    return p


def is_matrix(tree):
    """The weight-decay mask of the recipe: matrices decay, vectors do not."""
    return {k: v.ndim >= 2 for k, v in tree.items()}


def recipe(peak=6e-4, warmup=10, decay_steps=100_000, end=6e-5):
    """clip + AdamW with a weight-decay mask and a warmup-cosine schedule (nanoGPT's)."""
    schedule = ff.warmup_cosine_decay_schedule(0.0, peak, warmup, decay_steps, end)
    adamw = ff.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=is_matrix)
    return ff.chain(ff.clip_by_global_norm(1.0), adamw)


class Ours:
    """``fp16_update`` on one state, called again and again on the same gradients."""

    def __init__(self, params, grads, tx, donate=False, compiled=None, impl="auto"):
        self.state = ff.fp16_init(params, tx, ff.DynamicLossScale(init_scale=1.0))
        self.grads, self.donate, self.impl = grads, donate, impl
        self.path = ff.update_path(self.state, impl)
        self.fn = ff.fp16_update
        if compiled is not None:  # compiled: Inductor's options ({} for its defaults)
            self.fn = torch.compile(ff.fp16_update, fullgraph=True, options=compiled)

    def __call__(self):
        self.state = self.fn(self.state, self.grads, donate=self.donate, impl=self.impl)


class Stock:
    """FP32 parameters with ``GradScaler``: what a PyTorch user runs (nanoGPT's loop)."""

    def __init__(self, params, grads, kind):
        self.params = [v.float().requires_grad_() for v in params.values()]
        for p, g in zip(self.params, grads.values()):
            p.grad = g.float()
        decay = [p for p in self.params if p.ndim >= 2]
        other = [p for p in self.params if p.ndim < 2]
        if kind == "adamw":
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0}]
            self.opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=True)
        else:
            self.opt = torch.optim.SGD(self.params, lr=0.05, momentum=0.9, fused=True)
        # init_scale 1: unscale_ leaves the gradients as they are, call after call.
        self.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        self.scaler.scale(torch.ones(()))
        self.kind = kind

    def __call__(self):
        if self.kind == "sgd":
            self.scaler.step(self.opt)
        else:
            if self.kind == "adamw":
                for group in self.opt.param_groups:
                    group["lr"] = 6e-4  # nanoGPT sets each group's rate every step
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0, foreach=True)
            self.scaler.step(self.opt)
        self.scaler.update()


def _grads(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * 1e-3).half() for k, v in params.items()}


def rows_148(smoke: bool):
    params = gpt2_tree(layers=2 if smoke else 12)
    grads = _grads(params)
    flat = {"w": torch.cat([v.reshape(-1) for v in params.values()]).reshape(1, -1)}
    flat_grads = _grads(flat)
    rows = {
        "recipe pure": Ours(params, grads, recipe()),
        "recipe donated": Ours(params, grads, recipe(), donate=True),
        "recipe compiled": Ours(params, grads, recipe(), compiled={}),
        "recipe compiled, no size asserts": Ours(
            params, grads, recipe(), compiled={"size_asserts": False}
        ),
        "recipe pure, one tensor": Ours(flat, flat_grads, recipe()),
        "recipe compiled, one tensor": Ours(flat, flat_grads, recipe(), compiled={}),
        "nanoGPT AdamW(fused)": Stock(params, grads, "adamw"),
        "sgd pure": Ours(params, grads, ff.sgd(0.05, momentum=0.9)),
        "sgd donated": Ours(params, grads, ff.sgd(0.05, momentum=0.9), donate=True),
        "GradScaler+SGD(fused)": Stock(params, grads, "sgd"),
    }
    peers = {
        "recipe pure": "nanoGPT AdamW(fused)",
        "recipe donated": "nanoGPT AdamW(fused)",
        "recipe compiled": "recipe pure",
        "recipe compiled, no size asserts": "recipe pure",
        "recipe pure, one tensor": "recipe pure",
        "recipe compiled, one tensor": "recipe pure, one tensor",
        "sgd pure": "GradScaler+SGD(fused)",
        "sgd donated": "GradScaler+SGD(fused)",
    }
    return params, rows, peers


def rows_10m(smoke: bool):
    n = 10_300_000 if not smoke else 100_000
    params = {"w": (torch.randn(n) * 0.02).half()}
    grads = _grads(params)
    clip_sgd = ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.05, momentum=0.9))
    rows = {
        "clip+sgd pure": Ours(params, grads, clip_sgd),
        "unscale+clip+SGD(fused)": Stock(params, grads, "clip-sgd"),
        "sgd pure": Ours(params, grads, ff.sgd(0.05, momentum=0.9)),
        "GradScaler+SGD(fused)": Stock(params, grads, "sgd"),
    }
    peers = {"clip+sgd pure": "unscale+clip+SGD(fused)", "sgd pure": "GradScaler+SGD(fused)"}
    return params, rows, peers


def table(title, rows, peers, reps, warmup):
    times = C.time_interleaved(rows, reps=reps, warmup=warmup, shuffle=True)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    lines = [
        f"### {title}",
        "",
        "| row | path | median per call | ratio | to |",
        "|---|---|---|---|---|",
    ]
    for name, fn in rows.items():
        path = getattr(fn, "path", "torch")
        peer = peers.get(name)
        ratio = f"{med[name] / med[peer]:.2f}x" if peer else ""
        lines.append(f"| {name} | {path} | {med[name] * 1e3:.3f} ms | {ratio} | {peer or ''} |")
    return "\n".join(lines), med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="a few calls of each row, small trees")
    args = ap.parse_args(argv)
    C.set_threads(2)
    reps, warmup = (5, 2) if args.smoke else (args.reps, 20)
    out = [f"machine: {C.machine_line()}", ""]
    _, rows, peers = rows_148(args.smoke)
    text, _ = table("GPT-2 small's 148 leaves at width 32", rows, peers, reps, warmup)
    out += [text, ""]
    _, rows, peers = rows_10m(args.smoke)
    text, _ = table("10.3M parameters, one tensor", rows, peers, max(reps // 4, 3), warmup // 4)
    out += [text, ""]
    report = "\n".join(out)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
