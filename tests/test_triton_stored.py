"""The CUDA default's Triton kernel of Adam's stored-moment step
(``functional_fp16._fused.triton_stored``), run on the CPU in Triton's interpreter.

Triton interprets kernels only where ``TRITON_INTERPRET=1`` was set before it was
imported, so the cases run in a child process with it set (the suite's one case,
:func:`test_the_cases_pass_in_the_interpreter`, starts it). There each case runs
updates of a tree by the C kernel and by the CUDA default (whose Adam leaves with
E4M3 or bfloat16 moments go through the Triton kernel: asserted, one launch a
leaf) from the same state, and requires the two new states' bytes equal on those
leaves: codes, block scales, bfloat16 moments, master and working copy (both
kernels round each operation alike and contract the same multiply-adds; the C
kernel is held to the reference in ``test_fused_stored_moments``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused import device_kernels as dk
from functional_fp16._fused import triton_stored
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import (
    assert_bitwise_unchanged,
    bit_snapshot,
    bits,
    run_cases_in_interpreter,
    stored_step_grads,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_child = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter's process")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_cases_pass_in_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is the interpreter's process")
    if triton_stored.triton is None:
        pytest.skip("triton is not installed")
    run_cases_in_interpreter(__file__, "test_the_cases_pass_in_the_interpreter", N_CASES)


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(96, 64, generator=g) * 0.1).to(dtype),  # whole blocks
        "v": (torch.randn(41, 300, generator=g) * 0.1).to(dtype),  # a block and a rest a row
        "t": (torch.randn(6, 8, 40, generator=g) * 0.1).to(dtype),  # rows of 320, 3-d
        "n": (torch.randn(5, 8, generator=g) * 0.1).to(dtype),  # rows under 64: float32
        "b": torch.randn(64, generator=g) * 0.1,  # float32, no working copy
    }


TAKEN = {"e4m3": ("w", "v", "t"), "bf16": ("w", "v", "t", "n", "b")}
"""The leaves the Triton kernel takes: with E4M3, those with rows of at least 64 (the
others keep float32 moments); with bfloat16, every leaf."""

MASK = {"w": True, "v": True, "t": True, "n": True, "b": False}

FORMATS = {"e4m3": "e4m3", "bf16": torch.bfloat16}


def _tx(fmt, rounding, l2=False, clip=True):
    kw = dict(mu_dtype=FORMATS[fmt], nu_dtype=FORMATS[fmt], moment_rounding=rounding)
    if l2:
        inner = ff.chain(ff.add_decayed_weights(0.01), ff.adam(1e-3, **kw))
    else:
        inner = ff.adamw(1e-3, weight_decay=0.1, mask=MASK, **kw)
    return ff.chain(ff.clip_by_global_norm(1.0), inner) if clip else inner


@pytest.fixture
def launches(monkeypatch):
    """Each kernel launch's leaf shape (``triton_stored._run`` launches every kernel)."""
    calls = []
    real = triton_stored._run

    def counted(kernel, master, *rest):
        calls.append(master.shape)
        return real(kernel, master, *rest)

    monkeypatch.setattr(triton_stored, "_run", counted)
    return calls


def _update(monkeypatch, kernel, state, grads, donate=False):
    monkeypatch.setenv(dk.CPU_KERNEL_VARIABLE, kernel)
    if donate:
        state = tree_map(torch.clone, state)
    return ff.fp16_update(state, grads, donate=donate)


def _assert_taken_leaves_equal(new, want, fmt):
    taken = TAKEN[fmt]
    for k in taken:
        assert torch.equal(bits(new.master[k]), bits(want.master[k])), k
        assert torch.equal(bits(new.params[k]), bits(want.params[k])), k
    for got, ref in zip(_moments(new), _moments(want)):
        for k in taken:
            for x, y in zip(tree_leaves(got[k]), tree_leaves(ref[k]), strict=True):
                assert torch.equal(bits(x), bits(y)), k


def _moments(state):
    """Every dict of per-leaf tensors in the optimiser state (moments, codes, scales)."""
    found = []

    def walk(x):
        if isinstance(x, dict) and set(MASK) <= set(x):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
        elif hasattr(x, "_asdict"):
            walk(tuple(x._asdict().values()))
        elif hasattr(x, "__dict__") and not isinstance(x, torch.Tensor):
            walk(tuple(vars(x).values()))

    walk(state.opt_state)
    assert found, "no per-leaf states found"
    return found


CASES = [  # each format and rounding; FP16 and BF16 gradients and params in turn
    ("e4m3", "nearest", torch.float16),
    ("e4m3", "stochastic", torch.bfloat16),
    ("bf16", "nearest", torch.bfloat16),
    ("bf16", "stochastic", torch.float16),
]


