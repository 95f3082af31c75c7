"""The main job's training step against the seed's recipe run with stock PyTorch.

Both sides train the same network (the example's ``Net``, the seed's CNN) on
the same in-memory data with batch 128, each as its user runs it, each in its
own process (so that process-wide settings of one, such as the example's
``tune_malloc``, cannot help or hurt the other):

* **example**: ``examples/cifar10_functional.py``'s defaults: its policy
  (on CPU: FP16 parameters, BF16 compute where the CPU has native BF16), the
  pure ``train_step`` built from ``torch.func`` and ``fp16_update``,
  channels-last batches, ``tune_malloc()`` on CPU;
* **stock**: ``benchmarks/stock_recipe.py``: ``nn.Module`` + ``autocast``
  (BF16 on CPU; FP16 + ``GradScaler`` + ``SGD(fused=True)`` on CUDA) +
  ``SGD(lr=0.001, momentum=0.9)``, channels-last batches;
* **stock + tune_malloc** (CPU only): the same, in a process whose glibc
  thresholds were raised as the example raises them, to show what of the
  difference is the allocator;
* **example, compiled** (``--compiled``): the example's ``--compile``, its
  train step under ``torch.compile(fullgraph=True)``; the warm-up steps
  absorb the cold compile, whose time (the first call) is reported apart.

The two workers take turns, ``--rounds`` times: each round runs ``--steps``
timed steps after ``--warmup`` untimed ones and reports images/s. Printed:
the median of each side and their ratio (example / stock; above 1 means the
example is faster), with the CPU model.

    python benchmarks/bench_example_vs_stock.py --data-dir DIR   # ImageFolder or CIFAR-10
    python benchmarks/bench_example_vs_stock.py --smoke          # seconds, synthetic data
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, ROOT)
sys.path.insert(2, os.path.dirname(os.path.abspath(__file__)))


SIDES = ("example", "stock", "stock-tuned", "example-compiled")


def _load(args):
    import cifar10_data

    if args.data_dir:
        return cifar10_data.load_data("auto", args.data_dir, workers=2)
    return cifar10_data.make_fake(512 if args.steps < 10 else 4096, 64, seed=0)


def worker(args) -> None:
    """Runs one side for one round; prints a JSON line with its images/s."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.side == "stock-tuned":
        import functional_fp16 as ff

        ff.tune_malloc()
    data = _load(args)
    device = torch.device(args.device)
    batch = 128
    if args.side in ("example", "example-compiled"):
        import cifar10_functional as example

        argv = ["--device", args.device]
        ex = example.parse_args(argv)
        example.configure_process(ex, device, quiet=True)
        policy = example.resolve_policy(ex, device)
        model = example.build_model(10, 0)
        state, buffers = example.build_state(
            model, policy, example.resolve_loss_scale(ex, policy), ex, device
        )
        images = example.to_device_images(data.train.images, device)
        labels = data.train.labels.to(device)
        step_fn = example.make_train_step(model, policy)
        if args.side == "example-compiled":
            step_fn = torch.compile(step_fn, fullgraph=True)
        carry = {"state": state, "buffers": buffers}

        def step(x, y):
            carry["state"], carry["buffers"], _ = step_fn(carry["state"], carry["buffers"], x, y)
    else:  # the stock recipe, with or without the allocator setting
        import stock_recipe

        recipe = stock_recipe.StockRecipe(device, "fp16" if device.type == "cuda" else "bf16")
        split = stock_recipe.channels_last(data.train, device)
        images, labels = split.images, split.labels

        def step(x, y):
            recipe.step(x, y)

    g = torch.Generator().manual_seed(1)
    n = labels.shape[0]

    def batches(k):
        order = torch.randint(0, n, (k, batch), generator=g).to(device)
        return [(images[i], labels[i]) for i in order]

    first = None
    for x, y in batches(max(1, args.warmup)):
        t0 = time.perf_counter()
        step(x, y)
        first = time.perf_counter() - t0 if first is None else first
    work = batches(args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in work:
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {"side": args.side, "images_per_s": args.steps * batch / seconds, "first_call_s": first}
        )
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None, help="real data (default: synthetic)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--smoke", action="store_true", help="1 round of 3 steps each")
    ap.add_argument("--compiled", action="store_true", help="also the example under torch.compile")
    ap.add_argument(
        "--only-example", action="store_true", help="only the example (with --compiled: both)"
    )
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    if args.side:
        worker(args)
        return 0
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 3, 1
    import _common as C

    sides = SIDES[:3] if args.device == "cpu" else SIDES[:2]
    if args.only_example:
        sides = ("example",)
    if args.compiled:
        sides += ("example-compiled",)
    results: dict[str, list[float]] = {side: [] for side in sides}
    first_calls: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--side", side]
            for key in ("device", "steps", "warmup", "threads"):
                cmd += [f"--{key}", str(getattr(args, key))]
            if args.data_dir:
                cmd += ["--data-dir", args.data_dir]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                print(out.stdout + out.stderr, file=sys.stderr)
                return 1
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
            results[side].append(json.loads(line)["images_per_s"])
            first_calls[side].append(json.loads(line)["first_call_s"])
            print(f"[round {r + 1}] {side}: {results[side][-1]:.0f} images/s", file=sys.stderr)
    med = {side: statistics.median(v) for side, v in results.items()}
    ex, st = med["example"], med.get("stock", float("nan"))
    machine = C.machine_description()
    md = [
        "## The example's training step against the stock recipe",
        "",
        "Machine: " + "; ".join(f"{k}: {v}" for k, v in machine.items()),
        f"Data: {'real (' + args.data_dir + ')' if args.data_dir else 'synthetic'}; "
        f"{args.rounds} rounds of {args.steps} steps (batch 128) per side, processes alternating",
        "",
        "| side | images/s (median) | every round |",
        "|---|---:|---|",
        f"| example (functional FP16, defaults) | {ex:.0f} | "
        + ", ".join(f"{v:.0f}" for v in results["example"])
        + " |",
    ]
    if "stock" in results:
        md.append(
            f"| stock recipe (autocast{'+GradScaler' if args.device == 'cuda' else ''}) "
            f"| {st:.0f} | " + ", ".join(f"{v:.0f}" for v in results["stock"]) + " |"
        )
    if "stock-tuned" in med:
        md.append(
            f"| stock recipe + tune_malloc | {med['stock-tuned']:.0f} | "
            + ", ".join(f"{v:.0f}" for v in results["stock-tuned"])
            + " |"
        )
    if "example-compiled" in med:
        md.append(
            f"| example, compiled (`--compile`) | {med['example-compiled']:.0f} | "
            + ", ".join(f"{v:.0f}" for v in results["example-compiled"])
            + f" (cold compile, the first call: "
            f"{statistics.median(first_calls['example-compiled']):.1f} s) |"
        )
    md += ["", f"**example / stock: {ex / st:.2f}x** (above 1: the example is faster)"]
    if "example-compiled" in med:
        md.append(f"example compiled / example eager: {med['example-compiled'] / ex:.2f}x")
    if "stock-tuned" in med:
        md.append(f"example / (stock + tune_malloc): {ex / med['stock-tuned']:.2f}x")
    text = "\n".join(md)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
