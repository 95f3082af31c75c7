"""Train a small CNN on CIFAR-10 in FP16 mixed precision, functionally.

The classic recipe (a small CNN, SGD lr 0.001 momentum 0.9, batch 128, 10
epochs, "Accuracy of the network on the 10000 test images") written with
``functional_fp16``: the parameters are a dict of FP16 tensors with FP32 master
copies inside an ``FP16State``; the training step is a pure function

    state, buffers, metrics = train_step(state, buffers, images, labels)

built from ``torch.func`` (``make_apply`` + ``scaled_grad_and_value``) and
``fp16_update`` (dynamic loss scaling + SGD momentum); the loop only threads
the state through it.

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
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cifar10_data  # noqa: E402  (the sibling module, importable from any working directory)

import functional_fp16 as ff  # noqa: E402
from functional_fp16 import distributed as ffd  # noqa: E402
from functional_fp16.bridge import make_apply, scaled_grad_and_value, split_module  # noqa: E402
from functional_fp16.policy import Policy, default_loss_scale, get_policy  # noqa: E402

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
IMAGE_SIZE = 32
CHECKPOINT_PATTERN = "checkpoint_epoch_{:03d}.pt"


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


# -- configuration -------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small CNN on CIFAR-10 with functional FP16 mixed precision.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--dataset",
        choices=cifar10_data.DATASETS,
        default="auto",
        help="auto: real CIFAR-10 if --data-dir holds it, else synthetic data (said so)",
    )
    d.add_argument(
        "--data-dir",
        default="data",
        help="torchvision CIFAR10 root, or an ImageFolder tree with train/ and test/",
    )
    d.add_argument(
        "--download",
        action="store_true",
        help="download CIFAR-10 into --data-dir if it is missing (needs network)",
    )
    d.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="DataLoader workers for the one-time ImageFolder decode",
    )
    d.add_argument(
        "--no-cache", action="store_true", help="do not read or write the decoded-ImageFolder cache"
    )
    d.add_argument(
        "--cache-dir",
        default=None,
        help="where decoded ImageFolder tensors are cached (default DATA_DIR/.decoded)",
    )
    d.add_argument("--fake-train-size", type=int, default=50000)
    d.add_argument("--fake-test-size", type=int, default=10000)

    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=10)
    t.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="the global batch; with --distributed each rank takes batch-size / WORLD_SIZE of it",
    )
    t.add_argument("--eval-batch-size", type=int, default=1000)
    t.add_argument("--lr", type=float, default=0.001)
    t.add_argument("--momentum", type=float, default=0.9)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--max-steps-per-epoch",
        type=int,
        default=0,
        help="stop each epoch after this many steps (0: the whole training set)",
    )

    m = p.add_argument_group("precision and device")
    m.add_argument(
        "--precision",
        choices=sorted(PRECISIONS),
        default="fp16",
        help="parameter dtype (an FP32 master copy is always kept)",
    )
    m.add_argument(
        "--compute-dtype",
        choices=["auto", *sorted(PRECISIONS)],
        default="auto",
        help="dtype of the forward/backward pass; auto: the parameter dtype on CUDA; on CPU "
        "(no fast FP16) fp16 parameters compute in bf16 if the CPU has native BF16, else fp32",
    )
    m.add_argument(
        "--policy",
        default=None,
        help="a full policy string such as 'p=f16,c=f16,o=f32'; overrides "
        "--precision and --compute-dtype",
    )
    m.add_argument(
        "--loss-scale",
        choices=["auto", "dynamic", "none"],
        default="auto",
        help="auto: dynamic when the policy involves float16, none otherwise",
    )
    m.add_argument("--init-scale", type=float, default=2.0**16)
    m.add_argument(
        "--stuck-patience",
        type=int,
        default=20,
        help="stop with an error after N consecutive skipped steps at the minimum loss scale "
        "or with a non-finite loss, checked when metrics are logged (0: never)",
    )
    m.add_argument("--growth-interval", type=int, default=2000)
    m.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    m.add_argument(
        "--no-tune-malloc",
        action="store_true",
        help="on CPU, keep glibc's malloc thresholds (by default they are raised with "
        "ff.tune_malloc() so that freed activations are reused instead of page-faulted anew)",
    )
    m.add_argument(
        "--deterministic",
        action="store_true",
        help="use deterministic kernels (needed on CUDA for a resumed run to end bit-identical "
        "to an uninterrupted one; CPU runs are deterministic anyway)",
    )
    m.add_argument(
        "--compile",
        action="store_true",
        help="wrap the whole train step in torch.compile(fullgraph=True). Pays off on CUDA, where "
        "this small network's eager step is bound by kernel launches; on a CPU the compiled step "
        "runs at about eager speed after a cold compile of ~30 s, so it does not pay off there",
    )
    m.add_argument(
        "--distributed",
        action="store_true",
        help="data-parallel over the processes started by torchrun (gloo on CPU, NCCL on CUDA)",
    )

    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default="runs/cifar10")
    o.add_argument(
        "--resume",
        default=None,
        metavar="PATH",
        help="continue from a checkpoint written by this script",
    )
    o.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        help="keep only the newest N epoch checkpoints (0: keep all)",
    )
    o.add_argument(
        "--log-every",
        type=int,
        default=25,
        help="read metrics back from the device every N steps (no per-step sync)",
    )
    o.add_argument("--no-progress", action="store_true", help="disable the tqdm progress bar")
    o.add_argument("--no-plot", action="store_true", help="do not write training.png")
    args = p.parse_args(argv)

    for name in ("epochs", "batch_size", "eval_batch_size", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("max_steps_per_epoch", "keep_checkpoints", "workers", "stuck_patience"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        p.error(f"--lr must be finite and >= 0, got {args.lr}")
    if not (math.isfinite(args.momentum) and args.momentum >= 0):
        p.error(f"--momentum must be finite and >= 0, got {args.momentum}")
    if args.distributed and args.compile:
        p.error("--compile is not supported together with --distributed")
    if args.policy is not None:
        try:
            get_policy(args.policy)
        except (TypeError, ValueError) as err:
            p.error(f"--policy: {err}")
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but CUDA is not available on this machine")
    return torch.device(name)


def configure_process(args: argparse.Namespace, device: torch.device, quiet: bool = False) -> None:
    """Process-wide settings for fast CPU training, each said once.

    The forward and backward passes allocate and free tens of megabytes of
    activations per step; glibc returns such blocks to the system and
    page-faults them back in on the next step (about 9,000 faults per step
    here). ``ff.tune_malloc()`` keeps them in the heap instead.
    """
    if device.type != "cpu" or args.no_tune_malloc:
        return
    if ff.tune_malloc() and not quiet:
        print(
            "note: glibc malloc thresholds raised (ff.tune_malloc; --no-tune-malloc to keep them)"
        )


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


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), so BF16 beats FP32."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:  # a private probe: never let it break the example
        return False


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
    param = PRECISIONS[args.precision]
    if args.compute_dtype != "auto":
        compute = PRECISIONS[args.compute_dtype]
    elif device.type == "cpu" and param == torch.float16:
        compute = torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    else:
        compute = param
    return Policy(param, compute, torch.float32)


def resolve_loss_scale(args: argparse.Namespace, policy: Policy) -> ff.LossScale:
    kind = args.loss_scale
    if kind == "auto":
        kind = "dynamic" if isinstance(default_loss_scale(policy), ff.DynamicLossScale) else "none"
    if kind == "none":
        return ff.NoOpLossScale()
    return ff.DynamicLossScale(init_scale=args.init_scale, growth_interval=args.growth_interval)


# -- state and the pure step ---------------------------------------------------------


class StepMetrics(NamedTuple):
    """What one training step reports (0-d tensors, left on the device)."""

    loss: torch.Tensor  # float32: the unscaled loss
    loss_scale: torch.Tensor  # float32: the scale this step's gradients were computed with
    skipped: torch.Tensor  # bool: the step overflowed and was not applied


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
    tx = ff.sgd(args.lr, momentum=args.momentum)
    state = ff.fp16_init(params, tx, loss_scale, param_dtype=policy.param_dtype)
    return state, buffers


def preprocess(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 images in [0, 255] to ``dtype`` in [-1, 1] (``Normalize(0.5, 0.5)``)."""
    return (images.to(torch.float32) * (2.0 / 255.0) - 1.0).to(dtype)


