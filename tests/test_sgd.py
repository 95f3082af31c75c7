"""sgd and its parts: trace (momentum), scale_by_learning_rate, add_decayed_weights.

Fixed inputs in optax's style (initial params, per-step updates, ``STEPS``,
``LR``); every transform is checked for structure, shape and dtype
preservation as well as for its values, against ``torch.optim.SGD`` and
against the documented formulas computed by hand in float64.
"""

import math

import optree
import pytest
import torch

import functional_fp16 as ff
from tests._bad_inputs import Hyper, fuzz_hyperparameters, is_real
from tests.helpers import assert_transform_step_preserves, random_tree, scaled_error

STEPS = 12
LR = 0.05


def leaves(tree):
    return optree.tree_leaves(tree, namespace=ff.NAMESPACE)


def grads_sequence(params, steps=STEPS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        optree.tree_map(lambda p: torch.randn(p.shape, generator=g), params) for _ in range(steps)
    ]


def run_tx(tx, params, grads_seq):
    state = tx.init(params)
    for grads in grads_seq:
        updates, state = tx.update(grads, state, params)
        params = ff.apply_updates(params, updates)
    return params, state


# -- against torch.optim.SGD -------------------------------------------------------------------

SGD_CONFIGS = [
    dict(momentum=0.0),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, dampening=0.1),
    dict(momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.5, nesterov=True, weight_decay=1e-3),
]


