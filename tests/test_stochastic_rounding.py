"""Stochastic rounding (``functional_fp16.precision.stochastic_rounding``) and what it is
for: stored moments that follow their averages.

The rounding is pinned by its definition: the result is one of the value's two
neighbours on the format's grid (the value itself where it lies on the grid), and
its mean over many salts is the value (a bound of five standard deviations of the
mean). The hash by an independent Python computation. The transforms by the cases
where rounding to nearest stops a moving average (``b2 = 0.999``): the update after
thousands of steps within 5 % of FP32 moments', and Lion's reversal within 10 %.
"""

from __future__ import annotations

import bisect
import functools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16.precision import stochastic_rounding as sr

FORMATS = {  # dtype: (mantissa bits, smallest normal exponent)
    torch.bfloat16: (7, -126),
    torch.float16: (10, -14),
    torch.float8_e4m3fn: (3, -6),
}


def _py_mix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x7FEB352D) % 2**32
    h ^= h >> 15
    h = (h * 0x846CA68B) % 2**32
    return h ^ (h >> 16)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_the_tensor_hash_is_the_integer_hash(values):
    got = sr.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_py_mix(v) for v in values]
    assert [sr.mix32(v) for v in values] == got


@functools.cache
def _grid(dtype) -> list[float]:
    """Every finite value of ``dtype`` (8 or 16 bits), sorted: enumerated from its codes."""
    n = 256 if dtype == torch.float8_e4m3fn else 65536
    codes = torch.arange(n, dtype=torch.int32).to(torch.uint8 if n == 256 else torch.int16)
    values = codes.view(dtype).double()
    return sorted(set(values[values.isfinite()].tolist()))


def _neighbours(x: float, dtype) -> tuple[float, float]:
    """The largest value of ``dtype`` at most ``x`` and the smallest above it."""
    grid = _grid(dtype)
    i = bisect.bisect_right(grid, x) - 1
    return grid[i], grid[i + 1]


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(sorted(FORMATS, key=str)),
    x=st.floats(-400.0, 400.0, allow_nan=False, width=32),
    count=st.integers(0, 2**31 - 1),
    leaf=st.integers(0, 1000),
)
def test_a_value_rounds_to_one_of_its_neighbours(dtype, x, count, leaf):
    bits, emin = FORMATS[dtype]
    t = torch.tensor([x], dtype=torch.float32)
    r = sr.random_bits(t, sr.salt(torch.tensor(count, dtype=torch.int32), 0, leaf))
    assert 0 <= int(r) < 2**32
    out = sr.round_stochastic(t, bits, emin, r)
    assert torch.equal(out.to(dtype).float(), out)  # on the grid: the conversion is exact
    if float(t.to(dtype).float()) == float(t):
        assert float(out) == float(t)  # on the grid: itself
    else:
        assert float(out) in _neighbours(float(t), dtype)


@pytest.mark.parametrize("dtype", sorted(FORMATS, key=str))
@pytest.mark.parametrize("square", [False, True])
def test_the_rounding_is_unbiased(dtype, square):
    """Values spread over several binades (subnormals of the format included), each rounded
    with 4096 salts: the mean of the result (of its square, with ``square``) is the value's
    within five standard deviations of a mean of 4096 draws (a draw is off by at most one
    spacing, so its deviation is at most half the spacing's width)."""
    bits, emin = FORMATS[dtype]
    g = torch.Generator().manual_seed(0)
    top = 300.0 if dtype == torch.float8_e4m3fn else 3e4
    floor_exp = emin - bits if dtype != torch.bfloat16 else -100
    x = torch.exp2(torch.empty(64).uniform_(floor_exp, math.log2(top), generator=g))
    n = 4096
    counts = torch.arange(n, dtype=torch.int32)
    salts = torch.stack([sr.salt(c, 1, 7) for c in counts])
    xs = x.expand(n, -1)
    out = sr.round_stochastic(xs, bits, emin, sr.random_bits(xs, salts[:, None]), square=square)
    got = (out.double().square() if square else out.double()).mean(0)
    want = x.double().square() if square else x.double()
    exponent = torch.clamp(torch.frexp(x)[1] - 1, min=emin)
    spacing = torch.ldexp(torch.ones_like(x), exponent - bits).double()
    width = spacing * (2 * x.double() + spacing) if square else spacing
    assert bool(((got - want).abs() <= 5 * width / 2 / math.sqrt(n)).all())


def test_non_finite_values_and_zero_pass_through():
    t = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    for r in (0, 2**32 - 1):
        out = sr.round_stochastic(t, 3, -6, torch.full(t.shape, r, dtype=torch.int64))
        assert torch.equal(out[:4], t[:4]) and bool(out[4].isnan())
        assert torch.equal(out[:2].signbit(), t[:2].signbit())