def make_train_step(
    model: nn.Module, policy: Policy, distributed: bool = False
) -> Callable[..., Any]:
    """``train_step(state, buffers, images, labels) -> (state, buffers, StepMetrics)``, pure.

    With ``distributed`` the gradients (and the reported loss) are averaged over
    the ranks and the overflow decision is agreed, so every rank takes the same step.
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
        agree = None
        if distributed:
            grads = ff.tree_all_reduce_mean(grads)  # scaled FP16 gradients, mean over ranks
            loss = ff.tree_all_reduce_mean(loss.detach().float())
            agree = ff.agree_finite
        new_state = ff.fp16_update(state, grads, loss=loss, agree=agree)
        metrics = StepMetrics(
            loss=loss, loss_scale=state.loss_scale.loss_scale, skipped=~new_state.grads_finite
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


@torch.no_grad()
def evaluate(eval_step, params, buffers, split: cifar10_data.Split, batch_size: int) -> float:
    """Test accuracy in percent; one host synchronisation at the end.

    Under ``--distributed`` each rank evaluates every ``WORLD_SIZE``-th batch and
    the counts are summed, so every rank gets the accuracy of the whole split.
    """
    n = split.labels.shape[0]
    rank, world = ffd.get_rank(), ffd.get_world_size()
    correct = torch.zeros((), dtype=torch.int64, device=split.labels.device)
    for start in range(rank * batch_size, n, world * batch_size):
        sl = slice(start, start + batch_size)
        correct = correct + eval_step(params, buffers, split.images[sl], split.labels[sl])
    if world > 1:
        torch.distributed.all_reduce(correct)
    return 100.0 * correct.item() / n


# -- checkpoints ------------------------------------------------------------------------

RESUME_KEYS = ("seed", "batch_size", "lr", "momentum", "max_steps_per_epoch", "policy", "dataset")


def run_config(args: argparse.Namespace, policy: Policy, data: cifar10_data.Data) -> dict:
    """The settings a resumed run must share with the run that wrote the checkpoint."""
    return {
        "seed": args.seed,
        "batch_size": args.batch_size,
        "lr": float(args.lr),
        "momentum": float(args.momentum),
        "max_steps_per_epoch": args.max_steps_per_epoch,
        "policy": str(policy),
        "dataset": f"{data.source}:{data.train.labels.shape[0]}+{data.test.labels.shape[0]}",
    }


HISTORY_COLUMNS = ("step", "epoch", "loss", "loss_scale", "skipped", "lr")


def history_tensor(rows: list[dict]) -> torch.Tensor:
    """The per-step metrics so far as a float64 ``(steps, 6)`` tensor (for checkpoints)."""
    values = [[float(r[c]) for c in HISTORY_COLUMNS] for r in rows]
    return torch.tensor(values, dtype=torch.float64).reshape(len(rows), len(HISTORY_COLUMNS))


def history_rows(history: torch.Tensor) -> list[dict]:
    """The inverse of :func:`history_tensor`: metrics rows as written to ``metrics.jsonl``."""
    rows = []
    for values in history.tolist():
        row = dict(zip(HISTORY_COLUMNS, values))
        row["step"], row["epoch"] = int(row["step"]), int(row["epoch"])
        row["skipped"] = bool(row["skipped"])
        rows.append(row)
    return rows


def checkpoint_tree(state, buffers, epoch, global_step, data_rng, accuracies, config, rows) -> dict:
    """Everything needed to continue bit-identically, as plain tensors and numbers.

    ``history`` holds every step's metrics so far, so that a run resumed into
    another ``--out-dir`` still writes the whole run's ``metrics.jsonl`` and summary.
    """
    return {
        "history": history_tensor(rows),
        "state": state,
        "buffers": buffers,
        "epoch": epoch,  # epochs completed
        "global_step": global_step,  # training steps completed
        "data_rng": data_rng.get_state(),  # draws each epoch's shuffle
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "test_accuracy": torch.tensor(accuracies, dtype=torch.float64),
        "config": config,
    }


CHECKPOINT_KEYS = (
    "history",
    "state",
    "buffers",
    "epoch",
    "global_step",
    "data_rng",
    "torch_rng",
    "cuda_rng",
    "test_accuracy",
    "config",
)


def load_resume(path: str, state, buffers, config: dict) -> dict:
    """Reads a checkpoint, checks it belongs to this run's settings, restores RNG states.

    The checkpoint is read twice: once without a template to learn its sizes
    and settings, then against a template built from this run's freshly
    initialised state, which checks every tensor's shape and dtype and puts
    the state on this run's device.
    """
    if not os.path.isfile(path):
        raise SystemExit(f"error: --resume {path}: no such file")
    try:
        plain = ff.load_checkpoint(path, map_location="cpu")
    except ff.CheckpointError as err:
        raise SystemExit(f"error: --resume: {err}") from None
    if not isinstance(plain, dict) or any(k not in plain for k in CHECKPOINT_KEYS):
        raise SystemExit(f"error: --resume {path}: not a checkpoint written by this example")
    stored = plain["config"] if isinstance(plain["config"], dict) else {}
    for key in RESUME_KEYS:
        if stored.get(key) != config[key]:
            raise SystemExit(
                f"error: --resume {path}: the checkpoint was written with {key}={stored.get(key)!r}, "
                f"this run has {key}={config[key]!r}; a resumed run must use the same settings"
            )
    like = {
        "history": torch.empty_like(plain["history"]),
        "state": state,
        "buffers": buffers,
        "epoch": 0,
        "global_step": 0,
        "data_rng": torch.empty_like(plain["data_rng"]),
        "torch_rng": torch.empty_like(plain["torch_rng"]),
        "cuda_rng": None if plain["cuda_rng"] is None else torch.empty_like(plain["cuda_rng"]),
        "test_accuracy": torch.empty_like(plain["test_accuracy"]),
        "config": config,
    }
    try:
        ckpt = ff.load_checkpoint(path, like=like)
    except ff.CheckpointError as err:
        raise SystemExit(f"error: --resume: {err}") from None
    torch.set_rng_state(ckpt["torch_rng"])
    if ckpt["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(ckpt["cuda_rng"])
    return ckpt


def prune_checkpoints(out_dir: Path, keep: int, epoch: int) -> None:
    if keep <= 0:
        return
    for old in range(1, epoch - keep + 1):
        path = out_dir / CHECKPOINT_PATTERN.format(old)
        if path.exists():
            path.unlink()


# -- metrics and the plot ------------------------------------------------------------


def plot_metrics(path: Path, rows: list[dict], accuracies: list[float], title: str) -> None:
    """PNG with the loss and the loss scale per step and the test accuracy per epoch."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed, so no plot (pip install matplotlib)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [r["step"] for r in rows]
    losses = [r["loss"] for r in rows]
    ax = axes[0]
    ax.plot(steps, losses, lw=0.5, alpha=0.4, label="per step")
    if len(losses) >= 10:
        w = max(1, len(losses) // 50)
        smooth = [
            sum(losses[max(0, i - w + 1) : i + 1]) / len(losses[max(0, i - w + 1) : i + 1])
            for i in range(len(losses))
        ]
        ax.plot(steps, smooth, lw=1.5, label=f"mean of {w}")
    ax.set(xlabel="step", ylabel="training loss", title="loss")
    ax.legend()
    ax = axes[1]
    ax.plot(steps, [r["loss_scale"] for r in rows], lw=1.0)
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        ax.scatter(
            [r["step"] for r in skipped],
            [r["loss_scale"] for r in skipped],
            color="red",
            marker="x",
            s=20,
            label=f"skipped ({len(skipped)})",
            zorder=3,
        )
        ax.legend()
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale", title="loss scale")
    ax = axes[2]
    ax.plot(range(1, len(accuracies) + 1), accuracies, marker="o")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the loop ---------------------------------------------------------------------------


def epoch_order(data_rng: torch.Generator, n: int, batch_size: int, max_steps: int) -> torch.Tensor:
    """This epoch's shuffled indices, trimmed to whole batches (and to ``max_steps``)."""
    order = torch.randperm(n, generator=data_rng)
    steps = n // batch_size
    if max_steps:
        steps = min(steps, max_steps)
    return order[: steps * batch_size]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Loop(NamedTuple):
    """Everything the training loop changes, threaded through it explicitly."""

    state: ff.FP16State
    buffers: dict[str, torch.Tensor]
    global_step: int  # training steps completed
    accuracies: list[float]  # test accuracy after each completed epoch
    rows: list[dict]  # per-step metrics so far (rank 0 only; the other ranks keep none)
    speeds: list[tuple[int, float]]  # (images, seconds) of each epoch of this process


class Fixed(NamedTuple):
    """What stays the same for the whole run: settings, data, step functions, outputs."""

    args: argparse.Namespace
    train_step: Callable[..., Any]
    eval_step: Callable[..., Any]
    train: cifar10_data.Split
    test: cifar10_data.Split
    device: torch.device
    config: dict
    data_rng: torch.Generator  # draws each epoch's shuffle
    label: str  # "synthetic " for generated data, else ""
    main_rank: bool  # rank 0 prints and writes files
    metrics_file: Any  # metrics.jsonl (rank 0) or /dev/null
    monitor: ff.StuckScaleMonitor | None


def metrics_rows(pending: list[StepMetrics], last_step: int, epoch: int, lr: float) -> list[dict]:
    """The ``metrics.jsonl`` rows of the pending steps, read back in one host transfer."""
    if not pending:
        return []
    stacked = torch.stack(
        [torch.stack([m.loss.float(), m.loss_scale.float(), m.skipped.float()]) for m in pending]
    ).cpu()
    first = last_step - len(pending) + 1
    return [
        {
            "step": first + i,
            "epoch": epoch,
            "loss": loss,
            "loss_scale": scale,
            "skipped": bool(skipped),
            "lr": lr,
        }
        for i, (loss, scale, skipped) in enumerate(stacked.tolist())
    ]


def log_pending(fx: Fixed, pending: list[StepMetrics], last_step: int, epoch: int) -> list[dict]:
    """Writes the pending steps' metrics (rank 0) and runs the stuck-scale check."""
    if not fx.main_rank:  # the other ranks never read their metrics back
        return []
    rows = metrics_rows(pending, last_step, epoch, float(fx.args.lr))
    fx.metrics_file.writelines(json.dumps(row) + "\n" for row in rows)
    fx.metrics_file.flush()
    if fx.monitor is not None:
        try:
            fx.monitor.check()
        except ff.StuckScaleError as err:
            fx.metrics_file.close()
            raise SystemExit(f"error: {err}") from None
    return rows


def progress_bar(fx: Fixed, epoch: int, steps: int):
    """A tqdm bar for the epoch, or None (no tqdm, or --no-progress)."""
    if fx.args.no_progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress bars are optional
        return None
    return tqdm(
        total=steps,
        desc=f"epoch {epoch}/{fx.args.epochs}",
        unit="step",
        dynamic_ncols=True,
        leave=False,
    )


def train_epoch(fx: Fixed, loop: Loop, epoch: int) -> tuple[Loop, list[dict]]:
    """One epoch of steps: ``loop`` in, ``loop`` out, plus this epoch's metrics rows."""
    args = fx.args
    n = fx.train.labels.shape[0]
    rank, world = ffd.get_rank(), ffd.get_world_size()
    per_rank = args.batch_size // world
    order = epoch_order(fx.data_rng, n, args.batch_size, args.max_steps_per_epoch).to(fx.device)
    steps = order.shape[0] // args.batch_size
    bar = progress_bar(fx, epoch, steps)
    state, buffers, global_step = loop.state, loop.buffers, loop.global_step
    pending: list[StepMetrics] = []
    epoch_rows: list[dict] = []
    synchronize(fx.device)
    t0 = time.perf_counter()
    for i in range(steps):
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        idx = idx[rank * per_rank : (rank + 1) * per_rank]  # this rank's share
        state, buffers, m = fx.train_step(
            state, buffers, fx.train.images[idx], fx.train.labels[idx]
        )
        if fx.monitor is not None:
            fx.monitor.observe(state, m.loss)  # sync-free; checked when logging
        global_step += 1
        pending.append(m)
        if len(pending) >= args.log_every or i == steps - 1:
            new_rows = log_pending(fx, pending, global_step, epoch)
            epoch_rows += new_rows
            if bar is not None:
                bar.update(len(pending))
                if new_rows:
                    seconds = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix(
                        loss=f"{new_rows[-1]['loss']:.3f}",
                        scale=f"{new_rows[-1]['loss_scale']:g}",
                        img_s=f"{len(epoch_rows) * args.batch_size / seconds:.0f}",
                    )
            pending = []
    synchronize(fx.device)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    loop = loop._replace(
        state=state,
        buffers=buffers,
        global_step=global_step,
        rows=loop.rows + epoch_rows,
        speeds=loop.speeds + [(steps * args.batch_size, seconds)],
    )
    return loop, epoch_rows


def end_epoch(fx: Fixed, loop: Loop, epoch: int, epoch_rows: list[dict]) -> Loop:
    """Test accuracy, the epoch's line of output, and its checkpoint."""
    args = fx.args
    acc = evaluate(fx.eval_step, loop.state.params, loop.buffers, fx.test, args.eval_batch_size)
    loop = loop._replace(accuracies=loop.accuracies + [acc])
    if fx.main_rank:
        images, seconds = loop.speeds[-1]
        mean_loss = sum(r["loss"] for r in epoch_rows) / len(epoch_rows)
        skipped = sum(r["skipped"] for r in epoch_rows)
        print(
            f"epoch {epoch}/{args.epochs}: loss {mean_loss:.4f}, {fx.label}test accuracy "
            f"{acc:.2f} %, {images / seconds:.0f} images/s, loss scale "
            f"{epoch_rows[-1]['loss_scale']:g}, {skipped} skipped steps",
            flush=True,
        )
    tree = checkpoint_tree(
        loop.state,
        loop.buffers,
        epoch,
        loop.global_step,
        fx.data_rng,
        loop.accuracies,
        fx.config,
        loop.rows,
    )
    out_dir = Path(args.out_dir)
    if ffd.get_world_size() > 1:  # rank 0 writes; every rank returns once the file is complete
        ffd.save_checkpoint_rank0(out_dir / CHECKPOINT_PATTERN.format(epoch), tree)
    else:
        ff.save_checkpoint(out_dir / CHECKPOINT_PATTERN.format(epoch), tree)
    if fx.main_rank:
        prune_checkpoints(out_dir, args.keep_checkpoints, epoch)
    return loop


def fit(args, data, state, buffers, train_step, eval_step, device, policy, start) -> dict:
    """The training loop: threads a :class:`Loop` through ``train_epoch`` and ``end_epoch``."""
    main_rank = ffd.is_main_process()  # only rank 0 writes files
    metrics_path = Path(args.out_dir) / "metrics.jsonl"
    # The whole run's metrics so far (from the checkpoint when resuming), so
    # that metrics.jsonl and the summary describe the whole run in any --out-dir.
    rows = list(start.get("rows", [])) if main_rank else []
    if main_rank:
        with open(metrics_path, "w") as f:  # rewrite: drops steps after the resumed checkpoint
            f.writelines(json.dumps(r) + "\n" for r in rows)
    n = data.train.labels.shape[0]
    if n < args.batch_size:
        raise SystemExit(
            f"error: the training set has {n} images, fewer than --batch-size {args.batch_size}"
        )
    monitor = ff.StuckScaleMonitor(args.stuck_patience) if args.stuck_patience else None
    if monitor is not None:
        monitor.observe(state)  # starts the tracker from the state in force
    fx = Fixed(
        args=args,
        train_step=train_step,
        eval_step=eval_step,
        train=cifar10_data.Split(
            to_device_images(data.train.images, device), data.train.labels.to(device)
        ),
        test=cifar10_data.Split(
            to_device_images(data.test.images, device), data.test.labels.to(device)
        ),
        device=device,
        config=run_config(args, policy, data),
        data_rng=start["data_rng"],
        label="synthetic " if data.synthetic else "",
        main_rank=main_rank,
        metrics_file=open(metrics_path, "a") if main_rank else open(os.devnull, "w"),
        monitor=monitor,
    )
    loop = Loop(state, buffers, start["global_step"], list(start["accuracies"]), rows, [])
    for epoch in range(start["epoch"] + 1, args.epochs + 1):
        loop, epoch_rows = train_epoch(fx, loop, epoch)
        loop = end_epoch(fx, loop, epoch, epoch_rows)
    fx.metrics_file.close()

    # Throughput over the epochs of this run; the first one includes warm-up
    # (and compilation), so it is left out when there are others.
    measured = loop.speeds[1:] if len(loop.speeds) > 1 else loop.speeds
    images = sum(k for k, _ in measured)
    seconds = sum(s for _, s in measured)
    return {
        "state": loop.state,
        "buffers": loop.buffers,
        "accuracies": loop.accuracies,
        "rows": loop.rows,
        "images_per_s": images / seconds if seconds > 0 else float("nan"),
        "global_step": loop.global_step,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the example; returns a summary dict (also written to ``summary.json``)."""
    args = parse_args(argv)
    device = resolve_device(args.device)
    info = None
    if args.distributed:
        info = ffd.init_from_env(device if device.type == "cpu" else None)
        device = info.device
        if args.batch_size % info.world_size:
            raise SystemExit(
                f"error: --batch-size {args.batch_size} must be divisible by WORLD_SIZE "
                f"{info.world_size} (it is the global batch)"
            )
        if not info.is_main:  # rank 0 alone prints, shows progress and writes files
            sys.stdout = open(os.devnull, "w")
            args.no_progress = True
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    configure_process(args, device)
    policy = resolve_policy(args, device)
    loss_scale = resolve_loss_scale(args, policy)
    if info is not None and args.download and not info.is_main:
        torch.distributed.barrier()  # rank 0 downloads first
    try:
        data = cifar10_data.load_data(
            args.dataset,
            args.data_dir,
            download=args.download,
            workers=args.workers,
            cache=not args.no_cache,
            cache_dir=args.cache_dir,
            image_size=IMAGE_SIZE,
            fake_train_size=args.fake_train_size,
            fake_test_size=args.fake_test_size,
        )
    except cifar10_data.DataError as err:
        raise SystemExit(f"error: {err}") from None
    if info is not None and args.download and info.is_main:
        torch.distributed.barrier()
    out_dir = Path(args.out_dir)
    if ffd.is_main_process():
        out_dir.mkdir(parents=True, exist_ok=True)

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
        f"{n_params} parameters, compile: {args.compile}",
        flush=True,
    )
    if info is not None:
        print(
            f"distributed: {info.world_size} ranks ({info.backend}), global batch "
            f"{args.batch_size} = {args.batch_size // info.world_size} per rank",
            flush=True,
        )

    train_step = make_train_step(model, policy, distributed=info is not None)
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
            "rows": history_rows(ckpt["history"]),
        }
        print(
            f"resumed from {args.resume} after epoch {ckpt['epoch']} (step {ckpt['global_step']})",
            flush=True,
        )

    result = fit(args, data, state, buffers, train_step, eval_step, device, policy, start)
    accuracies = result["accuracies"]
    final = accuracies[-1] if accuracies else float("nan")
    n_test = data.test.labels.shape[0]
    summary = {
        "dataset": data.source,
        "synthetic": data.synthetic,
        "device": str(device),
        "policy": str(policy),
        "precision": args.precision,
        "compile": args.compile,
        "world_size": ffd.get_world_size(),
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
    if ffd.is_main_process():
        with open(out_dir / "summary.json", "w") as f:
            json.dump(summary, f, indent=2)
    if not args.no_plot and ffd.is_main_process():
        title = f"{'SYNTHETIC data' if data.synthetic else data.source}, {policy}, {device}"
        plot_metrics(out_dir / "training.png", result["rows"], accuracies, title)
    print(f"training throughput: {result['images_per_s']:.0f} images/s ({device}, {policy})")
    images = f"{n_test} synthetic test images" if data.synthetic else f"{n_test} test images"
    print(f"Accuracy of the network on the {images}: {int(final)} %", flush=True)
    summary["state"] = result["state"]
    summary["buffers"] = result["buffers"]
    if info is not None:
        ffd.shutdown()
    return summary


if __name__ == "__main__":
    main()
