"""One training step of the example CNN: the functional loop against the imperative one.

Rows (batch ``--batch``, CIFAR-10-shaped random data, SGD lr 0.01 momentum 0.9,
dynamic loss scale 2**16):

* ``functional eager`` — ``examples/cifar10_functional.make_train_step``: FP16
  parameters (FP32 master) computed in the ``--compute`` dtype (FP32 by
  default; the example itself picks BF16 on CPUs with native BF16),
  gradients through ``torch.func``, ``fp16_update``;
* ``functional eager (donate=True)`` — the same step with ``fp16_update(...,
  donate=True)``;
* ``functional compiled`` — the example's step under ``torch.compile(fullgraph=True)``;
* ``imperative`` — the usual loop on an FP32 ``nn.Module``: ``zero_grad``,
  forward, ``scaler.scale(loss).backward()``, ``scaler.step(SGD(foreach=True))``,
  ``scaler.update()``. With ``--compute fp32`` (the default) ``autocast`` is
  off, since with an FP32 compute dtype it would change nothing; with
  ``--compute bf16`` the forward pass runs under ``autocast("cpu", bfloat16)``.

Two more rows time forward + backward alone (no optimiser step) in each
style, to separate the two costs. Both loops read the same uint8 images and
labels; the rows take turns step by step. ``--smoke`` runs a few steps at
batch 8 (FP32) and checks that the loops' losses agree and that the
functional eager, donated and compiled parameters agree.

Usage::

    python benchmarks/bench_train_step.py [--batch 128] [--reps 20] [--compute fp32|bf16] [--out FILE.md]
    python benchmarks/bench_train_step.py --smoke
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
sys.path.insert(2, os.path.dirname(HERE))  # the package, when not installed

import _common as C  # noqa: E402
import cifar10_functional as ex  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16.allocator import tune_malloc  # noqa: E402
from functional_fp16.bridge import make_apply, scaled_grad_and_value, split_module  # noqa: E402
from functional_fp16.precision.policy import Policy  # noqa: E402

COMPUTE = torch.float32  # --compute: the compute dtype of both loops
LR = 0.01
MOMENTUM = 0.9
INIT_SCALE = 2.0**16


def _data(batch, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (steps, batch, 3, 32, 32), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (steps, batch), generator=g)
    return images, labels


def _grad_fn(model, policy):
    """The example's loss, differentiated with the library's torch.func bridge."""
    apply = make_apply(model, train=True)

    def loss_fn(params, buffers, images, labels):
        logits, new_buffers = apply(
            policy.cast_to_compute(params), buffers, ex.preprocess(images, policy.compute_dtype)
        )
        return F.cross_entropy(policy.cast_to_output(logits).float(), labels), new_buffers

    return scaled_grad_and_value(loss_fn, has_aux=True)


def _donating_train_step(model, policy):
    """The example's train step with ``fp16_update(..., donate=True)``."""
    grad_fn = _grad_fn(model, policy)

    def train_step(state, buffers, images, labels):
        grads, (loss, new_buffers) = grad_fn(
            state.loss_scale, state.params, buffers, images, labels
        )
        scale = state.loss_scale.loss_scale
        new_state = ff.fp16_update(state, grads, loss=loss, donate=True)
        counters = torch.stack(list(new_state.scale_stats)).float()
        skipped = ~new_state.grads_finite
        metrics = ex.StepMetrics(loss, scale, skipped, counters, new_state.leaf_finite)
        return new_state, new_buffers, metrics

    return train_step


class Functional:
    def __init__(self, compiled: bool, donate: bool = False):
        self.name = "functional compiled" if compiled else "functional eager"
        if donate:
            self.name += " (donate=True)"
        model = ex.build_model(10, seed=0)
        policy = Policy(torch.float16, COMPUTE, torch.float32)
        params, self.buffers = split_module(model)
        self.state = ff.fp16_init(
            params,
            ff.sgd(LR, momentum=MOMENTUM),
            ff.DynamicLossScale(INIT_SCALE),
        )
        step = _donating_train_step(model, policy) if donate else ex.make_train_step(model, policy)
        self.fn = torch.compile(step, fullgraph=True) if compiled else step
        self.losses = []

    def step(self, images, labels):
        self.state, self.buffers, metrics = self.fn(self.state, self.buffers, images, labels)
        self.losses.append(metrics.loss)

    def params(self):
        return self.state.master


def _autocast():
    """``autocast`` to the compute dtype; off for FP32, where it would change nothing."""
    return torch.autocast("cpu", dtype=COMPUTE, enabled=COMPUTE != torch.float32)


