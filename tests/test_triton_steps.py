"""The multi-tensor Triton steps (``_kernels/triton_steps.py``) against the C kernel.

Without a GPU, Triton's interpreter (``TRITON_INTERPRET=1``) runs the kernels'
source on CPU tensors. The variable must be set before triton is imported, so
the checks run in a fresh process: this file, run as a script.

The interpreter evaluates two operations differently from a GPU: ``tl.fma``
as a product and a sum rounded separately (NumPy has no fused multiply-add),
and the float32 to bfloat16 conversion by truncation (the GPU's ``cvt.rn``
rounds to nearest even). The script replaces those two interpreter
primitives by exact models (an fma correctly rounded through float64 with
round-to-odd, checked here against libm's ``fmaf``; torch's round-to-nearest
BF16 conversion) so that the kernels' results can be held to the C kernel bit
for bit: every output of SGD and Adam in every configuration, the skipped
group equal to its input, the gradient statistics' peaks exactly and their
float64 sums to 1e-12. It also counts the launches (one per dtype class) and
checks that malformed arguments raise, naming the argument, before any
launch. Small ``BLOCK``/``CHUNK`` sizes make the leaves span several chunks
and steps.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(interpret: bool, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_triton_steps_match_the_c_kernel_under_the_interpreter():
    pytest.importorskip("triton")
    proc = _run(True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("ALL OK"), proc.stdout


def test_triton_steps_refuse_cpu_tensors_without_the_interpreter():
    pytest.importorskip("triton")
    proc = _run(False, "--refuse-cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("REFUSED OK"), proc.stdout


# ---------------------------------------------------------------------------
# The script (a fresh process)
# ---------------------------------------------------------------------------


def _import_kernels():
    """The kernels' modules, loaded without the package's ``__init__``.

    ``functional_fp16._kernels`` imports nothing of the rest of the package;
    loading it alone keeps this (slow) interpreter process small.
    """
    import types

    if "functional_fp16" not in sys.modules:
        pkg = types.ModuleType("functional_fp16")
        pkg.__path__ = [os.path.join(ROOT, "functional_fp16")]
        sys.modules["functional_fp16"] = pkg
    from functional_fp16._kernels import cpu, triton_steps

    return cpu, triton_steps


def _fma32(x, y, z):
    """float32 fma(x, y, z), correctly rounded: the product is exact in float64, the
    sum's error is recovered exactly (TwoSum), and the float64 sum is rounded to odd
    before the final rounding to float32 (53 >= 2 * 24 + 2 bits: no double rounding)."""
    import numpy as np

    x, y, z = (np.asarray(a, dtype=np.float64) for a in (x, y, z))
    p = x * y
    s = np.asarray(p + z)
    t = s - p
    err = (p - (s - t)) + (z - t)
    even = (np.ascontiguousarray(s).view(np.int64) & 1) == 0
    nudge = np.isfinite(s) & (err != 0) & even
    s = np.where(nudge, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _check_fma_model():
    import ctypes
    import ctypes.util

    import numpy as np

    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.fmaf.restype = ctypes.c_float
    libm.fmaf.argtypes = [ctypes.c_float] * 3
    rng = np.random.default_rng(0)
    n = 20000
    x = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    y = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32)
    z = (rng.standard_normal(n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    z[::3] = -(x[::3] * y[::3])  # cancellations: the product's rounding error is the result
    z[1::7] = 0.0
    got = _fma32(x, y, z)
    want = np.array([libm.fmaf(a, b, c) for a, b, c in zip(x, y, z)], dtype=np.float32)
    assert np.array_equal(got.view(np.int32), want.view(np.int32)), "the fma model is wrong"


def _patch_interpreter():
    """Makes the interpreter's fma and float32->bfloat16 conversion those of a GPU."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast_impl = builder.cast_impl

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return interpreter.TensorHandle(x.data * y.data + z.data, z.dtype.scalar)
        return interpreter.TensorHandle(_fma32(x.data, y.data, z.data), z.dtype.scalar)

    def cast_rn(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return cast_impl(self, src, dst_type)

    builder.create_fma = create_fma
    builder.cast_impl = cast_rn


# The leaves: (shape, gradient dtype, working-copy dtype or "master"); with G = 3
# the groups are leaves {0, 1}, {2, 3}, {4, 5}, and group 1 is skipped.
LEAVES = [
    ((300,), "float16", "float16"),
    ((45,), "float16", "float32"),
    ((2, 3, 5, 4), "bfloat16", "bfloat16"),  # channels-last
    ((77,), "float32", "master"),
    ((130,), "bfloat16", "float16"),
    ((0,), "float16", "float16"),  # empty
]
UNALIGNED = 4  # this leaf's gradient starts 2 bytes past a 16-byte boundary


def _bits(t):
    import torch

    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _same_bits(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


class _State:
    """One set of step inputs, built from a seed."""

    def __init__(self, seed: int, n_groups: int, moments: tuple[str, ...]):
        import torch

        gen = torch.Generator().manual_seed(seed)

        def randn(shape, dtype="float32", scale=1.0):
            x = (torch.randn(shape, generator=gen) * scale).to(getattr(torch, dtype))
            if len(shape) == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            return x

        self.n_groups = n_groups
        self.grads = [randn(s, g, 300.0) for s, g, _ in LEAVES]
        self.master = [randn(s) for s, _, _ in LEAVES]
        self.params = [
            m if p == "master" else m.to(getattr(torch, p))
            for m, (_, _, p) in zip(self.master, LEAVES)
        ]
        self.moments = {name: [randn(s).abs() for s, _, _ in LEAVES] for name in moments}

    def inputs(self) -> dict:
        """Deep copies of the inputs (the working copy that is the master stays the master)."""
        master = [m.clone() for m in self.master]
        params = [
            master[i] if p is m else p.clone()
            for i, (p, m) in enumerate(zip(self.params, self.master))
        ]
        grads = [_unaligned(g) if i == UNALIGNED else g.clone() for i, g in enumerate(self.grads)]
        out = {"grads": grads, "master": master, "params": params}
        out.update({k: [x.clone() for x in v] for k, v in self.moments.items()})
        return out

    def outputs(self, inputs: dict, donate: bool) -> dict:
        """The outputs: the inputs themselves, or fresh tensors filled with NaN."""
        import torch

        names = ["master", "params", *self.moments]
        if donate:
            return {f"{k}_out": inputs[k] for k in names}
        out = {f"{k}_out": [torch.full_like(x, float("nan")) for x in inputs[k]] for k in names}
        for i, (_, _, p) in enumerate(LEAVES):
            if p == "master":
                out["params_out"][i] = out["master_out"][i]
        return out


def _unaligned(x):
    """A copy of the 1-d ``x`` one element into a fresh buffer (so not 16-byte aligned)."""
    import torch

    return torch.cat([x.new_zeros(1), x])[1:]


def _group_scalars(n_groups: int, skip: bool) -> dict:
    import torch

    f32 = torch.float32
    inv = torch.tensor([2.0**-8, 2.0**-9, 2.0**-10][:n_groups], dtype=f32)
    return dict(
        inv=inv,
        clip_div=torch.tensor([1.5, 2.0, 3.25][:n_groups], dtype=f32),
        clip_mul=torch.tensor([1.0, 0.75, 1.0][:n_groups], dtype=f32),
        lr=torch.tensor([-0.05, -0.02, -0.1][:n_groups], dtype=f32),
        apply=torch.tensor([True, not skip, True][:n_groups]),
    )


def _classes() -> int:
    """The number of classes of the update among the non-empty leaves."""
    return len({(g, p, i == UNALIGNED) for i, (s, g, p) in enumerate(LEAVES) if 0 not in s})


def _compare_step(cpu, ts, entry: str, state: _State, scalars: dict, hyper: dict) -> None:
    """Runs ``entry`` through both kernels, fresh and donated; every output bitwise equal."""
    import torch

    n_groups = state.n_groups
    per_group = len(LEAVES) // n_groups
    apply = scalars["apply"].tolist()
    for donate in (False, True):
        results = []
        for kernel in ("c", "triton"):
            inputs = state.inputs()
            outputs = state.outputs(inputs, donate)
            kw = dict(**inputs, **outputs, **scalars, **hyper)
            if entry == "sgd_update" and hyper["momentum"] == 0.0:
                kw["trace"] = kw["trace_out"] = None
            if kernel == "c":
                extra = {"peak_out": None} if entry == "sgd_update" else {}
                cpu.call(entry, n_groups=n_groups, threads=1, **extra, **kw)
            else:
                before = ts.launch_counts[entry]
                getattr(ts, entry)(n_groups=n_groups, **kw)
                assert ts.launch_counts[entry] - before == _classes(), "one launch per class"
            results.append(outputs)
        c_out, t_out = results
        original = state.inputs()
        for name in c_out:
            for i, (want, got) in enumerate(zip(c_out[name], t_out[name])):
                assert _same_bits(got, want), f"{entry} {name}[{i}] differs (donate={donate})"
                assert torch.isfinite(got.float()).all(), f"{entry}: {name}[{i}] not written"
                if not apply[i // per_group]:
                    kept = original[name[: -len("_out")]][i]
                    assert _same_bits(got, kept), f"{entry}: skipped {name}[{i}] changed"
                if got.dim() == 4:
                    assert got.is_contiguous(memory_format=torch.channels_last)


def _check_sgd(cpu, ts) -> None:
    import torch

    take = float(torch.tensor(1.0 - 0.3, dtype=torch.float32))
    cases = [
        # (n_groups, skip, started, clip, inv, hyper)
        (1, False, [True], False, True, dict(weight_decay=0.0, momentum=0.9, nesterov=0)),
        (1, False, [False], True, True, dict(weight_decay=1e-2, momentum=0.9, nesterov=0)),
        (3, True, [True, False, True], True, True, dict(weight_decay=1e-2, momentum=0.8,
                                                        nesterov=1)),
        (3, True, [False, True, True], False, False, dict(weight_decay=0.0, momentum=0.8,
                                                          nesterov=0)),
        (3, True, None, True, False, dict(weight_decay=1e-3, momentum=0.0, nesterov=0)),
        (1, False, None, False, True, dict(weight_decay=0.0, momentum=0.0, nesterov=0)),
    ]
    for seed, (n_groups, skip, started, clip, inv, hyper) in enumerate(cases):
        state = _State(seed, n_groups, ("trace",) if hyper["momentum"] else ())
        scalars = _group_scalars(n_groups, skip)
        if not clip:
            scalars["clip_div"] = scalars["clip_mul"] = None
        if not inv:
            scalars["inv"] = None
        scalars["started"] = None if started is None else torch.tensor(started)
        hyper = dict(hyper, take_started=take if hyper["momentum"] == 0.8 else 1.0)
        _compare_step(cpu, ts, "sgd_update", state, scalars, hyper)
        print("ok sgd", n_groups, started, clip, inv, hyper)


def _check_adam(cpu, ts) -> None:
    import torch

    def f32(x):
        return float(torch.tensor(x, dtype=torch.float32))

    cases = [
        # (n_groups, skip, clip, inv, b1, b2, l2, decoupled)
        (3, True, True, True, 0.9, 0.999, 1e-2, 0.0),
        (1, False, False, False, 0.3, 0.99, 0.0, 1e-2),
        (3, True, False, True, 0.9, 0.95, 0.0, 0.0),
    ]
    for seed, (n_groups, skip, clip, inv, b1, b2, l2, decoupled) in enumerate(cases):
        state = _State(100 + seed, n_groups, ("mu", "nu"))
        scalars = _group_scalars(n_groups, skip)
        if not clip:
            scalars["clip_div"] = scalars["clip_mul"] = None
        if not inv:
            scalars["inv"] = None
        t = torch.tensor([3.0, 1.0, 10.0][:n_groups], dtype=torch.float64)
        scalars["inv_c1"] = (1.0 / (1.0 - b1**t)).float()
        scalars["sqrt_c2"] = torch.sqrt(1.0 - b2**t).float()
        hyper = dict(l2=l2, w=f32(1.0 - b1), b2=b2, c2=1.0 - b2, eps=1e-8, decoupled=decoupled)
        _compare_step(cpu, ts, "adam_update", state, scalars, hyper)
        print("ok adam", n_groups, clip, inv, hyper)


def _check_grad_stats(cpu, ts) -> None:
    import math

    import torch

    n_classes = len({(g, i == UNALIGNED) for i, (s, g, _) in enumerate(LEAVES) if 0 not in s})
    for n_groups, inv, special in ((1, True, None), (3, False, None), (3, True, "inf"),
                                   (3, True, "nan"), (1, False, "nan")):
        state = _State(7, n_groups, ())
        grads = state.inputs()["grads"]
        if special:  # in leaves 0 (group 0) and 4 (group 2 of 3)
            grads[0][5] = grads[4][100] = float(special)
        kw = dict(grads=grads, inv=_group_scalars(n_groups, False)["inv"] if inv else None)
        for sum_squares in (0, 1):
            results = []
            for kernel in ("c", "triton"):
                peak = torch.full((n_groups,), -1.0)
                sq = torch.full((n_groups,), -1.0, dtype=torch.float64) if sum_squares else None
                args = dict(kw, sum_squares=sum_squares, peak_out=peak, sum_sq_out=sq)
                if kernel == "c":
                    cpu.call("grad_stats", n_groups=n_groups, threads=1, **args)
                else:
                    before = ts.launch_counts.copy()
                    ts.grad_stats(n_groups=n_groups, **args)
                    assert ts.launch_counts["grad_stats"] - before["grad_stats"] == n_classes
                    assert ts.launch_counts["group_reduce"] - before["group_reduce"] == 1
                results.append((peak, sq))
            (c_peak, c_sq), (t_peak, t_sq) = results
            assert _same_bits(t_peak, c_peak), (t_peak, c_peak)
            for want, got in zip(c_sq.tolist() if sum_squares else [],
                                 t_sq.tolist() if sum_squares else []):
                if math.isfinite(want):
                    assert abs(got - want) <= 1e-12 * abs(want), (got, want)
                else:
                    assert math.isnan(got) == math.isnan(want) and (got == want or got != got)
        print("ok grad_stats", n_groups, inv, special)


def _check_bad_inputs(ts) -> None:
    import torch

    state = _State(3, 3, ("trace",))
    inputs = state.inputs()
    good = dict(**inputs, **state.outputs(inputs, False), **_group_scalars(3, True))
    good.update(started=torch.tensor([True] * 3), weight_decay=0.0, momentum=0.9,
                take_started=1.0, nesterov=0)

    def cut(name, i, value):
        return [value if j == i else x for j, x in enumerate(good[name])]

    bad = [
        ("master", dict(master=good["master"][:-1]), ValueError),
        ("master[0]", dict(master=cut("master", 0, good["master"][0].half())), TypeError),
        ("params[1]", dict(params=cut("params", 1, torch.zeros(44))), ValueError),
        ("master[2]", dict(master=cut("master", 2, good["master"][2].contiguous())), ValueError),
        ("grads[0]", dict(grads=cut("grads", 0, torch.zeros(600).half()[::2])), ValueError),
        ("lr", dict(lr=torch.zeros(4)), ValueError),
        ("lr", dict(lr=torch.zeros(3, dtype=torch.float64)), TypeError),
        ("apply", dict(apply=torch.ones(3, dtype=torch.bool, device="meta")), ValueError),
        ("apply", dict(apply=None), TypeError),
        ("clip_div", dict(clip_mul=None), ValueError),
        ("trace", dict(trace=None), TypeError),
        ("weight_decay", dict(weight_decay="0.1"), TypeError),
        ("params_out[0]", dict(params_out=cut("params_out", 0, torch.zeros(300))), TypeError),
        ("groups", dict(n_groups=4), ValueError),
    ]
    for needle, change, error in bad:
        kw = dict(good, n_groups=3)
        kw.update(change)
        before = sum(ts.launch_counts.values())
        try:
            ts.sgd_update(**kw)
        except error as err:
            assert needle in str(err), (needle, str(err))
        else:
            raise AssertionError(f"no {error.__name__} for a bad {needle}")
        assert sum(ts.launch_counts.values()) == before, f"launched with a bad {needle}"
    peak = torch.zeros(3)
    for needle, kw, error in [
        ("sum_sq_out", dict(sum_squares=1, peak_out=peak, sum_sq_out=None), TypeError),
        ("peak_out", dict(sum_squares=0, peak_out=peak.double(), sum_sq_out=None), TypeError),
        ("inv", dict(inv=torch.ones(1), sum_squares=0, peak_out=peak, sum_sq_out=None),
         ValueError),
    ]:
        try:
            ts.grad_stats(**dict(dict(n_groups=3, grads=good["grads"], inv=None), **kw))
        except error as err:
            assert needle in str(err), (needle, str(err))
        else:
            raise AssertionError(f"no {error.__name__} for a bad {needle}")
    print("ok bad inputs")


def _main_interpreted() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _check_fma_model()
    _patch_interpreter()
    cpu, ts = _import_kernels()
    assert cpu.available(), cpu.unavailable_reason()
    _check_bad_inputs(ts)
    ts.BLOCK, ts.CHUNK = 1024, 32768  # the defaults: every leaf in one chunk and one step
    _check_sgd(cpu, ts)
    ts.BLOCK, ts.CHUNK = 32, 64  # several chunks per leaf, two steps per chunk
    _check_sgd(cpu, ts)
    _check_adam(cpu, ts)
    _check_grad_stats(cpu, ts)
    print("ALL OK")


def _main_refuse_cpu() -> None:
    import torch

    assert "TRITON_INTERPRET" not in os.environ
    _, ts = _import_kernels()
    assert ts.available() == torch.cuda.is_available()
    g = [torch.zeros(4, dtype=torch.float16)]
    try:
        ts.grad_stats(n_groups=1, grads=g, inv=None, sum_squares=0,
                      peak_out=torch.zeros(1), sum_sq_out=None)
    except ValueError as err:
        assert "grads[0]" in str(err) and "cuda" in str(err), str(err)
    else:
        raise AssertionError("CPU tensors were accepted without the interpreter")
    print("REFUSED OK")


if __name__ == "__main__":
    if sys.argv[1:] == ["--refuse-cpu"]:
        _main_refuse_cpu()
    else:
        _main_interpreted()
