"""GPU checks for fp16_update: one script, PASS/FAIL lines, a markdown summary.

Run on a CUDA machine from the repository root (no network needed)::

    PYTHONPATH=. python3 benchmarks/cuda_checks.py --out cuda_checks.md

It finishes in under three minutes on one GPU and prints one line per check:

1. ``sync-free``: every implementation, pure and donated, and a whole
   ``torch.func`` training step, under ``torch.cuda.set_sync_debug_mode("error")``
   (any host synchronisation raises), through a skipped (overflowing) step;
2. ``cuda-graph``: the update captured once in a CUDA graph and replayed step
   after step (gradients copied into static inputs, the new state copied back)
   equals eager execution bitwise, skipped step included;
3. ``compiled``: ``torch.compile(fp16_update, fullgraph=True)`` matches eager
   within 16 float32 eps at the scale of each tensor, for four steps with one
   overflow, without recompiling;
4. ``foreach-vs-reference``: the fast path against the reference on the GPU
   (bitwise on the CPU; on CUDA the kernels may contract multiply-adds
   differently, so the largest difference is reported and must stay within
   16 eps at the tensor's scale);
5. ``fused-vs-reference``: the fused op's contract (decisions bitwise, master
   within one ulp at the operation's scale) for SGD, Adam, the transformer
   recipe (clip + masked AdamW + schedule) and the recipe under ``MultiSteps``;
6. ``reduce-overhead``: the recipe's update under
   ``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graphs) against eager.

On CUDA the fused op runs PyTorch's own kernels (multi-tensor ops and
``torch._fused_sgd_``); ``--device cpu`` with ``$FUNCTIONAL_FP16_CPU_KERNEL=cuda-default``
runs the same code path on the CPU.

then a speed table at 10M and 100M FP16 parameters: ``fp16_update`` pure,
donated, compiled (pure and donated) and replayed from a CUDA graph, against
``GradScaler`` + ``SGD(fused=True)`` and ``GradScaler`` + ``SGD(foreach=True)``
on FP32 parameters, with effective GB/s at each row's bytes per parameter and
the fraction of a measured device-to-device ``copy_`` bandwidth.

``--device cpu`` runs the same code on the CPU (the CUDA-only checks print
SKIP); ``--smoke`` uses small sizes. ``--list`` prints the checks' names (the
keys of ``CHECKS``), ``--check NAME`` (repeated) runs only those checks.
Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))

import bench_recipe  # noqa: E402

import functional_fp16 as ff  # noqa: E402
from functional_fp16._util.tree import tree_leaves, tree_map  # noqa: E402
from functional_fp16.update.dispatch import IMPLEMENTATIONS as _IMPLEMENTATIONS  # noqa: E402

LR, MOMENTUM, SCALE = 0.05, 0.9, 2.0**12
RESULTS: list[tuple[str, str, str]] = []  # (verdict, check, detail)
START = time.time()


def report(verdict: str, check: str, detail: str = "") -> None:
    RESULTS.append((verdict, check, detail))
    print(f"{verdict} {check}" + (f": {detail}" if detail else ""), flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_tree(device, sizes=(7, 64, 65, 4099), seed=0):
    g = torch.Generator().manual_seed(seed)
    tree = {f"w{i}": torch.randn(n, generator=g) * 0.1 for i, n in enumerate(sizes)}
    tree["s"] = torch.tensor(0.5)
    tree["m"] = torch.randn(9, 7, generator=g) * 0.1
    return {k: v.to(device) for k, v in tree.items()}


def grads_for(state, step, bad=False):
    g = torch.Generator().manual_seed(1000 + step)
    out = tree_map(
        lambda p: (torch.randn(p.shape, generator=g) * 0.01 * SCALE).to(p.dtype).to(p.device),
        state.params,
    )
    if bad:
        out["w1"][3] = math.inf
    return out


def recipe():
    """The transformer recipe (``bench_recipe.recipe``) with a schedule that moves in a few steps."""
    return bench_recipe.recipe(peak=1e-3, warmup=2, decay_steps=100, end=1e-4)


def txs():
    return {
        "sgd-momentum": ff.sgd(LR, momentum=MOMENTUM),
        "nesterov-wd": ff.sgd(LR, momentum=MOMENTUM, nesterov=True, weight_decay=1e-4),
        "clip+sgd": ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(LR, momentum=MOMENTUM)),
        "adam": ff.adam(1e-3),
        "recipe": recipe(),
        "recipe+MultiSteps(2)": ff.MultiSteps(recipe(), every_k_schedule=2),
    }


def clone(state):
    return tree_map(lambda t: t.clone(), state)


def scaled_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of float32 epsilon times max |b| (ulps at the tensor's scale).

    Plain ulp counts explode where a value passes near zero, so results rounded
    in a different order are compared at the scale of the whole tensor.
    """
    if a.numel() == 0:
        return 0.0
    a, b = a.float(), b.float()
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    mag = float(b.abs().max())
    if mag == 0.0:
        return 0.0 if torch.equal(a, b) else math.inf
    return float((a - b).abs().max()) / (torch.finfo(torch.float32).eps * mag)


