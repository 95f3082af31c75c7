"""The step-scalars op (``functional_fp16::step_scalars``, ``_fused/step_scalars.py``): the
decision from the leaves' peaks, the clip factors and every declared schedule in one
call, bitwise the library's definitions (``Decision.leaves``, ``clip_factors``, the
schedule called on its count) from every kernel: the C++ kernel here, the Triton kernel
in Triton's interpreter (a child process with ``TRITON_INTERPRET=1``, started by
:func:`test_the_triton_cases_pass_in_the_interpreter`). Schedules of every
kind with random parameters (the exponents whose powers ATen computes specially among
them), at counts from 0 to int32's top; ``vmap`` per member.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._fused import step_scalars as ss
from functional_fp16._fused import triton_step_scalars
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16.transforms.schedules import declared_form
from tests.helpers import run_cases_in_interpreter

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
in_parent = pytest.mark.skipif(INTERPRETED, reason="the C++ kernel's cases run in the parent")

values = st.sampled_from([0.0, 1e-3, 6e-4, 0.1, 1.0, 3.0, 1e-8, 123.456])
steps = st.sampled_from([1, 2, 7, 10, 1000, 100_000, 2**31 - 1])
begins = st.sampled_from([0, 1, 5, 1000])
powers = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, 1.5, 0.3, 7.0])
exponents = st.sampled_from([0.5, 1.0, 2.0, 3.0, 1.5, 0.25])
rates = st.sampled_from([0.5, 0.9, 0.99, 1.0, 1.1, 2.0])
ends = st.sampled_from([None, 0.0, 1e-4, 0.5, 10.0])


def _piecewise(v0, pairs):
    return ff.piecewise_constant_schedule(v0, dict(pairs))


simple = st.one_of(
    st.builds(ff.constant_schedule, values),
    st.builds(ff.linear_schedule, values, values, steps, begins),
    st.builds(ff.polynomial_schedule, values, values, powers, steps, begins),
    st.builds(ff.exponential_decay, values, steps, rates, begins, st.booleans(), ends),
    st.builds(
        _piecewise,
        values,
        st.lists(
            st.tuples(st.integers(0, 3000), st.sampled_from([0.5, 0.1, 2.0, 1.0])), max_size=4
        ),
    ),
    st.builds(ff.cosine_decay_schedule, values, steps, st.sampled_from([0.0, 0.1, 1.0]), exponents),
)


@st.composite
def schedules(draw):
    if draw(st.booleans()):
        return draw(simple)
    if draw(st.booleans()):
        peak = draw(values)
        end = draw(st.sampled_from([0.0, peak / 10, peak]))
        warm = draw(st.sampled_from([0, 1, 10, 2000]))
        return ff.warmup_cosine_decay_schedule(0.0, peak, warm, warm + draw(steps) % 10**6 + 1, end)
    parts = draw(st.lists(simple, min_size=2, max_size=3))
    cuts = sorted(
        draw(st.sets(st.integers(1, 5000), min_size=len(parts) - 1, max_size=len(parts) - 1))
    )
    return ff.join_schedules(parts, cuts)


counts = st.lists(
    st.one_of(
        st.integers(0, 12), st.integers(0, 5000), st.sampled_from([2**31 - 1, 2**31 - 2, 10**6])
    ),
    min_size=1,
    max_size=6,
)


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int32).tolist()


def _kernels():
    if INTERPRETED:
        return {"triton": lambda *a: triton_step_scalars.run(*a, reference=ss.reference)}
    out = {"reference": ss.reference}
    if c_kernel.ops_available():
        out["c++"] = lambda *a: c_kernel.run_op("step_scalars", *a)
    return out


def _check_schedules(run, scheds, cs):
    forms = [declared_form(s) for s in scheds]
    assert all(f is not None for f in forms)
    programs: list[float] = []
    signs = [(-1.0) ** i for i in range(len(scheds))]
    for sign, form in zip(signs, forms):
        programs += [sign, *ss.program(form)]
    count = torch.tensor(cs, dtype=torch.int32)
    out = run(None, None, None, None, 1.0, [count] * len(scheds), programs, len(cs))
    for sched, sign, got in zip(scheds, signs, out[5]):
        want = torch.stack([sched(torch.tensor(c, dtype=torch.int32)) for c in cs]) * sign
        assert _bits(got) == _bits(want), (declared_form(sched), cs, got, want)


@settings(max_examples=300, deadline=None)
@given(st.lists(schedules(), min_size=1, max_size=3), counts)
def test_every_kernel_evaluates_declared_schedules_bitwise(scheds, cs):
    for run in _kernels().values():
        _check_schedules(run, scheds, cs)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 2, 9, 2**24 - 1, 2**24, 2**24 + 1, 10**7 + 3, 2**31 - 1]),
             min_size=1, max_size=4),
    st.sampled_from([0.9, 0.95, 0.999, 0.5, 0.0]),
)  # fmt: skip
def test_every_kernel_makes_what_a_step_reads_of_its_count(cs, b):
    """Adam's float32 count after the step (``fl32(fl32(c) + 1)``, which rounds twice past
    2^24) and its bias corrections at the count after the step (saturating), by their
    definitions."""
    from functional_fp16.transforms.adam import bias_corrections
    from functional_fp16.transforms.base import saturating_increment

    count = torch.tensor(cs, dtype=torch.int32)
    forms = [("count",), ("inv_c1", b), ("sqrt_c2", b)]
    programs = [x for f in forms for x in (1.0, *ss.program(f))]
    for run in _kernels().values():
        out = run(None, None, None, None, 1.0, [count] * 3, programs, len(cs))[5]
        for k, c in enumerate(cs):
            t = torch.tensor(c, dtype=torch.int32)
            inv_c1, sqrt_c2 = bias_corrections(saturating_increment(t), b, b)
            want = [t.to(torch.float32) + 1.0, inv_c1, sqrt_c2]
            assert [_bits(o[k]) for o in out] == [_bits(w.reshape(())) for w in want], (c, b)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(2.0**-126, 2.0**127, width=32), min_size=1, max_size=4))
def test_every_kernel_makes_the_unscale_factor_of_a_scales_bits(scales):
    from functional_fp16.precision.loss_scale import unscale_factor

    s = torch.tensor(scales, dtype=torch.float32)
    for run in _kernels().values():
        out = run(None, None, None, None, 1.0, [s.view(torch.int32)], [1.0, 10.0], len(scales))
        assert _bits(out[5][0]) == _bits(unscale_factor(s))


peaks = st.sampled_from([0.0, 1.0, 6.5e4, 3.4e38, math.inf, math.nan, 1e-40, 2.0**127])
invs = st.sampled_from([1.0, 2.0**-16, 2.0**10, 2.0**100, 0.3])


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.data(),
    st.sampled_from([0.5, 1.0, 3.0, 1e30]),
)
def test_every_kernel_decides_and_clips_as_the_library_defines(members, leaves, data, max_norm):
    peak = torch.tensor(
        data.draw(st.lists(peaks, min_size=members * leaves, max_size=members * leaves))
    )
    inv = data.draw(st.one_of(st.none(), st.lists(invs, min_size=members, max_size=members)))
    inv = None if inv is None else torch.tensor(inv)
    require = data.draw(
        st.one_of(st.none(), st.lists(st.booleans(), min_size=members, max_size=members))
    )
    require = None if require is None else torch.tensor(require)
    sq = data.draw(st.lists(st.sampled_from([0.0, 0.25, 1.0, 9.0, 1e300, math.inf, 2.0]),
                            min_size=members, max_size=members))  # fmt: skip
    sum_sq = torch.tensor(sq, dtype=torch.float64)
    want_leaves = torch.isfinite(
        peak.reshape(members, -1) * (1.0 if inv is None else inv.reshape(-1, 1))
    )
    want_finite = want_leaves.all(dim=1) & (True if require is None else require)
    want_div, want_mul = [], []
    for s in sq:
        norm = ff.transforms.clipping.norm_of_sum_of_squares(torch.tensor(s, dtype=torch.float64))
        d, m = ff.transforms.clipping.clip_factors(norm, max_norm)
        want_div.append(d)
        want_mul.append(m)
    for run in _kernels().values():
        got = run(peak, inv, require, sum_sq, max_norm, [], [], members)
        assert got[0].tolist() == want_leaves.reshape(-1).tolist()
        assert got[1].tolist() == want_finite.tolist()
        assert _bits(got[2]) == _bits(torch.where(want_finite, 0.0, 1.0))  # found_inf
        assert _bits(got[3]) == _bits(torch.stack(want_div))
        assert _bits(got[4]) == _bits(torch.stack(want_mul))
        assert got[5] == []


@in_parent
def test_the_op_steps_vmapped_members_as_alone():
    sched = ff.warmup_cosine_decay_schedule(0.0, 1e-3, 3, 50, 1e-4)
    form = declared_form(sched)
    peak = torch.tensor([[1.0, 2.0], [math.inf, 0.0], [3.0, 4.0]])
    inv = torch.tensor([[0.5], [1.0], [2.0**-4]])
    sq = torch.tensor([[0.25], [100.0], [4.0]], dtype=torch.float64)
    count = torch.tensor([0, 3, 40], dtype=torch.int32)

    def one(p, i, s, c):
        return ss.step_scalars(p, i, None, s, 1.0, [(c, -1.0, form)])

    batched = torch.func.vmap(one)(peak, inv, sq, count)
    for k in range(3):
        alone = one(peak[k], inv[k], sq[k], count[k])
        for b, a in zip(batched[:4], alone[:4]):
            assert _bits(b[k].float()) == _bits(a.float())
        assert _bits(batched[4][0][k]) == _bits(alone[4][0])


def test_a_cosine_is_atens_where_the_c_library_differs_in_the_last_bit():
    """A cosine argument where ATen's float64 cosine and the C library's differ in the
    last bit, and the difference survives the rounding to float32 (found by search): the
    C++ kernel takes ATen's, as the schedule's ``torch.cos`` does."""
    sched = ff.cosine_decay_schedule(2.785132121004681, 468048)
    count = torch.tensor([276600], dtype=torch.int32)
    programs = [1.0, *ss.program(declared_form(sched))]
    want = sched(count[0])
    for name, run in _kernels().items():
        if name == "triton":  # NumPy's cosine in the interpreter (docs/fused_optimisers.md)
            continue
        got = run(None, None, None, None, 0.0, [count], programs, 1)[5][0]
        assert _bits(got) == _bits(want.reshape(1)), name


def test_a_schedule_the_library_did_not_make_declares_nothing():
    assert declared_form(lambda step: step.float()) is None
    base = ff.linear_schedule(1e-2, 0.0, 100)

    @functools.wraps(base)  # copies the function's attributes
    def scaled(step):
        return base(step) * 10

    assert declared_form(base) is not None and declared_form(scaled) is None
    params = {"w": torch.ones(4, dtype=torch.float16)}
    grads = {"w": torch.ones(4, dtype=torch.float16)}
    for impl in ("fused", "reference"):  # the wrapper's rate, not the wrapped one's
        state = ff.fp16_init(params, ff.sgd(scaled), ff.StaticLossScale(1.0))
        new = ff.fp16_update(state, grads, impl=impl)
        assert torch.equal(new.master["w"], torch.full((4,), 0.9)), (impl, new.master["w"])
    nested = ff.join_schedules(
        [ff.constant_schedule(1.0), ff.join_schedules([ff.constant_schedule(2.0)] * 2, [3])], [5]
    )
    assert declared_form(nested) is None  # a join of joins is evaluated by its own ops
    assert declared_form(ff.linear_schedule(0.0, 1.0, 2**60)) is None  # past float64's integers


@in_parent
def test_the_cpp_kernel_refuses_what_it_cannot_read():
    if not c_kernel.ops_available():
        pytest.skip("no C++ ops here")
    count = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="programs"):
        c_kernel.run_op("step_scalars", None, None, None, None, 1.0, [count], [1.0, 1.0, 0.0], 1)
    with pytest.raises(RuntimeError, match="programs"):
        c_kernel.run_op(
            "step_scalars", None, None, None, None, 1.0, [count], [1.0, 0.0, 1.0, 9.0], 1
        )
    with pytest.raises(RuntimeError, match="counts"):
        c_kernel.run_op(
            "step_scalars", None, None, None, None, 1.0, [count.long()], [1.0, 0.0, 1.0], 1
        )
    with pytest.raises(RuntimeError, match="peak"):
        c_kernel.run_op("step_scalars", torch.ones(3), None, None, None, 1.0, [], [], 2)


@in_parent
@pytest.mark.slow
def test_the_triton_cases_pass_in_the_interpreter():
    run_cases_in_interpreter(
        __file__, "test_the_triton_cases_pass_in_the_interpreter", 3, skips=True
    )


def test_a_derived_value_is_made_once_per_unwritten_tensor():
    """``plain_kernels.derived``: the groups of one update share the skip flag and the
    descending rate; a tensor written since, or another tensor, gets its own."""
    from functional_fp16._fused import plain_kernels as pk

    made = []

    def neg(x):
        made.append(1)
        return -x

    lr = torch.tensor([0.5])
    assert pk.derived("t", lr, neg).item() == -0.5
    assert pk.derived("t", lr, neg).item() == -0.5 and len(made) == 1
    lr.add_(1.0)  # written: its version moves
    assert pk.derived("t", lr, neg).item() == -1.5 and len(made) == 2
    assert pk.derived("t", lr.clone(), neg).item() == -1.5 and len(made) == 3
    torch.func.vmap(lambda x: pk.derived("t", x, neg))(torch.ones(2, 1))  # not kept there
    assert pk.derived("t", lr, neg).item() == -1.5 and len(made) == 4


def test_a_derived_value_of_a_tensor_subclass_is_not_kept():
    """A DTensor holds its mesh (and process group): the cache keeps plain tensors only."""
    from functional_fp16._fused import plain_kernels as pk

    class Sub(torch.Tensor):
        pass

    x = torch.tensor([0.5]).as_subclass(Sub)
    pk.derived("t", x, lambda t: -t)
    assert not any(entry[0] is x for entry in pk._DERIVED.values())