class Imperative:
    name = "imperative GradScaler+SGD(foreach)"

    def __init__(self):
        self.model = ex.build_model(10, seed=0)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM, foreach=True)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
        self.losses = []

    def step(self, images, labels):
        self.opt.zero_grad(set_to_none=True)
        x = ex.preprocess(images, torch.float32)
        with _autocast():
            logits = self.model(x)
        loss = F.cross_entropy(logits.float(), labels)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.losses.append(loss.detach())

    def params(self):
        return dict(self.model.named_parameters())


class ForwardBackwardOnly:
    """Forward and backward without the optimiser step, to split the cost."""

    def __init__(self, functional: bool):
        model = ex.build_model(10, seed=0)
        if functional:
            self.name = "functional forward+backward only"
            policy = Policy(torch.float16, COMPUTE, torch.float32)
            params, self.buffers = split_module(model)
            self.state = ff.fp16_init(params, ff.sgd(LR, momentum=MOMENTUM))
            self.grad_fn = _grad_fn(model, policy)
        else:
            self.name = "imperative forward+backward only"
            self.model = model
        self.functional = functional

    def step(self, images, labels):
        if self.functional:
            self.grad_fn(self.state.loss_scale, self.state.params, self.buffers, images, labels)
        else:
            self.model.zero_grad(set_to_none=True)
            with _autocast():
                logits = self.model(ex.preprocess(images, torch.float32))
            loss = F.cross_entropy(logits.float(), labels)
            (loss * INIT_SCALE).backward()


def smoke() -> int:
    images, labels = _data(8, 4)
    rows = [Functional(False), Functional(True), Imperative(), Functional(False, donate=True)]
    for i in range(4):
        for r in rows:
            r.step(images[i], labels[i])
    ok = True
    eager, compiled, imperative, donated = rows
    for name in eager.params():
        if not torch.equal(eager.params()[name], donated.params()[name]):
            print(f"FAIL eager pure vs donated params {name}")
            ok = False
    for name in eager.params():
        a, b = eager.params()[name], compiled.params()[name]
        # Compiled kernels may round convolution sums differently (an FP16 ulp
        # of a gradient), so the parameters agree closely but not bitwise.
        if not torch.allclose(a, b, rtol=1e-3, atol=1e-5):
            print(f"FAIL eager vs compiled params {name}: {float((a - b).abs().max()):.3e}")
            ok = False
    for i in range(4):
        le, lc, li = (float(r.losses[i]) for r in rows[:3])
        # FP16 parameters vs FP32 parameters: the losses agree to FP16 rounding.
        if abs(le - lc) > 1e-4 * abs(le) or abs(le - li) > 1e-2 * abs(li):
            print(f"FAIL step {i} losses: eager {le:.6f} compiled {lc:.6f} imperative {li:.6f}")
            ok = False
    print("PASS train-step smoke" if ok else "FAIL train-step smoke")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-tune-malloc", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--compute",
        choices=["fp32", "bf16"],
        default="fp32",
        help="compute dtype of both loops (bf16: imperative under autocast, functional policy)",
    )
    args = ap.parse_args(argv)
    global COMPUTE
    COMPUTE = torch.bfloat16 if args.compute == "bf16" else torch.float32
    C.set_threads(args.threads)
    tuned = False if args.no_tune_malloc else tune_malloc()
    if args.smoke:
        return smoke()

    steps = args.warmup + args.reps + 1
    images, labels = _data(args.batch, steps)
    rows = [
        Imperative(),
        Functional(False),
        Functional(False, donate=True),
        Functional(True),
        ForwardBackwardOnly(False),
        ForwardBackwardOnly(True),
    ]
    for r in rows:  # the first call compiles; keep it out of the numbers
        r.step(images[0], labels[0])
    counter = {r.name: 0 for r in rows}

    def run(r):
        def go():
            i = 1 + counter[r.name] % (steps - 1)
            counter[r.name] += 1
            r.step(images[i], labels[i])

        return go

    times = C.time_interleaved({r.name: run(r) for r in rows}, args.reps, args.warmup)
    base = C.median(times[Imperative.name])
    base_fb = C.median(times["imperative forward+backward only"])
    md = [
        f"### Training step, example CNN, batch {args.batch} (CPU, {args.compute.upper()} compute)",
        "",
        C.machine_line(),
        f"glibc malloc thresholds raised (tune_malloc): {tuned}",
        "",
        "| row | ms/step | vs imperative (same kind of row) |",
        "|---|---:|---:|",
    ]
    for r in rows:
        t = C.median(times[r.name])
        ref = base_fb if isinstance(r, ForwardBackwardOnly) else base
        md.append(f"| {r.name} | {t * 1e3:.1f} | {t / ref:.3f}x |")
    C.print_report(md, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