def bitwise_equal(a, b) -> bool:
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


# -- 1. sync-free ---------------------------------------------------------------------


def check_sync_free(device) -> None:
    if device.type != "cuda":
        report("SKIP", "sync-free", "needs CUDA (the CPU test suite patches Tensor methods)")
        return
    for impl in sorted(_IMPLEMENTATIONS):
        for donate in (False, True):
            for tx_name, tx in txs().items():
                name = f"sync-free update impl={impl} donate={donate} tx={tx_name}"
                state = ff.fp16_init(make_tree(device), tx, ff.DynamicLossScale(SCALE))
                grads = [grads_for(state, i, bad=(i == 2)) for i in range(4)]
                loss = torch.ones((), device=device)
                sync(device)
                try:
                    torch.cuda.set_sync_debug_mode("error")
                    for g in grads:
                        state = ff.fp16_update(state, g, impl=impl, donate=donate, loss=loss)
                    torch.cuda.set_sync_debug_mode(0)
                    sync(device)
                    ok = int(state.step) == 4
                    report("PASS" if ok else "FAIL", name, "4 steps, one skipped")
                except Exception as err:
                    torch.cuda.set_sync_debug_mode(0)
                    where = traceback.extract_tb(err.__traceback__)[-1]
                    report(
                        "FAIL",
                        name,
                        f"{str(err).splitlines()[0]} at {where.filename}:{where.lineno}",
                    )
    # A whole training step: forward, torch.func backward, update.
    params = {
        "w": (torch.randn(16, 32) * 0.2).to(device),
        "b": torch.zeros(16, device=device),
    }
    state = ff.fp16_init(params, ff.sgd(LR, momentum=MOMENTUM))
    x = torch.randn(64, 32, device=device)
    y = torch.randn(64, 16, device=device)

    def step(state):
        def scaled(p):
            out = torch.tanh(x @ p["w"].float().T + p["b"].float())
            loss = torch.mean((out - y) ** 2)
            return state.loss_scale.scale(loss), loss.detach()

        grads, (_, loss) = torch.func.grad_and_value(scaled, has_aux=True)(state.params)
        return ff.fp16_update(state, grads, loss=loss)

    state = step(state)  # first call: lazy CUDA initialisation is not a step
    sync(device)
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(3):
            state = step(state)
        torch.cuda.set_sync_debug_mode(0)
        report("PASS", "sync-free training step (forward + torch.func grad + fp16_update)")
    except Exception as err:
        torch.cuda.set_sync_debug_mode(0)
        report("FAIL", "sync-free training step", str(err).splitlines()[0])


# -- 2. CUDA graphs -------------------------------------------------------------------


def check_cuda_graph(device) -> None:
    if device.type != "cuda":
        report("SKIP", "cuda-graph", "needs CUDA")
        return
    for impl, tx_name in [*[(i, "sgd") for i in sorted(_IMPLEMENTATIONS)], ("fused", "recipe")]:
        for donate in (False, True):
            name = f"cuda-graph capture+replay == eager impl={impl} donate={donate} tx={tx_name}"
            try:
                tx = recipe() if tx_name == "recipe" else None
                ok, detail = _graph_vs_eager(device, impl, donate, tx)
                report("PASS" if ok else "FAIL", name, detail)
            except Exception as err:  # report and go on with the other checks
                report("FAIL", name, f"{type(err).__name__}: {str(err).splitlines()[0]}")


