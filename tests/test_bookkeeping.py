"""The bookkeeping op (``functional_fp16::bookkeeping``, ``_fused/bookkeeping.py``): the
loss scale's adjustment with hysteresis and bounds, the ``ScaleStats`` counters, the step
and the optimisers' counts and flags in one call, bitwise the library's reference
(``DynamicLossScale.adjust``, ``advance_stats``, ``saturating_increment``) from every
kernel: the C++ kernel here, the Triton kernel in Triton's interpreter (a child process
with ``TRITON_INTERPRET=1``, started by :func:`test_the_triton_cases_pass_in_the_interpreter`).
Trajectories of random flags from random configurations, scales at float32's edges,
counters at int32's top; ``vmap`` per member; one launch an update. (``torch.compile``
through the op's fake kernel: ``tests/test_compile.py``, every optimiser compiled against
eager, scale, statistics and step included.)
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._fused import bookkeeping as bk
from functional_fp16._fused import device_kernels as dk
from functional_fp16._fused import triton_bookkeeping
from functional_fp16._kernels import cpu as c_kernel
from tests.helpers import run_cases_in_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_child = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter's process")
in_parent = pytest.mark.skipif(INTERPRETED, reason="the C++ kernel's cases run in the parent")
ROOT = Path(__file__).resolve().parents[1]

F32_MAX = (2.0 - 2.0**-23) * 2.0**127

configs = st.builds(
    dict,
    growth_factor=st.sampled_from([2.0, 3.0, 1.5, 1.0000001, 2.0**64]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.3, 0.999, 2.0**-60]),
    growth_interval=st.sampled_from([1, 2, 3, 7]),
    min_scale=st.sampled_from([1.0, 2.0**-10, 0.7, 2.0**-100]),
    max_scale=st.sampled_from([2.0**24, math.inf, 1e38, F32_MAX, 2.0**10, 3.0e38]),
    hysteresis=st.sampled_from([1, 2, 3]),
)
scales = st.sampled_from([1.0, 2.0**16, 2.0**24, 3.0e38, F32_MAX, 2.0**-100, 7.0, 1.0e-20])
int32s = st.sampled_from([0, 1, 5, 2**31 - 2, 2**31 - 1, -(2**31)])


def _loss_scale(config, scale):
    lo, hi = config["min_scale"], config["max_scale"]
    s = float(torch.tensor(min(max(scale, lo), hi if hi < math.inf else F32_MAX)))
    s = min(max(s, lo), hi)
    if not lo <= s <= hi or not math.isfinite(float(torch.tensor(s, dtype=torch.float32))):
        s = lo
    return ff.DynamicLossScale(init_scale=s, **config)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(_bits(a), _bits(b)), (a, b)


def _flat(out):
    """Every output of the op, in order: scale fields, stats, step, inverse, counters."""
    scale, stats, step, inv, counters = out
    return [*scale, *stats, step, inv, *counters]


def _run(kernel, config, scale, flags, stats, step, counters):
    """Each step's outputs from ``kernel`` and from the reference, compared bitwise."""
    ls = _loss_scale(config, scale)
    kind, conf = bk._config(ls)
    fields = [getattr(ls, n) for n in ls.TENSOR_FIELDS]
    st_ = [torch.tensor(v, dtype=torch.int32) for v in stats]
    step_t = torch.tensor(step, dtype=torch.int32)
    cs = [
        torch.tensor(c, dtype=torch.bool if isinstance(c, bool) else torch.int32) for c in counters
    ]
    for f in flags:
        finite = torch.tensor(f)
        got = kernel(finite, fields, st_, step_t, cs, conf, kind)
        want = bk.reference(finite, fields, st_, step_t, cs, conf, kind)
        for g, w in zip(_flat(got), _flat(want)):
            _equal(g, w)
        fields, st_, step_t, _, cs = [list(x) if isinstance(x, list) else x for x in want]
    return fields


counters_st = st.lists(st.one_of(int32s.filter(lambda c: c >= 0), st.booleans()), max_size=6)


@in_parent
@settings(max_examples=150, deadline=None)
@given(configs, scales, st.lists(st.booleans(), min_size=1, max_size=30),
       st.lists(int32s, min_size=4, max_size=4), int32s, counters_st)  # fmt: skip
def test_cpp_kernel_is_the_reference(config, scale, flags, stats, step, counters):
    if not c_kernel.ops_available():
        pytest.skip(c_kernel.ops_reason())
    cpp = lambda *a: c_kernel.run_op("bookkeeping", *a)  # noqa: E731
    _run(cpp, config, scale, flags, stats, step, counters)


@in_child
@settings(max_examples=25, deadline=None)
@given(configs, scales, st.lists(st.booleans(), min_size=1, max_size=10),
       st.lists(int32s, min_size=4, max_size=4), int32s, counters_st)  # fmt: skip
def test_triton_kernel_is_the_reference(config, scale, flags, stats, step, counters):
    assert triton_bookkeeping.available(torch.device("cpu"))
    _run(triton_bookkeeping.run, config, scale, flags, stats, step, counters)


def test_fixed_scales_and_the_edges_by_hand():
    """A growth that would overflow float32 keeps the scale (no bound) or stops at the
    bound; a backoff stops at min_scale; hysteresis keeps the scale until spent; counts
    saturate at int32's top and flags stay set."""
    kernel = (
        triton_bookkeeping.run if INTERPRETED else lambda *a: c_kernel.run_op("bookkeeping", *a)
    )
    if not INTERPRETED and not c_kernel.ops_available():
        pytest.skip(c_kernel.ops_reason())
    top = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=1, min_scale=1.0,
               max_scale=math.inf, hysteresis=2)  # fmt: skip
    fields = _run(kernel, top, 2.0**127, [True], [0] * 4, 0, [2**31 - 1, True, False])
    assert fields[0].item() == 2.0**127  # 2^128 overflows: kept
    bounded = dict(top, max_scale=3.0e38)
    fields = _run(kernel, bounded, 2.0**127, [True], [0] * 4, 0, [])
    assert fields[0].item() == float(torch.tensor(3.0e38))
    fields = _run(kernel, top, 2.0, [False, False, False], [0] * 4, 0, [])
    assert fields[0].item() == 1.0 and fields[2].item() == 0  # 2 -> 2 (kept) -> 1 -> 1


