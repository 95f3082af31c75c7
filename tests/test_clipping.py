"""clip, clip_by_global_norm and global_norm.

Fixed inputs in optax's style (initial params, per-step updates, ``STEPS``);
the rule is optax's: ``u`` unchanged when ``||u|| < c``, else ``(u / ||u||) * c``.
"""

import math

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map
from tests._bad_inputs import Hyper, fuzz_hyperparameters, is_real
from tests.helpers import (
    assert_states_bitwise_equal,
    assert_transform_step_preserves,
    bits,
    random_tree,
)

STEPS = 50


def clip(max_norm, updates):
    return ff.clip_by_global_norm(max_norm).update(updates, ff.EmptyState())[0]


def test_clip_by_global_norm_values():
    tree = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}  # norm 5
    tx = ff.clip_by_global_norm(1.0)
    out, _ = tx.update(tree, tx.init(tree))
    assert torch.allclose(ff.global_norm(out), torch.tensor(1.0))
    assert torch.allclose(out["a"], torch.tensor([0.6, 0.0]))
    tx = ff.clip_by_global_norm(10.0)
    out, _ = tx.update(tree, tx.init(tree))
    assert torch.equal(out["a"], tree["a"]) and torch.equal(out["b"], tree["b"])


def test_clipped_norm_is_the_max_norm_and_clipping_again_changes_nothing(per_step_updates):
    """optax's test: for c = 1/i the clipped norm is c, and clipping a clipped tree is stable."""
    updates = per_step_updates
    for i in range(1, STEPS + 1):
        updates = clip(1.0 / i, updates)
        assert float(ff.global_norm(updates)) == pytest.approx(1.0 / i, rel=1e-6)
        fresh = clip(1.0 / i, per_step_updates)
        for a, b in zip(updates, fresh):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0.0)


# Non-zero and non-power-of-two values, for which (u / ||u||) * ||u|| rounds
# away from u in at least one element: the two branches give different bits.
AT_THE_MAX = {"a": torch.tensor([0.2, 1.0, -3.0]), "b": torch.tensor([[0.7]])}


def test_a_norm_exactly_at_the_max_is_clipped_as_optax_does():
    """``||u|| < c`` passes ``u`` through; at ``||u|| == c`` it is ``(u / ||u||) * c``."""
    norm = ff.global_norm(AT_THE_MAX)
    by_hand = {k: (u / norm) * norm for k, u in AT_THE_MAX.items()}
    assert any(not torch.equal(by_hand[k], u) for k, u in AT_THE_MAX.items())  # the fixture works
    out = clip(float(norm), AT_THE_MAX)
    for k in AT_THE_MAX:
        assert torch.equal(out[k], by_hand[k])


def test_a_norm_one_ulp_below_the_max_is_left_bitwise_unchanged():
    norm = ff.global_norm(AT_THE_MAX)
    above = float(torch.nextafter(norm, torch.tensor(math.inf)))
    out = clip(above, AT_THE_MAX)
    for k, u in AT_THE_MAX.items():
        assert torch.equal(out[k], u)


def test_global_norm_is_computed_in_float32():
    # 300**2 overflows FP16 (max 65504); the norm must not.
    tree = [torch.full((4,), 300.0, dtype=torch.float16)]
    n = ff.global_norm(tree)
    assert n.dtype == torch.float32 and float(n) == 600.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_global_norm_is_a_float32_scalar_of_every_leaf(dtype, per_step_updates):
    tree = {"x": [u.to(dtype) for u in per_step_updates], "s": torch.tensor(4.0, dtype=dtype)}
    n = ff.global_norm(tree)
    assert n.shape == () and n.dtype == torch.float32
    by_hand = math.sqrt(sum(float(x) ** 2 for u in per_step_updates for x in u) + 16.0)
    assert float(n) == pytest.approx(by_hand, rel=1e-7)


def test_empty_trees_have_norm_zero_and_pass_through():
    assert float(ff.global_norm({})) == 0.0
    assert clip(1.0, {}) == {}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clipped", "unclipped"])
def test_clip_preserves_structure_shape_dtype_and_inputs(dtype, max_norm):
    params = random_tree(0, dtype=dtype)
    grads = random_tree(1, dtype=dtype)
    out, _ = assert_transform_step_preserves(ff.clip_by_global_norm(max_norm), params, grads)
    norm = float(ff.global_norm(out))
    if max_norm < float(ff.global_norm(grads)):
        # Each element rounded once to the leaf dtype: within a few of its ulps.
        assert norm == pytest.approx(max_norm, rel=4 * torch.finfo(dtype).eps)
    else:
        assert norm == float(ff.global_norm(grads))


