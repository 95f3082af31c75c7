"""Launches and transient memory per update on the CUDA default path, run on the CPU.

This process sets ``FUNCTIONAL_FP16_CPU_KERNEL=cuda-default``, so the CPU runs
exactly the kernel CUDA runs by default (the plain PyTorch kernel, see
``docs/fused_optimisers.md``, "Running the CUDA default on the CPU"; and with
``TRITON_INTERPRET=1``, set here, its Triton kernels in Triton's interpreter), and
measures one update of each row against torch's own recipes in the same run:

* **launches**: ``torch.profiler`` (CPU activity) around one update after two
  warm-up calls; the top-level ``aten::*`` ops, those with no ``aten::*``
  ancestor (a ``functional_fp16::*`` op is transparent: the aten ops inside it
  count; a ``triton::*`` range is one Triton kernel launch, and what its
  interpreter does inside it is not counted), that compute: an op counts if it is not one that only allocates or
  makes a view (``empty``, ``view``, ``reshape``, ``select``, ``item``, ...:
  :data:`NO_LAUNCH`) or, for those and the conversions (``to``,
  ``_to_copy``, ``contiguous``, ``type_as``), if one of the ops inside it
  computes (a ``reshape`` that copies, a ``to`` that converts). On a GPU each
  is at least one kernel launch (a multi-tensor ``_foreach_*`` op one per
  chunk of tensors). **host reads**: the top-level ``aten::item``,
  ``_local_scalar_dense`` and ``is_nonzero`` calls (``item()``, ``bool()``
  on a tensor), each a device synchronisation on a GPU;
* **per leaf?**: the launches at GPT-2 small's 148 leaves against those of
  a smaller GPT-2 tree (one block: 16 leaves): whether the count grows with
  the number of leaves, and by how much per leaf;
* **transient memory**: for a ~10M-parameter tree (three large tensors), the
  peak growth of the CPU allocator's allocated bytes during one update,
  per parameter: ``torch.profiler`` with ``profile_memory=True``, the
  allocation events in time order (``experimental_event_tree``), their
  running sum's maximum above its start. Outputs come from ``torch.empty_like``
  as on CUDA (the CPU output pool is switched off, so the caching it does for
  CPU tensors does not hide allocations). Donated: the whole peak growth;
  pure: the peak growth less the bytes of the new state it returns.

Rows: ``fp16_update`` with ``ff.DynamicLossScale(2**10)``, pure and donated,
for the transformer recipe (clip + AdamW with a weight-decay mask and a
warmup-cosine schedule), SGD with momentum, Adam, Lion, RMSprop, SGD with a
masked weight decay, ``multi_transform`` (SGD on matrices, Adam on vectors),
``MultiSteps`` (k = 2: the accumulating and the applying call) and
``inject_hyperparams(adamw)``; torch: nanoGPT's recipe (FP32 parameters with
their ``.grad``, ``GradScaler``: ``unscale_`` + ``clip_grad_norm_(foreach)``
+ ``AdamW(fused=True)`` in two parameter groups + ``update``) and
``GradScaler`` + ``SGD(fused=True, momentum=0.9)``.

Usage::

    python benchmarks/bench_cuda_default.py [--json [FILE]] [--ops] [--out FILE.md]
        [--layers 12] [--small-layers 1] [--width 32] [--params 10000000] [--only WORD ...] [--c-kernel]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from collections.abc import Callable

os.environ["FUNCTIONAL_FP16_CPU_KERNEL"] = "cuda-default"  # this process: CUDA's default path
os.environ.setdefault("TRITON_INTERPRET", "1")  # its Triton kernels, in Triton's interpreter

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as C  # noqa: E402
from bench_recipe import Stock, gpt2_tree  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16._fused import device_kernels, memory  # noqa: E402
from functional_fp16._util.tree import tree_leaves  # noqa: E402
from functional_fp16.update import dispatch  # noqa: E402

SCALE = 2.0**10

NO_LAUNCH = frozenset(
    "aten::" + n
    for n in (
        "empty empty_like empty_strided view reshape _reshape_alias alias detach as_strided "
        "select slice t transpose permute expand expand_as unsqueeze squeeze _unsafe_view "
        "split split_with_sizes chunk unbind narrow view_as result_type item "
        "_local_scalar_dense is_nonzero set_ lift_fresh resize_"
    ).split()
)
"""Ops that launch nothing by themselves: allocations, views, host reads, metadata."""

WRAPPERS = frozenset(f"aten::{n}" for n in ("to", "_to_copy", "contiguous", "type_as"))
"""Ops that compute only through an op inside them (a ``to`` to its own dtype does nothing)."""

TRITON = "triton::"
"""Profiler ranges of Triton kernel launches: one launch each (see ``triton_stored``)."""
HOST_READS = frozenset(f"aten::{n}" for n in ("item", "_local_scalar_dense", "is_nonzero"))
"""Top-level ops that read a tensor's value on the host (on a GPU: a synchronisation)."""