@pytest.mark.parametrize(
    "cfg", SGD_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_sgd_matches_torch_optim_sgd(cfg):
    params = random_tree(0)
    grads_seq = grads_sequence(params)
    ours, state = run_tx(ff.sgd(LR, **cfg), params, grads_seq)

    flat = [p.clone().requires_grad_(True) for p in leaves(params)]
    opt = torch.optim.SGD(flat, lr=LR, foreach=False, **cfg)
    for grads in grads_seq:
        for p, g in zip(flat, leaves(grads)):
            p.grad = g.clone()
        opt.step()
    worst = max(scaled_error(a, b.detach()) for a, b in zip(leaves(ours), flat))
    # PyTorch fuses `p - lr * b` into one rounding (add with alpha, an FMA on
    # vector CPUs); the optax composition rounds `-lr * b` first, so the
    # trajectories differ by float32 rounding: a few eps at the tensor's scale.
    assert worst <= 4, f"max deviation {worst} eps"
    if cfg["momentum"]:
        trace_state = next(s for s in state if isinstance(s, ff.TraceState))
        for buf, p in zip(leaves(trace_state.trace), flat):
            theirs = opt.state[p]["momentum_buffer"]
            assert scaled_error(buf, theirs) <= 4


def test_momentum_bitwise_equal_to_torch_without_dampening():
    """With dampening 0 the buffer recursion uses PyTorch's exact operations."""
    params = random_tree(3)
    grads_seq = grads_sequence(params, seed=4)
    tx = ff.trace(0.9, nesterov=True)
    state = tx.init(params)
    bufs = [None] * len(leaves(params))
    for grads in grads_seq:
        out, state = tx.update(grads, state)
        expected = []
        for i, g in enumerate(leaves(grads)):
            bufs[i] = g.clone() if bufs[i] is None else bufs[i].mul_(0.9).add_(g)
            expected.append(g.add(bufs[i], alpha=0.9))
        for a, b in zip(leaves(out), expected):
            assert torch.equal(a, b)


# -- values against the formulas, on the fixed inputs ------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.5, 0.875])
def test_sgd_with_constant_updates_follows_the_closed_form(init_params, per_step_updates, momentum):
    r"""With a constant gradient g the buffer is :math:`b_t = g (1 - \mu^t) / (1 - \mu)`.

    So after ``STEPS`` steps :math:`p = p_0 - \eta \sum_{t=1}^{T} b_t`, computed
    here in float64 from the formula; a float64 run must agree to rounding.
    (The momenta are exact in float32: trace holds its coefficients as float32
    scalars, whatever the dtype of the updates.)
    """
    params = tuple(p.double() for p in init_params)
    updates = tuple(u.double() for u in per_step_updates)
    tx = ff.sgd(LR, momentum)
    state = tx.init(params)
    for _ in range(STEPS):
        step, state = tx.update(updates, state, params)
        params = ff.apply_updates(params, step)
    if momentum:
        total = sum((1 - momentum**t) / (1 - momentum) for t in range(1, STEPS + 1))
    else:
        total = STEPS
    for p, p0, u in zip(params, init_params, per_step_updates):
        assert p.dtype == torch.float64
        expected = p0.double() - LR * total * u.double()
        torch.testing.assert_close(p, expected, rtol=1e-12, atol=1e-12)


def test_trace_first_step_is_the_gradient_itself_even_with_dampening():
    params = random_tree(0)
    grads = grads_sequence(params, steps=1)[0]
    tx = ff.trace(0.9, dampening=0.3)
    state = tx.init(params)
    assert not bool(state.initialized)
    out, state = tx.update(grads, state)
    assert bool(state.initialized)
    for o, b, g in zip(leaves(out), leaves(state.trace), leaves(grads)):
        assert torch.equal(o, g) and torch.equal(b, g)
    out2, state2 = tx.update(grads, state)
    for o, g in zip(leaves(out2), leaves(grads)):
        torch.testing.assert_close(o, 0.9 * g + 0.7 * g, rtol=1e-6, atol=1e-7)


def test_nesterov_outputs_the_gradient_plus_momentum_times_the_new_buffer(per_step_updates):
    tx = ff.trace(0.5, nesterov=True)
    state = tx.init(per_step_updates)
    _, state = tx.update(per_step_updates, state)  # b_1 = g
    out, state = tx.update(per_step_updates, state)  # b_2 = 0.5 g + g, out = g + 0.5 b_2
    for o, b, g in zip(out, state.trace, per_step_updates):
        assert torch.equal(b, 1.5 * g)
        assert torch.equal(o, g + 0.5 * (1.5 * g))


def test_zero_momentum_passes_updates_through_and_keeps_its_zero_buffers(per_step_updates):
    tx = ff.trace(0.0)
    state = tx.init(per_step_updates)
    out, new_state = tx.update(per_step_updates, state)
    assert all(torch.equal(o, u) for o, u in zip(out, per_step_updates))
    assert all(torch.equal(b, torch.zeros_like(u)) for b, u in zip(new_state.trace, out))


def test_scale_by_learning_rate_signs(per_step_updates):
    down, _ = ff.scale_by_learning_rate(LR).update(per_step_updates, ff.EmptyState())
    up, _ = ff.scale_by_learning_rate(LR, flip_sign=False).update(per_step_updates, ff.EmptyState())
    for d, u, g in zip(down, up, per_step_updates):
        assert torch.equal(d, g * -LR)
        assert torch.equal(u, g * LR)


def test_schedule_counts_applied_updates_only():
    lr = ff.linear_schedule(1.0, 0.0, transition_steps=4)
    tx = ff.sgd(lr)
    params = {"w": torch.zeros(())}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({"w": torch.ones(())}, state)
    assert int(state[-1].count) == 3
    updates, _ = tx.update({"w": torch.ones(())}, state)
    assert float(updates["w"]) == -0.25


def test_schedule_step_count_saturates_at_the_int32_maximum():
    top = torch.iinfo(torch.int32).max
    tx = ff.scale_by_learning_rate(ff.constant_schedule(0.5))
    state = ff.ScaleByScheduleState(count=torch.tensor(top, dtype=torch.int32))
    _, state = tx.update({"w": torch.ones(2)}, state)
    assert state.count.dtype == torch.int32
    assert int(state.count) == top


def test_add_decayed_weights_adds_the_weights_times_the_decay(init_params, per_step_updates):
    tx = ff.add_decayed_weights(0.25)
    out, _ = tx.update(per_step_updates, tx.init(init_params), init_params)
    for o, u, p in zip(out, per_step_updates, init_params):
        assert torch.equal(o, u + 0.25 * p)  # exact: 0.25 * p and the sums are representable


def test_zero_weight_decay_keeps_negative_zeros():
    """No ``u + 0 * p``, which would turn -0.0 into +0.0."""
    tx = ff.add_decayed_weights(0.0)
    updates = {"w": torch.tensor([-0.0, 1.0])}
    out, _ = tx.update(updates, tx.init(updates), {"w": torch.ones(2)})
    assert math.copysign(1.0, float(out["w"][0])) == -1.0


def test_add_decayed_weights_needs_params():
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    tx = ff.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))


