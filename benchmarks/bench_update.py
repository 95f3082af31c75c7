"""The FP16 optimiser step, side by side with the tools people use instead.

For each parameter tree (the example CNN, a ResNet-18-shaped tree, one flat
10M and one flat 100M tensor) every row performs one SGD-momentum step
(lr 0.05, momentum 0.9) from the same parameters and the same gradients.

The first table, **default**, is what users run as they would run it:
``fp16_update(state, grads)`` pure and with ``donate=True`` (the fused kernel),
next to ``GradScaler`` with ``SGD(fused=True)`` and ``SGD(foreach=True)`` on
FP32 parameters, without and with global-norm clipping
(``chain(clip_by_global_norm(1), sgd(...))`` against ``scaler.unscale_`` +
``clip_grad_norm_`` + the step). Its *first call* column is the time of a
row's first call in the process; the one-off build of the CPU kernel (once
per machine, then cached on disk) is timed separately.

The second table, **compiled**, runs ``torch.compile(fp16_update,
fullgraph=True)`` next to the eager update it should match (pure and
donated; the compiled step calls the same fused op), with GradScaler +
``SGD(fused=True)`` as the yardstick; ``--tables compiled`` runs it alone.

The third table, **peers**, adds the other ways of doing the step:

=========================  ==========================================================
row                        what one step does
=========================  ==========================================================
copy_ (bandwidth)          ``dst.copy_(src)`` in FP32: the measured copy bandwidth
add (3-stream bandwidth)   ``torch.add(a, b, out=c)`` in FP32, a second yardstick
fp16_update eager          ``fp16_update(state, grads)``: pure, the default impl
fp16_update donated        ``fp16_update(state, grads, donate=True)``
fp16_update foreach        ``impl="foreach"``: the multi-tensor path (no compiler)
fp16_update compiled       ``torch.compile(fp16_update, fullgraph=True)``, pure
fp16_update compiled+don.  the same with ``donate=True``
fp16_update reference      ``impl="reference"`` (the specification; not at 100M)
GradScaler+SGD foreach     FP32 params/grads, ``SGD(foreach=True)``, ``GradScaler``
GradScaler+SGD fused       FP32 params/grads, ``SGD(fused=True)``, ``GradScaler``
apex FP16_Optimizer alg.   FP16 model params + FP32 master in stock PyTorch: copy
                           grads to FP32, ``.item()`` overflow check per tensor,
                           unscale, SGD step, copy master back to FP16
torchopt.sgd               functional SGD on FP32 params (no loss scaling), pure
optax.sgd + jmp (jit)      the JAX original: FP16 grads, FP32 master, jmp dynamic
                           loss scale, ``jax.jit`` with donated state, on the CPU
=========================  ==========================================================

Every row reports the median time, the effective bandwidth at its stated bytes
per parameter (the least memory traffic its algorithm needs), that bandwidth
as a fraction of the measured copy bandwidth, and the peak resident-set growth
during its calls. Rows take turns call by call, so background load hits them
alike. Before timing, a numerical check runs every row for three steps plus an
overflowing fourth from identical inputs and compares the resulting FP32
master weights with ``fp16_update(impl="reference")``.

Usage::

    python benchmarks/bench_update.py                 # full run, markdown to stdout
    python benchmarks/bench_update.py --out FILE.md   # also write the markdown
    python benchmarks/bench_update.py --smoke         # seconds: agreement checks only

glibc's allocator keeps its default settings, as in a user's process;
``--tune-malloc`` raises its thresholds first (see
``functional_fp16.tune_malloc``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package

import _common as C  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16.allocator import tune_malloc  # noqa: E402

LR = 0.05
MOMENTUM = 0.9
SCALE = 2.0**10
MAX_NORM = 1.0  # the clipped rows: the gradients' norm is well above it
RTOL = 1e-5  # agreement: |a - b| <= RTOL * max|reference| per tensor


# -- parameter trees ------------------------------------------------------------------


def _example_cnn_shapes() -> dict[str, tuple[int, ...]]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "examples"))
    try:
        import cifar10_functional

        net = cifar10_functional.Net()
    finally:
        sys.path.pop(0)
    return {k: tuple(v.shape) for k, v in net.named_parameters()}


def _resnet18_shapes() -> dict[str, tuple[int, ...]]:
    import torchvision

    with torch.device("meta"):
        net = torchvision.models.resnet18()
    return {k: tuple(v.shape) for k, v in net.named_parameters()}


def trees(smoke: bool) -> dict[str, dict[str, tuple[int, ...]]]:
    if smoke:
        return {
            "small tree": {
                "conv.w": (8, 3, 3, 3),
                "conv.b": (8,),
                "fc.w": (10, 72),
                "flat": (4099,),
                "s": (),
            }
        }
    return {
        "example CNN": _example_cnn_shapes(),
        "ResNet-18 shapes": _resnet18_shapes(),
        "flat 10M": {"w": (10_000_000,)},
        "flat 100M": {"w": (100_000_000,)},
    }


def make_inputs(shapes, steps=4, seed=0):
    """FP32 initial params and ``steps`` sets of scaled FP16 grads (the fourth overflowing)."""
    g = torch.Generator().manual_seed(seed)
    p0 = {k: torch.randn(s, generator=g) * 0.05 for k, s in shapes.items()}
    grads = []
    for step in range(steps):
        gs = {k: (torch.randn(s, generator=g) * 1e-2 * SCALE).half() for k, s in shapes.items()}
        if step == 3:
            first = next(iter(gs))
            gs[first].view(-1)[0] = math.inf
        grads.append(gs)
    return p0, grads


# -- rows -----------------------------------------------------------------------------


class Row:
    """One way of doing the step. ``step(i)`` consumes the gradients of step ``i``."""

    name = ""
    bytes_per_param = 0
    supports_skip = True

    def __init__(self, p0, grads):
        raise NotImplementedError

    def prepare(self, i: int) -> None:  # untimed, before each timed step
        pass

    def step(self, i: int) -> None:
        raise NotImplementedError

    def master(self) -> list[torch.Tensor]:
        """The FP32 weights after the steps so far, in the tree's key order."""
        raise NotImplementedError


