"""The seed article's CIFAR-10 recipe, run imperatively with stock PyTorch.

The same network as ``examples/cifar10_functional.py`` (``Net``: the seed's
CNN with two linear layers), ``nn.CrossEntropyLoss``, ``SGD(lr=0.001,
momentum=0.9)``, batch 128, as a user writes it:

* CPU: FP32 parameters, the forward pass under ``torch.autocast("cpu",
  torch.bfloat16)`` (``--precision bf16``) or plain FP32 (``--precision fp32``);
* CUDA: ``torch.autocast("cuda", torch.float16)`` + ``GradScaler`` +
  ``SGD(fused=True)`` (``--precision fp16``), or FP32.

The data are the example's (``cifar10_data``: decoded once, in memory), with
the example's shuffling, initialisation seed and normalisation, and the
images in channels-last memory, as ``torch.from_numpy(nhwc).permute(0, 3, 1, 2)``
gives a user who loads CIFAR-10 from NumPy. So the two runs differ only in how
the step is written. ``python benchmarks/stock_recipe.py --data-dir DIR``
trains for ``--epochs`` and prints the test accuracy after every epoch, which
is what the README's results table compares.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, ROOT)

import cifar10_data  # noqa: E402
import cifar10_functional as example  # noqa: E402
import cifar10_loop  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16")


class StockRecipe:
    """``step(images_u8, labels)`` and ``accuracy(split)`` of the imperative recipe."""

    def __init__(self, device: torch.device, precision: str, seed: int = 0, lr: float = 0.001):
        self.device = device
        self.net = example.build_model(10, seed).to(device)
        self.autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[
            precision
        ]
        fused = device.type == "cuda"
        self.opt = torch.optim.SGD(
            self.net.parameters(), lr=lr, momentum=0.9, **({"fused": True} if fused else {})
        )
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = example.preprocess(images, torch.float32)
        self.opt.zero_grad(set_to_none=True)
        with self._autocast():
            loss = F.cross_entropy(self.net(x), labels)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()
        return loss.detach()

    @torch.no_grad()
    def accuracy(self, split: cifar10_data.Split, batch_size: int = 1000) -> float:
        self.net.eval()
        correct = 0
        for start in range(0, split.labels.shape[0], batch_size):
            x = example.preprocess(split.images[start : start + batch_size], torch.float32)
            with self._autocast():
                logits = self.net(x)
            correct += int((logits.argmax(1) == split.labels[start : start + batch_size]).sum())
        self.net.train()
        return 100.0 * correct / split.labels.shape[0]


def channels_last(split: cifar10_data.Split, device: torch.device) -> cifar10_data.Split:
    """The images in NHWC memory, as a user loading CIFAR-10 from NumPy has them."""
    images = split.images.to(device).contiguous(memory_format=torch.channels_last)
    return cifar10_data.Split(images, split.labels.to(device))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True, help="an ImageFolder tree or CIFAR-10 root")
    ap.add_argument("--dataset", default="auto", choices=cifar10_data.DATASETS)
    ap.add_argument("--precision", default="bf16", choices=PRECISIONS)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the per-epoch results as JSON here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    data = cifar10_data.load_data(args.dataset, args.data_dir, workers=2)
    train, test = channels_last(data.train, device), channels_last(data.test, device)
    recipe = StockRecipe(device, args.precision, seed=args.seed)
    rng = torch.Generator().manual_seed(args.seed)
    n = train.labels.shape[0]
    accuracies, speeds = [], []
    for epoch in range(1, args.epochs + 1):
        order = cifar10_loop.epoch_order(rng, n, 128, 0).to(device)
        t0 = time.perf_counter()
        for i in range(order.shape[0] // 128):
            idx = order[i * 128 : (i + 1) * 128]
            recipe.step(train.images[idx], train.labels[idx])
        if device.type == "cuda":
            torch.cuda.synchronize()
        speeds.append(order.shape[0] / (time.perf_counter() - t0))
        accuracies.append(recipe.accuracy(test))
        print(
            f"stock {args.precision} epoch {epoch}: test accuracy {accuracies[-1]:.2f} %, "
            f"{speeds[-1]:.0f} images/s",
            flush=True,
        )
    result = {"precision": args.precision, "accuracy": accuracies, "images_per_s": speeds}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
