"""The list operations of ``_util/multi_tensor.py``: multi-tensor outside ``vmap``, the same bits
inside it, and ``MultiSteps`` on them in a number of launches that does not grow with the leaves."""

from __future__ import annotations

import math

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused import op_library
from functional_fp16._util import multi_tensor as mt
from tests.helpers import bits, computing_ops

SPECIAL = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, -1e-7, 3.5]


def _lists():
    g = torch.Generator().manual_seed(0)
    xs = [
        torch.tensor(SPECIAL, dtype=torch.float32),
        (torch.randn(7, 3, generator=g) * 1e3).half(),
        torch.randn(5, generator=g).bfloat16(),
        torch.empty(0, dtype=torch.float16),
        torch.tensor(SPECIAL, dtype=torch.float16),
    ]
    return xs


def _per_tensor_peaks(xs):
    out = []
    for x in xs:
        if x.numel() == 0:
            out.append(torch.tensor(0.0))
        elif torch.isnan(x).any():
            out.append(torch.tensor(math.nan))
        else:
            out.append(x.float().abs().max())
    return torch.stack(out)


def test_peaks_are_the_largest_magnitudes_nan_where_a_tensor_holds_one():
    xs = _lists()
    got, want = mt.peaks(xs), _per_tensor_peaks(xs)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("flag", [True, False])
def test_zero_where_keeps_every_bit_or_zeroes_every_bit(flag):
    xs = [x for x in _lists() if x.numel()]
    out = mt.zero_where(torch.tensor(flag), xs)
    for x, o in zip(xs, out):
        assert o.dtype == x.dtype and o.shape == x.shape and o is not x
        want = torch.zeros_like(x) if flag else x
        assert torch.equal(bits(o), bits(want))  # -0.0, inf and NaN bits kept; +0 all zero


def test_unscaled_is_fl32_times_the_inverse_bit_for_bit():
    xs = [x for x in _lists()]
    inv = torch.tensor(2.0**-10)
    for x, u in zip(xs, mt.unscaled(xs, inv)):
        assert u.dtype == torch.float32
        assert torch.equal(bits(u), bits(x.float() * inv))


def test_under_vmap_the_same_bits_tensor_by_tensor():
    """``torch._foreach_*`` has no batching rule: inside ``vmap`` the per-tensor form runs."""
    a = (torch.randn(3, 4, 5) * 100).half()
    a[1, 2, 3] = math.inf
    flags = torch.tensor([True, False, True])

    def member(x, flag):
        xs = [x, x * 2]
        peak = mt.peaks(xs)
        zeroed = mt.zero_where(flag, [x.float()])[0]
        return peak, zeroed, mt.unscaled(xs, torch.tensor(0.5))[1]

    batched = torch.vmap(member)(a, flags)
    for k in range(3):
        one = member(a[k], flags[k])
        for b, o in zip(batched, one):
            assert torch.equal(bits(b[k]), bits(o))


def test_multisteps_launches_do_not_grow_with_the_leaves(monkeypatch):
    """``MultiSteps``' accumulation (unscale, flags, the sum, the reset) is multi-tensor."""
    monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
    counts = []
    for n in (4, 16):
        params = {f"w{i:02d}": torch.full((3, 5), 0.1, dtype=torch.float16) for i in range(n)}
        state = ff.fp16_init(params, ff.MultiSteps(ff.sgd(0.05, momentum=0.9), 2))
        grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
        state = ff.fp16_update(ff.fp16_update(state, grads), grads)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            ff.fp16_update(state, grads)
        counts.append(len(computing_ops(prof)))
    assert counts[0] == counts[1], counts
