"""The main job's train step in its two parts, eager against ``torch.compile``.

``examples/cifar10_functional.py --compile`` compiles the whole step: the
gradients (the CNN's forward and backward, through ``torch.func``) and
``fp16_update``. This script times the two parts apart, each eager and under
``torch.compile(fullgraph=True)``, in one process with the calls interleaved
(synthetic CIFAR-shaped data, batch 128, the example's default policy), so a
difference between ``--compile`` and eager can be put where it belongs.

Usage::

    python benchmarks/bench_compiled_step_parts.py [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, ROOT)
sys.path.insert(2, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import cifar10_data  # noqa: E402
import cifar10_functional as example  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16.bridge import make_apply, scaled_grad_and_value  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device("cpu")
    ex = example.parse_args(["--device", "cpu"])
    example.configure_process(ex, device, quiet=True)
    policy = example.resolve_policy(ex, device)
    model = example.build_model(10, 0)
    state, buffers = example.build_state(
        model, policy, example.resolve_loss_scale(ex, policy), ex, device
    )
    data = cifar10_data.make_fake(1024, 64, seed=0)
    images = example.to_device_images(data.train.images, device)[:128]
    labels = data.train.labels[:128]
    apply = make_apply(model, train=True)

    def loss_fn(params, buffers, x, y):
        logits, new_buffers = apply(
            policy.cast_to_compute(params), buffers, example.preprocess(x, policy.compute_dtype)
        )
        return F.cross_entropy(policy.cast_to_output(logits).float(), y), new_buffers

    grad_fn = scaled_grad_and_value(loss_fn, has_aux=True)

    def gradients(state, buffers, x, y):
        return grad_fn(state.loss_scale, state.params, buffers, x, y)

    def update(state, grads, loss):
        return ff.fp16_update(state, grads, loss=loss)

    compiled_gradients = torch.compile(gradients, fullgraph=True)
    compiled_update = torch.compile(update, fullgraph=True)
    grads, (loss, _) = gradients(state, buffers, images, labels)
    box = {"eager": state, "compiled": state}
    rows = {
        "gradients, eager": lambda: gradients(state, buffers, images, labels),
        "gradients, compiled": lambda: compiled_gradients(state, buffers, images, labels),
        "update, eager": lambda: box.__setitem__("eager", update(box["eager"], grads, loss)),
        "update, compiled": lambda: box.__setitem__(
            "compiled", compiled_update(box["compiled"], grads, loss)
        ),
    }
    times = C.time_interleaved(rows, args.reps, args.warmup)
    med = {k: C.median(v) * 1e3 for k, v in times.items()}
    print("# The main job's train step in parts: eager against torch.compile\n")
    print(", ".join(f"{k}: {v}" for k, v in C.machine_description().items()))
    print(f"\nrows interleaved, {args.reps} reps, medians\n")
    print("| part | eager ms | compiled ms | compiled / eager |")
    print("|---|---:|---:|---:|")
    for part in ("gradients", "update"):
        e, c = med[f"{part}, eager"], med[f"{part}, compiled"]
        print(f"| {part} | {e:.2f} | {c:.2f} | {c / e:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