@in_child
@pytest.mark.parametrize("fmt, rounding, dtype", CASES)
def test_each_step_is_the_c_kernels(monkeypatch, launches, fmt, rounding, dtype):
    state = ff.fp16_init(_params(dtype), _tx(fmt, rounding), ff.DynamicLossScale(2.0**10))
    for step in range(3):
        grads = stored_step_grads(state, step, bad=float("inf") if step == 2 else None)
        want = _update(monkeypatch, "c", state, grads)
        launches.clear()
        got = _update(monkeypatch, "cuda-default", state, grads)
        assert len(launches) == len(TAKEN[fmt]), launches
        assert bool(got.grads_finite) == (step != 2)
        _assert_taken_leaves_equal(got, want, fmt)
        state = want


@in_child
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_l2_decay_fp32_grads_and_no_loss_scale(monkeypatch, launches, fmt):
    """Adam's L2 term, no clipping, float32 gradients and working copies, no loss scale."""
    params = {k: v.float() for k, v in _params(torch.float16, 3).items()}
    state = ff.fp16_init(params, _tx(fmt, "stochastic", l2=True, clip=False), ff.NoOpLossScale())
    for step in range(3):
        grads = stored_step_grads(state, step)
        want = _update(monkeypatch, "c", state, grads)
        launches.clear()
        got = _update(monkeypatch, "cuda-default", state, grads)
        assert len(launches) == len(TAKEN[fmt])
        _assert_taken_leaves_equal(got, want, fmt)
        state = want


@in_child
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_donated_and_skipped_steps(monkeypatch, launches, fmt):
    """Donated steps are the pure ones; a skipped step (inf, NaN) keeps every byte."""
    state = ff.fp16_init(_params(torch.float16), _tx(fmt, "stochastic"))
    for step in range(2):
        grads = stored_step_grads(state, step)
        pure = _update(monkeypatch, "cuda-default", state, grads)
        donated = _update(monkeypatch, "cuda-default", state, grads, donate=True)
        _assert_taken_leaves_equal(donated, pure, fmt)
        state = pure
    kept = (state.master, state.params, state.opt_state)
    before = bit_snapshot(kept)
    for bad in (float("inf"), float("nan")):
        for donate in (False, True):
            skipped = _update(
                monkeypatch, "cuda-default", state, stored_step_grads(state, 5, bad), donate
            )
            assert not bool(skipped.grads_finite)
            assert_bitwise_unchanged((skipped.master, skipped.params, skipped.opt_state), before)
    assert_bitwise_unchanged(kept, before)


OTHERS = {
    "lion_e4m3": lambda: ff.chain(
        ff.clip_by_global_norm(1.0),
        ff.lion(1e-4, weight_decay=0.1, mu_dtype="e4m3", block_size=128),
    ),
    "lion_bf16": lambda: ff.lion(1e-4, mu_dtype=torch.bfloat16),
    "lion_fp16_nearest": lambda: ff.lion(
        1e-4, weight_decay=0.1, mu_dtype=torch.float16, moment_rounding="nearest"
    ),
    "sgd_e4m3_nesterov": lambda: ff.chain(
        ff.clip_by_global_norm(1.0),
        ff.add_decayed_weights(1e-3, mask=MASK),
        ff.sgd(0.05, momentum=0.9, nesterov=True, accumulator_dtype="e4m3"),
    ),
    "sgd_bf16_dampened": lambda: ff.sgd(
        0.05, momentum=0.9, dampening=0.1, accumulator_dtype=torch.bfloat16
    ),
    "adam_fp16_mu_e4m3_nu": lambda: ff.adamw(
        1e-3, mu_dtype=torch.float16, nu_dtype="e4m3", block_size=64, weight_decay=0.1
    ),
}


def _stored_leaves(state) -> int:
    """Leaves whose optimiser state is stored in fewer bits (each one launch)."""
    stored = set()
    for found in _moments(state):
        for k, x in found.items():
            if any(t.dtype in (torch.uint8, torch.bfloat16, torch.float16) for t in tree_leaves(x)):
                stored.add(k)
    return len(stored)


