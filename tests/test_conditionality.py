"""apply_if_finite: skip non-finite updates, give up after max_consecutive_errors.

Fixed inputs in optax's style (initial params, per-step updates, ``LR``);
optax itself is compared in ``test_references.py``.
"""

import math

import optree
import pytest
import torch

import functional_fp16 as ff
from tests._bad_inputs import Hyper, fuzz_hyperparameters, is_int
from tests.helpers import assert_transform_step_preserves, random_tree

LR = 0.1


def poisoned(updates, value=math.nan):
    first, *rest = updates
    return (torch.cat([first[:1], torch.tensor([value])]), *rest)


def leaves(tree):
    return optree.tree_leaves(tree, namespace=ff.NAMESPACE)


def test_apply_if_finite_counts_and_gives_up_like_optax():
    params = {"w": torch.zeros(3)}
    tx = ff.apply_if_finite(ff.sgd(1.0, momentum=0.5), max_consecutive_errors=2)
    state = tx.init(params)
    bad = {"w": torch.tensor([1.0, math.nan, 0.0])}
    good = {"w": torch.ones(3)}
    applied = []
    for g in [good, bad, bad, bad, good, bad]:
        updates, state = tx.update(g, state, params)
        applied.append(bool(torch.any(updates["w"] != 0)))
    # Rejects two consecutive bad updates, gives up on the third.
    assert applied == [True, False, False, True, True, False]
    assert int(state.total_notfinite) == 4
    assert int(state.notfinite_count) == 1
    assert not bool(state.last_finite)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_rejected_update_is_zeros_and_leaves_the_inner_state_bitwise_alone(
    init_params, per_step_updates, value
):
    tx = ff.apply_if_finite(ff.sgd(LR, momentum=0.9), max_consecutive_errors=3)
    state = tx.init(init_params)
    _, state = tx.update(per_step_updates, state, init_params)  # a momentum buffer to keep
    inner = [x.clone() for x in leaves(state.inner_state)]
    out, new = tx.update(poisoned(per_step_updates, value), state, init_params)
    for o in out:
        assert torch.equal(o, torch.zeros_like(o))
        assert math.copysign(1.0, float(o.min())) == 1.0  # +0.0, not -0.0 or NaN
    for a, b in zip(leaves(new.inner_state), inner, strict=True):
        assert torch.equal(a, b)
    assert (int(new.notfinite_count), int(new.total_notfinite), bool(new.last_finite)) == (
        1,
        1,
        False,
    )


def test_a_finite_update_is_the_inner_update_and_resets_the_consecutive_count(
    init_params, per_step_updates
):
    tx = ff.apply_if_finite(ff.sgd(LR), max_consecutive_errors=3)
    state = tx.init(init_params)
    _, state = tx.update(poisoned(per_step_updates), state, init_params)
    out, state = tx.update(per_step_updates, state, init_params)
    for o, u in zip(out, per_step_updates):
        assert torch.equal(o, u * -LR)
    assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1
    assert bool(state.last_finite)


def test_zero_max_consecutive_errors_applies_every_update(init_params, per_step_updates):
    """n = 1 > 0 already: nothing is ever rejected, but the counters still count."""
    tx = ff.apply_if_finite(ff.identity(), max_consecutive_errors=0)
    state = tx.init(init_params)
    bad = poisoned(per_step_updates)
    out, state = tx.update(bad, state)
    assert math.isnan(float(out[0][1])) and torch.equal(out[1], bad[1])
    assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 1


def test_counters_saturate_at_the_int32_maximum(init_params, per_step_updates):
    top = torch.iinfo(torch.int32).max
    tx = ff.apply_if_finite(ff.identity(), max_consecutive_errors=5)
    state = tx.init(init_params)._replace(
        notfinite_count=torch.tensor(top, dtype=torch.int32),
        total_notfinite=torch.tensor(top, dtype=torch.int32),
    )
    _, state = tx.update(poisoned(per_step_updates), state)
    assert int(state.notfinite_count) == top and int(state.total_notfinite) == top


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_apply_if_finite_preserves_structure_shape_dtype_and_inputs(dtype):
    params = random_tree(0, dtype=dtype)
    grads = random_tree(1, dtype=dtype)
    tx = ff.apply_if_finite(ff.sgd(LR), 2)
    out, _ = assert_transform_step_preserves(tx, params, grads)
    for o, g in zip(leaves(out), leaves(grads)):
        assert torch.equal(o, g * -LR)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, error, match",
    [
        (lambda: ff.apply_if_finite(ff.sgd(0.1), -1), ValueError, "max_consecutive_errors"),
        (lambda: ff.apply_if_finite(ff.sgd(0.1), True), TypeError, "max_consecutive_errors"),
        (lambda: ff.apply_if_finite(ff.sgd(0.1), 2.0), TypeError, "max_consecutive_errors"),
        (lambda: ff.apply_if_finite("sgd", 3), TypeError, "inner must be a GradientTransformation"),
    ],
)
def test_bad_arguments_are_named(factory, error, match):
    with pytest.raises(error, match=match):
        factory()


HYPER = {
    "apply_if_finite.max_consecutive_errors": Hyper(
        lambda v: ff.apply_if_finite(ff.sgd(0.1), v),
        lambda v: is_int(v) and v >= 0,
        "max_consecutive_errors",
    ),
}


def test_fuzz_hyperparameters():
    """Random values (NaN, inf, negative, wrong type): accepted or named."""
    seen = fuzz_hyperparameters(HYPER, "apply_if_finite")
    assert seen["rejected"] >= 100 and seen["accepted"] >= 40  # both branches, many times
