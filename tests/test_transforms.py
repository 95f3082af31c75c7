"""The optax-style transforms: values, shapes, dtypes, purity and bad input."""

import math

import optree
import pytest
import torch

import functional_fp16 as ff
from tests.helpers import random_tree, scaled_error

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


@pytest.mark.parametrize(
    "tx",
    [
        ff.sgd(0.1, momentum=0.9),
        ff.sgd(ff.cosine_decay_schedule(0.1, 10)),
        ff.clip_by_global_norm(1.0),
        ff.add_decayed_weights(0.1),
        ff.apply_if_finite(ff.sgd(0.1, momentum=0.9), 2),
        ff.chain(ff.clip_by_global_norm(1.0), ff.trace(0.9), ff.scale_by_learning_rate(0.1)),
        ff.identity(),
    ],
    ids=["sgd", "sgd-schedule", "clip", "decay", "apply_if_finite", "chain", "identity"],
)
def test_transforms_preserve_structure_shape_dtype_and_inputs(tx):
    params = random_tree(0)
    grads = grads_sequence(params, steps=1)[0]
    snapshot = [x.clone() for x in leaves((params, grads))]
    state = tx.init(params)
    state_snapshot = [x.clone() for x in leaves(state)]
    updates, new_state = tx.update(grads, state, params)
    assert optree.tree_structure(updates) == optree.tree_structure(grads)
    for u, g in zip(leaves(updates), leaves(grads)):
        assert u.shape == g.shape and u.dtype == g.dtype
    assert optree.tree_structure(new_state) == optree.tree_structure(state)
    for a, b in zip(leaves((params, grads)), snapshot):
        assert torch.equal(a, b)
    for a, b in zip(leaves(state), state_snapshot):
        assert torch.equal(a, b)


def test_clip_by_global_norm_values():
    tree = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([[4.0]])}  # norm 5
    tx = ff.clip_by_global_norm(1.0)
    out, _ = tx.update(tree, tx.init(tree))
    assert torch.allclose(ff.global_norm(out), torch.tensor(1.0))
    assert torch.allclose(out["a"], torch.tensor([0.6, 0.0]))
    tx = ff.clip_by_global_norm(10.0)
    out, _ = tx.update(tree, tx.init(tree))
    assert torch.equal(out["a"], tree["a"]) and torch.equal(out["b"], tree["b"])


def test_global_norm_is_computed_in_float32():
    # 300**2 overflows FP16 (max 65504); the norm must not.
    tree = [torch.full((4,), 300.0, dtype=torch.float16)]
    n = ff.global_norm(tree)
    assert n.dtype == torch.float32 and float(n) == 600.0


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


def test_schedules_values():
    cos = ff.cosine_decay_schedule(1.0, 10, alpha=0.1)
    assert float(cos(torch.tensor(0, dtype=torch.int32))) == 1.0
    assert math.isclose(float(cos(torch.tensor(5))), 0.55, rel_tol=1e-6)
    assert math.isclose(float(cos(torch.tensor(10))), 0.1, rel_tol=1e-6)
    assert math.isclose(float(cos(torch.tensor(100))), 0.1, rel_tol=1e-6)
    warm = ff.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14)
    assert [round(float(warm(torch.tensor(t))), 6) for t in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert math.isclose(float(warm(torch.tensor(9))), 0.5, rel_tol=1e-6)
    const = ff.constant_schedule(0.3)
    assert float(const(torch.tensor(123))) == pytest.approx(0.3)
    assert const(torch.tensor(1)).dtype == torch.float32


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: ff.sgd(-0.1), "learning_rate"),
        (lambda: ff.sgd(math.nan), "learning_rate"),
        (lambda: ff.sgd(math.inf), "learning_rate"),
        (lambda: ff.sgd("0.1"), "learning_rate"),
        (lambda: ff.sgd(0.1, momentum=-0.9), "momentum"),
        (lambda: ff.sgd(0.1, weight_decay=-1.0), "weight_decay"),
        (lambda: ff.sgd(0.1, nesterov=True), "nesterov"),
        (lambda: ff.sgd(0.1, momentum=0.9, nesterov=True, dampening=0.1), "nesterov"),
        (lambda: ff.trace(0.9, dampening=1.5), "dampening"),
        (lambda: ff.clip_by_global_norm(0.0), "max_norm"),
        (lambda: ff.clip_by_global_norm(math.nan), "max_norm"),
        (lambda: ff.apply_if_finite(ff.sgd(0.1), -1), "max_consecutive_errors"),
        (lambda: ff.chain(ff.sgd(0.1), "sgd"), "chain argument 1"),
        (lambda: ff.cosine_decay_schedule(0.1, 0), "decay_steps"),
        (lambda: ff.linear_schedule(-1.0, 0.0, 3), "init_value"),
        (lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5), "decay_steps"),
        (lambda: ff.warmup_cosine_decay_schedule(0.0, 0.1, 10, 50, end_value=0.5), "end_value"),
        (lambda: ff.warmup_cosine_decay_schedule(0.0, 0.0, 10, 50, end_value=0.1), "end_value"),
    ],
)
def test_bad_hyperparameters_are_named(factory, match):
    with pytest.raises((ValueError, TypeError), match=match):
        factory()


def test_structure_mismatch_names_the_trees():
    params = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match="different tree structure"):
        ff.apply_updates(params, {"a": torch.zeros(2)})
    tx = ff.add_decayed_weights(0.1)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, tx.init(params))


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
