"""zero_nans: NaNs become zeros, per-leaf flags in optax's layout.

Fixed inputs in optax's style at the top. Everything here is exact: the
transform selects between an element and zero, so every comparison is bitwise
(against optax too, whose ``jnp.where`` selects the same way).
"""

from __future__ import annotations

import math

import numpy as np
import optree
import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import (
    assert_bitwise_unchanged,
    assert_states_bitwise_equal,
    assert_transform_step_preserves,
    bit_snapshot,
    bits,
    random_tree,
)

NAN = math.nan
STEPS = 12


def init_params():
    return {"a": torch.zeros(3), "b": (torch.zeros(2, 2), torch.zeros(()))}


def per_step_updates():
    """Step 0 has NaNs in ``a`` and the 0-d leaf, step 1 none, step 2 only an inf."""
    return [
        {
            "a": torch.tensor([1.0, NAN, -0.0]),
            "b": (torch.tensor([[2.0, 3.0], [4.0, 5.0]]), torch.tensor(NAN)),
        },
        {"a": torch.tensor([1.0, 2.0, 3.0]), "b": (torch.ones(2, 2), torch.tensor(-1.0))},
        {"a": torch.tensor([math.inf, 0.0, -math.inf]), "b": (torch.ones(2, 2), torch.tensor(0.0))},
    ]


def flags(state):
    return [bool(x) for x in tree_leaves(state.found_nan)]


def test_nans_become_zeros_and_the_flags_say_where():
    tx = ff.zero_nans()
    state = tx.init(init_params())
    assert isinstance(state, ff.ZeroNansState) and flags(state) == [False, False, False]
    seen = []
    for u in per_step_updates():
        out, state = tx.update(u, state)
        seen.append(flags(state))
        for got, given in zip(tree_leaves(out), tree_leaves(u)):
            want = torch.where(torch.isnan(given), torch.zeros_like(given), given)
            assert torch.equal(bits(got), bits(want))  # -0.0 and infinities kept bitwise
            assert not bool(torch.isnan(got).any())
    # The flags describe the last call only: set at step 0, cleared at step 1, an inf is no NaN.
    assert seen == [[True, False, True], [False, False, False], [False, False, False]]


def test_state_layout_is_optaxs_one_0d_bool_per_leaf_on_its_device():
    params = {
        "x": torch.zeros(3),
        "y": [torch.zeros(2, dtype=torch.float16)],
        "m": torch.zeros(2, device="meta"),
    }
    state = ff.zero_nans().init(params)
    ns = ff.NAMESPACE
    assert optree.tree_structure(state.found_nan, namespace=ns) == optree.tree_structure(
        params, namespace=ns
    )
    for flag, p in zip(tree_leaves(state.found_nan), tree_leaves(params)):
        assert flag.shape == () and flag.dtype == torch.bool and flag.device == p.device


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_structure_shape_and_dtype_are_preserved(dtype):
    params = random_tree(0, dtype=dtype)
    out, state = assert_transform_step_preserves(
        ff.zero_nans(), params, random_tree(1, dtype=dtype)
    )
    assert flags(state) == [False] * len(tree_leaves(params))
    # With a NaN (which the helper's torch.equal cannot compare): inputs kept bitwise.
    updates = random_tree(1, dtype=dtype)
    tree_leaves(updates)[4].view(-1)[2] = NAN
    given = bit_snapshot(updates)
    tx = ff.zero_nans()
    out, state = tx.update(updates, tx.init(params))
    assert_bitwise_unchanged(updates, given)
    assert [i for i, f in enumerate(flags(state)) if f] == [4]
    assert float(tree_leaves(out)[4].view(-1)[2]) == 0.0
    assert [x.dtype for x in tree_leaves(out)] == [dtype] * len(tree_leaves(params))


