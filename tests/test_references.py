"""Live comparisons with the JAX originals: jmp's loss scaling and optax's transforms.

Whole trees are compared with chex's pytree assertions, on NumPy views of our
tensors (chex cannot take torch tensors, nor BF16 arrays through NumPy, so the
BF16 paths are compared elsewhere in torch). Skipped when JAX, optax or jmp
are not installed.
"""

import math

import numpy as np
import optree
import pytest
import torch

import functional_fp16 as ff
from tests.helpers import random_tree, scaled_error

chex = pytest.importorskip("chex")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
jmp = pytest.importorskip("jmp")

NS = ff.NAMESPACE


def leaves(tree):
    return optree.tree_leaves(tree, namespace=NS)


def to_jax(tree):
    return [jnp.asarray(x.numpy()) for x in leaves(tree)]


def to_torch(x):
    return torch.from_numpy(np.asarray(x).copy())


def to_numpy(tree):
    """Our tree's leaves as NumPy arrays (views), in flattening order, for chex."""
    return [x.detach().numpy() for x in leaves(tree)]


def grads16(state, seed, inject):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(p.shape, generator=g) * 50).half() for p in leaves(state.params)]
    if inject is not None:
        out[inject[0]].view(-1)[0] = inject[1]
    return optree.tree_unflatten(optree.tree_structure(state.params, namespace=NS), out)


@pytest.mark.parametrize("nesterov", [False, True])
def test_fp16_update_matches_jmp_and_optax_sgd(nesterov):
    """The JAX recipe: jmp.DynamicLossScale + optax.sgd + jmp.select_tree."""
    lr, momentum, period, steps = 0.01, 0.9, 3, 30
    params = random_tree(0)
    state = ff.fp16_init(
        params,
        ff.sgd(lr, momentum=momentum, nesterov=nesterov),
        ff.DynamicLossScale(init_scale=2.0**10, growth_interval=period, max_scale=math.inf),
    )

    tx = optax.sgd(lr, momentum=momentum, nesterov=nesterov)
    j_master = to_jax(state.master)
    j_opt = tx.init(j_master)
    j_scale = jmp.DynamicLossScale(jnp.asarray(2.0**10, jnp.float32), period=period, factor=2)

    @jax.jit
    def j_step(master, opt, scale, grads):
        g = scale.unscale(grads)
        finite = jmp.all_finite(g)
        updates, new_opt = tx.update(g, opt, master)
        new_master = optax.apply_updates(master, updates)
        master = jmp.select_tree(finite, new_master, master)
        opt = jmp.select_tree(finite, new_opt, opt)
        return master, opt, scale.adjust(finite), finite

    rng = np.random.default_rng(0)
    worst = 0.0
    skipped = 0
    for step in range(steps):
        inject = (
            (int(rng.integers(0, 9)), [math.inf, math.nan][step % 2])
            if rng.random() < 0.2
            else None
        )
        grads = grads16(state, step, inject)
        j_master, j_opt, j_scale, j_finite = j_step(j_master, j_opt, j_scale, to_jax(grads))
        state = ff.fp16_update(state, grads)
        assert bool(state.grads_finite) == bool(j_finite)
        skipped += int(not bool(j_finite))
        assert float(state.loss_scale.loss_scale) == float(j_scale.loss_scale)
        assert int(state.loss_scale.growth_count) == int(j_scale.counter)
        chex.assert_trees_all_equal_shapes_and_dtypes(to_numpy(state.master), j_master)
        chex.assert_trees_all_equal(
            state.loss_scale.loss_scale.numpy(), np.asarray(j_scale.loss_scale)
        )
        for ours, theirs in zip(leaves(state.master), j_master):
            worst = max(worst, scaled_error(ours, to_torch(theirs)))
    assert skipped > 0
    # Same float32 operations in the same order, except that XLA contracts
    # `b * m + g` and `p + (-lr) * u` into FMAs under jit (one rounding where
    # eager PyTorch rounds twice): the trajectories stay within ~1 eps.
    assert worst <= 1.0, f"max deviation {worst} eps"