MEMORY_METHOD = (
    "torch.profiler(profile_memory=True): running sum of the CPU allocator's allocation "
    "events in time order, its maximum above the start; outputs from torch.empty_like as "
    "on CUDA (the CPU output pool off)"
)


# ---------------------------------------------------------------------------
# The rows.
# ---------------------------------------------------------------------------


def is_matrix(tree):
    return {k: v.ndim >= 2 for k, v in tree.items()}


def labels(tree):
    return {k: "matrix" if v.ndim >= 2 else "vector" for k, v in tree.items()}


def recipe(**moments):
    schedule = ff.warmup_cosine_decay_schedule(0.0, 6e-4, 10, 1000, 6e-5)
    adamw = ff.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=is_matrix, **moments)
    return ff.chain(ff.clip_by_global_norm(1.0), adamw)


OURS: dict[str, Callable[[], ff.GradientTransformation]] = {
    "recipe: clip + adamw(mask, warmup-cosine)": recipe,
    "recipe, bf16 moments": lambda: recipe(mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
    "recipe, e4m3 moments": lambda: recipe(mu_dtype="e4m3", nu_dtype="e4m3"),
    "sgd(0.05, momentum=0.9)": lambda: ff.sgd(0.05, momentum=0.9),
    "sgd, e4m3 trace": lambda: ff.sgd(0.05, momentum=0.9, accumulator_dtype="e4m3"),
    "lion, e4m3 momentum": lambda: ff.lion(1e-4, weight_decay=0.1, mu_dtype="e4m3"),
    "recipe, split master": recipe,
    "recipe, split master, e4m3 moments": lambda: recipe(mu_dtype="e4m3", nu_dtype="e4m3"),
    "sgd, split master": lambda: ff.sgd(0.05, momentum=0.9),
    "adam(1e-3)": lambda: ff.adam(1e-3),
    "lion(1e-4, weight_decay=0.1)": lambda: ff.lion(1e-4, weight_decay=0.1),
    "rmsprop(1e-3)": lambda: ff.rmsprop(1e-3),
    "add_decayed_weights(mask) + sgd": lambda: ff.chain(
        ff.add_decayed_weights(1e-2, mask=is_matrix), ff.sgd(0.05, momentum=0.9)
    ),
    "multi_transform(sgd, adam)": lambda: ff.multi_transform(
        {"matrix": ff.sgd(0.05, momentum=0.9), "vector": ff.adam(1e-3)}, labels
    ),
    "MultiSteps(sgd, k=2)": lambda: ff.MultiSteps(ff.sgd(0.05, momentum=0.9), every_k_schedule=2),
    "inject_hyperparams(adamw)": lambda: ff.inject_hyperparams(
        ff.adamw, static_args=("b1", "b2", "eps", "weight_decay", "mask")
    )(6e-4, b1=0.9, b2=0.95, weight_decay=0.1, mask=is_matrix),
}
"""The library's rows: name -> a fresh transform."""

CYCLE = {"MultiSteps(sgd, k=2)": 2}
"""Rows whose calls differ in a cycle (MultiSteps: accumulate, apply): each call is measured."""


class Ours:
    """``fp16_update`` on one state with ``DynamicLossScale(2**10)``, pure or donated (the
    rows named "split master": ``fp16_init(..., master="split")``)."""

    def __init__(self, params, grads, make_tx, donate, master="float32"):
        wide = {k: v.float() for k, v in params.items()}
        self.state = ff.fp16_init(wide, make_tx(), ff.DynamicLossScale(SCALE), master=master)
        self.grads, self.donate = grads, donate
        route = dispatch.route(self.state)
        self.path = route.name + (f" ({route.kernel})" if route.kernel else "")

    def prepare(self):
        pass

    def __call__(self):
        old = self.state
        self.state = ff.fp16_update(old, self.grads, donate=self.donate)
        return old

    def state_bytes(self) -> int:
        return _storage_bytes(tree_leaves(self.state))


class Torch(Stock):
    """``bench_recipe``'s stock recipe (FP32 parameters, ``GradScaler("cpu")``, a fused
    optimiser; nanoGPT's loop for AdamW), fed each call the scaled FP32 ``.grad`` that
    ``backward()`` leaves."""

    def __init__(self, params, grads, kind):
        super().__init__(params, grads, kind)
        self.scaled = [g.float() for g in grads.values()]
        for p, g in zip(self.params, self.scaled):
            p.grad = g.clone()
        self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        self.scaler.scale(torch.ones(()))  # the scaler creates its state lazily here
        self.path = "torch"

    def prepare(self):
        # Stands in for backward(): fresh scaled gradients (unscale_ divides them in place).
        for p, g in zip(self.params, self.scaled):
            p.grad.copy_(g)

    def __call__(self):
        super().__call__()
        return None

    def state_bytes(self) -> int:
        tensors = [*self.params, *(p.grad for p in self.params)]
        tensors += [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return _storage_bytes(tensors)


TORCH = {
    "torch: nanoGPT GradScaler + clip + AdamW(fused)": "adamw",
    "torch: GradScaler + SGD(fused, momentum=0.9)": "sgd",
}


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------
# Counting.
# ---------------------------------------------------------------------------


def _computes(event, memo: dict) -> bool:
    """Whether ``event`` (an aten op) launches work: it is not an allocation, a view or a
    wrapper, or an op inside it computes."""
    key = id(event)
    if key not in memo:
        own = event.name not in NO_LAUNCH and event.name not in WRAPPERS
        memo[key] = own or any(
            _computes(c, memo) for c in event.cpu_children if c.name.startswith("aten::")
        )
    return memo[key]


def count_launches(events) -> tuple[int, int, collections.Counter]:
    """(launches, host reads, the launches by op name) of one profiled update."""
    tops: collections.Counter = collections.Counter()
    reads = 0
    memo: dict = {}
    for e in events:
        if e.name.startswith(TRITON):  # one Triton kernel launch (run by its interpreter)
            tops[e.name] += 1
            continue
        if not e.name.startswith("aten::"):
            if e.name.startswith("functional_fp16_cpu::"):
                raise RuntimeError(f"{e.name} ran: the C++ kernel, not CUDA's default path")
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", TRITON)):
            parent = parent.cpu_parent
        if parent is not None and parent.name.startswith(TRITON):
            continue  # the interpreter's own work inside a launch
        if parent is None and e.name in HOST_READS:
            reads += 1
        elif parent is None and _computes(e, memo):
            tops[e.name] += 1
    return sum(tops.values()), reads, tops


def _warm(row) -> None:
    """Two calls before any is measured (plans, routes and the allocator settle)."""
    for _ in range(2):
        row.prepare()
        row()


def measure_launches(row, calls: int) -> list[tuple[int, int, collections.Counter]]:
    """Two warm-up calls, then each of ``calls`` calls profiled on its own."""
    _warm(row)
    out = []
    for _ in range(calls):
        row.prepare()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            row()
        out.append(count_launches(prof.events()))
    return out


# ---------------------------------------------------------------------------
# Memory.
# ---------------------------------------------------------------------------


def _allocations(prof) -> list[tuple[int, int]] | None:
    """(time in ns, bytes: + allocated, - freed) of every CPU allocation event, in time order."""
    try:
        from torch._C._profiler import _EventType

        roots = prof.profiler.kineto_results.experimental_event_tree()
    except (AttributeError, ImportError, RuntimeError):
        return None
    out = []
    stack = list(roots)
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and str(e.extra_fields.device) == "cpu":
            out.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    return sorted(out)


def measure_growth(row, calls: int) -> list[tuple[int | None, int]]:
    """Per measured call: (peak growth of allocated bytes, bytes of fresh storages in the
    state it returns: 0 when donated), after two warm-up calls."""
    _warm(row)
    out = []
    for _ in range(calls):
        row.prepare()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            old = row()
        events = _allocations(prof)
        peak = None
        if events is not None:
            total = peak = 0
            for _, size in events:
                total += size
                peak = max(peak, total)
        fresh = 0
        if old is not None:
            before = {t.untyped_storage().data_ptr() for t in tree_leaves(old)}
            new = [
                t for t in tree_leaves(row.state) if t.untyped_storage().data_ptr() not in before
            ]
            fresh = _storage_bytes(new)
        del old
        out.append((peak, fresh))
    return out


# ---------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------


def _grads(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=g) * 1e-3 * SCALE).half() for k, v in params.items()}