def test_matches_optax():
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(0)
    params = init_params()
    ours_tx, their_tx = ff.zero_nans(), optax.zero_nans()
    ours = ours_tx.init(params)
    theirs = their_tx.init(tree_map(lambda x: jnp.asarray(x.numpy()), params))
    assert len(ours) == len(theirs) == 1 and ours._fields == theirs._fields == ("found_nan",)
    for _ in range(STEPS):
        u = tree_map(
            lambda p: torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)), params
        )
        for x in tree_leaves(u):
            x.view(-1)[torch.from_numpy(rng.random(x.numel()) < 0.3)] = NAN
        out, ours = ours_tx.update(u, ours)
        jout, theirs = their_tx.update(tree_map(lambda x: jnp.asarray(x.numpy()), u), theirs)
        for a, b in zip(tree_leaves(out), optree.tree_leaves(jout)):
            assert np.array_equal(a.numpy().view(np.uint32), np.asarray(b).view(np.uint32))
        assert flags(ours) == [bool(x) for x in optree.tree_leaves(theirs.found_nan)]


def test_zeroed_updates_can_then_be_applied_by_apply_if_finite():
    """zero_nans first: apply_if_finite sees finite updates and applies them."""
    params = init_params()
    tx = ff.chain(ff.zero_nans(), ff.apply_if_finite(ff.sgd(0.5, momentum=0.9), 0))
    state = tx.init(params)
    u, state = tx.update(per_step_updates()[0], state, params)
    assert bool(state[1].last_finite) and int(state[1].total_notfinite) == 0
    assert float(u["a"][1]) == 0.0 and float(u["a"][0]) == -0.5
    # The other way round, apply_if_finite sees the NaN and skips the whole step.
    other = ff.apply_if_finite(ff.chain(ff.zero_nans(), ff.sgd(0.5)), 1)
    s = other.init(params)
    before = bit_snapshot(s.inner_state)
    u, s = other.update(per_step_updates()[0], s, params)
    assert not bool(s.last_finite)
    assert_bitwise_unchanged(s.inner_state, before)
    assert all(float(x.abs().sum()) == 0.0 for x in tree_leaves(u))


def test_masked_and_multi_transform_zero_only_their_leaves():
    u = per_step_updates()[0]
    mask = {"a": True, "b": False}
    tx = ff.masked(ff.zero_nans(), mask)
    out, state = tx.update(u, tx.init(init_params()))
    assert float(out["a"][1]) == 0.0 and math.isnan(float(out["b"][1]))
    assert bool(state.inner_state.found_nan["a"]) and isinstance(
        state.inner_state.found_nan["b"], ff.MaskedNode
    )
    labels = {"a": "zero", "b": "keep"}
    multi = ff.multi_transform({"zero": ff.zero_nans(), "keep": ff.identity()}, labels)
    out2, _ = multi.update(u, multi.init(init_params()))
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(tree_leaves(out2), tree_leaves(out)))


def test_inside_fp16_update_every_implementation_agrees_and_a_skipped_step_changes_nothing(impl):
    """fp16_update skips a NaN step before the transform runs: the flags stay as they were."""
    params = random_tree(3)
    tx = ff.chain(ff.zero_nans(), ff.sgd(0.1, momentum=0.9))
    state = ff.fp16_init(params, tx, ff.DynamicLossScale(2.0**10, growth_interval=3))
    ref = state
    g = torch.Generator().manual_seed(4)
    for step in range(6):
        grads = tree_map(lambda p: (torch.randn(p.shape, generator=g) * 100).half(), state.params)
        if step == 3:
            tree_leaves(grads)[1].view(-1)[0] = NAN
        before = bit_snapshot((state.master, state.opt_state))
        state = ff.fp16_update(state, grads, impl=impl)
        ref = ff.fp16_update(ref, grads, impl="reference")
        assert_states_bitwise_equal(state, ref)
        if step == 3:
            assert not bool(state.grads_finite)
            assert_bitwise_unchanged((state.master, state.opt_state), before)
    assert flags(state.opt_state[0]) == [False] * len(tree_leaves(params))


def test_updates_of_another_structure_are_refused_naming_the_state():
    tx = ff.zero_nans()
    state = tx.init({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="found_nan has a different tree structure"):
        tx.update({"a": torch.zeros(2), "b": torch.zeros(1)}, state)