def test_apply_if_finite_matches_optax():
    params = {"w": torch.zeros(5), "b": torch.zeros(())}
    ours_tx = ff.apply_if_finite(ff.sgd(0.1, momentum=0.5), max_consecutive_errors=2)
    their_tx = optax.apply_if_finite(optax.sgd(0.1, momentum=0.5), max_consecutive_errors=2)
    ours = ours_tx.init(params)
    j_params = {k: jnp.asarray(v.numpy()) for k, v in params.items()}
    theirs = their_tx.init(j_params)
    rng = np.random.default_rng(1)
    for _step in range(40):
        g = {
            "w": torch.from_numpy(rng.standard_normal(5).astype(np.float32)),
            "b": torch.tensor(float(rng.standard_normal())),
        }
        if rng.random() < 0.4:
            g["w"][int(rng.integers(0, 5))] = math.nan
        u, ours = ours_tx.update(g, ours, params)
        ju, theirs = their_tx.update(
            {k: jnp.asarray(v.numpy()) for k, v in g.items()}, theirs, j_params
        )
        assert int(ours.notfinite_count) == int(theirs.notfinite_count)
        assert int(ours.total_notfinite) == int(theirs.total_notfinite)
        assert bool(ours.last_finite) == bool(theirs.last_finite)
        chex.assert_trees_all_equal({k: v.numpy() for k, v in u.items()}, ju)


def test_clip_by_global_norm_matches_optax():
    tree = random_tree(4, scale=3.0)
    j_tree = to_jax(tree)
    for max_norm in [0.5, 5.0, 100.0]:
        ours, _ = ff.clip_by_global_norm(max_norm).update(tree, ff.EmptyState())
        tx = optax.clip_by_global_norm(max_norm)
        theirs, _ = tx.update(j_tree, tx.init(j_tree))
        chex.assert_trees_all_equal_shapes_and_dtypes(to_numpy(ours), theirs)
        # The global norm is a sum reduced in another order (ours in float64):
        # within 2 eps of the tree's magnitude.
        scale = 2 * float(np.finfo(np.float32).eps) * max(float(abs(x).max()) for x in theirs)
        chex.assert_trees_all_close(to_numpy(ours), theirs, rtol=0, atol=scale)
    assert float(ff.global_norm(tree)) == pytest.approx(float(optax.tree.norm(j_tree)), rel=1e-6)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (
            ff.cosine_decay_schedule(0.1, 100, alpha=0.05),
            optax.cosine_decay_schedule(0.1, 100, alpha=0.05),
        ),
        (
            ff.linear_schedule(0.0, 0.3, 20, transition_begin=5),
            optax.linear_schedule(0.0, 0.3, 20, transition_begin=5),
        ),
        (
            ff.warmup_cosine_decay_schedule(0.0, 0.1, 10, 120, end_value=0.001),
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 120, end_value=0.001),
        ),
        (
            ff.warmup_cosine_decay_schedule(0.0, 0.1, 10, 120, end_value=0.001, exponent=2.0),
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 10, 120, end_value=0.001, exponent=2.0),
        ),
        (ff.linear_schedule(0.2, 0.3, 0), optax.linear_schedule(0.2, 0.3, 0)),
        (ff.linear_schedule(0.2, 0.3, -3, 5), optax.linear_schedule(0.2, 0.3, -3, 5)),
    ],
    ids=["cosine", "linear", "warmup_cosine", "warmup_cosine_exponent", "linear_0", "linear_neg"],
)
def test_schedules_match_optax(ours, theirs):
    for t in range(0, 150, 3):
        a = float(ours(torch.tensor(t, dtype=torch.int32)))
        b = float(theirs(t))
        # optax evaluates in float32 arithmetic, we in float64 rounded once.
        assert a == pytest.approx(b, rel=2e-6, abs=1e-9), t


def test_trace_matches_optax_trace():
    params = random_tree(2)
    tx = ff.trace(0.9, nesterov=True)
    jtx = optax.trace(0.9, nesterov=True)
    s = tx.init(params)
    js = jtx.init(to_jax(params))
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        grads = optree.tree_map(lambda p: torch.randn(p.shape, generator=g), params)
        out, s = tx.update(grads, s)
        jout, js = jtx.update(to_jax(grads), js)
        chex.assert_trees_all_equal_shapes_and_dtypes(to_numpy(out), jout)
        for a, b in zip(leaves(out), jout):
            assert scaled_error(a, to_torch(b)) <= 1.0


# -- exponential, polynomial and piecewise-constant schedules ------------------------------------

EPS32 = 2.0**-23


def _exponential(*args, **kwargs):
    """The two libraries' exponential_decay and the bound on their difference at step t.

    optax rounds the exponent p = (t - t_b) / T to float32 (relative 2^-24),
    which ``r^p`` amplifies by |p ln r|; its power and product add about an
    ulp each. We compute in float64 and round once.
    """
    init, steps, rate = args[:3]
    begin = args[3] if len(args) > 3 else kwargs.get("transition_begin", 0)

    def rel(t):
        if steps <= 0 or rate == 0.0:  # the constant init value, rounded once in both: exact
            return 0.0
        p = max(t - begin, 0) / steps
        return EPS32 * (2.0 + abs(p * math.log(rate)))

    return ff.exponential_decay(*args, **kwargs), optax.exponential_decay(*args, **kwargs), rel