@settings(max_examples=300, deadline=None)
@given(
    dtype=st.sampled_from(sorted(FORMATS, key=str)),
    x=st.floats(-400.0, 400.0, allow_nan=False, allow_subnormal=True, width=32),
    r=st.integers(0, 2**32 - 1),
)
def test_the_rule_is_the_exact_fraction_and_symmetric(dtype, x, r):
    """Away from zero exactly where u = floor(r / 2^8) / 2^24 is under (|x| - l) / (h - l),
    taken in exact rationals (the integer and float forms of the definition agree with it);
    -x rounds to the negation of x's result with the same bits."""
    bits, emin = FORMATS[dtype]
    t = torch.tensor([x, -x], dtype=torch.float32)
    out = sr.round_stochastic(t, bits, emin, torch.tensor([r, r], dtype=torch.int64))
    assert torch.equal(out[1].view(torch.int32), (-out[0]).view(torch.int32))
    mag = abs(float(t[0]))
    lo, hi = _neighbours(mag, dtype)
    if lo == mag:
        assert float(out[0].abs()) == mag
        return
    away = Fraction(r >> 8, 2**24) < (Fraction(mag) - Fraction(lo)) / (Fraction(hi) - Fraction(lo))
    assert float(out[0].abs()) == (hi if away else lo)


# -- the transforms: a stored moment follows its average -----------------------------------

ROWS, ROW = 8, 256
SPREAD = 1.0 + 2.0**-10 * torch.linspace(0.0, 1.0, ROWS * ROW).reshape(ROWS, ROW)


def _gradient(value: float) -> torch.Tensor:
    g = value * SPREAD  # every element its own bits
    g[:, 0] = 4.0  # each row's (block's) largest moment
    return g


def _last_update(tx, schedule) -> torch.Tensor:
    params = torch.zeros(ROWS, ROW)
    state = tx.init(params)
    for steps, value in schedule:
        g = _gradient(value)
        for _ in range(steps):
            u, state = tx.update(g, state, params)
    return u[:, 1:]


@pytest.mark.parametrize(
    ("kind", "schedule"),
    [
        ("bf16", [(3000, 1.0)]),  # rounded to nearest: 1.92x
        ("int8", [(1000, 1.0), (2800, 0.3)]),  # rounded to nearest: 0.72x
    ],
)
def test_adam_moments_rounded_stochastically_follow_their_averages(kind, schedule):
    stored = {"bf16": torch.bfloat16, "int8": "int8"}[kind]
    fp32 = float(_last_update(ff.adam(1e-3), schedule).abs().mean())
    tx = ff.adam(1e-3, mu_dtype=stored, nu_dtype=stored, moment_rounding="stochastic")
    ours = float(_last_update(tx, schedule).abs().mean())
    assert abs(ours / fp32 - 1.0) <= 0.05, (ours, fp32)


def _reversal(tx) -> float:
    params = torch.zeros(ROWS, ROW)
    state = tx.init(params)
    first = torch.full((ROWS, ROW - 1), -1)
    for step in range(1000 + 300):
        g = _gradient(1.0 if step < 1000 else -1.0)
        u, state = tx.update(g, state, params)
        if step >= 1000:
            flipped = (u[:, 1:] > 0) & (first < 0)
            first[flipped] = step - 999
    assert bool((first > 0).all()), "some element never reversed"
    return float(first.float().mean())


def test_lion_int8_momentum_rounded_stochastically_reverses_with_its_average():
    """Rounded to nearest, an element's momentum never left +1 and its update never turned."""
    fp32 = _reversal(ff.lion(1e-3, b2=0.99))
    ours = _reversal(ff.lion(1e-3, b2=0.99, mu_dtype="int8", moment_rounding="stochastic"))
    assert abs(ours / fp32 - 1.0) <= 0.10, (ours, fp32)


def test_rounding_is_checked_and_declared():
    with pytest.raises(ValueError, match="moment_rounding must be 'nearest' or 'stochastic'"):
        ff.adam(1e-3, mu_dtype="int8", moment_rounding="up")
    tx = ff.adamw(1e-3, mu_dtype="e4m3", nu_dtype="e4m3", moment_rounding="nearest")
    assert tx.spec.parts[0].mu_format.rounding == "nearest"
    # stochastic by default; "int8" is the former name of the same format
    assert ff.adam(1e-3, mu_dtype="int8").spec.parts[0].mu_format.rounding == "stochastic"
    assert ff.adam(1e-3, mu_dtype="int8").spec == ff.adam(1e-3, mu_dtype="e4m3").spec
    assert ff.lion(1e-4, mu_dtype=torch.bfloat16).spec.parts[0].mu_format.rounding == "stochastic"


def test_salt_table_is_salt_for_every_stream_and_leaf():
    """The batched salts (the CUDA default's) equal the per-leaf ones, for counts that
    wrap past 2^32 and leaf indices of any size."""
    leaves = [0, 1, 7, 148, 2**31 + 5]
    for t in (0, 1, 12345, 2**31 - 1):
        count = torch.tensor(t, dtype=torch.int32)
        table = sr.salt_table(count, leaves)
        assert table.shape == (2, len(leaves)) and table.dtype == torch.int64
        for stream in (0, 1):
            for i, leaf in enumerate(leaves):
                assert int(table[stream, i]) == int(sr.salt(count, stream, leaf)), (t, stream, leaf)
