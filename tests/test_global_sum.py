"""``global_sum``: how a sum over one shard of the tree becomes the whole tree's, passed explicitly.

A state that holds one shard of the parameters (``distributed.sharded_update``)
must clip by the norm of the whole tree. The hook travels as a declared
argument: ``fp16_update(..., global_sum=h)`` hands it to ``tx.update`` as the
keyword ``global_sum``; the combinators pass it on; ``clip_by_global_norm``
maps its float64 sum of squares :math:`s` to :math:`h(s)` before the root.
With :math:`h(s) = 4s` the norm is exactly twice the local one (scaling by a
power of two is exact in float64), so the expected clipped updates are
computed from ``clip_factors(2 * norm)`` and compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import functional_fp16 as ff
from functional_fp16.transforms.base import update_with_extra_args
from functional_fp16.transforms.clipping import clip_factors
from tests.helpers import bits

MAX_NORM = 0.5


def _updates():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _clipped_by(norm: torch.Tensor, updates):
    div, fac = clip_factors(norm, MAX_NORM)
    return {k: (u / div) * fac for k, u in updates.items()}


class _Spy:
    """``h(s) = 4 s``, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        assert s.dtype == torch.float64 and s.ndim == 0
        return s * 4


def _plain_scale_by_half():
    """A user transform with the three-argument ``update`` of optax's interface."""
    seen = []

    def update(updates, state, params=None):
        seen.append(True)
        return {k: u * 0.5 for k, u in updates.items()}, state

    return ff.GradientTransformation(lambda p: ff.EmptyState(), update), seen


def _wrapped(kind: str):
    clip = ff.clip_by_global_norm(MAX_NORM)
    if kind == "clip":
        return clip
    if kind == "chain":
        return ff.chain(ff.identity(), clip)
    if kind == "masked":
        return ff.masked(clip, {"w": True, "b": True})
    if kind == "multi_transform":
        return ff.multi_transform({"all": clip}, {"w": "all", "b": "all"})
    if kind == "apply_if_finite":
        return ff.apply_if_finite(clip, max_consecutive_errors=2)
    if kind == "MultiSteps":
        return ff.MultiSteps(clip, every_k_schedule=1)
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["clip", "chain", "masked", "multi_transform", "apply_if_finite", "MultiSteps"]
)
def test_global_sum_reaches_the_clip_through_every_combinator(kind):
    tx, u = _wrapped(kind), _updates()
    spy = _Spy()
    out, _ = update_with_extra_args(tx, u, tx.init(u), u, global_sum=spy)
    want = _clipped_by(2 * ff.global_norm(u), u)
    assert spy.calls == 1
    for k in u:
        assert torch.equal(bits(out[k]), bits(want[k])), k
    # Without the hook the norm is the local one: the result differs.
    local, _ = tx.update(u, tx.init(u), u)
    assert not torch.equal(local["w"], out["w"])


def test_a_transform_without_the_keyword_is_called_without_it():
    half, seen = _plain_scale_by_half()
    tx, u = ff.chain(half, ff.clip_by_global_norm(MAX_NORM)), _updates()
    spy = _Spy()
    out, _ = update_with_extra_args(tx, u, tx.init(u), None, global_sum=spy)
    halved = {k: x * 0.5 for k, x in u.items()}
    want = _clipped_by(2 * ff.global_norm(halved), halved)
    assert seen == [True] and spy.calls == 1
    assert all(torch.equal(bits(out[k]), bits(want[k])) for k in u)


def test_global_norm_of_an_empty_shard_still_takes_part_in_the_sum():
    spy = _Spy()
    assert float(ff.global_norm({}, global_sum=lambda s: spy(s) + 9.0)) == 3.0
    assert spy.calls == 1


def test_fp16_update_passes_global_sum_to_the_clip(impl):  # impl: every implementation
    params = {k: v.half() for k, v in _updates().items()}
    tx = ff.chain(ff.clip_by_global_norm(MAX_NORM), ff.sgd(0.1, momentum=0.9))
    state = ff.fp16_init(params, tx, ff.StaticLossScale(1.0))
    grads = {k: (v * 3).half() for k, v in _updates().items()}
    spy = _Spy()
    hooked = ff.fp16_update(state, grads, impl=impl, global_sum=spy)
    local = ff.fp16_update(state, grads, impl=impl)
    reference = ff.fp16_update(state, grads, impl="reference", global_sum=_Spy())
    assert spy.calls == 1
    assert not torch.equal(hooked.master["w"], local.master["w"])
    for k in params:  # one step: within one ulp of the reference (FMA contraction)
        diff = (bits(hooked.master[k]).long() - bits(reference.master[k]).long()).abs()
        assert int(diff.max()) <= 1, k


def test_global_sum_must_be_callable_and_nothing_moves():
    params = {"w": torch.ones(3, dtype=torch.float16)}
    state = ff.fp16_init(params, ff.sgd(0.1))
    before = bits(state.master["w"]).clone()
    with pytest.raises(TypeError, match="global_sum must be a callable or None, got int"):
        ff.fp16_update(state, {"w": torch.ones(3, dtype=torch.float16)}, global_sum=3)
    assert torch.equal(bits(state.master["w"]), before)