def _polynomial(*args):
    """optax forms (v0 - v1) * frac**p + v1 in float32: a few ulps of max(v0, v1) absolute
    (the sum cancels when the value nears 0), a few ulps relative elsewhere."""
    scale = max(args[0], args[1])
    return (
        ff.polynomial_schedule(*args),
        optax.polynomial_schedule(*args),
        lambda t: 4 * EPS32,
        4 * EPS32 * scale,
    )


@pytest.mark.parametrize(
    "case",
    [
        lambda: _exponential(0.1, 10, 0.7),
        lambda: _exponential(0.1, 7, 0.5, 5, True, 0.001),
        lambda: _exponential(1e-3, 13, 1.3, 3, False, 0.05),
        lambda: _exponential(0.4, 9, 0.9, 0, False, 0.5),  # end above init: bounds every step
        lambda: _exponential(0.2, 5, 1.0, 2, False, 0.1),  # r = 1: the upper bound
        lambda: _exponential(0.3, 0, 0.5),  # no transition: the init value
        lambda: _exponential(0.3, -4, 0.5, 0, False, 0.01),
        lambda: _exponential(0.3, 10, 0.0, 0, False, 0.01),  # r = 0: the init value
        lambda: _polynomial(0.3, 0.01, 2.5, 90, 7),
        lambda: _polynomial(0.0, 0.2, 0.5, 40),
        lambda: _polynomial(0.1, 0.2, 0.0, 40),  # p = 0: init everywhere (0^0 = 1)
        lambda: _polynomial(0.1, 0.2, 3.0, 0, 5),
        lambda: _polynomial(0.1, 0.2, 1.0, 30, 4),  # linear_schedule
        lambda: (
            ff.piecewise_constant_schedule(0.1, {30: 0.5, 10: 0.3, 90: 3.0}),
            optax.piecewise_constant_schedule(0.1, {30: 0.5, 10: 0.3, 90: 3.0}),
            lambda t: 4 * EPS32,  # optax rounds after each factor (at most 3 here), we once
        ),
        lambda: (
            ff.piecewise_constant_schedule(0.25, {0: 0.5, 1: 2.0, 2: 0.0, 3: 7.0}),
            optax.piecewise_constant_schedule(0.25, {0: 0.5, 1: 2.0, 2: 0.0, 3: 7.0}),
            lambda t: 0.0,  # powers of two and zero: exact in both
        ),
        lambda: (
            ff.piecewise_constant_schedule(0.3),
            optax.piecewise_constant_schedule(0.3),
            lambda t: 0.0,
        ),
    ],
    ids=[
        "exp",
        "exp_staircase_bounded",
        "exp_growth_capped",
        "exp_end_above_init",
        "exp_rate_1",
        "exp_steps_0",
        "exp_steps_negative",
        "exp_rate_0",
        "poly",
        "poly_warmup_sqrt",
        "poly_power_0",
        "poly_steps_0",
        "poly_power_1",
        "piecewise",
        "piecewise_from_0",
        "piecewise_none",
    ],
)
def test_more_schedules_match_optax(case):
    ours, theirs, rel, *rest = case()
    atol = rest[0] if rest else 0.0
    for t in range(0, 200):
        a = float(ours(torch.tensor(t, dtype=torch.int32)))
        b = float(np.float32(theirs(t)))  # optax's value, float32 (a Python float where constant)
        assert a == pytest.approx(b, rel=rel(t), abs=atol), t


def test_clip_matches_optax():
    tree = random_tree(5, scale=3.0)
    tree16 = random_tree(6, dtype=torch.float16, scale=3.0)
    leaves(tree)[3].view(-1)[0] = math.nan
    leaves(tree)[4].view(-1)[1] = -math.inf
    for max_delta in [0.0, 0.1, 1.0, 7.5]:
        for t in (tree, tree16):
            ours, _ = ff.clip(max_delta).update(t, ff.EmptyState())
            tx = optax.clip(max_delta)
            j = [jnp.asarray(x.numpy()) for x in leaves(t)]
            theirs, _ = tx.update(j, tx.init(j))
            chex.assert_trees_all_equal_shapes_and_dtypes(to_numpy(ours), theirs)
            # A select between the element and the bound (rounded to the leaf's dtype
            # in both): bitwise, NaN payloads and signed zeros included.
            for a, b in zip(to_numpy(ours), theirs):
                b = np.asarray(b)
                assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}"))
