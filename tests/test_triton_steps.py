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


def test_fp16_update_through_the_triton_kernel_equals_the_c_kernel():
    """End to end under the interpreter: the fused op's CUDA path (``kernel_for`` made to
    answer ``"triton"``), plain and vmapped, is bitwise the C path."""
    pytest.importorskip("triton")
    proc = _run(True, "--end-to-end")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("END TO END OK"), proc.stdout


def test_kernels_compile_for_sm90_with_the_intended_arithmetic():
    """Without a GPU: the CUDA compilation (to PTX and cubin) and the instructions it emits."""
    pytest.importorskip("triton")
    proc = _run(False, "--compile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.stdout.rstrip().endswith("COMPILED OK"), proc.stdout


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
    # x * y a float32 tie (1 + 2^-11 + 2^-24) and z far below a float64 ulp: rounding the
    # float64 sum to nearest first would round back to the tie, then to even (wrongly)
    x[:4] = y[:4] = 1.0 + 2.0**-12
    z[:4] = [2.0**-80, -(2.0**-80), 2.0**-100, -(2.0**-100)]
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


# The leaves: (shape, gradient dtype, working-copy dtype or "master"). With G = 3
# the groups are leaves {0, 1, 2}, {3, 4, 5}, {6, 7, 8}, and group 1 is skipped.
# Leaves 0, 2 and 8 form one class (one launch across two groups); leaves 5 and
# 6 differ only in alignment.
LEAVES = [
    ((300,), "float16", "float16"),
    ((45,), "float16", "float32"),
    ((64,), "float16", "float16"),
    ((2, 3, 5, 4), "bfloat16", "bfloat16"),  # channels-last
    ((77,), "float32", "master"),
    ((33,), "bfloat16", "float16"),
    ((130,), "bfloat16", "float16"),
    ((0,), "float16", "float16"),  # empty
    ((20,), "float16", "float16"),
]
UNALIGNED = 6  # this leaf's gradient starts 2 bytes past a 16-byte boundary


def _bits(t):
    import torch

    views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().reshape(-1).view(views[t.element_size()])


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
        # a working copy not exactly fl(master), so that a skipped group must copy it
        self.params = [
            m if p == "master" else (m * 1.01).to(getattr(torch, p))
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
            if p == "master":  # a view: the same memory as another tensor object
                out["params_out"][i] = out["master_out"][i][...]
        return out


def _unaligned(x):
    """A copy of the 1-d ``x`` one element into a fresh buffer (so not 16-byte aligned)."""
    import torch

    return torch.cat([x.new_zeros(1), x])[1:]


def _group_scalars(n_groups: int, clip: bool = True, inv: bool = True) -> dict:
    """Per-group scalars; with three groups the middle one is skipped."""
    import torch

    f32 = torch.float32
    return dict(
        inv=torch.tensor([2.0**-8, 2.0**-9, 2.0**-10][:n_groups], dtype=f32) if inv else None,
        clip_div=torch.tensor([1.5, 2.0, 3.25][:n_groups], dtype=f32) if clip else None,
        clip_mul=torch.tensor([1.0, 0.75, 1.0][:n_groups], dtype=f32) if clip else None,
        lr=torch.tensor([-0.05, -0.02, -0.1][:n_groups], dtype=f32),
        apply=torch.tensor([True, False, True][:n_groups] if n_groups == 3 else [True]),
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
                extra = (
                    {"require": None, "decided_out": None, "leaf_finite_out": None}
                    if entry == "sgd_update"
                    else {}
                )
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


SGD_CASES = [
    # n_groups, clip, inv, started, weight_decay, momentum, dampening, nesterov
    (1, False, True, [True], 0.0, 0.9, 0.0, 0),
    (1, True, True, [False], 1e-2, 0.9, 0.0, 0),
    (3, True, True, [True, False, True], 1e-2, 0.8, 0.3, 1),
    (3, False, False, [False, True, True], 0.0, 0.8, 0.3, 0),
    (3, True, False, None, 1e-3, 0.0, 0.0, 0),
    (1, False, True, None, 0.0, 0.0, 0.0, 0),
]

ADAM_CASES = [
    # n_groups, clip, inv, b1, b2, l2, decoupled
    (3, True, True, 0.9, 0.999, 1e-2, 0.0),
    (1, False, False, 0.3, 0.99, 0.0, 1e-2),
    (3, False, True, 0.9, 0.95, 0.0, 0.0),
]


def _check_sgd(cpu, ts) -> None:
    import torch

    for seed, case in enumerate(SGD_CASES):
        n_groups, clip, inv, started, weight_decay, momentum, dampening, nesterov = case
        state = _State(seed, n_groups, ("trace",) if momentum else ())
        scalars = _group_scalars(n_groups, clip, inv)
        scalars["started"] = None if started is None else torch.tensor(started)
        hyper = dict(
            weight_decay=weight_decay,
            momentum=momentum,
            take_started=1.0 - dampening,
            nesterov=nesterov,
        )
        _compare_step(cpu, ts, "sgd_update", state, scalars, hyper)
        print("ok sgd", case)


def _check_adam(cpu, ts) -> None:
    import torch

    for seed, case in enumerate(ADAM_CASES):
        n_groups, clip, inv, b1, b2, l2, decoupled = case
        state = _State(100 + seed, n_groups, ("mu", "nu"))
        scalars = _group_scalars(n_groups, clip, inv)
        t = torch.tensor([3.0, 1.0, 10.0][:n_groups], dtype=torch.float64)  # step counts
        scalars["inv_c1"] = (1.0 / (1.0 - b1**t)).float()
        scalars["sqrt_c2"] = torch.sqrt(1.0 - b2**t).float()
        w = float(torch.tensor(1.0 - b1, dtype=torch.float32))
        hyper = dict(l2=l2, w=w, b2=b2, c2=1.0 - b2, eps=1e-8, decoupled=decoupled)
        _compare_step(cpu, ts, "adam_update", state, scalars, hyper)
        print("ok adam", case)


def _check_grad_stats(cpu, ts) -> None:
    import math

    import torch

    n_classes = len({(g, i == UNALIGNED) for i, (s, g, _) in enumerate(LEAVES) if 0 not in s})
    for n_groups, inv, special in (
        (1, True, None),
        (3, False, None),
        (3, True, "inf"),
        (3, True, "nan"),
        (1, False, "nan"),
    ):
        state = _State(7, n_groups, ())
        grads = state.inputs()["grads"]
        if special:  # in leaves 0 (group 0) and 6 (group 2 of 3)
            grads[0][5] = grads[6][100] = float(special)
        kw = dict(grads=grads, inv=_group_scalars(n_groups, inv=inv)["inv"])
        for sum_squares in (0, 1):
            results = []
            for kernel in ("c", "triton"):
                peak = torch.full((len(grads),), -1.0)  # one per leaf
                sq = torch.full((n_groups,), -1.0, dtype=torch.float64) if sum_squares else None
                args = dict(kw, sum_squares=sum_squares, peak_out=peak, sum_sq_out=sq)
                if kernel == "c":
                    cpu.call("grad_stats", n_groups=n_groups, threads=1, **args)
                else:
                    before = ts.launch_counts.copy()
                    ts.grad_stats(n_groups=n_groups, **args)
                    assert ts.launch_counts["grad_stats"] - before["grad_stats"] == n_classes
                    assert ts.launch_counts["leaf_reduce"] - before["leaf_reduce"] == 1
                    reduced = ts.launch_counts["group_reduce"] - before["group_reduce"]
                    assert reduced == sum_squares
                results.append((peak, sq))
            (c_peak, c_sq), (t_peak, t_sq) = results
            assert _same_bits(t_peak, c_peak), (t_peak, c_peak)
            if special:  # exactly the two leaves that hold it
                assert [i for i, v in enumerate(c_peak.tolist()) if v == math.inf] == [0, 6]
            for want, got in zip(
                c_sq.tolist() if sum_squares else [], t_sq.tolist() if sum_squares else []
            ):
                if math.isfinite(want):
                    assert abs(got - want) <= 1e-12 * abs(want), (got, want)
                else:
                    assert math.isnan(got) == math.isnan(want) and (got == want or got != got)
        print("ok grad_stats", n_groups, inv, special)


def _check_no_leaves(cpu, ts) -> None:
    """No leaves: the statistics are zeros, and an update launches nothing."""
    import torch

    peaks = [torch.full((0,), -1.0) for _ in range(2)]  # one per leaf: none
    sums = [torch.full((2,), -1.0, dtype=torch.float64) for _ in range(2)]
    kw = dict(grads=[], inv=None, sum_squares=1)
    cpu.call("grad_stats", n_groups=2, threads=1, peak_out=peaks[0], sum_sq_out=sums[0], **kw)
    ts.grad_stats(n_groups=2, peak_out=peaks[1], sum_sq_out=sums[1], **kw)
    assert _same_bits(peaks[0], peaks[1]) and torch.equal(sums[0], sums[1])
    assert peaks[1].tolist() == [] and sums[1].tolist() == [0.0, 0.0]
    before = ts.launch_counts["sgd_update"]
    none = dict(grads=[], master=[], params=[], master_out=[], params_out=[])
    none.update(trace=None, trace_out=None, started=None, **_group_scalars(1, False, False))
    ts.sgd_update(n_groups=1, weight_decay=0.0, momentum=0.0, take_started=1.0, nesterov=0, **none)
    assert ts.launch_counts["sgd_update"] == before
    print("ok no leaves")


def _expect_error(ts, call, needle: str, error: type) -> None:
    """``call()`` raises ``error`` naming ``needle``, and launches nothing."""
    before = sum(ts.launch_counts.values())
    try:
        call()
    except error as err:
        assert needle in str(err), (needle, str(err))
    else:
        raise AssertionError(f"no {error.__name__} for a bad {needle}")
    assert sum(ts.launch_counts.values()) == before, f"launched with a bad {needle}"


def _check_bad_inputs(ts) -> None:
    import torch

    state = _State(3, 3, ("trace",))
    inputs = state.inputs()
    good = dict(n_groups=3, **inputs, **state.outputs(inputs, False), **_group_scalars(3))
    good.update(started=torch.tensor([True] * 3), weight_decay=0.0, momentum=0.9)
    good.update(take_started=1.0, nesterov=0)

    def cut(name, i, value):
        return [value if j == i else x for j, x in enumerate(good[name])]

    bad_sgd = [
        ("master", dict(master=good["master"][:-1]), ValueError),
        ("master[0]", dict(master=cut("master", 0, good["master"][0].half())), TypeError),
        ("params[1]", dict(params=cut("params", 1, torch.zeros(44))), ValueError),
        ("master[3]", dict(master=cut("master", 3, good["master"][3].contiguous())), ValueError),
        ("grads[0]", dict(grads=cut("grads", 0, torch.zeros(600).half()[::2])), ValueError),
        ("lr", dict(lr=torch.zeros(4)), ValueError),
        ("lr", dict(lr=torch.zeros(3, dtype=torch.float64)), TypeError),
        ("apply", dict(apply=torch.ones(3, dtype=torch.bool, device="meta")), ValueError),
        ("apply", dict(apply=None), TypeError),
        ("clip_div", dict(clip_mul=None), ValueError),
        ("trace", dict(trace=None), ValueError),  # without trace_out: both or neither
        ("weight_decay", dict(weight_decay="0.1"), TypeError),
        ("params_out[0]", dict(params_out=cut("params_out", 0, torch.zeros(300))), TypeError),
        ("groups", dict(n_groups=4), ValueError),
    ]
    for needle, change, error in bad_sgd:
        _expect_error(ts, lambda: ts.sgd_update(**dict(good, **change)), needle, error)
    stats = dict(n_groups=3, grads=good["grads"], inv=None, sum_squares=0)
    stats.update(peak_out=torch.zeros(len(good["grads"])), sum_sq_out=None)
    bad_stats = [
        ("sum_sq_out", dict(sum_squares=1), TypeError),
        ("peak_out", dict(peak_out=torch.zeros(9, dtype=torch.float64)), TypeError),
        ("peak_out", dict(peak_out=torch.zeros(3)), ValueError),  # one per group, not per leaf
        ("inv", dict(inv=torch.ones(1)), ValueError),
    ]
    for needle, change, error in bad_stats:
        _expect_error(ts, lambda: ts.grad_stats(**dict(stats, **change)), needle, error)
    print("ok bad inputs")


def _main_interpreted() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _check_fma_model()
    _patch_interpreter()
    cpu, ts = _import_kernels()
    assert cpu.available(), cpu.unavailable_reason()
    _check_bad_inputs(ts)
    _check_no_leaves(cpu, ts)
    ts.BLOCK, ts.CHUNK = 1024, 32768  # the defaults: every leaf in one chunk and one step
    _check_sgd(cpu, ts)
    ts.BLOCK, ts.CHUNK = 32, 64  # several chunks per leaf, two steps per chunk
    _check_sgd(cpu, ts)
    _check_adam(cpu, ts)
    _check_grad_stats(cpu, ts)
    ts.BLOCK, ts.CHUNK = 8, 16  # more chunks per group than the reduction's block
    _check_grad_stats(cpu, ts)
    print("ALL OK")


def _main_compile() -> None:
    """Compiles each kernel for sm_90 (H100/H200) without a GPU and reads its PTX."""
    import re

    import triton
    import triton.language as tl

    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
        from triton.compiler import ASTSource
    except ImportError as err:
        print("SKIP: no NVIDIA backend in triton:", err)
        return
    _, ts = _import_kernels()
    from functional_fp16._kernels.triton_lion import _lion_kernel

    types = {"leaves": "*i64", "chunks": "*i64", "bounds": "*i64", "apply_ptr": "*i1"}
    types.update(started_ptr="*i1", sq_part="*fp64", sq_out="*fp64")

    def ptx(kernel, pointers=None, **constexprs) -> str:
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            else:
                fp32 = "*fp32" if name.endswith(("_ptr", "_part", "_out")) else "fp32"
                sig[name] = {**types, **(pointers or {})}.get(name, fp32)
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
        options = {"enable_fp_fusion": False}
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    def count(text: str, pattern: str) -> int:
        return len(re.findall(pattern, text))

    sizes = dict(CHUNK=ts.CHUNK, BLOCK=ts.BLOCK)
    f16, bf16 = tl.float16, tl.bfloat16
    for aligned in (False, True):
        stats = ptx(ts._stats_kernel, G_TY=f16, ALIGNED=aligned, HAS_INV=True, SUM_SQ=True, **sizes)
        sgd = ptx(
            ts._sgd_kernel,
            **dict(G_TY=f16, P_TY=bf16, ALIGNED=aligned, HAS_INV=True, CLIP=True, DECAY=True),
            **dict(MOMENTUM=True, STARTED=True, NESTEROV=True, P_IS_MASTER=False, **sizes),
        )
        adam = ptx(
            ts._adam_kernel,
            **dict(G_TY=bf16, P_TY=f16, ALIGNED=aligned, HAS_INV=True, CLIP=True, L2=True),
            **dict(DECOUPLED=True, SMALL_W=False, P_IS_MASTER=False, **sizes),
        )
        lion = ptx(
            _lion_kernel,
            **dict(G_TY=f16, P_TY=f16, ALIGNED=aligned, HAS_INV=True, CLIP=True),
            **dict(DECOUPLED=True, P_IS_MASTER=False, **sizes),
        )
        for text in (stats, sgd, adam, lion):  # vector loads exactly where the class is aligned
            assert (count(text, r"ld\.global(\.\w+)*\.v\d") > 0) == aligned
        for text in (sgd, adam, lion):  # only explicit roundings; no approximate division
            assert count(text, r"\b(mul|add|sub)\.f32") == 0
            assert count(text, r"\.(approx|full)\.f32") == 0
        # per element, SGD: one clip division, fma for decay, Nesterov and the step, and
        # the momentum sum b*k + u*t as two products and one add
        assert count(sgd, r"fma\.rn\.f32") == 3 * count(sgd, r"div\.rn\.f32")
        assert count(sgd, r"add\.rn\.f32") == count(sgd, r"div\.rn\.f32")
        assert count(sgd, r"cvt\.rn\.bf16\.f32") > 0
        # Adam: fma for L2, lerp, v', decoupled decay and step; one root, two divisions
        assert count(adam, r"fma\.rn\.f32") == 5 * count(adam, r"sqrt\.rn\.f32") > 0
        assert count(adam, r"div\.rn\.f32") == 3 * count(adam, r"sqrt\.rn\.f32")
        # Lion: one clip division, fma for the decay and the step, and the direction and
        # the momentum as two products and one add each
        assert count(lion, r"fma\.rn\.f32") == 2 * count(lion, r"div\.rn\.f32") > 0
        assert count(lion, r"add\.rn\.f32") == 2 * count(lion, r"div\.rn\.f32")
        assert count(stats, r"\.f64") > 0
    # a group's sum of squares (float64), a leaf's peak (float32)
    wide = {"part": "*fp64", "out": "*fp64"}
    assert count(ptx(ts._segment_reduce_kernel, wide, SUM=True, BLOCK=ts.BLOCK), r"\.f64") > 0
    narrow = {"part": "*fp32", "out": "*fp32"}
    ptx(ts._segment_reduce_kernel, narrow, SUM=False, BLOCK=ts.BLOCK)
    print("COMPILED OK")


def _main_refuse_cpu() -> None:
    import torch

    assert "TRITON_INTERPRET" not in os.environ
    _, ts = _import_kernels()
    assert ts.available() == torch.cuda.is_available()
    g = [torch.zeros(4, dtype=torch.float16)]
    try:
        ts.grad_stats(
            n_groups=1, grads=g, inv=None, sum_squares=0, peak_out=torch.zeros(1), sum_sq_out=None
        )
    except ValueError as err:
        assert "grads[0]" in str(err) and "cuda" in str(err), str(err)
    else:
        raise AssertionError("CPU tensors were accepted without the interpreter")
    print("REFUSED OK")


def _main_end_to_end() -> None:
    """fp16_update with the Triton kernels (on CPU tensors) against the C kernel, bitwise."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    _patch_interpreter()
    import torch

    import functional_fp16 as ff
    from functional_fp16._fused import op_library
    from functional_fp16._util.tree import tree_leaves

    txs = {
        "sgd": ff.sgd(0.1, momentum=0.9, weight_decay=1e-3),
        "clip-nesterov": ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.1, 0.9, nesterov=True)),
        "adamw": ff.adamw(1e-2, weight_decay=0.1),
        "lion": ff.lion(1e-3, weight_decay=0.1),
        "clip-lion": ff.chain(ff.clip_by_global_norm(1.0), ff.lion(1e-3, b1=0.5)),
    }
    real = op_library.kernel_for

    def run(kernel, fn, *args):
        op_library.kernel_for = (lambda device: "triton") if kernel == "triton" else real
        try:
            return fn(*args)
        finally:
            op_library.kernel_for = real

    g = torch.Generator().manual_seed(0)

    def params(k):
        return {
            "c": torch.randn(3, 2, 3, 3, generator=g).to(memory_format=torch.channels_last),
            "w": torch.randn(40, generator=g),
            "s": torch.randn((), generator=g),
        }

    from functional_fp16._fused import triton_fallback
    from functional_fp16._kernels.triton_launch import launch_counts

    for name, tx in txs.items():
        launched = sum(launch_counts.values())
        members = [ff.fp16_init(params(k), tx) for k in range(2)]
        stacked = ff.tree_stack(members)
        for step in range(3):
            grads = [
                {k: (torch.randn(v.shape, generator=g) * 50).half() for k, v in m.params.items()}
                for m in members
            ]
            if step == 1:
                grads[1]["w"][3] = float("inf")
            vm = torch.func.vmap(ff.fp16_update)
            new_t = run("triton", lambda: [ff.fp16_update(m, x) for m, x in zip(members, grads)])
            new_c = run("c", lambda: [ff.fp16_update(m, x) for m, x in zip(members, grads)])
            st_t = run("triton", vm, stacked, ff.tree_stack(grads))
            for a, b in zip(tree_leaves(new_t), tree_leaves(new_c)):
                assert _same_bits(a, b), (name, step)
            for a, b in zip(tree_leaves(st_t), tree_leaves(ff.tree_stack(new_c))):
                assert _same_bits(a, b), (name, step, "vmap")
            members, stacked = new_c, st_t
        # the Triton kernels ran and none fell back to the plain kernel
        assert sum(launch_counts.values()) > launched and not triton_fallback._failed, name
        print("ok", name)
    print("END TO END OK")


if __name__ == "__main__":
    {
        "--refuse-cpu": _main_refuse_cpu,
        "--compile": _main_compile,
        "--end-to-end": _main_end_to_end,
    }.get(sys.argv[1] if len(sys.argv) > 1 else "", _main_interpreted)()