class Copy(Row):
    name = "copy_ (bandwidth)"
    bytes_per_param = 8
    supports_skip = False

    def __init__(self, p0, grads):
        self.src = [v.clone() for v in p0.values()]
        self.dst = [torch.empty_like(v) for v in self.src]

    def step(self, i):
        torch._foreach_copy_(self.dst, self.src)

    def master(self):
        return None


class AddBandwidth(Row):
    """A second bandwidth yardstick with three streams, like the optimisers' kernels."""

    name = "add(a, b, out=c) (3-stream bandwidth)"
    bytes_per_param = 12
    supports_skip = False

    def __init__(self, p0, grads):
        self.a = [v.clone() for v in p0.values()]
        self.b = [v.clone() for v in p0.values()]
        self.c = [torch.empty_like(v) for v in self.a]

    def step(self, i):
        for a, b, c in zip(self.a, self.b, self.c):
            torch.add(a, b, out=c)

    def master(self):
        return None


class FP16Update(Row):
    bytes_per_param = 22

    def __init__(
        self, p0, grads, *, impl="auto", donate=False, compiled=False, clip=False, name=""
    ):
        self.name = name
        self.grads = grads
        self.keys = list(p0)
        tx = ff.sgd(LR, momentum=MOMENTUM)
        if clip:
            tx = ff.chain(ff.clip_by_global_norm(MAX_NORM), tx)
        self.state = ff.fp16_init(p0, tx, ff.DynamicLossScale(SCALE, growth_interval=10**6))

        def update(state, g):
            return ff.fp16_update(state, g, impl=impl, donate=donate)

        self.update = torch.compile(update, fullgraph=True) if compiled else update

    def step(self, i):
        self.state = self.update(self.state, self.grads[i])

    def master(self):
        return [self.state.master[k] for k in self.keys]


