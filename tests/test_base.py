"""The transform interface: GradientTransformation, identity, chain, apply_updates.

Fixed inputs in optax's style (initial params, per-step updates, ``STEPS``, ``LR``).
"""

import math

import optree
import pytest
import torch

import functional_fp16 as ff
from functional_fp16.transforms.base import ChainSpec
from tests.helpers import assert_transform_step_preserves, random_tree

STEPS = 12
LR = 0.05


def leaves(tree):
    return optree.tree_leaves(tree, namespace=ff.NAMESPACE)


def scale(factor: float) -> ff.GradientTransformation:
    """A user-written transform (no spec): multiplies the updates by ``factor``."""
    return ff.GradientTransformation(
        lambda params: ff.EmptyState(),
        lambda updates, state, params=None: (
            optree.tree_map(lambda u: u * factor, updates),
            state,
        ),
    )


# -- identity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_identity_returns_the_updates_unchanged(dtype):
    params = random_tree(0, dtype=dtype)
    grads = random_tree(1, dtype=dtype)
    out, state = assert_transform_step_preserves(ff.identity(), params, grads)
    assert state == ff.EmptyState()
    for o, g in zip(leaves(out), leaves(grads)):
        assert torch.equal(o, g)


# -- chain -------------------------------------------------------------------------------------


def test_chain_applies_its_transforms_left_to_right(per_step_updates):
    """Clipping then scaling by 10 gives norm 10; scaling then clipping gives norm 1."""
    norm = math.sqrt(sum(float(x) ** 2 for u in per_step_updates for x in u))
    clip_first = ff.chain(ff.clip_by_global_norm(1.0), scale(10.0))
    scale_first = ff.chain(scale(10.0), ff.clip_by_global_norm(1.0))
    first_clip, _ = clip_first.update(per_step_updates, clip_first.init(per_step_updates))
    first_scale, _ = scale_first.update(per_step_updates, scale_first.init(per_step_updates))
    for a, b, u in zip(first_clip, first_scale, per_step_updates):
        torch.testing.assert_close(a, 10.0 * u / norm, rtol=1e-6, atol=0.0)
        torch.testing.assert_close(b, u / norm, rtol=1e-6, atol=0.0)


def test_chain_state_is_the_tuple_of_the_inner_states_in_order(init_params, per_step_updates):
    tx = ff.chain(ff.trace(0.9), ff.scale_by_learning_rate(ff.constant_schedule(LR)))
    state = tx.init(init_params)
    assert isinstance(state, tuple) and len(state) == 2
    assert isinstance(state[0], ff.TraceState) and isinstance(state[1], ff.ScaleByScheduleState)
    params = init_params
    for _ in range(STEPS):
        updates, state = tx.update(per_step_updates, state, params)
        params = ff.apply_updates(params, updates)
    assert bool(state[0].initialized) and int(state[1].count) == STEPS
    for b, u in zip(state[0].trace, per_step_updates):  # b_T = u (1 - 0.9^T) / (1 - 0.9)
        torch.testing.assert_close(b, u * (1 - 0.9**STEPS) / (1 - 0.9), rtol=1e-5, atol=0.0)


def test_chain_of_nothing_is_the_identity(per_step_updates):
    tx = ff.chain()
    assert tx.init(per_step_updates) == ()
    out, state = tx.update(per_step_updates, ())
    assert state == ()
    for o, u in zip(out, per_step_updates):
        assert torch.equal(o, u)


def test_chain_preserves_structure_shape_dtype_and_inputs():
    params = random_tree(0)
    grads = random_tree(1)
    tx = ff.chain(ff.clip_by_global_norm(1.0), ff.trace(0.9), ff.scale_by_learning_rate(0.1))
    assert_transform_step_preserves(tx, params, grads)


def test_chain_declares_the_specs_of_its_parts():
    assert scale(2.0).spec is None  # user-written transforms declare nothing
    tx = ff.chain(ff.clip_by_global_norm(1.0), scale(2.0))
    assert tx.spec == ChainSpec((ff.clip_by_global_norm(1.0).spec, None))
    assert ff.identity().spec == ChainSpec(())


@pytest.mark.parametrize("state", [(), (ff.EmptyState(),) * 3, [ff.EmptyState()] * 2, None])
def test_chain_rejects_a_state_that_is_not_one_per_transform(state, per_step_updates):
    tx = ff.chain(ff.identity(), ff.identity())
    with pytest.raises(ValueError, match="chain state must be a tuple of 2 inner states"):
        tx.update(per_step_updates, state)


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: ff.chain(ff.sgd(0.1), "sgd"), "chain argument 1"),
        (
            lambda: ff.chain(ff.sgd(0.1), "clip"),
            "chain argument 1 must be a GradientTransformation",
        ),
        (lambda: ff.chain((lambda p: p, lambda u, s, p: (u, s))), "chain argument 0"),
    ],
)
def test_chain_rejects_what_is_not_a_transform(factory, match):
    with pytest.raises(TypeError, match=match):
        factory()


# -- apply_updates -----------------------------------------------------------------------------


def test_apply_updates_adds_leaf_by_leaf_and_leaves_its_inputs_alone(init_params, per_step_updates):
    keep = [x.clone() for x in leaves((init_params, per_step_updates))]
    out = ff.apply_updates(init_params, per_step_updates)
    assert [o.tolist() for o in out] == [[501.0, 7.0], [303.0, 7.0]]
    for a, b in zip(leaves((init_params, per_step_updates)), keep):
        assert torch.equal(a, b)


def test_apply_updates_rounds_once_in_the_params_dtype():
    # 1 + (2**-11 + 2**-22) (exact in float32) rounds up to the next FP16
    # number: the sum is above half an FP16 ulp of 1.0. Rounding the update to
    # FP16 first gives 2**-11, a tie, and the sum would round to even: 1.0.
    # optax adds, then casts once.
    p = {"w": torch.tensor([1.0], dtype=torch.float16)}
    u = {"w": torch.tensor([2.0**-11 + 2.0**-22], dtype=torch.float32)}
    out = ff.apply_updates(p, u)
    assert out["w"].dtype == torch.float16
    assert out["w"].item() == 1.0 + 2.0**-10


@pytest.mark.parametrize(
    "p_dtype, u_dtype",
    [
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
        (torch.float64, torch.float32),
    ],
)
def test_apply_updates_keeps_the_params_dtype(p_dtype, u_dtype):
    params = random_tree(0, dtype=p_dtype)
    updates = random_tree(1, dtype=u_dtype, scale=LR)
    out = ff.apply_updates(params, updates)
    promoted = torch.promote_types(p_dtype, u_dtype)
    for o, p, u in zip(leaves(out), leaves(params), leaves(updates)):
        assert o.dtype == p_dtype and o.shape == p.shape
        # The sum in the promoted dtype, then one rounding to the params' dtype.
        assert torch.equal(o, (p.to(promoted) + u.to(promoted)).to(p_dtype))


def test_apply_updates_keeps_none_entries():
    out = ff.apply_updates(
        {"w": torch.ones(2), "frozen": None}, {"w": torch.ones(2), "frozen": None}
    )
    assert out["frozen"] is None and torch.equal(out["w"], torch.full((2,), 2.0))


def test_apply_updates_names_a_structure_mismatch():
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match="different tree structure"):
        ff.apply_updates(params, {"a": torch.zeros(2)})