@in_child
@pytest.mark.parametrize("name", sorted(OTHERS))
def test_lion_sgd_and_mixed_adam_are_the_c_kernels(monkeypatch, launches, name):
    """Lion's momentum and SGD's trace (E4M3, BF16, FP16; FP32 on the leaves E4M3 leaves
    alone) and Adam with an FP16 first and an E4M3 second moment: every byte of every
    leaf the kernels take, step after step."""
    state = ff.fp16_init(_params(torch.float16), OTHERS[name](), ff.DynamicLossScale(2.0**10))
    # Adam's leaves of FP32 moments take the FP32 step's multi-tensor ops; Lion's and
    # SGD's stored steps take every leaf through the kernel
    n = _stored_leaves(state) if name.startswith("adam") else len(state.master)
    assert n >= 3
    for step in range(3):
        grads = stored_step_grads(state, step, bad=float("nan") if step == 2 else None)
        want = _update(monkeypatch, "c", state, grads)
        launches.clear()
        got = _update(monkeypatch, "cuda-default", state, grads)
        assert len(launches) == n, (launches, n)
        assert bool(got.grads_finite) == (step != 2)
        for x, y in zip(tree_leaves(_moments(got)), tree_leaves(_moments(want)), strict=True):
            assert torch.equal(bits(x), bits(y))
        for k in ("w", "v", "t") if name.startswith("adam") else tuple(MASK):
            assert torch.equal(bits(got.master[k]), bits(want.master[k])), k
            assert torch.equal(bits(got.params[k]), bits(want.params[k])), k
        state = want


SPLIT = {
    "adamw": lambda: ff.chain(
        ff.clip_by_global_norm(1.0), ff.adamw(1e-3, weight_decay=0.1, mask=MASK)
    ),
    "adamw_e4m3": lambda: ff.adamw(1e-3, weight_decay=0.1, mu_dtype="e4m3", nu_dtype="e4m3"),
    "lion": lambda: ff.lion(1e-4, weight_decay=0.1),
    "sgd_bf16": lambda: ff.sgd(0.05, momentum=0.9, accumulator_dtype=torch.bfloat16),
}


def _split_params():
    """FP16 params at every scale the split master treats apart (``test_master_split``)."""
    p = {k: v.half() for k, v in _params(torch.float16, 4).items()}
    p["v"][0, :6] = torch.tensor([0.0, -0.0, 2.0**-20, -3 * 2.0**-25, 6e-8, -(2.0**-14)])
    p["t"] = p["t"] * 2.0**-12  # subnormal FP16 params
    return p


@in_child
@pytest.mark.parametrize("name", sorted(SPLIT))
def test_split_masters_are_the_c_kernels(monkeypatch, launches, name):
    """A split master (FP16 params and int16 residuals): one launch a leaf joins, steps and
    splits, every byte the C kernel's (params, residuals, moments), skipped steps too."""
    state = ff.fp16_init(
        _split_params(), SPLIT[name](), ff.DynamicLossScale(2.0**10), master="split"
    )
    for step in range(3):
        grads = stored_step_grads(state, step, bad=float("inf") if step == 1 else None)
        for donate in (False, True):
            want = _update(monkeypatch, "c", state, grads, donate)
            launches.clear()
            got = _update(monkeypatch, "cuda-default", state, grads, donate)
            assert len(launches) == len(state.master), launches
            assert bool(got.grads_finite) == (step != 1)
            for x, y in zip(tree_leaves(got), tree_leaves(want), strict=True):
                assert torch.equal(bits(x), bits(y))
        state = want


@in_child
def test_the_interpreters_fma_rounds_once():
    """The interpreter's ``tl.fma`` given one rounding: against exact rationals."""
    from fractions import Fraction

    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(x_ptr, y_ptr, z_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, tl.fma(tl.load(x_ptr + i), tl.load(y_ptr + i), tl.load(z_ptr + i)))

    assert triton_stored.available(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 1024, generator=g)
    z = -(x * y) * (1 + torch.randn(1024, generator=g) * 2.0**-20)  # cancellation
    out = torch.empty(1024)
    fma_kernel[(1,)](x, y, z, out, N=1024)
    for a, b, c, o in zip(x.tolist(), y.tolist(), z.tolist(), out.tolist()):
        exact = Fraction(a) * Fraction(b) + Fraction(c)
        assert o == _round_to_float32(exact, float(exact)), (a, b, c)


def _round_to_float32(exact, near: float) -> float:
    """The float32 nearest the rational ``exact`` (ties to even), from ``near``, the
    float64 nearest it: the nearer of the two float32 values around it."""
    from fractions import Fraction

    up = torch.tensor(float("inf"))
    f = torch.tensor(near, dtype=torch.float32)
    lo = torch.nextafter(f, -up) if Fraction(f.item()) > exact else f
    hi = torch.nextafter(lo, up)
    dl, dh = exact - Fraction(lo.item()), Fraction(hi.item()) - exact
    if dl != dh:
        return (lo if dl < dh else hi).item()
    return (lo if int(lo.view(torch.int32)) % 2 == 0 else hi).item()


N_CASES = len(CASES) + 2 * len(FORMATS) + len(OTHERS) + len(SPLIT) + 1