@in_parent
def test_vmap_steps_each_member_as_alone():
    if not c_kernel.ops_available():
        pytest.skip(c_kernel.ops_reason())
    config = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=2, min_scale=1.0,
                  max_scale=2.0**24, hysteresis=2)  # fmt: skip
    ls = _loss_scale(config, 8.0)
    kind, conf = bk._config(ls)
    k = 5
    finite = torch.tensor([True, False, True, False, True])
    fields = [torch.tensor([8.0, 8.0, 2.0**24, 1.0, 3.0]), torch.tensor([1, 0, 1, 0, 0], dtype=torch.int32),
              torch.tensor([2, 1, 2, 0, 2], dtype=torch.int32)]  # fmt: skip
    stats = [torch.arange(k, dtype=torch.int32) + i for i in range(4)]
    step = torch.arange(k, dtype=torch.int32)
    counters = [torch.tensor([0, 2**31 - 1, 3, 4, 5], dtype=torch.int32), finite.flip(0)]
    op = torch.ops.functional_fp16.bookkeeping.default
    got = torch.func.vmap(lambda *a: op(*a, conf, kind))(finite, fields, stats, step, counters)
    for i in range(k):
        one = bk.reference(finite[i], [f[i] for f in fields], [s[i] for s in stats], step[i],
                           [c[i] for c in counters], conf, kind)  # fmt: skip
        for g, w in zip(_flat(got), _flat(one)):
            _equal(g[i], w)


@in_child
def test_one_launch_an_update_on_cudas_default(monkeypatch):
    """CUDA's default forced on the CPU: the update's bookkeeping is one Triton launch."""
    monkeypatch.setenv(dk.CPU_KERNEL_VARIABLE, "cuda-default")
    params = {"w": torch.randn(8, 4).half(), "b": torch.zeros(4).half()}
    state = ff.fp16_init(params, ff.sgd(0.05, momentum=0.9))
    g = {"w": torch.randn(8, 4).half(), "b": torch.ones(4).half()}
    state = ff.fp16_update(state, g)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ff.fp16_update(state, g)
    names = [e.name for e in prof.events()]
    assert names.count(triton_bookkeeping.LAUNCH_LABEL) == 1, names


@pytest.mark.slow
def test_the_triton_cases_pass_in_the_interpreter():
    if INTERPRETED:
        pytest.skip("this is the interpreter's process")
    if triton_bookkeeping.triton is None:
        pytest.skip("triton is not installed")
    run_cases_in_interpreter(
        __file__, "test_the_triton_cases_pass_in_the_interpreter", 5, skips=True
    )


@pytest.mark.parametrize("make", [lambda: ff.StaticLossScale(8.0), ff.NoOpLossScale])
def test_a_fixed_scale_is_kept_and_counted(make):
    """Kind 1 (a static or no-op scale): the scale kept, the counters still advanced."""
    if INTERPRETED:
        kernel = triton_bookkeeping.run
    elif c_kernel.ops_available():
        kernel = lambda *a: c_kernel.run_op("bookkeeping", *a)  # noqa: E731
    else:
        pytest.skip(c_kernel.ops_reason())
    ls = make()
    kind, conf = bk._config(ls)
    assert kind == 1
    fields = [ls.loss_scale]
    stats = [torch.tensor(v, dtype=torch.int32) for v in (3, 4, 5, 6)]
    step = torch.tensor(9, dtype=torch.int32)
    for f in (True, False):
        finite = torch.tensor(f)
        counters = [torch.tensor(2**31 - 1, dtype=torch.int32), torch.tensor(False)]
        got = kernel(finite, fields, stats, step, counters, conf, kind)
        want = bk.reference(finite, fields, stats, step, counters, conf, kind)
        for g, w in zip(_flat(got), _flat(want)):
            _equal(g, w)
        assert torch.equal(got[0][0], ls.loss_scale)


@in_parent
def test_the_next_update_reads_the_inverse_the_op_made():
    """An update's state carries its scale's unscale factor (from the op, bitwise
    ``unscale_factor``); a scale written in place, or a rebuilt loss scale, computes it."""
    from functional_fp16.precision.loss_scale import unscale_factor, unscale_inverse

    params = {"w": torch.randn(8, 4).half()}
    state = ff.fp16_init(params, ff.sgd(0.05), ff.DynamicLossScale(init_scale=3.0))
    state = ff.fp16_update(state, {"w": torch.randn(8, 4).half()})
    known = state.loss_scale._inverse
    assert known[0] is state.loss_scale.loss_scale
    assert unscale_inverse(state.loss_scale) is known[2]
    _equal(known[2], unscale_factor(state.loss_scale.loss_scale))
    state.loss_scale.loss_scale.copy_(torch.tensor(7.0))  # written in place: not kept
    _equal(unscale_inverse(state.loss_scale), unscale_factor(torch.tensor(7.0)))
    rebuilt = state.loss_scale.replace(loss_scale=torch.tensor(5.0))
    assert not hasattr(rebuilt, "_inverse")
    _equal(unscale_inverse(rebuilt), unscale_factor(torch.tensor(5.0)))