class GradScalerSGD(Row):
    bytes_per_param = 28

    def __init__(self, p0, grads, *, fused, name, clip=False):
        self.name = name
        self.clip = clip
        self.params = [torch.nn.Parameter(v.clone()) for v in p0.values()]
        self.grads32 = [[g.float() for g in gs.values()] for gs in grads]
        kw = {"fused": True} if fused else {"foreach": True}
        self.opt = self.optimizer(self.params, **kw)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
        self.scaler.scale(torch.ones(()))  # the scaler creates its state lazily here

    def optimizer(self, params, **kw):
        """The torch optimizer this row steps (a subclass may use another)."""
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, **kw)

    def prepare(self, i):
        # Stands in for backward(): fresh scaled FP32 gradients in .grad.
        for p, g in zip(self.params, self.grads32[i]):
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)

    def step(self, i):
        if self.clip:
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM, foreach=True)
        self.scaler.step(self.opt)
        self.scaler.update()

    def master(self):
        return [p.detach() for p in self.params]


class ApexAlgorithm(Row):
    """apex's FP16_Optimizer + DynamicLossScaler, written out in stock PyTorch."""

    name = "apex FP16_Optimizer alg."
    bytes_per_param = 40

    def __init__(self, p0, grads):
        self.model = [torch.nn.Parameter(v.half()) for v in p0.values()]
        self.master_params = [torch.nn.Parameter(v.clone()) for v in p0.values()]
        for m in self.master_params:
            m.grad = torch.zeros_like(m)
        self.opt = torch.optim.SGD(self.master_params, lr=LR, momentum=MOMENTUM, foreach=True)
        self.grads = [list(gs.values()) for gs in grads]
        self.scale = SCALE

    def prepare(self, i):
        for p, g in zip(self.model, self.grads[i]):
            p.grad = g  # stands in for backward() on the FP16 model

    def step(self, i):
        # DynamicLossScaler.has_overflow: one host read per tensor.
        for p in self.model:
            s = float(p.grad.float().sum())
            if s in (math.inf, -math.inf) or s != s:
                self.scale /= 2.0
                return
        master_grads = [m.grad for m in self.master_params]
        torch._foreach_copy_(master_grads, [p.grad for p in self.model])
        torch._foreach_mul_(master_grads, 1.0 / self.scale)
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.model], self.master_params)

    def master(self):
        return [m.detach() for m in self.master_params]


class TorchOpt(Row):
    name = "torchopt.sgd (FP32, pure)"
    bytes_per_param = 20
    supports_skip = False

    def __init__(self, p0, grads):
        import torchopt

        self.torchopt = torchopt
        self.tx = torchopt.sgd(LR, momentum=MOMENTUM)
        self.params = tuple(v.clone() for v in p0.values())
        self.opt_state = self.tx.init(self.params)
        inv = ff.unscale_factor(torch.tensor(SCALE))
        self.grads = [tuple(g.float() * inv for g in gs.values()) for gs in grads]

    def step(self, i):
        updates, self.opt_state = self.tx.update(self.grads[i], self.opt_state, inplace=False)
        self.params = self.torchopt.apply_updates(self.params, updates, inplace=False)

    def master(self):
        return list(self.params)


class OptaxJmp(Row):
    name = "optax.sgd + jmp (jax.jit, donated)"
    bytes_per_param = 22

    def __init__(self, p0, grads):
        import jax
        import jax.numpy as jnp
        import jmp
        import optax

        self.jax = jax
        tx = optax.sgd(LR, momentum=MOMENTUM)
        self.keys = list(p0)
        master = {k: jnp.asarray(v.numpy()) for k, v in p0.items()}
        self.state = (
            master,
            tx.init(master),
            jax.tree_util.tree_map(lambda m: m.astype(jnp.float16), master),
            jmp.DynamicLossScale(jnp.float32(SCALE), period=10**6),
        )
        self.grads = [{k: jnp.asarray(v.numpy()) for k, v in gs.items()} for gs in grads]

        def step(state, grads16):
            master, opt_state, _, loss_scale = state
            g = loss_scale.unscale(jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), grads16))
            finite = jmp.all_finite(g)
            updates, new_opt = tx.update(g, opt_state, master)
            new_master = optax.apply_updates(master, updates)
            master = jmp.select_tree(finite, new_master, master)
            opt_state = jmp.select_tree(finite, new_opt, opt_state)
            params = jax.tree_util.tree_map(lambda m: m.astype(jnp.float16), master)
            return master, opt_state, params, loss_scale.adjust(finite)

        self.fn = jax.jit(step, donate_argnums=(0,))

    def step(self, i):
        self.state = self.fn(self.state, self.grads[i])
        self.jax.block_until_ready(self.state)

    def master(self):
        import numpy as np

        return [torch.from_numpy(np.asarray(self.state[0][k]).copy()) for k in self.keys]