def flat_tree(n: int) -> dict[str, torch.Tensor]:
    """About ``n`` parameters in three large FP16 tensors: two matrices and a vector."""
    rows = max(1, int((n * 0.45) ** 0.5))
    k = max(1, n * 45 // 100 // rows)
    return {
        "w1": torch.zeros(rows, k, dtype=torch.float16).normal_(0, 0.02),
        "w2": torch.zeros(k, rows, dtype=torch.float16).normal_(0, 0.02),
        "b": torch.zeros(max(1, n - 2 * rows * k), dtype=torch.float16).normal_(0, 0.02),
    }


def _per_leaf(big: list[int], small: list[int], n_big: int, n_small: int) -> str:
    if big == small:
        return "no"
    slopes = [(b - s) / (n_big - n_small) for b, s in zip(big, small)]
    return "yes, " + " / ".join(f"{x:+.2f}" for x in slopes) + " per leaf"


def _fmt_counts(xs) -> str:
    return " / ".join(str(x) for x in xs)


def _fmt_bpp(xs, n) -> str:
    return " / ".join("n/a" if x is None else f"{x / n:.2f}" for x in xs)


def run(args) -> dict:
    t0 = time.perf_counter()
    big, small = (
        gpt2_tree(args.width, layers=args.layers),
        gpt2_tree(args.width, layers=args.small_layers),
    )
    big_g, small_g = _grads(big), _grads(small)
    flat = flat_tree(args.params)
    flat_g = _grads(flat)
    n_params = sum(v.numel() for v in flat.values())
    memory.POOL.min_bytes = 1 << 62  # outputs from torch.empty_like, as on CUDA

    def ours(name, donate):
        master = "split" if "split master" in name else "float32"
        return lambda p, g: Ours(p, g, OURS[name], donate, master)

    rows = []
    specs = [(name, "pure", ours(name, False)) for name in OURS]
    specs += [(name, "donated", ours(name, True)) for name in OURS]
    specs += [
        (name, "in place", lambda p, g, k=kind: Torch(p, g, k)) for name, kind in TORCH.items()
    ]
    if getattr(args, "only", None):
        specs = [spec for spec in specs if any(w in spec[0] for w in args.only)]
    results: dict = {}
    for name, mode, make in specs:
        calls = CYCLE.get(name, 1)
        row_big = make(big, big_g)
        launches = measure_launches(row_big, calls)
        path = row_big.path
        del row_big
        launches_small = measure_launches(make(small, small_g), calls)
        row_mem = make(flat, flat_g)
        growth = measure_growth(row_mem, calls)
        state_bytes = row_mem.state_bytes()
        del row_mem
        beyond = mode == "pure"  # pure: the new state it returns is not transient
        transient = [None if p is None else max(0, p - f * beyond) for p, f in growth]
        results.setdefault(name, {"row": name, "path": path})[mode] = {
            "launches": [n for n, _, _ in launches],
            "launches_small": [n for n, _, _ in launches_small],
            "host_reads": [r for _, r, _ in launches],
            "ops": [dict(t.most_common()) for _, _, t in launches],
            "peak_growth_bytes": [p for p, _ in growth],
            "new_state_bytes": [f for _, f in growth],
            "transient_bytes_per_param": [None if x is None else x / n_params for x in transient],
            "state_bytes_per_param": state_bytes / n_params,
        }
    c_kernel = {}
    if getattr(args, "c_kernel", False):  # the C kernel's memory on the same rows
        os.environ["FUNCTIONAL_FP16_CPU_KERNEL"] = "c"
        try:
            for name, mode, make in specs:
                if mode == "in place":
                    continue
                row_mem = make(flat, flat_g)
                growth = measure_growth(row_mem, CYCLE.get(name, 1))
                beyond = mode == "pure"
                c_kernel.setdefault(name, {})[mode] = [
                    None if p is None else max(0, p - f * beyond) / n_params for p, f in growth
                ]
                del row_mem
        finally:
            os.environ["FUNCTIONAL_FP16_CPU_KERNEL"] = "cuda-default"
    leaves = (len(big), len(small))
    for r in results.values():
        for mode in ("pure", "donated", "in place"):
            if mode in r:
                m = r[mode]
                m["per_leaf"] = _per_leaf(m["launches"], m["launches_small"], *leaves)
        rows.append(r)
    return {
        "cpu": C.machine_description()["cpu"],
        "machine": C.machine_line(),
        "kernel": device_kernels.kernel_for(torch.device("cpu")),
        "leaves": list(leaves),
        "width": args.width,
        "params": n_params,
        "launch_method": "torch.profiler (CPU): top-level aten ops that compute, see the docstring",
        "memory_method": MEMORY_METHOD,
        "rows": rows,
        "c_kernel_transient_bytes_per_param": c_kernel,
        "seconds": time.perf_counter() - t0,
    }


def markdown(res: dict, ops: bool) -> list[str]:
    n_big, n_small = res["leaves"]
    small = " (GPT-2 small's)" if n_big == 148 else ""
    md = [
        f"CPU: {res['cpu']}",
        "",
        f"CUDA's default path on the CPU (FUNCTIONAL_FP16_CPU_KERNEL=cuda-default: "
        f"kernel_for(cpu) = {res['kernel']!r}); launches per update on GPT-2's parameter "
        f"tree at width {res['width']}, {n_big} leaves{small}; per leaf?: against {n_small} leaves; transient memory at "
        f"{res['params'] / 1e6:.1f}M parameters, bytes per parameter. "
        "MultiSteps: accumulate / apply.",
        "",
        "| row | route | launches pure | launches donated | per leaf? (pure; donated) "
        "| host reads | transient B/param donated | transient B/param pure, beyond new state "
        "| state B/param |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        if "in place" in r:
            m = r["in place"]
            md.append(
                f"| {r['row']} | {r['path']} | n/a | {_fmt_counts(m['launches'])} (in place) "
                f"| {m['per_leaf']} | {_fmt_counts(m['host_reads'])} "
                f"| {_fmt_bpp(m['transient_bytes_per_param'], 1)} | n/a "
                f"| {m['state_bytes_per_param']:.0f} |"
            )
            continue
        p, d = r["pure"], r["donated"]
        per_leaf = (
            p["per_leaf"] if p["per_leaf"] == d["per_leaf"] else f"{p['per_leaf']}; {d['per_leaf']}"
        )
        md.append(
            f"| {r['row']} | {r['path']} | {_fmt_counts(p['launches'])} "
            f"| {_fmt_counts(d['launches'])} | {per_leaf} "
            f"| {_fmt_counts(p['host_reads'])}; {_fmt_counts(d['host_reads'])} "
            f"| {_fmt_bpp(d['transient_bytes_per_param'], 1)} "
            f"| {_fmt_bpp(p['transient_bytes_per_param'], 1)} "
            f"| {d['state_bytes_per_param']:.0f} |"
        )
    if res.get("c_kernel_transient_bytes_per_param"):
        md += [
            "",
            "The C kernel (FUNCTIONAL_FP16_CPU_KERNEL=c), the same rows' transient memory at "
            f"{res['params'] / 1e6:.1f}M parameters:",
            "",
            "| row | transient B/param donated | transient B/param pure, beyond new state |",
            "|---|---:|---:|",
        ]
        for name, m in res["c_kernel_transient_bytes_per_param"].items():
            md.append(
                f"| {name} | {_fmt_bpp(m.get('donated', []), 1)} | {_fmt_bpp(m.get('pure', []), 1)} |"
            )
    md += [
        "",
        "Launches: " + res["launch_method"] + ". Host reads: top-level aten::item, "
        "_local_scalar_dense, is_nonzero (pure; donated). Memory: "
        + res["memory_method"]
        + ". State B/param: the state's "
        "storages (ours: FP16 params, FP32 master, optimiser state; torch: FP32 params, "
        f".grad, optimiser state). {res['seconds']:.0f} s.",
    ]
    if ops:
        md += ["", "Launches by op (pure / donated, the first measured call):", ""]
        for r in res["rows"]:
            for mode in ("pure", "donated", "in place"):
                if mode in r:
                    top = ", ".join(
                        f"{k.removeprefix('aten::')} {v}" for k, v in r[mode]["ops"][0].items()
                    )
                    md.append(f"- {r['row']} ({mode}): {top}")
    return md


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--layers", type=int, default=12, help="GPT-2 blocks of the big tree (148 leaves)"
    )
    ap.add_argument("--small-layers", type=int, default=1, help="blocks of the small tree")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--params", type=int, default=10_000_000, help="parameters of the memory tree")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="the results as JSON: alone, printed instead of the table; with FILE, written there",
    )
    ap.add_argument("--ops", action="store_true", help="also list each row's launches by op")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--only", nargs="*", help="only the rows whose name holds one of these")
    ap.add_argument(
        "--c-kernel", action="store_true", help="also the C kernel's transient memory, same rows"
    )
    args = ap.parse_args(argv)
    if args.layers == args.small_layers:
        ap.error("--layers and --small-layers must differ")
    C.set_threads(args.threads)
    res = run(args)
    if args.json:
        text = json.dumps(res, indent=1)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    C.print_report(markdown(res, args.ops), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
