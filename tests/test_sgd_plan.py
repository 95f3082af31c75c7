"""sgd_plan: which chains the fused kernel takes, read from the transforms' declared specs."""

import optree
import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused.sgd import sgd_plan
from functional_fp16.transforms.base import replace_at, state_at


def test_sgd_declares_its_hyperparameters():
    plan = sgd_plan(ff.sgd(0.25, momentum=0.5, nesterov=True, weight_decay=0.125))
    assert plan is not None
    assert (plan.weight_decay, plan.momentum, plan.nesterov, plan.dampening) == (
        0.125,
        0.5,
        True,
        0.0,
    )
    assert (plan.learning_rate, plan.sign, plan.max_norm) == (0.25, -1.0, None)
    assert (plan.trace_path, plan.lr_path) == ((1,), (2,))
    plain = sgd_plan(ff.sgd(0.1))
    assert plain.weight_decay == 0.0 and plain.momentum == 0.0 and plain.trace_path is None
    sched = ff.constant_schedule(0.1)
    assert sgd_plan(ff.sgd(sched, momentum=0.9)).learning_rate is sched


def test_the_readme_chains_are_fusable():
    clipped = sgd_plan(ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.1, momentum=0.9)))
    assert clipped.max_norm == 1.0 and clipped.trace_path == (1, 1) and clipped.lr_path == (1, 2)
    decayed = sgd_plan(ff.chain(ff.add_decayed_weights(1e-4), ff.sgd(0.1, momentum=0.9)))
    assert decayed.weight_decay == 1e-4 and decayed.trace_path == (1, 1)
    warm = ff.warmup_cosine_decay_schedule(0.0, 0.1, 10, 100)
    assert sgd_plan(ff.chain(ff.clip_by_global_norm(2.0), ff.sgd(warm, momentum=0.9))) is not None
    by_hand = sgd_plan(ff.chain(ff.trace(0.9), ff.scale_by_learning_rate(0.1, flip_sign=False)))
    assert by_hand.sign == 1.0 and by_hand.trace_path == (0,)


def _undeclared():
    inner = ff.sgd(0.1)
    return ff.GradientTransformation(inner.init, lambda u, s, p=None: (u, s))


@pytest.mark.parametrize(
    "tx",
    [
        ff.identity(),
        ff.chain(ff.scale_by_learning_rate(0.1), ff.trace(0.9)),  # wrong order
        ff.chain(ff.trace(0.9), ff.add_decayed_weights(0.1), ff.scale_by_learning_rate(0.1)),
        ff.chain(ff.add_decayed_weights(0.1), ff.sgd(0.1, weight_decay=0.1)),  # twice
        ff.chain(ff.sgd(0.1), ff.clip_by_global_norm(1.0)),  # clip after the step
        ff.chain(ff.trace(0.9)),  # no learning rate
        ff.apply_if_finite(ff.sgd(0.1), 1),  # undeclared wrapper
        _undeclared(),  # same init, another update, no spec
    ],
    ids=[
        "identity",
        "order",
        "decay_after_trace",
        "decay_twice",
        "clip_last",
        "no_lr",
        "apply_if_finite",
        "undeclared",
    ],
)
def test_other_chains_run_as_written(tx):
    assert sgd_plan(tx) is None
    state = ff.fp16_init({"w": torch.ones(3)}, tx)
    assert ff.update_path(state) == "foreach"


def test_zero_coefficients_pass_through_and_keep_one_layout():
    # momentum and weight decay of 0 keep their state, so checkpoints load across settings
    a = ff.fp16_init({"w": torch.ones(3)}, ff.sgd(0.1))
    b = ff.fp16_init({"w": torch.ones(3)}, ff.sgd(0.1, momentum=0.9, weight_decay=1e-3))
    spec = lambda t: optree.tree_structure(t, namespace=ff.NAMESPACE)  # noqa: E731
    assert spec(a.opt_state) == spec(b.opt_state)
    # ... and pass their input through bitwise (no "+ 0 * p": -0.0 stays -0.0)
    g = {"w": torch.tensor([-0.0, 1.0, -2.0])}
    for part in (ff.add_decayed_weights(0.0), ff.trace(0.0)):
        state = part.init(a.master)
        out, new = part.update(g, state, a.master)
        assert out["w"] is g["w"] and torch.signbit(out["w"][0])
        assert new is state  # the unused momentum is untouched


def test_state_paths_read_and_replace_nested_states():
    state = ((1, (2, 3)), 4)
    assert state_at(state, (0, 1, 0)) == 2
    assert replace_at(state, (0, 1, 0), 9) == ((1, (9, 3)), 4)
    assert replace_at(state, (), 7) == 7