# -- structure, shape and dtype ----------------------------------------------------------------

TRANSFORMS = {
    "sgd": lambda: ff.sgd(0.1),
    "sgd-momentum": lambda: ff.sgd(0.1, momentum=0.9),
    "sgd-nesterov-wd": lambda: ff.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
    "sgd-schedule": lambda: ff.sgd(ff.cosine_decay_schedule(0.1, 10)),
    "trace-dampening": lambda: ff.trace(0.9, dampening=0.1),
    "scale_by_learning_rate": lambda: ff.scale_by_learning_rate(0.1),
    "add_decayed_weights": lambda: ff.add_decayed_weights(0.1),
}
MOMENTUM = {"sgd-momentum", "sgd-nesterov-wd", "trace-dampening"}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transforms_preserve_structure_shape_dtype_and_inputs(name):
    params = random_tree(0)
    grads = grads_sequence(params, steps=1)[0]
    assert_transform_step_preserves(TRANSFORMS[name](), params, grads)


def _dtype_cases():
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        for name in sorted(TRANSFORMS):
            yield pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("name, dtype", list(_dtype_cases()))
def test_transforms_keep_the_dtype_of_every_leaf_zero_dimensional_included(name, dtype):
    params = random_tree(0, dtype=dtype)  # holds a 0-d leaf
    grads = optree.tree_map(lambda p: torch.full_like(p, 0.5), params)
    tx = TRANSFORMS[name]()
    assert_transform_step_preserves(tx, params, grads)
    state = tx.init(params)
    for _ in range(2):  # the second step is the first that reads a momentum buffer
        grads, state = tx.update(grads, state, params)
    assert [g.dtype for g in leaves(grads)] == [p.dtype for p in leaves(params)]


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: ff.sgd(-0.1), "learning_rate"),
        (lambda: ff.sgd(math.nan), "learning_rate"),
        (lambda: ff.sgd(math.inf), "learning_rate"),
        (lambda: ff.sgd("0.1"), "learning_rate"),
        (lambda: ff.sgd(0.1, momentum=-0.9), "momentum"),
        (lambda: ff.sgd(0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: ff.sgd(0.1, nesterov=True), "nesterov momentum requires momentum > 0"),
        (lambda: ff.sgd(0.1, momentum=0.9, nesterov=True, dampening=0.1), "nesterov"),
        (lambda: ff.trace(0.9, dampening=1.5), "dampening"),
    ],
)
def test_bad_hyperparameters_are_named(factory, match):
    with pytest.raises((ValueError, TypeError), match=match):
        factory()


HYPER = {
    "sgd.learning_rate": Hyper(
        lambda v: ff.sgd(v), lambda v: is_real(v) and 0.0 <= v < math.inf, "learning_rate"
    ),
    "sgd.momentum": Hyper(
        lambda v: ff.sgd(0.1, momentum=v), lambda v: is_real(v) and 0.0 <= v < math.inf, "momentum"
    ),
    "sgd.dampening": Hyper(
        lambda v: ff.sgd(0.1, momentum=0.9, dampening=v),
        lambda v: is_real(v) and 0.0 <= v <= 1.0,
        "dampening",
    ),
    "sgd.weight_decay": Hyper(
        lambda v: ff.sgd(0.1, weight_decay=v),
        lambda v: is_real(v) and 0.0 <= v < math.inf,
        "weight_decay",
    ),
    # trace's argument is called decay; its errors say momentum, as sgd's do.
    "trace.decay": Hyper(
        lambda v: ff.trace(v), lambda v: is_real(v) and 0.0 <= v < math.inf, "momentum"
    ),
}


def test_fuzz_hyperparameters():
    """Random values (NaN, inf, negative, wrong type) for every argument: accepted or named."""
    seen = fuzz_hyperparameters(HYPER, "sgd")
    assert seen["rejected"] >= 100 and seen["accepted"] >= 40  # both branches, many times