def default_rows(clip: bool) -> list[Callable[..., Row]]:
    """The first table: the default update and the stock recipe, as users run them."""
    tag = " + clip" if clip else ""
    return [
        lambda p, g: FP16Update(p, g, clip=clip, name=f"fp16_update{tag} (pure, default)"),
        lambda p, g: FP16Update(p, g, clip=clip, donate=True, name=f"fp16_update{tag} donated"),
        lambda p, g: GradScalerSGD(
            p, g, fused=True, clip=clip, name=f"GradScaler{tag} + SGD(fused) FP32"
        ),
        lambda p, g: GradScalerSGD(
            p, g, fused=False, clip=clip, name=f"GradScaler{tag} + SGD(foreach) FP32"
        ),
    ]


def compiled_rows() -> list[Callable[..., Row]]:
    """The compiled table: the update under ``torch.compile`` next to eager mode."""
    return [
        lambda p, g: FP16Update(p, g, name="fp16_update eager (pure)"),
        lambda p, g: FP16Update(p, g, compiled=True, name="fp16_update compiled (pure)"),
        lambda p, g: FP16Update(p, g, donate=True, name="fp16_update eager donated"),
        lambda p, g: FP16Update(
            p, g, compiled=True, donate=True, name="fp16_update compiled donated"
        ),
        lambda p, g: GradScalerSGD(p, g, fused=True, name="GradScaler+SGD(fused) FP32"),
    ]


def peer_rows(n_params: int) -> list[Callable[..., Row]]:
    """The second table: bandwidth yardsticks and every other way of doing the step."""
    rows: list[Callable[..., Row]] = [
        Copy,
        AddBandwidth,
        lambda p, g: FP16Update(p, g, name="fp16_update eager (pure)"),
        lambda p, g: FP16Update(p, g, donate=True, name="fp16_update eager donated"),
        lambda p, g: FP16Update(p, g, impl="foreach", name="fp16_update foreach (pure)"),
        lambda p, g: FP16Update(p, g, compiled=True, name="fp16_update compiled (pure)"),
        lambda p, g: FP16Update(
            p, g, compiled=True, donate=True, name="fp16_update compiled donated"
        ),
    ]
    if n_params <= 20_000_000:
        rows.append(lambda p, g: FP16Update(p, g, impl="reference", name="fp16_update reference"))
    rows += [
        lambda p, g: GradScalerSGD(p, g, fused=False, name="GradScaler+SGD(foreach) FP32"),
        lambda p, g: GradScalerSGD(p, g, fused=True, name="GradScaler+SGD(fused) FP32"),
        ApexAlgorithm,
        TorchOpt,
        OptaxJmp,
    ]
    return rows


def _default_path() -> str:
    state = ff.fp16_init({"w": torch.zeros(4)}, ff.sgd(LR, momentum=MOMENTUM))
    return ff.update_path(state)


