"""The split master (``fp16_init(..., master="split")``): state per parameter and time per call.

Tables:

* **state**: ``ff.state_nbytes`` on GPT-2 small's parameter shapes (124M parameters),
  params + master, and params + master + moments, in bytes per parameter: the FP32
  master with FP32 moments, the split master with FP32 moments, the split master with
  E4M3 ("int8") moments; beside them ``torch.optim.AdamW`` + ``GradScaler`` on FP32
  parameters (12 bytes of parameters and moments per parameter, 16 with FP32 gradients).
* **time**: one update per call, rows taking turns call by call, medians: the
  transformer recipe (clip + AdamW, mask, warmup-cosine) and SGD with momentum, each
  with the split master against the same optimiser with the FP32 master, pure and
  donated, on GPT-2's 148 leaves at width 32 (162k parameters: the work around the
  kernels) and 256, and on one 10.3M-parameter matrix.

Usage::

    python benchmarks/bench_master.py [--reps 30] [--out FILE.md] [--smoke]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_moments import gpt2_small_shapes, recipe, report  # noqa: E402
from bench_recipe import Ours, _grads  # noqa: E402

import functional_fp16 as ff  # noqa: E402


class Split(Ours):
    """:class:`Ours` on a state made with ``master="split"``."""

    def __init__(self, params, grads, tx, donate=False):
        super().__init__(params, grads, tx, donate=donate)
        self.state = ff.fp16_init(params, tx, ff.DynamicLossScale(init_scale=1.0), master="split")
        self.path = ff.update_path(self.state)


def state_table(smoke: bool) -> list[str]:
    params = gpt2_small_shapes(meta=False)
    if smoke:
        params = {k: v[:8] for k, v in list(params.items())[:6]}
    n = sum(p.numel() for p in params.values())
    rows = {
        "FP32 master, FP32 moments": (recipe(), "float32"),
        "split master, FP32 moments": (recipe(), "split"),
        "split master, int8 (E4M3) moments": (recipe(mu_dtype="int8", nu_dtype="int8"), "split"),
    }
    lines = [
        f"### State on GPT-2 small's shapes ({n:,} parameters)",
        "",
        "| state | params + master | moments | params + master + moments |",
        "|---|---:|---:|---:|",
    ]
    for name, (tx, master) in rows.items():
        b = ff.state_nbytes(ff.fp16_init(params, tx, master=master))
        lines.append(
            f"| {name} | {(b.params + b.master) / n:.2f} B | {b.opt_state / n:.2f} B | "
            f"{(b.params + b.master + b.opt_state) / n:.2f} B |"
        )
    lines.append("| torch AdamW + GradScaler, FP32 params | 4.00 B | 8.00 B | 12.00 B |")
    return lines


def time_table(title, params, reps, warmup) -> list[str]:
    grads = _grads(params)
    sgd = lambda: ff.sgd(0.05, momentum=0.9)  # noqa: E731
    rows = {}
    for name, make in (("recipe", recipe), ("sgd-momentum", sgd)):
        for donate in (False, True):
            tag = f"{name}{', donated' if donate else ''}"
            rows[f"{tag}: FP32 master"] = Ours(params, grads, make(), donate=donate)
            rows[f"{tag}: split master"] = Split(params, grads, make(), donate=donate)
    times = C.time_interleaved(rows, reps=reps, warmup=warmup, shuffle=True)
    med = {k: C.median(v) for k, v in times.items()}
    lines = [f"### {title}", "", "| row | path | median per call | split / FP32 master |"]
    lines.append("|---|---|---:|---:|")
    for name, row in rows.items():
        peer = med[name.replace("split master", "FP32 master")]
        lines.append(
            f"| {name} | {row.path} | {med[name] * 1e3:.2f} ms | {med[name] / peer:.2f}x |"
        )
    return lines


def main(argv=None) -> int:
    heading = "## The split master (`bench_master.py`)"
    return report(heading, __doc__.split("\n\n")[0], state_table, time_table, argv, small=True)


if __name__ == "__main__":
    raise SystemExit(main())
