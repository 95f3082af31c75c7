"""The GPT example's training step against the stock PyTorch recipe, tokens per second.

Both sides train the same model (``examples/gpt_functional.py``'s ``GPT``,
the defaults: 4 layers, 4 heads, width 128, context 128, batch 32, unless
the size flags say otherwise) on the same text, each as its user runs it,
each in its own process (so that process-wide settings of one, such as the
example's ``tune_malloc``, cannot help or hurt the other):

* **example**: ``gpt_functional.py``'s defaults: its policy (on a CPU: FP16
  parameters, BF16 compute where the CPU has native BF16, FP32 LayerNorms,
  attention, embeddings and head), the pure ``train_step`` built from
  ``torch.func`` and ``fp16_update`` (clipping, masked AdamW, schedule),
  ``tune_malloc()`` on a CPU;
* **stock**: ``benchmarks/stock_gpt.py``: ``nn.Module`` + ``autocast``
  (BF16 on a CPU; FP16 + ``GradScaler`` on CUDA) + ``AdamW(fused=True)``
  with two parameter groups + ``clip_grad_norm_``;
* **stock + tune_malloc** (CPU only): the same, in a process whose glibc
  thresholds were raised as the example raises them;
* **stock FP32** (``--fp32``): the stock recipe without autocast;
* **example, compiled** (``--compiled``): the example's ``--compile`` (the
  forward and backward pass under ``torch.compile``); the warm-up steps
  absorb the cold compile, whose time (the first call) is reported apart.

The sides take turns, ``--rounds`` times, the order reversed every other
round: each round runs ``--steps`` timed steps after ``--warmup`` untimed
ones on batches drawn alike. Printed: the median tokens/s of each side and
the ratio example / stock (above 1: the example is faster), with the CPU model.

    python benchmarks/bench_gpt_vs_stock.py --text ../shared/data/tinyshakespeare.txt
    python benchmarks/bench_gpt_vs_stock.py --smoke       # seconds, a tiny model
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

SIDES = ("example", "stock", "stock-tuned", "stock-fp32", "example-compiled")
LABELS = {
    "example": "example (functional FP16, defaults)",
    "stock": "stock recipe (autocast)",
    "stock-tuned": "stock recipe + tune_malloc",
    "stock-fp32": "stock recipe, FP32",
    "example-compiled": "example, compiled (`--compile`)",
}
SIZE_FLAGS = ("layers", "heads", "width", "context", "batch_size")


def example_argv(args) -> list[str]:
    """The example's flags for this benchmark's settings."""
    argv = ["--device", args.device]
    if args.text:
        argv += ["--text", args.text]
    else:
        argv += ["--synthetic", "--synthetic-chars", "200000"]
    for key in SIZE_FLAGS:
        if getattr(args, key) is not None:
            argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv + ["--max-steps", str(max(2, args.steps + args.warmup + 1)), "--warmup-steps", "1"]


def worker(args) -> None:
    """Runs one side for one round; prints a JSON line with its tokens/s."""
    import gpt_data
    import gpt_functional as example
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.side == "stock-tuned":
        import functional_fp16 as ff

        ff.tune_malloc()
    ex = example.parse_args(example_argv(args))
    device = torch.device(args.device)
    data = gpt_data.load_text(
        text=ex.text,
        data_dir=ex.data_dir,
        synthetic=ex.synthetic,
        synthetic_chars=ex.synthetic_chars,
        context=ex.context,
    )
    cfg = example.model_config(ex, data.vocab_size)
    if args.side in ("example", "example-compiled"):
        example.configure_process(ex, device, quiet=True)
        policy = example.resolve_policy(ex, device)
        model = example.build_model(cfg, ex.seed)
        state = example.build_state(
            model, policy, example.resolve_loss_scale(ex, policy), ex, device
        )
        step_fn = example.make_train_step(
            model,
            policy,
            example.lr_schedule(ex),
            compiled=args.side == "example-compiled",
        )
        carry = {"state": state}

        def step(x, y):
            carry["state"], _ = step_fn(carry["state"], x, y)
    else:  # the stock recipe, autocast or FP32, with or without the allocator setting
        import stock_gpt

        precision = "fp32" if args.side == "stock-fp32" else "auto"
        recipe = stock_gpt.StockGPT(cfg, ex, device, stock_gpt.resolve_precision(precision, device))

        def step(x, y):
            recipe.step(x, y)

    train = data.train.to(device)
    g = torch.Generator().manual_seed(1)

    def batches(k):
        out = []
        for _ in range(k):
            x, y = gpt_data.sample_batch(train, g, ex.batch_size, ex.context)
            out.append((x[None], y[None]))
        return out

    first, seconds = C.time_steps(step, batches, args.warmup, args.steps, device, sync_warmup=True)
    tokens = args.steps * ex.batch_size * ex.context
    print(json.dumps({"side": args.side, "tokens_per_s": tokens / seconds, "first_call_s": first}))


def side_command(args, side: str) -> list[str]:
    """The command line of one side's worker process for one round."""
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side]
    for key in ("device", "steps", "warmup", "threads", "text", *SIZE_FLAGS):
        if getattr(args, key) is not None:
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return cmd


def run_side(args, side: str) -> dict | None:
    """Runs one side for one round in a fresh process; its JSON line, or None if it failed."""
    return C.run_worker(side_command(args, side))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=None, help="a UTF-8 text (default: synthetic text)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    for key in SIZE_FLAGS:
        ap.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="1 round of 2 steps, a tiny model")
    ap.add_argument("--fp32", action="store_true", help="also the stock recipe in FP32")
    ap.add_argument("--compiled", action="store_true", help="also the example under torch.compile")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="also write the markdown here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.side:
        worker(args)
        return 0
    if args.smoke:
        args.rounds, args.steps, args.warmup = 1, 2, 1
        args.layers, args.heads, args.width, args.context, args.batch_size = 1, 2, 32, 16, 4
    sides = ["example", "stock"] + (["stock-tuned"] if args.device == "cpu" else [])
    if args.fp32:
        sides.append("stock-fp32")
    if args.compiled:
        sides.append("example-compiled")
    rounds = C.alternate_rounds(
        args.rounds, sides, lambda side: run_side(args, side), "tokens_per_s", "tokens/s"
    )
    if rounds is None:
        return 1
    results, first_calls = rounds
    med = {side: C.median(v) for side, v in results.items()}
    size = ", ".join(
        f"{k.replace('_', ' ')} {getattr(args, k)}" for k in SIZE_FLAGS if getattr(args, k)
    )
    md = [
        "## The GPT example's training step against the stock recipe",
        "",
        C.machine_line(),
        f"Text: {args.text or 'synthetic'}; model: {size or 'the example defaults'}; "
        f"{args.rounds} rounds of {args.steps} steps per side, processes alternating",
        "",
    ]
    labels = dict(LABELS)
    if args.device == "cuda":
        labels["stock"] = "stock recipe (autocast FP16 + GradScaler)"
    md += C.rounds_table(
        "tokens/s", sides, labels, results, first_calls, cold_compile=["example-compiled"]
    )
    ex, st = med["example"], med["stock"]
    md += ["", f"**example / stock: {ex / st:.2f}x** (above 1: the example is faster)"]
    if "stock-tuned" in med:
        md.append(f"example / (stock + tune_malloc): {ex / med['stock-tuned']:.2f}x")
    if "stock-fp32" in med:
        md.append(f"example / stock FP32: {ex / med['stock-fp32']:.2f}x")
    if "example-compiled" in med:
        md.append(f"example compiled / example eager: {med['example-compiled'] / ex:.2f}x")
    C.print_report(md, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
