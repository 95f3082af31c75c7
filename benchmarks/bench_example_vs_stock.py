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
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(1, ROOT)
sys.path.insert(2, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

SIDES = ("example", "stock", "stock-tuned", "example-compiled")
LABELS = {
    "example": "example (functional FP16, defaults)",
    "stock": "stock recipe (autocast)",
    "stock-tuned": "stock recipe + tune_malloc",
    "example-compiled": "example, compiled (`--compile`)",
}


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

    first, seconds = C.time_steps(step, batches, args.warmup, args.steps, device, sync_warmup=False)
    print(
        json.dumps(
            {"side": args.side, "images_per_s": args.steps * batch / seconds, "first_call_s": first}
        )
    )


def side_command(args, side: str) -> list[str]:
    """The command line of one side's worker process for one round."""
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side]
    for key in ("device", "steps", "warmup", "threads"):
        cmd += [f"--{key}", str(getattr(args, key))]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    return cmd


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
    sides = SIDES[:3] if args.device == "cpu" else SIDES[:2]
    if args.only_example:
        sides = ("example",)
    if args.compiled:
        sides += ("example-compiled",)
    rounds = C.alternate_rounds(
        args.rounds,
        sides,
        lambda side: C.run_worker(side_command(args, side)),
        "images_per_s",
        "images/s",
    )
    if rounds is None:
        return 1
    results, first_calls = rounds
    med = {side: C.median(v) for side, v in results.items()}
    ex, st = med["example"], med.get("stock", float("nan"))
    md = [
        "## The example's training step against the stock recipe",
        "",
        C.machine_line(),
        f"Data: {'real (' + args.data_dir + ')' if args.data_dir else 'synthetic'}; "
        f"{args.rounds} rounds of {args.steps} steps (batch 128) per side, processes alternating",
        "",
    ]
    labels = dict(LABELS)
    if args.device == "cuda":
        labels["stock"] = "stock recipe (autocast+GradScaler)"
    md += C.rounds_table(
        "images/s", sides, labels, results, first_calls, cold_compile=["example-compiled"]
    )
    md += ["", f"**example / stock: {ex / st:.2f}x** (above 1: the example is faster)"]
    if "example-compiled" in med:
        md.append(f"example compiled / example eager: {med['example-compiled'] / ex:.2f}x")
    if "stock-tuned" in med:
        md.append(f"example / (stock + tune_malloc): {ex / med['stock-tuned']:.2f}x")
    C.print_report(md, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