def _graph_vs_eager(device, impl, donate, tx=None):
    tx = tx or ff.sgd(LR, momentum=MOMENTUM, weight_decay=1e-4)
    static_state = ff.fp16_init(
        make_tree(device), tx, ff.DynamicLossScale(SCALE, growth_interval=2)
    )
    static_grads = grads_for(static_state, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (with donation this advances the state; fine)
            warm = ff.fp16_update(static_state, static_grads, impl=impl, donate=donate)
            if donate:
                _copy_back(static_state, warm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ff.fp16_update(static_state, static_grads, impl=impl, donate=donate)
    eager = clone(static_state)
    skipped = 0
    for i in range(6):
        g = grads_for(static_state, 10 + i, bad=(i == 3))
        for dst, src in zip(tree_leaves(static_grads), tree_leaves(g)):
            dst.copy_(src)
        graph.replay()
        _copy_back(static_state, out)
        eager = ff.fp16_update(eager, g, impl=impl)
        skipped += int(not bool(eager.grads_finite))
        if not bitwise_equal(static_state, eager):
            return False, f"differs from eager at step {i}"
    return skipped == 1, f"6 replays, {skipped} skipped, bitwise equal"


def _copy_back(static_state, out) -> None:
    for dst, src in zip(tree_leaves(static_state), tree_leaves(out)):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)


# -- 3. compiled -----------------------------------------------------------------------


def check_compiled(device) -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    for donate in (False, True):
        name = f"compiled update (fullgraph, no recompiles) == eager donate={donate}"
        try:
            torch._dynamo.reset()
            counters.clear()
            tx = ff.sgd(LR, momentum=MOMENTUM, nesterov=True, weight_decay=1e-4)
            state = ff.fp16_init(make_tree(device), tx, ff.DynamicLossScale(SCALE))
            fn = torch.compile(lambda s, g: ff.fp16_update(s, g, donate=donate), fullgraph=True)
            comp, eager, worst = clone(state), clone(state), 0
            with torch._dynamo.config.patch(error_on_recompile=True):
                for i in range(4):
                    g = grads_for(state, 20 + i, bad=(i == 1))
                    comp = clone(fn(comp, g))
                    eager = ff.fp16_update(eager, g, impl="reference")
                    for x, y in zip(tree_leaves(comp.master), tree_leaves(eager.master)):
                        worst = max(worst, scaled_error(x, y))
                    if bool(comp.grads_finite) != bool(eager.grads_finite):
                        raise AssertionError(f"skip decision differs at step {i}")
            graphs = counters["stats"]["unique_graphs"]
            ok = worst <= 16 and graphs == 1
            detail = f"max error {worst:.1f} eps x max|master|, {graphs} graph(s)"
            report("PASS" if ok else "FAIL", name, detail)
        except Exception as err:
            report("FAIL", name, f"{type(err).__name__}: {str(err).splitlines()[0]}")


def check_reduce_overhead(device) -> None:
    """``torch.compile(mode="reduce-overhead")`` (Inductor's CUDA graphs) of the recipe's update."""
    if device.type != "cuda":
        report("SKIP", "reduce-overhead", "needs CUDA")
        return
    import torch._dynamo

    name = "compiled mode=reduce-overhead (CUDA graphs) == eager tx=recipe"
    try:
        torch._dynamo.reset()
        state = ff.fp16_init(make_tree(device), recipe(), ff.DynamicLossScale(SCALE))
        fn = torch.compile(ff.fp16_update, fullgraph=True, mode="reduce-overhead")
        comp, eager, worst = clone(state), clone(state), 0.0
        for i in range(8):
            g = grads_for(state, 80 + i, bad=(i == 4))
            comp = clone(fn(comp, g))  # the graph's outputs are overwritten by the next replay
            eager = ff.fp16_update(eager, g)
            if bool(comp.grads_finite) != bool(eager.grads_finite):
                raise AssertionError(f"skip decision differs at step {i}")
            if not bitwise_equal(comp.loss_scale, eager.loss_scale):
                raise AssertionError(f"loss scale differs at step {i}")
            for x, y in zip(tree_leaves(comp.master), tree_leaves(eager.master)):
                worst = max(worst, scaled_error(x, y))
        ok = worst <= 16
        report("PASS" if ok else "FAIL", name, f"8 steps, max error {worst:.1f} eps x max|master|")
    except Exception as err:
        report("FAIL", name, f"{type(err).__name__}: {str(err).splitlines()[0]}")


# -- 4. fast paths vs reference on the device -----------------------------------------


def check_fused_vs_reference(device) -> None:
    """The default (fused) update against the reference: the numerical contract, step by step."""
    from tests.helpers import assert_within_one_operation_ulp

    for tx_name, tx in txs().items():
        name = f"fused-vs-reference (contract) tx={tx_name}"
        try:
            state = ff.fp16_init(make_tree(device), tx, ff.DynamicLossScale(SCALE))
            path = ff.update_path(state)
            for i in range(5):
                g = grads_for(state, 60 + i, bad=(i == 2))
                ref = ff.fp16_update(state, g, impl="reference")
                new = ff.fp16_update(state, g)
                if bool(new.grads_finite) != bool(ref.grads_finite):
                    raise AssertionError(f"skip decision differs at step {i}")
                if not bitwise_equal(new.loss_scale, ref.loss_scale):
                    raise AssertionError(f"loss scale differs at step {i}")
                if bool(ref.grads_finite):
                    for x, r, m in zip(
                        tree_leaves(new.master), tree_leaves(ref.master), tree_leaves(state.master)
                    ):
                        assert_within_one_operation_ulp(x, r, m)
                elif not bitwise_equal(new.master, state.master) or not bitwise_equal(
                    new.opt_state, ref.opt_state
                ):  # (MultiSteps counts a skipped micro-step in its state, as the reference)
                    raise AssertionError(f"skipped step {i} changed the state")
                state = ref
            report("PASS", name, f"path {path}: decisions bitwise, master within 1 ulp")
        except Exception as err:
            report("FAIL", name, f"{type(err).__name__}: {str(err).splitlines()[0]}")


def check_foreach_vs_reference(device) -> None:
    try:
        _foreach_vs_reference(device)
    except Exception as err:
        report("FAIL", "foreach-vs-reference", f"{type(err).__name__}: {str(err).splitlines()[0]}")


def _foreach_vs_reference(device) -> None:
    for tx_name, tx in txs().items():
        for donate in (False, True):
            name = f"foreach-vs-reference tx={tx_name} donate={donate}"
            a = ff.fp16_init(make_tree(device), tx, ff.DynamicLossScale(SCALE))
            b = clone(a)
            worst, bitwise = 0, True
            for i in range(5):
                g = grads_for(a, 40 + i, bad=(i == 2))
                a = ff.fp16_update(a, g, impl="reference")
                b = ff.fp16_update(b, g, impl="foreach", donate=donate)
                b = clone(b) if donate else b
                bitwise &= bitwise_equal(a, b)
                for x, y in zip(tree_leaves(a.master), tree_leaves(b.master)):
                    worst = max(worst, scaled_error(x, y))
            ok = worst <= 16 and bool(a.grads_finite) == bool(b.grads_finite)
            detail = "bitwise equal" if bitwise else f"max error {worst:.1f} eps x max|master|"
            report("PASS" if ok else "FAIL", name, detail)


CHECKS = {
    "sync-free": check_sync_free,
    "cuda-graph": check_cuda_graph,
    "compiled": check_compiled,
    "foreach-vs-reference": check_foreach_vs_reference,
    "fused-vs-reference": check_fused_vs_reference,
    "reduce-overhead": check_reduce_overhead,
}
"""The checks by name, in the order they run; each reports its PASS/FAIL/SKIP lines."""


def run_check(name: str, device) -> list[tuple[str, str, str]]:
    """Runs the check ``name`` on ``device``; its ``(verdict, check, detail)`` lines."""
    before = len(RESULTS)
    CHECKS[name](device)
    return RESULTS[before:]


# -- speed ---------------------------------------------------------------------------


def _time(fn, device, reps, inner) -> float:
    for _ in range(3):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def speed_table(device, sizes, reps, inner, budget) -> list[str]:
    lines = []
    for n in sizes:
        lines += [
            "",
            f"### {n / 1e6:g}M parameters (one flat tensor), {device.type}",
            "",
            "| row | ms | bytes/param | GB/s | of copy BW | vs GradScaler+fused |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        rows = []
        src = torch.randn(n, device=device)
        dst = torch.empty_like(src)
        rows.append(("copy_ FP32 (bandwidth)", 8, lambda: dst.copy_(src)))
        p0 = {"w": torch.randn(n, device=device) * 0.05}
        g16 = {"w": (torch.randn(n, device=device) * 0.01 * SCALE).half()}
        holders = {}

        def ff_row(key, donate, compiled):
            holders[key] = ff.fp16_init(
                p0, ff.sgd(LR, momentum=MOMENTUM), ff.DynamicLossScale(SCALE)
            )
            upd = lambda s, g: ff.fp16_update(s, g, donate=donate)
            if compiled:
                upd = torch.compile(upd, fullgraph=True)

            def run():
                holders[key] = upd(holders[key], g16)

            return run

        rows.append(("fp16_update eager (pure)", 22, ff_row("pure", False, False)))
        rows.append(("fp16_update eager donated", 22, ff_row("donated", True, False)))
        rows.append(("fp16_update compiled (pure)", 22, ff_row("cpure", False, True)))
        rows.append(("fp16_update compiled donated", 22, ff_row("cdon", True, True)))
        if device.type == "cuda":
            try:
                gstate = ff.fp16_init(p0, ff.sgd(LR, momentum=MOMENTUM), ff.DynamicLossScale(SCALE))
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    ff.fp16_update(gstate, g16)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    ff.fp16_update(gstate, g16)
                rows.append(("fp16_update eager, CUDA-graph replay", 22, graph.replay))
            except Exception as err:
                report("FAIL", "speed row CUDA-graph capture", f"{type(err).__name__}: {err}")
        for fused in (True, False):
            param = torch.nn.Parameter(p0["w"].clone())
            param.grad = g16["w"].float()
            kw = {"fused": True} if fused else {"foreach": True}
            opt = torch.optim.SGD([param], lr=LR, momentum=MOMENTUM, **kw)
            scaler = torch.amp.GradScaler(device.type, init_scale=SCALE, growth_interval=10**6)
            scaler.scale(torch.ones((), device=device))

            def gs_step(opt=opt, scaler=scaler):
                scaler.step(opt)
                scaler.update()

            label = "fused=True" if fused else "foreach=True"
            rows.append((f"GradScaler+SGD({label}) FP32", 28, gs_step))
        results = []
        for name, bpp, fn in rows:
            if time.time() - START > budget:
                results.append((name, bpp, None))
                continue
            try:
                results.append((name, bpp, _time(fn, device, reps, inner)))
            except Exception as err:
                report("FAIL", f"speed row {name}", f"{type(err).__name__}: {err}")
                results.append((name, bpp, None))
        copy_t = results[0][2]
        fused_t = next(t for name, _, t in results if "fused=True" in name)
        for name, bpp, t in results:
            if t is None:
                lines.append(f"| {name} | skipped (time budget) | {bpp} | | | |")
                continue
            bw = bpp * n / t
            frac = f"{bw / (8 * n / copy_t):.0%}" if copy_t else ""
            vs = f"{fused_t / t:.2f}x" if fused_t else ""
            lines.append(f"| {name} | {t * 1e3:.3f} | {bpp} | {bw / 1e9:.0f} | {frac} | {vs} |")
        print("\n".join(lines[-(len(results) + 2) :]), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true", help="small sizes, few repetitions")
    ap.add_argument("--out", default="cuda_checks.md", help="markdown summary path")
    ap.add_argument("--budget", type=float, default=160.0, help="seconds before rows are skipped")
    ap.add_argument("--list", action="store_true", help="print the checks' names and exit")
    ap.add_argument(
        "--check", action="append", choices=list(CHECKS), help="run only this check (repeatable)"
    )
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(CHECKS))
        return 0
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # steadier numbers on shared machines
    if device.type == "cuda" and not torch.cuda.is_available():
        print("FAIL cuda: torch.cuda.is_available() is False")
        return 1
    print(
        f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        flush=True,
    )
    for name in args.check or CHECKS:
        run_check(name, device)
    sizes = (100_000,) if args.smoke else (10_000_000, 100_000_000)
    reps, inner = (3, 2) if args.smoke else (7, 10)
    table = speed_table(device, sizes, reps, inner, args.budget)
    failed = sum(v == "FAIL" for v, _, _ in RESULTS)
    md = [
        "## GPU checks (benchmarks/cuda_checks.py)",
        "",
        f"torch {torch.__version__}; device: "
        + (torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        + f"; {time.time() - START:.0f} s",
        "",
    ]
    md += [f"- **{v}** {c}" + (f": {d}" if d else "") for v, c, d in RESULTS]
    md += table
    md += ["", f"{failed} check(s) failed." if failed else "All checks passed."]
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"{'FAIL' if failed else 'PASS'} overall: {failed} failed; summary in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
