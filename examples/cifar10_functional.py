"""Train a small CNN on CIFAR-10 in FP16 mixed precision, functionally.

The classic recipe (a small CNN, SGD lr 0.001 momentum 0.9, batch 128, 10
epochs, "Accuracy of the network on the 10000 test images") written with
``functional_fp16``: the parameters are a dict of FP16 tensors with FP32 master
copies inside an ``FP16State``; the training step is a pure function

    state, buffers, metrics = train_step(state, buffers, images, labels)

built from ``torch.func`` (``make_apply`` + ``scaled_grad_and_value``) and
``fp16_update`` (dynamic loss scaling + SGD momentum); the loop only threads
the state through it. This file holds the model, the pure steps and
:func:`main`; its siblings hold the flags (``cifar10_cli.py``), the loop
(``cifar10_loop.py``), what a run writes and resumes from (``cifar10_outputs.py``)
and the data (``cifar10_data.py``).

    python examples/cifar10_functional.py --download          # real CIFAR-10 into ./data
    python examples/cifar10_functional.py --dataset imagefolder --data-dir DIR
    python examples/cifar10_functional.py --dataset fake --epochs 1 --max-steps-per-epoch 20
    torchrun --nproc-per-node 2 examples/cifar10_functional.py --distributed   # data parallel

Outputs in ``--out-dir`` (default ``runs/cifar10``): ``metrics.jsonl`` (one line
per step: step, epoch, loss, loss_scale, skipped, lr), ``summary.json``,
``training.png`` (loss and loss scale per step, test accuracy per epoch) and a
checkpoint per epoch (``checkpoint_epoch_NNN.pt``); ``--resume`` continues from
one so that the run ends bit-identical to an uninterrupted one.

With ``--distributed`` (under ``torchrun``) the run is data-parallel:
``--batch-size`` stays the global batch and each of the ``WORLD_SIZE`` ranks
takes its ``batch-size / WORLD_SIZE`` share of every step's shuffled batch (the
same permutation on every rank, so the ranks together see exactly the batches
of a one-process run); the scaled FP16 gradients are averaged with
``tree_all_reduce_mean`` and every rank applies the same ``fp16_update`` with
``agree=agree_finite``, so the ranks stay bitwise identical and skip the same
steps. Evaluation is split across the ranks too. Only rank 0 prints and writes
metrics, plots, the summary and checkpoints; ``--resume`` reads the checkpoint
on every rank (a shared file system, or a copy on every machine).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The sibling modules, importable from any working directory.
import cifar10_data  # noqa: E402
import run_cli  # noqa: E402
from cifar10_cli import parse_args  # noqa: E402
from cifar10_loop import fit  # noqa: E402
from cifar10_outputs import load_resume, plot_metrics, run_config  # noqa: E402
from run_outputs import counters_of, state_bytes, summary_head, write_summary  # noqa: E402
from run_setup import (  # noqa: E402
    auto_policy,
    configure_process,  # noqa: F401 - ensemble_vmap.py and the benchmarks use it
    cpu_has_fast_bf16,
    end_process,
    load_data_once,
    loss_scale_from_flags,
    make_out_dir,
    print_distributed,
    resolve_device,  # noqa: F401 - ensemble_vmap.py and the benchmarks use it
    start_run,
)

import functional_fp16 as ff  # noqa: E402
from functional_fp16 import distributed as ffd  # noqa: E402
from functional_fp16.bridge import make_apply, scaled_grad_and_value, split_module  # noqa: E402
from functional_fp16.precision.policy import Policy, get_policy  # noqa: E402

IMAGE_SIZE = 32


# -- the model ----------------------------------------------------------------------


class Net(nn.Module):
    """The seed recipe's CNN, with ``fc1`` sized from the real feature map.

    conv(3->64, 3x3) -> ReLU -> maxpool 2 -> conv(64->128, 3x3) -> ReLU -> maxpool 2
    -> fc1(128*6*6 -> 256) -> ReLU -> fc2(256 -> classes): 1,258,122 parameters
    for CIFAR-10. For 32x32 inputs the feature map is 128x6x6 (32-2=30, /2=15,
    15-2=13, /2=6), not the 128x5x5 the recipe is written with; it is computed
    here by running the convolutional part on a meta tensor, so any image size
    works.
    """

    def __init__(self, num_classes: int = 10, image_size: int = IMAGE_SIZE) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3)
        self.conv2 = nn.Conv2d(64, 128, 3)
        self.pool = nn.MaxPool2d(2, 2)
        with torch.device("meta"):
            features = self.features(torch.empty(1, 3, image_size, image_size)).shape[1]
        self.fc1 = nn.Linear(features, 256)
        self.fc2 = nn.Linear(256, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        return torch.flatten(x, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(self.features(x))))


# -- configuration: from the flags (cifar10_cli.py) to the run's settings ---------------


def to_device_images(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """uint8 ``(N, 3, H, W)`` images on ``device``, channels-last on the CPU.

    CPU convolutions and max-pooling in BF16 are several times faster on NHWC
    memory (NCHW max-pooling takes a scalar path); on CUDA cuDNN picks its own
    layout for this small network.
    """
    images = images.to(device)
    if device.type == "cpu":
        images = images.contiguous(memory_format=torch.channels_last)
    return images


def to_device_data(data: cifar10_data.Data, device: torch.device) -> cifar10_data.Data:
    """``data`` with both splits on ``device``, images laid out as :func:`to_device_images` does."""

    def place(split: cifar10_data.Split) -> cifar10_data.Split:
        return cifar10_data.Split(to_device_images(split.images, device), split.labels.to(device))

    return data._replace(train=place(data.train), test=place(data.test))


def resolve_policy(args: argparse.Namespace, device: torch.device) -> Policy:
    """The precision policy from ``--policy``, or ``--precision`` and ``--compute-dtype``.

    Defaults are chosen to be fast everywhere: on CUDA the computation runs in
    the parameter dtype (FP16 tensor cores). CPUs have no fast FP16 arithmetic
    (FP16 convolutions are about 8x slower than FP32), so there FP16 parameters
    are computed in BF16 when the CPU has native BF16 (about 1.4x faster than
    FP32 for this CNN) and in FP32 otherwise; either way the parameters still
    get FP16 gradients, so loss scaling is exercised. Outputs are float32.
    """
    if args.policy is not None:
        return get_policy(args.policy)
    return auto_policy(args, device, cpu_has_fast_bf16)


def resolve_loss_scale(args: argparse.Namespace, policy: Policy) -> ff.LossScale:
    """The loss scale ``--loss-scale`` asks for (``auto``: the policy's default kind)."""
    return loss_scale_from_flags(args, policy)


# -- state and the pure step ---------------------------------------------------------


class StepMetrics(NamedTuple):
    """What one training step reports (0-d tensors, left on the device)."""

    loss: torch.Tensor  # float32: the unscaled loss
    loss_scale: torch.Tensor  # float32: the scale this step's gradients were computed with
    skipped: torch.Tensor  # bool: the step overflowed and was not applied
    counters: torch.Tensor  # float32 (4,): the loss-scale counters after it (run_outputs.COUNTERS)
    leaf_finite: torch.Tensor  # bool (leaves,): per parameter, its gradient was finite


def build_model(num_classes: int, seed: int) -> Net:
    """The CNN with its default (Kaiming-uniform) initialisation drawn from ``seed`` on the CPU."""
    torch.manual_seed(seed)
    return Net(num_classes)


def build_state(
    model: nn.Module,
    policy: Policy,
    loss_scale: ff.LossScale,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[ff.FP16State, dict[str, torch.Tensor]]:
    """The initial ``FP16State`` (FP32 master + working copy in the policy's param dtype) and buffers."""
    params, buffers = split_module(model)
    params = {k: v.to(device) for k, v in params.items()}
    buffers = {k: v.to(device) for k, v in buffers.items()}
    tx = ff.sgd(args.lr, momentum=args.momentum, accumulator_dtype=run_cli.moment_dtype(args))
    state = ff.fp16_init(
        params,
        tx,
        loss_scale,
        param_dtype=policy.param_dtype,
        master=args.master,
    )
    return state, buffers


def preprocess(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 images in [0, 255] to ``dtype`` in [-1, 1] (``Normalize(0.5, 0.5)``)."""
    return (images.to(torch.float32) * (2.0 / 255.0) - 1.0).to(dtype)


def make_train_step(
    model: nn.Module, policy: Policy, distributed: bool = False, shard_master: bool = False
) -> Callable[..., Any]:
    """``train_step(state, buffers, images, labels) -> (state, buffers, StepMetrics)``, pure.

    With ``distributed`` the gradients (and the reported loss) are averaged over
    the ranks and the overflow decision is agreed, so every rank takes the same step.
    With ``shard_master`` too, ``state`` is this rank's shard (``ffd.shard_state``):
    the gradients are reduce-scattered, each rank steps its slice of the FP32
    state, and the new FP16 parameters are all-gathered (``ffd.sharded_update``).
    """
    apply = make_apply(model, train=True)

    def loss_fn(params, buffers, images, labels):
        logits, new_buffers = apply(
            policy.cast_to_compute(params), buffers, preprocess(images, policy.compute_dtype)
        )
        loss = F.cross_entropy(policy.cast_to_output(logits).float(), labels)
        return loss, new_buffers

    grad_fn = scaled_grad_and_value(loss_fn, has_aux=True)

    def train_step(state: ff.FP16State, buffers, images, labels):
        grads, (loss, new_buffers) = grad_fn(
            state.loss_scale, state.params, buffers, images, labels
        )
        if shard_master:  # reduce-scatter, step this rank's rows, all-gather the params
            loss = ff.tree_all_reduce_mean(loss.detach().float())
            new_state = ffd.sharded_update(state, grads, loss=loss)
        elif distributed:
            grads = ff.tree_all_reduce_mean(grads)  # scaled FP16 gradients, mean over ranks
            loss = ff.tree_all_reduce_mean(loss.detach().float())
            new_state = ff.fp16_update(state, grads, loss=loss, agree=ff.agree_finite)
        else:
            new_state = ff.fp16_update(state, grads, loss=loss)
        metrics = StepMetrics(
            loss=loss,
            loss_scale=state.loss_scale.loss_scale,
            skipped=~new_state.grads_finite,
            counters=counters_of(new_state),
            leaf_finite=new_state.leaf_finite,
        )
        return new_state, new_buffers, metrics

    return train_step


def make_eval_step(model: nn.Module, policy: Policy) -> Callable[..., torch.Tensor]:
    """``eval_step(params, buffers, images, labels) -> number correct`` (0-d int64), pure."""
    apply = make_apply(model, train=False)

    def eval_step(params, buffers, images, labels):
        logits, _ = apply(
            policy.cast_to_compute(params), buffers, preprocess(images, policy.compute_dtype)
        )
        return (logits.argmax(dim=1) == labels).sum()

    return eval_step


def fp32_bytes(state: ff.FP16State) -> int:
    """Bytes of this rank's master copy and optimiser state."""
    leaves = optree.tree_leaves((state.master, state.opt_state), namespace=ff.NAMESPACE)
    leaves = [x.to_local() if hasattr(x, "to_local") else x for x in leaves]  # DTensor: its rows
    return sum(x.numel() * x.element_size() for x in leaves if isinstance(x, torch.Tensor))


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example; returns a summary dict (also written to ``summary.json``)."""
    args = parse_args(argv)
    info, device = start_run(args)
    policy = resolve_policy(args, device)
    loss_scale = resolve_loss_scale(args, policy)
    data = load_data_once(
        info,
        args.download,
        lambda: cifar10_data.load_data(
            args.dataset,
            args.data_dir,
            download=args.download,
            workers=args.workers,
            cache=not args.no_cache,
            cache_dir=args.cache_dir,
            image_size=IMAGE_SIZE,
            fake_train_size=args.fake_train_size,
            fake_test_size=args.fake_test_size,
        ),
        cifar10_data.DataError,
    )
    out_dir = make_out_dir(args.out_dir)

    model = build_model(len(data.classes), args.seed)
    state, buffers = build_state(model, policy, loss_scale, args, device)
    if info is not None:  # every rank starts from rank 0's values (and shapes are checked)
        state, buffers = ffd.broadcast_state((state, buffers))
    n_params = sum(p.numel() for p in state.params.values())
    kind = "SYNTHETIC data" if data.synthetic else data.source
    print(
        f"data: {kind}, {data.train.labels.shape[0]} train / {data.test.labels.shape[0]} test "
        f"images, {len(data.classes)} classes",
        flush=True,
    )
    print(
        f"device: {device}, policy: {policy}, loss scale: {type(loss_scale).__name__}, "
        f"{n_params} parameters, compile: {args.compile}, momentum stored as: {args.moments}, "
        f"master: {args.master}",
        flush=True,
    )
    print_distributed(info, args.batch_size)
    stored_bytes = state_bytes(state)

    train_step = make_train_step(
        model, policy, distributed=info is not None, shard_master=args.shard_master
    )
    eval_step = make_eval_step(model, policy)
    if args.compile:
        if device.type == "cuda":
            # Inductor's loop reordering after fusion trips an internal
            # assertion on this step with CUDA (seen with torch 2.11); the
            # fused kernels are as fast without it.
            import torch._inductor.config as inductor_config

            inductor_config.loop_ordering_after_fusion = False
        train_step = torch.compile(train_step, fullgraph=True)

    config = run_config(args, policy, data)
    data_rng = torch.Generator().manual_seed(args.seed)
    start = {"epoch": 0, "global_step": 0, "accuracies": [], "data_rng": data_rng}
    if args.resume:
        ckpt = load_resume(args.resume, state, buffers, config)
        state, buffers = ckpt["state"], ckpt["buffers"]
        data_rng.set_state(ckpt["data_rng"])
        start = {
            "epoch": ckpt["epoch"],
            "global_step": ckpt["global_step"],
            "accuracies": ckpt["test_accuracy"].tolist(),
            "data_rng": data_rng,
            "rows": ckpt["rows"],
        }
        print(
            f"resumed from {args.resume} after epoch {ckpt['epoch']} (step {ckpt['global_step']})",
            flush=True,
        )

    if args.shard_master:  # after a resume, which reads the full state from the checkpoint
        full_bytes = fp32_bytes(state)
        state = ffd.shard_state(state)
        print(
            f"sharded FP32 state (ZeRO-1): master and optimiser state {fp32_bytes(state) / 2**20:.2f} "
            f"MiB on this rank, {full_bytes / 2**20:.2f} MiB unsharded",
            flush=True,
        )
    on_device = to_device_data(data, device)
    result = fit(args, on_device, state, buffers, train_step, eval_step, device, policy, start)
    accuracies = result["accuracies"]
    final = accuracies[-1] if accuracies else float("nan")
    n_test = data.test.labels.shape[0]
    summary = {
        **summary_head(args, data, device, policy),
        "shard_master": args.shard_master,
        "moments": args.moments,
        "master": args.master,
        "state_bytes": stored_bytes,
        "per_rank_batch": args.batch_size // ffd.get_world_size(),
        "epochs": args.epochs,
        "steps": result["global_step"],
        "test_accuracy_per_epoch": accuracies,
        "final_test_accuracy": final,
        "train_images_per_s": result["images_per_s"],
        "decode_seconds": data.decode_seconds,
        "final_loss_scale": float(result["state"].loss_scale.loss_scale),
        "skipped_steps": sum(1 for r in result["rows"] if r["skipped"]),
    }
    write_summary(out_dir, summary)
    if not args.no_plot and ffd.is_main_process():
        title = f"{'SYNTHETIC data' if data.synthetic else data.source}, {policy}, {device}"
        plot_metrics(out_dir / "training.png", result["rows"], accuracies, title)
    print(f"training throughput: {result['images_per_s']:.0f} images/s ({device}, {policy})")
    images = f"{n_test} synthetic test images" if data.synthetic else f"{n_test} test images"
    print(f"Accuracy of the network on the {images}: {int(final)} %", flush=True)
    summary["state"] = result["state"]
    summary["buffers"] = result["buffers"]
    if info is not None:
        ffd.shutdown(wait_for_peers=True)
    return summary


if __name__ == "__main__":
    main()
    end_process()  # a torchrun process ends without Python's finalisation (see there)