def kernel_build_seconds() -> float:
    """Seconds to compile the CPU kernel from scratch (into a throw-away cache folder)."""
    from functional_fp16._kernels import cpu as cpu_kernel

    old = os.environ.get("FUNCTIONAL_FP16_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["FUNCTIONAL_FP16_CACHE"] = tmp
        try:
            t0 = time.perf_counter()
            cpu_kernel._build()
            return time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ["FUNCTIONAL_FP16_CACHE"]
            else:
                os.environ["FUNCTIONAL_FP16_CACHE"] = old


# -- running --------------------------------------------------------------------------


def agreement(shapes) -> list[tuple[str, str, float]]:
    """Runs every row through 3 finite steps and one overflow; compares with the reference."""
    p0, grads = make_inputs(shapes)
    n = sum(math.prod(s) for s in shapes.values())
    results = []
    for clip, makers in [(False, peer_rows(n) + default_rows(False)), (True, default_rows(True))]:
        results += _agreement(p0, grads, clip, makers)
    return results


def _agreement(p0, grads, clip, makers) -> list[tuple[str, str, float]]:
    ref = FP16Update(p0, grads, impl="reference", clip=clip, name="reference")
    for i in range(4):
        ref.step(i)
    assert not bool(ref.state.grads_finite)
    expected = ref.master()
    results = []
    for make in makers:
        row = make(p0, grads)
        got = None
        if not isinstance(row, (Copy, AddBandwidth)):
            for i in range(4):
                if i == 3 and not row.supports_skip:
                    continue
                row.prepare(i)
                row.step(i)
            got = row.master()
        if got is None:
            results.append((row.name, "n/a", 0.0))
            continue
        worst = 0.0
        for a, b in zip(got, expected):
            scale = float(b.abs().max()) or 1.0
            worst = max(worst, float((a.float() - b).abs().max()) / scale)
        results.append((row.name, "PASS" if worst <= RTOL else "FAIL", worst))
    return results


def bench_tree(makers, shapes, reps, warmup, mem_calls, interleave_max=20_000_000):
    """Times every row on one tree.

    Up to ``interleave_max`` parameters all rows live at once and take turns
    call by call; above it (the 100M tree would need ~16 GB that way) each
    row is built, measured and freed in turn.
    """
    n = sum(math.prod(s) for s in shapes.values())
    interleave = n <= interleave_max
    p0, grads = make_inputs(shapes, steps=3 if interleave else 1)
    k = len(grads)
    counters: dict[str, int] = {}

    def call(r):
        def run():
            r.step(counters[r.name] % k)

        return run

    def prep(r):
        def run():
            counters[r.name] += 1
            r.prepare(counters[r.name] % k)

        return run

    def measure(rows):
        mem, first = {}, {}
        for r in rows:
            counters[r.name] = 0
            r.prepare(0)
            t0 = time.perf_counter()
            r.step(0)  # compile / first-call costs stay out of the memory and time numbers
            first[r.name] = time.perf_counter() - t0
            mem[r.name] = C.peak_growth(lambda r=r: (prep(r)(), call(r)()), mem_calls)
        times = C.time_interleaved(
            {r.name: call(r) for r in rows},
            reps=reps,
            warmup=warmup,
            prepare={r.name: prep(r) for r in rows},
        )
        return {
            r.name: (C.median(times[r.name]), r.bytes_per_param, mem[r.name], first[r.name])
            for r in rows
        }

    measured = {}
    order = []
    if interleave:
        rows = [make(p0, grads) for make in makers]
        order = [r.name for r in rows]
        measured = measure(rows)
        del rows
    else:
        for make in makers:
            row = make(p0, grads)
            order.append(row.name)
            measured.update(measure([row]))
            del row
            C.release_free_memory()
    out = []
    for name in order:
        t, bpp, mem, first = measured[name]
        out.append((name, t, bpp, bpp * n / t, mem, first))
    return n, out, interleave


def default_table(label, n, n_tensors, results) -> str:
    """The first table: time relative to GradScaler + SGD(fused), with and without clipping."""
    lines = [
        f"### {label}: {n:,} parameters in {n_tensors} tensors",
        "",
        "| row | ms | time vs GradScaler + SGD(fused) | GB/s at its bytes/param "
        "| first call | peak RSS growth |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, t, bpp, bw, mem, first in results:
        clip = "clip" in name
        fused = next(t2 for n2, t2, *_ in results if "SGD(fused)" in n2 and ("clip" in n2) == clip)
        lines.append(
            f"| {name} | {t * 1e3:.2f} | {t / fused:.2f}x | {bw / 1e9:.1f} ({bpp} B) "
            f"| {first * 1e3:.1f} ms | {C.fmt_bytes(mem)} |"
        )
    return "\n".join(lines)


def compiled_table(label, n, n_tensors, results) -> str:
    """Compiled against eager: each compiled row over its eager twin, and against GradScaler."""
    lines = [
        f"### {label}: {n:,} parameters in {n_tensors} tensors",
        "",
        "| row | ms | compiled vs eager | time vs GradScaler + SGD(fused) | first call |",
        "|---|---:|---:|---:|---:|",
    ]
    by_name = {name: t for name, t, *_ in results}
    fused = by_name["GradScaler+SGD(fused) FP32"]
    for name, t, _bpp, _bw, _mem, first in results:
        twin = name.replace("compiled", "eager")
        ratio = f"{t / by_name[twin]:.2f}x" if "compiled" in name else ""
        lines.append(
            f"| {name} | {t * 1e3:.2f} | {ratio} | {t / fused:.2f}x | {first * 1e3:.0f} ms |"
        )
    return "\n".join(lines)


def peer_table(label, n, n_tensors, results) -> str:
    lines = [
        f"### {label}: {n:,} parameters in {n_tensors} tensors",
        "",
        "| row | ms | bytes/param | GB/s | of copy BW | time vs fused GradScaler "
        "| peak RSS growth |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    copy_bw = next(bw / bpp * 8 for name, t, bpp, bw, *_ in results if name == Copy.name)
    fused = next(t for name, t, *_ in results if "SGD(fused)" in name)
    for name, t, bpp, bw, mem, _first in results:
        lines.append(
            f"| {name} | {t * 1e3:.2f} | {bpp} | {bw / 1e9:.1f} | {bw / copy_bw:.0%} | "
            f"{t / fused:.2f}x | {C.fmt_bytes(mem)} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny trees, agreement checks only")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mem-calls", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated tree labels to run")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (and XLA's); 1 keeps shared machines' noise down",
    )
    ap.add_argument(
        "--interleave-max",
        type=int,
        default=20_000_000,
        help="largest tree (params) whose rows are interleaved; bigger ones run row by row",
    )
    ap.add_argument(
        "--tune-malloc", action="store_true", help="raise glibc's malloc thresholds first"
    )
    ap.add_argument("--no-peers", action="store_true", help="no peers table")
    ap.add_argument(
        "--tables",
        default="default,compiled,peers",
        help="comma-separated tables to run: default, compiled, peers",
    )
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)

    C.set_threads(args.threads)
    tuned = tune_malloc() if args.tune_malloc else False
    all_trees = trees(args.smoke)
    if args.only:
        wanted = {s.strip() for s in args.only.split(",")}
        all_trees = {k: v for k, v in all_trees.items() if k in wanted}
    md = ["## Optimiser step", ""]
    md.append(C.machine_line())
    md.append(f"glibc malloc thresholds raised (tune_malloc): {tuned}")
    md.append(f"update path of the default rows: {_default_path()}")
    if not args.smoke:
        md.append(
            f"CPU kernel build from scratch (once per machine): {kernel_build_seconds():.2f} s"
        )
    md.append("")
    failed = False
    tables: dict[str, list[str]] = {"default": [], "compiled": [], "peers": []}
    wanted_tables = {t.strip() for t in args.tables.split(",")}
    if args.no_peers:
        wanted_tables.discard("peers")
    for label, shapes in all_trees.items():
        if label in ("example CNN", "small tree"):
            md.append(
                f"Agreement with `fp16_update(impl='reference')` on {label} "
                f"(3 steps + 1 overflow; max |diff| / max |ref|, limit {RTOL:g}):"
            )
            md.append("")
            for name, verdict, err in agreement(shapes):
                md.append(f"- {verdict} {name}: {err:.2e}")
                failed |= verdict == "FAIL"
            md.append("")
        if args.smoke:
            continue
        n = sum(math.prod(s) for s in shapes.values())
        groups = [
            ("default", default_rows(False) + default_rows(True), default_table),
            ("compiled", compiled_rows(), compiled_table),
            ("peers", peer_rows(n), peer_table),
        ]
        groups = [g for g in groups if g[0] in wanted_tables]
        for group, makers, table in groups:
            print(f"[bench] {label}: {group} ...", file=sys.stderr, flush=True)
            n, results, interleaved = bench_tree(
                makers, shapes, args.reps, args.warmup, args.mem_calls, args.interleave_max
            )
            how = "interleaved call by call" if interleaved else "one after another"
            tables[group] += [table(label, n, len(shapes), results), "", f"(rows {how})", ""]
            C.release_free_memory()
    md += ["## Default: the update as users call it", ""] + tables["default"]
    md += ["## Compiled: `torch.compile(fp16_update, fullgraph=True)` next to eager", ""]
    md += tables["compiled"]
    md += ["## Peers", ""] + tables["peers"]
    md.append(f"load average at the end: {C.machine_description()['load average (1, 5, 15 min)']}")
    C.print_report(md, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