# -- clip (element-wise) -----------------------------------------------------------------------


def clip_elements(max_delta, updates):
    tx = ff.clip(max_delta)
    return tx.update(updates, tx.init(updates))[0]


def test_clip_values_at_and_around_the_bounds(per_step_updates):
    out = clip_elements(4.0, per_step_updates)
    assert torch.equal(out[0], torch.tensor([4.0, 4.0])) and torch.equal(
        out[1], torch.tensor([4.0, 3.0])
    )
    x = torch.tensor([-5.0, -2.0, -2.0 - 2**-22, 2.0, 2.0 + 2**-22, 0.5, -0.0, math.inf, -math.inf])
    got = clip_elements(2.0, {"x": x})["x"]
    want = torch.tensor([-2.0, -2.0, -2.0, 2.0, 2.0, 0.5, -0.0, 2.0, -2.0])
    assert torch.equal(bits(got), bits(want))  # inside the interval bitwise, -0.0 included


def test_clip_keeps_nan_and_zero_clips_to_signed_zeros():
    x = torch.tensor([math.nan, 3.0, -3.0, 0.0])
    got = clip_elements(1.0, [x])[0]
    assert math.isnan(float(got[0])) and got[1:].tolist() == [1.0, -1.0, 0.0]
    zeros = clip_elements(0.0, [x[1:]])[0]
    assert torch.equal(bits(zeros), bits(torch.tensor([0.0, -0.0, 0.0])))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_elementwise_clip_preserves_structure_shape_dtype_and_inputs(dtype):
    params = random_tree(0, dtype=dtype)
    grads = random_tree(1, dtype=dtype, scale=3.0)
    out, state = assert_transform_step_preserves(ff.clip(0.75), params, grads)
    assert state == ff.EmptyState()
    bound = float(torch.tensor(0.75, dtype=dtype))  # the bound as the leaf's dtype holds it
    for u, g in zip(tree_leaves(out), tree_leaves(grads)):
        assert float(u.abs().max()) <= bound
        inside = g.abs() <= bound
        assert torch.equal(u[inside], g[inside]) and bool((u[~inside].abs() == bound).all())
    assert any(bool((g.abs() > bound).any()) for g in tree_leaves(grads))  # the fixture clips


def test_clip_in_fp16_update_agrees_across_implementations(impl):
    params = random_tree(2)
    tx = ff.chain(ff.clip(0.01), ff.sgd(0.5, momentum=0.9))
    state = ff.fp16_init(params, tx, ff.StaticLossScale(1024.0))
    ref = state
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        grads = tree_map(lambda p: (torch.randn(p.shape, generator=g) * 100).half(), state.params)
        state = ff.fp16_update(state, grads, impl=impl)
        ref = ff.fp16_update(ref, grads, impl="reference")
    assert_states_bitwise_equal(state, ref)
    # Every clipped gradient is +-0.01 (unscaled, |g| ~ 0.1): each step moves by at most 0.5 * 0.01 / (1 - 0.9).
    moved = [
        float((a - b).abs().max()) for a, b in zip(tree_leaves(state.master), tree_leaves(params))
    ]
    assert max(moved) <= 4 * 0.5 * 0.01 * 10 and max(moved) > 0.0


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_delta", [-1.0, -1e-30, math.nan, math.inf, "1", None, True])
def test_bad_max_delta_is_named(max_delta):
    with pytest.raises((ValueError, TypeError), match="max_delta"):
        ff.clip(max_delta)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.nan, math.inf, "1"])
def test_bad_max_norm_is_named(max_norm):
    with pytest.raises((ValueError, TypeError), match="max_norm"):
        ff.clip_by_global_norm(max_norm)


HYPER = {
    "clip_by_global_norm.max_norm": Hyper(
        lambda v: ff.clip_by_global_norm(v), lambda v: is_real(v) and 0.0 < v < math.inf, "max_norm"
    ),
    "clip.max_delta": Hyper(
        lambda v: ff.clip(v), lambda v: is_real(v) and 0.0 <= v < math.inf, "max_delta"
    ),
}


def test_fuzz_hyperparameters():
    """Random values (NaN, inf, negative, wrong type): accepted or named."""
    seen = fuzz_hyperparameters(HYPER, "clipping")
    assert seen["rejected"] >= 100 and seen["accepted"] >= 40  # both branches, many times
