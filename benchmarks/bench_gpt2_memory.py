"""Peak memory of GPT-2 small training steps: the stock recipe against ours, FP32 and split.

Each row is its own process (a process's peak resident set only grows), running a
few steps of ``--preset gpt2`` (GPT-2 small, 124M parameters, GPT-2's vocabulary; on
the CPU a context of 128 and batch 1 by default, so that the state, not the
activations, is what differs, and FP16 autocast's CPU matmuls finish) on Tiny
Shakespeare:

* **stock**: ``benchmarks/stock_gpt.py --precision fp16``: FP32 parameters, FP16
  autocast, ``GradScaler``, ``clip_grad_norm_``, ``AdamW(fused=True)``: 12 bytes of
  state per parameter, plus 4 of FP32 gradients;
* **ours, FP32 master**: ``examples/gpt_functional.py`` with the FP32 master and FP32
  moments (14 bytes of state per parameter);
* **ours, split master + int8 moments**: ``--master split --moments int8`` (6.04).

Reported: the process's peak memory (``VmHWM`` on the CPU, CUDA's peak allocation on a
GPU) and the bytes the state accounts for (``ff.state_nbytes``; the stock row's is its
parameters and AdamW's moments).

    python benchmarks/bench_gpt2_memory.py --text ../shared/data/tinyshakespeare.txt
    python benchmarks/bench_gpt2_memory.py --smoke    # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ROWS = {
    "stock: FP32 params, FP16 autocast, GradScaler, AdamW(fused)": (
        "benchmarks/stock_gpt.py",
        ["--precision", "fp16"],
    ),
    "ours: FP32 master, FP32 moments": ("examples/gpt_functional.py", []),
    "ours: split master, int8 moments": (
        "examples/gpt_functional.py",
        ["--master", "split", "--moments", "int8"],
    ),
}


def run(script: str, extra: list[str], common: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(ROOT / script), *common, *extra, "--out-dir", out]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
            )
        return json.loads((Path(out) / "summary.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=128, help="GPT-2's is 1024 (the preset's)")
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on synthetic text")
    args = ap.parse_args(argv)
    if args.smoke:
        common = [
            "--synthetic",
            "--layers",
            "1",
            "--width",
            "32",
            "--heads",
            "2",
            "--context",
            "32",
        ]
        common += ["--batch-size", "2", "--max-steps", "2"]
    else:
        common = ["--preset", "gpt2", "--text", args.text, "--max-steps", str(args.steps)]
        common += ["--batch-size", str(args.batch_size), "--context", str(args.context)]
    common += ["--eval-interval", "1000000", "--eval-batches", "1"]
    md = ["## Peak memory of GPT-2 small training steps (`bench_gpt2_memory.py`)", ""]
    md += [C.machine_line(), "", f"Each row its own process: `{' '.join(common)}`.", ""]
    md += ["| run | parameters | state, B/param | peak memory |", "|---|---:|---:|---:|"]
    for name, (script, extra) in ROWS.items():
        ours = script.startswith("examples")
        mine = ["--no-plot", "--no-progress", "--sample-chars", "0"] if ours else []
        s = run(script, extra + mine, common)
        n = s["parameters"]
        state = s.get("state_bytes", {}).get("per_param", {}).get("total")
        shown = f"{state:.2f}" if state is not None else "12.00 (params + moments)"
        md.append(
            f"| {name} | {n:,} | {shown} | {s['peak_memory_mib']:.0f} MiB ({s['peak_memory_kind']}) |"
        )
    C.print_report(md, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
