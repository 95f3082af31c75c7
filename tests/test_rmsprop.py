"""RMSProp: scale_by_rms, scale_by_stddev and rmsprop against optax, torch.optim.RMSprop and Adam.

Fixed inputs in optax's style at the top. The bounds, stated once:

* Against ``torch.optim.RMSprop`` (``eps_in_sqrt=False``, ``decay = alpha``):
  the moving averages are bitwise torch's (the same ``mul``, ``addcmul`` and
  ``lerp`` on the same FP32 gradients). The parameters after a long run are
  within a few FP32 epsilons of the tensor's magnitude (``scaled_error``):
  torch rounds ``p - lr * (g / d)`` as one ``addcdiv`` where the optax
  composition rounds ``g / d`` and ``-lr * u`` first, and torch's CPU square
  root is not always correctly rounded (ours is, see ``sqrt_rn``). Each
  differs by about an ulp of the *update*, far below an ulp of the parameter.
* Against optax (float32 in XLA): the averages are formed in another order
  (optax's ``(1 - rho) * g**2 + rho * nu`` against torch's ``addcmul``, which
  may contract the product into a fused multiply-add; optax's
  ``(1 - rho) * g + rho * mu`` against ``lerp``), so each step's new term
  differs by at most about one ulp, and older differences decay with ``rho``:
  ``nu`` stays within ``NU_ULPS`` ulps (relative) of optax's; the updates
  ``g / sqrt(nu + eps)`` (optax: ``g * rsqrt(nu + eps)``, one more rounding)
  within ``U_ULPS``. The centred mean passes through zero, so it is compared
  at the scale of the gradients' root mean square. Measured over these
  fixtures: at most about 6 ulps for ``nu`` and 3.5 for the updates.
* Our own compositions (masked, multi_transform, MultiSteps, apply_if_finite,
  every ``impl`` of ``fp16_update``) are compared bitwise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map
from tests._bad_inputs import Hyper, fuzz_hyperparameters, is_real
from tests.helpers import (
    assert_bitwise_unchanged,
    assert_states_bitwise_equal,
    assert_transform_step_preserves,
    bit_snapshot,
    bits,
    random_tree,
    scaled_error,
)

N = 4_099
STEPS = 60
LR = 1e-3
SCALE = 1024.0
EPS32 = 2.0**-23
NU_ULPS = 16.0
U_ULPS = 8.0

# optax's option grid for scale_by_rms / scale_by_stddev (decay 0.5 makes the
# products exact powers of two apart: a different rounding path than 0.9).
OPTIONS = [
    {},
    {"eps_in_sqrt": False},
    {"bias_correction": True},
    {"eps_in_sqrt": False, "bias_correction": True},
    {"decay": 0.5, "initial_scale": 1.0},
    {"decay": 0.99, "eps": 1e-3, "eps_in_sqrt": False},
]
OPTION_IDS = ["default", "eps_outside", "bias", "bias_eps_outside", "decay_half_tf1", "torch_like"]


def fixed_grads(seed: int, steps: int = STEPS, n: int = N, scale: float = 1.0):
    """Gradients fixed per seed, of magnitudes differing by leaf position (as test_adam)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * scale * (1 + i % 5) for i in range(steps)]


def tree_grads(params, seed: int, steps: int = STEPS):
    g = torch.Generator().manual_seed(seed)
    return [
        tree_map(lambda p: torch.randn(p.shape, generator=g).to(p.dtype), params)
        for _ in range(steps)
    ]


def fp16_grads(params, seed: int, steps: int = STEPS, scale: float = SCALE):
    """FP16 gradients of a ``scale``-scaled loss."""
    g = torch.Generator().manual_seed(seed)
    return [
        tree_map(lambda p: (torch.randn(p.shape, generator=g) * scale * 0.1).half(), params)
        for _ in range(steps)
    ]


def relative_ulps(ours: torch.Tensor, theirs: torch.Tensor, condition=1.0) -> float:
    """max |ours - theirs| / (|theirs| * condition) in FP32 epsilons (``theirs`` nowhere zero)."""
    return float(((ours - theirs).abs() / (theirs.abs() * condition)).max()) / EPS32


def _condition(state, t: int, kwargs: dict) -> torch.Tensor | float:
    """How much the denominator amplifies relative differences of ``nu``: ``nu / variance``
    (1 without centring), from our state in float64."""
    if not isinstance(state, ff.ScaleByRStdDevState):
        return 1.0
    decay, eps = kwargs.get("decay", 0.9), kwargs.get("eps", 1e-8)
    c = 1.0 - decay**t if kwargs.get("bias_correction") else 1.0
    nu, mu = state.nu.double() / c, state.mu.double() / c
    var = nu - mu * mu
    if kwargs.get("eps_in_sqrt", True):
        return torch.clamp(nu / (var + eps), min=1.0)
    return torch.clamp(nu / (var + eps * var.clamp(min=0.0).sqrt()), min=1.0)


# -- against optax ------------------------------------------------------------------------------


def _optax():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    return jax, jnp, optax


def _to_torch(x):
    return torch.from_numpy(np.asarray(x).copy())


@pytest.mark.parametrize("centered", [False, True], ids=["rms", "stddev"])
@pytest.mark.parametrize("kwargs", OPTIONS, ids=OPTION_IDS)
def test_scale_by_rms_and_stddev_follow_optax_step_by_step(kwargs, centered):
    jax, jnp, optax = _optax()
    ours_tx = (ff.scale_by_stddev if centered else ff.scale_by_rms)(**kwargs)
    their_tx = (optax.scale_by_stddev if centered else optax.scale_by_rms)(**kwargs)
    update = jax.jit(their_tx.update)
    grads = fixed_grads(1)
    ours = ours_tx.init(torch.zeros(N))
    theirs = their_tx.init(jnp.zeros(N, jnp.float32))
    worst_nu = worst_u = worst_mu = 0.0
    for t, g in enumerate(grads, start=1):
        u, ours = ours_tx.update(g, ours)
        ju, theirs = update(jnp.asarray(g.numpy()), theirs)
        assert int(ours.count) == t
        assert u.dtype == torch.float32 and u.shape == (N,)
        worst_nu = max(worst_nu, relative_ulps(ours.nu, _to_torch(theirs.nu)))
        if centered:
            # The mean passes through zero: at the scale of the gradients' RMS.
            rms = ours.nu.sqrt()
            worst_mu = max(
                worst_mu, float(((ours.mu - _to_torch(theirs.mu)).abs() / rms).max()) / EPS32
            )
            if t == 1 and kwargs.get("bias_correction"):
                # Bias-corrected, the first variance is g^2 - g^2: rounding noise in both.
                continue
        # Centred, the variance nu - mu^2 cancels: its few-ulp differences, relative
        # to the variance, grow by nu / variance. Each element is allowed that factor.
        worst_u = max(worst_u, relative_ulps(u, _to_torch(ju), _condition(ours, t, kwargs)))
    assert worst_nu <= NU_ULPS, worst_nu
    assert worst_u <= U_ULPS, worst_u
    assert worst_mu <= U_ULPS, worst_mu


RMSPROP_CASES = {
    "default": dict(),
    "torch_like": dict(decay=0.99, eps_in_sqrt=False),
    "centered": dict(centered=True),
    "momentum": dict(momentum=0.9),
    "nesterov_centered": dict(momentum=0.8, nesterov=True, centered=True),
    # Bias-corrected and centred, the first variance is g^2 - g^2, rounding noise of
    # about ulp(g^2) (here up to ~2e-5) in either library; with a small eps the first
    # step is that noise's root. An eps far above it keeps the step defined.
    "centered_bias": dict(centered=True, bias_correction=True, eps=1.0),
    "tf1": dict(initial_scale=1.0, decay=0.95, momentum=0.0),
}


@pytest.mark.parametrize("schedule", [False, True], ids=["constant_lr", "schedule"])
@pytest.mark.parametrize("case", sorted(RMSPROP_CASES))
def test_rmsprop_follows_optax_over_a_long_run(case, schedule):
    """The whole optimiser, parameters compared after STEPS steps."""
    jax, jnp, optax = _optax()
    kwargs = RMSPROP_CASES[case]
    ours_lr = ff.exponential_decay(LR, 10, 0.7) if schedule else LR
    their_lr = optax.exponential_decay(LR, 10, 0.7) if schedule else LR
    ours_tx = ff.rmsprop(ours_lr, **kwargs)
    their_tx = optax.rmsprop(their_lr, **kwargs)

    @jax.jit
    def step(p, s, g):
        u, s = their_tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    m0 = torch.randn(N, generator=torch.Generator().manual_seed(2)) * 0.05
    p, s = m0.clone(), ours_tx.init(m0)
    jp = jnp.asarray(m0.numpy())
    js = their_tx.init(jp)
    for g in fixed_grads(3):
        u, s = ours_tx.update(g, s, p)
        p = ff.apply_updates(p, u)
        jp, js = step(jp, js, jnp.asarray(g.numpy()))
    # The state layout is optax's chain: (scaling, learning rate, momentum or identity).
    assert len(s) == len(js) == 3
    assert isinstance(
        s[0], ff.ScaleByRStdDevState if kwargs.get("centered") else ff.ScaleByRmsState
    )
    assert isinstance(s[2], ff.TraceState if "momentum" in kwargs else ff.EmptyState)
    # Each update within a few ulps of optax's (above) is far below an ulp of the
    # parameter; the sums p + u round apart now and then: a few epsilons after STEPS.
    assert scaled_error(p, _to_torch(jp)) <= 4.0


# -- against torch.optim.RMSprop ----------------------------------------------------------------


def run_fp16(tx, grads, params, impl="auto", loss_scale=None):
    state = ff.fp16_init(params, tx, loss_scale or ff.StaticLossScale(SCALE))
    for g in grads:
        state = ff.fp16_update(state, g, impl=impl)
    return state


def run_torch_rmsprop(grads, m0, **kwargs):
    param = torch.nn.Parameter(m0.clone())
    opt = torch.optim.RMSprop([param], foreach=False, **kwargs)
    inv = ff.unscale_factor(torch.tensor(SCALE))
    for g in grads:
        param.grad = g["w"].float() * inv
        opt.step()
    return param.detach(), opt.state[param]


@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centered"])
def test_rmsprop_follows_torch_rmsprop_in_fp16_update(impl, centered):
    alpha, eps = 0.99, 1e-8
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(4)) * 0.05
    grads = fp16_grads({"w": m0}, seed=5)
    tx = ff.rmsprop(LR, decay=alpha, eps=eps, eps_in_sqrt=False, centered=centered)
    state = run_fp16(tx, grads, {"w": m0}, impl)
    param, tstate = run_torch_rmsprop(grads, m0, lr=LR, alpha=alpha, eps=eps, centered=centered)
    scaling = state.opt_state[0]
    assert int(scaling.count) == STEPS == int(tstate["step"])
    assert torch.equal(bits(scaling.nu["w"]), bits(tstate["square_avg"]))
    if centered:
        assert torch.equal(bits(scaling.mu["w"]), bits(tstate["grad_avg"]))
    assert scaled_error(state.master["w"], param) <= 4.0


def test_rmsprop_momentum_with_a_constant_lr_is_torchs_up_to_rounding():
    """optax applies the lr before the momentum, torch after: the same for a constant lr."""
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(6)) * 0.05
    grads = fp16_grads({"w": m0}, seed=7)
    tx = ff.rmsprop(LR, decay=0.99, eps_in_sqrt=False, momentum=0.9)
    state = run_fp16(tx, grads, {"w": m0})
    param, tstate = run_torch_rmsprop(grads, m0, lr=LR, alpha=0.99, momentum=0.9)
    assert torch.equal(bits(state.opt_state[0].nu["w"]), bits(tstate["square_avg"]))
    # Our buffer holds -lr * (g / d), torch's g / d: equal up to the rounding of the product.
    buf = state.opt_state[2].trace["w"]
    assert scaled_error(buf, -LR * tstate["momentum_buffer"]) <= 8.0
    assert scaled_error(state.master["w"], param) <= 8.0
    # And it is not plain RMSprop: the momentum moved the parameters elsewhere.
    plain, _ = run_torch_rmsprop(grads, m0, lr=LR, alpha=0.99)
    assert scaled_error(state.master["w"], plain) > 100.0


def test_bias_corrected_rms_with_eps_outside_is_adam_without_its_first_moment():
    """optax's note: scale_by_rms(b2, eps_in_sqrt=False, bias_correction=True) is
    scale_by_adam(b1=0, b2); here bitwise, second moments included."""
    grads = fixed_grads(8, steps=30)
    rms = ff.scale_by_rms(0.95, 1e-6, eps_in_sqrt=False, bias_correction=True)
    adam = ff.scale_by_adam(0.0, 0.95, 1e-6)
    rs, as_ = rms.init(torch.zeros(N)), adam.init(torch.zeros(N))
    for g in grads:
        ru, rs = rms.update(g, rs)
        au, as_ = adam.update(g, as_)
        assert torch.equal(bits(ru), bits(au))
        assert torch.equal(bits(rs.nu), bits(as_.nu))
    # Without the bias correction it is not: the first updates differ by 1/sqrt(1 - b2^t).
    plain = ff.scale_by_rms(0.95, 1e-6, eps_in_sqrt=False)
    pu, _ = plain.update(grads[0], plain.init(torch.zeros(N)))
    au, _ = adam.update(grads[0], adam.init(torch.zeros(N)))
    assert not torch.allclose(pu, au)


def test_the_rule_by_hand_on_one_element():
    """Two steps of every option, against the docstring's formulas in float64."""
    g1, g2, rho, eps, nu0 = 3.0, -1.5, 0.8, 1e-2, 0.5
    for eps_in_sqrt in (True, False):
        for bias in (True, False):
            nu1 = rho * nu0 + (1 - rho) * g1**2
            nu2 = rho * nu1 + (1 - rho) * g2**2
            mu1 = (1 - rho) * g1
            mu2 = rho * mu1 + (1 - rho) * g2
            for centered in (False, True):
                tx = (ff.scale_by_stddev if centered else ff.scale_by_rms)(
                    rho, eps, nu0, eps_in_sqrt=eps_in_sqrt, bias_correction=bias
                )
                s = tx.init(torch.zeros(()))
                for t, (g, nu, mu) in enumerate([(g1, nu1, mu1), (g2, nu2, mu2)], start=1):
                    u, s = tx.update(torch.tensor(g), s)
                    c = 1 - rho**t if bias else 1.0
                    second = nu / c - (mu / c) ** 2 if centered else nu / c
                    d = math.sqrt(second + eps) if eps_in_sqrt else math.sqrt(second) + eps
                    assert float(u) == pytest.approx(g / d, rel=8 * EPS32), (
                        eps_in_sqrt,
                        bias,
                        centered,
                        t,
                    )


# -- layout, dtypes, compositions ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "make",
    [
        lambda: ff.scale_by_rms(),
        lambda: ff.scale_by_stddev(bias_correction=True, eps=1.0),  # step 1: var = g^2 - g^2
        lambda: ff.rmsprop(LR, momentum=0.9, nesterov=True),
        lambda: ff.rmsprop(ff.linear_schedule(LR, 0.0, 10), centered=True),
    ],
    ids=["rms", "stddev", "rmsprop_nesterov", "rmsprop_centered_schedule"],
)
def test_shapes_dtypes_and_fp32_state(make, dtype):
    params = random_tree(0, dtype=dtype)
    updates = random_tree(1, dtype=dtype)
    tx = make()
    out, state = assert_transform_step_preserves(tx, params, updates)
    scaling = state if isinstance(state, (ff.ScaleByRmsState, ff.ScaleByRStdDevState)) else state[0]
    assert (
        scaling.count.dtype == torch.int32 and scaling.count.shape == () and int(scaling.count) == 1
    )
    moments = tree_leaves(scaling.nu) + tree_leaves(getattr(scaling, "mu", ()))
    assert moments and all(x.dtype == torch.float32 for x in moments)
    # The FP32 average of the low-precision updates, each taken exactly to FP32.
    u32 = [x.float() for x in tree_leaves(updates)]
    expected = [torch.addcmul(torch.zeros_like(u), u, u, value=0.1) for u in u32]
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(scaling.nu), expected))
    assert all(torch.isfinite(x).all() for x in tree_leaves(out))


def test_initial_scale_fills_the_average_and_the_input_state_is_untouched():
    tx = ff.scale_by_rms(initial_scale=1.0)
    s0 = tx.init({"a": torch.zeros(3, dtype=torch.float16)})
    assert s0.nu["a"].dtype == torch.float32 and torch.equal(s0.nu["a"], torch.ones(3))
    g = {"a": torch.tensor([2.0, 0.0, -4.0], dtype=torch.float16)}
    u, s1 = tx.update(g, s0)
    assert torch.equal(s0.nu["a"], torch.ones(3)) and int(s0.count) == 0
    nu = torch.tensor([0.9 + 0.1 * 4, 0.9, 0.9 + 0.1 * 16])
    assert torch.allclose(s1.nu["a"], nu, rtol=EPS32)
    assert u["a"].dtype == torch.float16
    assert torch.allclose(u["a"].float(), g["a"].float() / (nu + 1e-8).sqrt(), rtol=1e-3)


def test_every_implementation_agrees_and_a_skipped_step_changes_nothing(impl):
    params = random_tree(9)
    tx = ff.rmsprop(
        ff.warmup_cosine_decay_schedule(0.0, LR, 3, 20), centered=True, momentum=0.9, nesterov=True
    )
    grads = fp16_grads(params, seed=10, steps=8)
    bad = tree_map(torch.clone, grads[5])
    tree_leaves(bad)[5].view(-1)[1] = math.inf
    grads[5] = bad
    ls = ff.DynamicLossScale(init_scale=SCALE, growth_interval=3)
    ours = ff.fp16_init(params, tx, ls)
    ref = ff.fp16_init(params, tx, ls)
    for i, g in enumerate(grads):
        before = bit_snapshot((ours.params, ours.master, ours.opt_state))
        ours = ff.fp16_update(ours, g, impl=impl)
        ref = ff.fp16_update(ref, g, impl="reference")
        assert_states_bitwise_equal(ours, ref)
        if i == 5:
            assert not bool(ours.grads_finite)
            assert_bitwise_unchanged((ours.params, ours.master, ours.opt_state), before)
    assert int(ours.opt_state[0].count) == 7  # the applied steps


def test_masked_rmsprop_is_rmsprop_on_the_masked_leaves(impl):
    params = {"w": torch.randn(6, 4), "b": torch.randn(4), "v": torch.randn(5, 2)}
    mask = {"w": True, "b": False, "v": True}
    grads = fp16_grads(params, seed=11, steps=6)
    state = run_fp16(ff.masked(ff.rmsprop(LR, momentum=0.5), mask), grads, params, impl)
    inside = {k: params[k] for k in ("w", "v")}
    alone = run_fp16(
        ff.rmsprop(LR, momentum=0.5), [{k: g[k] for k in inside} for g in grads], inside
    )
    for k in inside:
        assert torch.equal(bits(state.master[k]), bits(alone.master[k]))
    inv = ff.unscale_factor(torch.tensor(SCALE))
    by_hand = params["b"] + sum(g["b"].float() * inv for g in grads)  # passed through: p + g
    assert scaled_error(state.master["b"], by_hand) <= 4.0
    inner = state.opt_state.inner_state[0]
    assert isinstance(inner.nu["b"], ff.MaskedNode) and inner.nu["w"].shape == (6, 4)


def test_multi_transform_gives_each_label_its_optimiser(impl):
    params = {"body": torch.randn(8, 3), "head": torch.randn(3)}
    labels = {"body": "rms", "head": "sgd"}
    tx = ff.multi_transform({"rms": ff.rmsprop(LR, centered=True), "sgd": ff.sgd(0.1)}, labels)
    grads = fp16_grads(params, seed=12, steps=5)
    state = run_fp16(tx, grads, params, impl)
    body = run_fp16(
        ff.rmsprop(LR, centered=True),
        [{"body": g["body"]} for g in grads],
        {"body": params["body"]},
    )
    head = run_fp16(ff.sgd(0.1), [{"head": g["head"]} for g in grads], {"head": params["head"]})
    assert torch.equal(bits(state.master["body"]), bits(body.master["body"]))
    assert torch.equal(bits(state.master["head"]), bits(head.master["head"]))


def test_multi_steps_applies_rmsprop_to_the_mean_of_each_window():
    params = {"w": torch.randn(7, 5)}
    grads = tree_grads(params, seed=13, steps=9)
    multi = ff.MultiSteps(ff.rmsprop(LR, momentum=0.9), 3)
    inner = ff.rmsprop(LR, momentum=0.9)
    p, s = params, multi.init(params)
    q, t = params, inner.init(params)
    for i, g in enumerate(grads):
        u, s = multi.update(g, s, p)
        p = ff.apply_updates(p, u)
        if i % 3 == 2:
            window = grads[i - 2 : i + 1]
            mean = {"w": (window[0]["w"] + window[1]["w"] + window[2]["w"]) / 3}
            v, t = inner.update(mean, t, q)
            q = ff.apply_updates(q, v)
            assert torch.equal(bits(p["w"]), bits(q["w"]))
        else:
            assert torch.equal(u["w"], torch.zeros_like(u["w"]))
    assert int(s.inner_opt_state[0].count) == 3 and not torch.equal(p["w"], params["w"])


def test_multi_steps_rmsprop_in_fp16_update_agrees_with_the_reference(impl):
    params = random_tree(14)
    tx = ff.MultiSteps(ff.rmsprop(LR, bias_correction=True), 2)
    grads = fp16_grads(params, seed=15, steps=6)
    grads[3] = tree_map(torch.clone, grads[3])
    tree_leaves(grads[3])[0].view(-1)[0] = math.nan
    ours = run_fp16(tx, grads, params, impl, ff.DynamicLossScale(SCALE, growth_interval=4))
    ref = run_fp16(tx, grads, params, "reference", ff.DynamicLossScale(SCALE, growth_interval=4))
    assert_states_bitwise_equal(ours, ref)
    assert int(ours.opt_state.inner_opt_state[0].count) == 2  # windows 1 and 3; window 2 overflowed


def test_apply_if_finite_keeps_the_rms_state_bitwise_through_bad_updates():
    params = {"w": torch.randn(10), "s": torch.randn(())}
    tx = ff.apply_if_finite(ff.rmsprop(LR, centered=True, momentum=0.9), max_consecutive_errors=3)
    state = tx.init(params)
    rng = np.random.default_rng(16)
    skipped = 0
    for step in range(30):
        g = tree_map(
            lambda p: torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32)), params
        )
        bad = step % 4 == 1
        if bad:
            g["w"][3] = math.nan
        before = bit_snapshot(state.inner_state)
        u, state = tx.update(g, state, params)
        if bad:
            skipped += 1
            assert_bitwise_unchanged(state.inner_state, before)
            assert all(torch.equal(x, torch.zeros_like(x)) for x in tree_leaves(u))
        else:
            assert all(bool(torch.isfinite(x).all()) for x in tree_leaves(u))
    assert int(state.inner_state[0].count) == 30 - skipped and int(state.total_notfinite) == skipped


def test_a_state_round_trips_through_a_checkpoint(tmp_path):
    m0 = {"w": torch.randn(300, generator=torch.Generator().manual_seed(17))}
    grads = fp16_grads(m0, seed=18, steps=6)

    def tx():
        return ff.rmsprop(ff.exponential_decay(LR, 2, 0.5), centered=True, momentum=0.9)

    state = run_fp16(tx(), grads[:3], m0)
    ff.save_checkpoint(tmp_path / "r.ckpt", state)
    like = ff.fp16_init({"w": torch.zeros(300)}, tx(), ff.StaticLossScale(SCALE))
    resumed = ff.load_checkpoint(tmp_path / "r.ckpt", like)
    for g in grads[3:]:
        state = ff.fp16_update(state, g)
        resumed = ff.fp16_update(resumed, g)
    assert_states_bitwise_equal(state, resumed)


def test_an_empty_tree_passes_through_and_counts():
    tx = ff.scale_by_stddev(bias_correction=True)
    s = tx.init({})
    u, s = tx.update({}, s)
    assert u == {} and int(s.count) == 1


def test_a_state_of_another_structure_is_refused_naming_it():
    tx = ff.scale_by_rms()
    s = tx.init({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="nu has a different tree structure"):
        tx.update({"b": torch.zeros(2)}, s)


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, error, match",
    [
        (lambda: ff.scale_by_rms(decay=1.5), ValueError, "decay"),
        (lambda: ff.scale_by_rms(decay=-0.1), ValueError, "decay"),
        (lambda: ff.scale_by_rms(eps=-1e-8), ValueError, "eps"),
        (lambda: ff.scale_by_rms(eps=math.nan), ValueError, "eps"),
        (lambda: ff.scale_by_rms(initial_scale=-1.0), ValueError, "initial_scale"),
        (lambda: ff.scale_by_rms(decay="0.9"), TypeError, "decay"),
        (lambda: ff.scale_by_rms(eps_in_sqrt=1), TypeError, "eps_in_sqrt"),
        (lambda: ff.scale_by_stddev(bias_correction=None), TypeError, "bias_correction"),
        (lambda: ff.scale_by_stddev(1.0, bias_correction=True), ValueError, "decay must be < 1"),
        (lambda: ff.rmsprop(-1.0), ValueError, "learning_rate"),
        (lambda: ff.rmsprop(LR, momentum=-0.5), ValueError, "momentum"),
        (lambda: ff.rmsprop(LR, momentum=True), TypeError, "momentum"),
        (lambda: ff.rmsprop(LR, nesterov=True), ValueError, "nesterov"),
        (lambda: ff.rmsprop(LR, momentum=0.0, nesterov=True), ValueError, "nesterov"),
        (lambda: ff.rmsprop(LR, centered="yes"), TypeError, "centered"),
        (lambda: ff.rmsprop(LR, 0.9, 1e-8, 0.0, True), TypeError, "positional"),
    ],
)
def test_bad_hyperparameters_are_named(factory, error, match):
    with pytest.raises(error, match=match):
        factory()


HYPER = {
    "scale_by_rms.decay": Hyper(
        lambda v: ff.scale_by_rms(decay=v), lambda v: is_real(v) and 0.0 <= v <= 1.0, "decay"
    ),
    "scale_by_rms.eps": Hyper(
        lambda v: ff.scale_by_rms(eps=v), lambda v: is_real(v) and 0.0 <= v < math.inf, "eps"
    ),
    "scale_by_stddev.initial_scale": Hyper(
        lambda v: ff.scale_by_stddev(initial_scale=v),
        lambda v: is_real(v) and 0.0 <= v < math.inf,
        "initial_scale",
    ),
    "rmsprop.momentum": Hyper(
        lambda v: ff.rmsprop(LR, momentum=v),
        lambda v: v is None or (is_real(v) and 0.0 <= v < math.inf),
        "momentum",
    ),
}


def test_fuzz_hyperparameters():
    """Random values (NaN, inf, negative, wrong type): accepted or named."""
    seen = fuzz_hyperparameters(HYPER, "rmsprop")
    assert seen["rejected"] >= 100 and seen["accepted"] >= 40


def test_flags_are_keyword_only():
    import inspect

    kinds = {n: p.kind for n, p in inspect.signature(ff.rmsprop).parameters.items()}
    kw = inspect.Parameter.KEYWORD_ONLY
    assert all(kinds[n] == kw for n in ("eps_in_sqrt", "centered", "momentum", "nesterov"))
    assert list(kinds)[:4] == ["learning_rate", "decay", "eps", "initial_scale"]


# -- the fused step -----------------------------------------------------------------------------
#
# ``rmsprop`` without centring or bias correction runs as one fused op (``_fused/rmsprop.py``):
# a plain kernel that computes each operation as the chain does, so its states are compared
# with the chain's bit for bit, on the C kernel's CPU and on CUDA's default kernel forced on
# the CPU, pure and donated, whole and cut into pieces.

FUSED_CASES = {
    "plain": lambda: ff.rmsprop(LR),
    "eps_outside": lambda: ff.rmsprop(LR, decay=0.99, eps_in_sqrt=False),
    "momentum": lambda: ff.rmsprop(LR, momentum=0.9),
    "nesterov_schedule": lambda: ff.rmsprop(
        ff.warmup_cosine_decay_schedule(0.0, LR, 3, 20), momentum=0.9, nesterov=True
    ),
    "clip": lambda: ff.chain(
        ff.clip_by_global_norm(0.5), ff.rmsprop(LR, momentum=0.5, eps_in_sqrt=False)
    ),
    "initial_scale": lambda: ff.rmsprop(LR, decay=0.5, initial_scale=1.0),
    "ascent": lambda: ff.chain(
        ff.scale_by_rms(), ff.scale_by_learning_rate(LR, flip_sign=False), ff.trace(0.9)
    ),
}

UNFUSED_CASES = {
    "centered": lambda: ff.rmsprop(LR, centered=True),
    "bias_correction": lambda: ff.rmsprop(LR, bias_correction=True),
    "dampened_trace": lambda: ff.chain(
        ff.scale_by_rms(), ff.scale_by_learning_rate(LR), ff.trace(0.9, dampening=0.1)
    ),
    "trace_before_lr": lambda: ff.chain(
        ff.scale_by_rms(), ff.trace(0.9), ff.scale_by_learning_rate(LR)
    ),
    "bf16_trace": lambda: ff.chain(
        ff.scale_by_rms(),
        ff.scale_by_learning_rate(LR),
        ff.trace(0.9, accumulator_dtype=torch.bfloat16),
    ),  # fmt: skip
}


def _fused_tree(seed: int):
    """``random_tree``'s awkward sizes, plus a leaf that is not contiguous (a transposed
    matrix: its master keeps the strides, so the kernel steps it whole)."""
    tree = random_tree(seed)
    tree["transposed"] = torch.randn(40, 9, generator=torch.Generator().manual_seed(seed)).t()
    return tree


@pytest.mark.parametrize(
    ("kernel", "piece"),
    [("c", None), ("cuda-default", None), ("cuda-default", 16)],
    ids=["c", "cuda-default", "cuda-default-pieces-of-16"],
)
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("case", sorted(FUSED_CASES))
def test_the_fused_step_is_the_chain_bitwise(case, donate, piece, kernel, monkeypatch):
    """Every state tensor, the decisions and the loss scale bitwise the chain's
    (``impl="reference"``) through an overflow, which leaves every state tensor as it was,
    and through zero gradients (where -0.0 and +0.0 part)."""
    from functional_fp16._fused import rmsprop as fused

    monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", kernel)
    if piece is not None:  # leaves of 64, 65 and 360 elements cut, small ones joined
        monkeypatch.setattr(fused, "PIECE", piece)
    params = _fused_tree(3)
    grads = fp16_grads(params, seed=11, steps=7)
    max(tree_leaves(grads[4]), key=torch.numel).view(-1)[3] = math.inf
    for i in (1, 2):
        tree_leaves(grads[i])[i + 2].zero_()
        tree_leaves(grads[i])[i + 3].fill_(-0.0)
    ls = ff.DynamicLossScale(init_scale=SCALE, growth_interval=3)
    ours = ff.fp16_init(params, FUSED_CASES[case](), ls)
    ref = ff.fp16_init(params, FUSED_CASES[case](), ls)
    assert ff.update_path(ours) == "fused"
    for i, g in enumerate(grads):
        before = bit_snapshot((ours.params, ours.master, ours.opt_state))
        ours = ff.fp16_update(ours, g, donate=donate)
        ref = ff.fp16_update(ref, g, impl="reference")
        assert_states_bitwise_equal(ours, ref)
        if i == 4:
            assert not bool(ours.grads_finite)
            assert_bitwise_unchanged((ours.params, ours.master, ours.opt_state), before)
    rms = next(
        s for s in tree_leaves_of_states(ours.opt_state) if isinstance(s, ff.ScaleByRmsState)
    )
    assert int(rms.count) == 6  # the applied steps


def tree_leaves_of_states(opt_state):
    """The NamedTuple states inside a chain's nested tuple state."""
    out = []
    for s in opt_state:
        if isinstance(s, tuple) and not hasattr(s, "_fields"):
            out.extend(tree_leaves_of_states(s))
        else:
            out.append(s)
    return out


@pytest.mark.parametrize("case", sorted(UNFUSED_CASES))
def test_what_the_fused_step_does_not_compute_runs_as_written(case):
    state = ff.fp16_init(random_tree(1), UNFUSED_CASES[case]())
    assert ff.update_path(state) == "foreach"


def _op_call(kernel, monkeypatch, *, nu, trace, started, momentum):
    from functional_fp16._fused.rmsprop import rmsprop_step

    monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", kernel)
    g, m = [torch.ones(3, dtype=torch.float16)], [torch.ones(3)]
    rmsprop_step(
        g, m, nu, trace, [], [False], None, None, None, torch.full((1,), -LR), None, None,
        started, 0.9, 1e-8, True, momentum, False, 1,
    )  # fmt: skip


BAD_OP_CALLS = {
    "no started": (dict(started=None, momentum=0.9), TypeError, "started is required"),
    "started not bool": (
        dict(started=torch.tensor([1]), momentum=0.9),
        TypeError,
        "started must be torch.bool",
    ),
    "no nu": (dict(nu=[], momentum=0.0, trace=[]), ValueError, "nu has 0 tensors"),
    "no trace with momentum": (dict(trace=[], momentum=0.9), ValueError, "trace has 0 tensors"),
    "a trace without momentum": (
        dict(momentum=0.0, started=None),
        ValueError,
        "trace must be empty",
    ),
}


@pytest.mark.parametrize("kernel", ["c", "cuda-default"])
@pytest.mark.parametrize("case", sorted(BAD_OP_CALLS))
def test_the_op_refuses_what_does_not_fit_in_every_kernel(case, kernel, monkeypatch):
    """Each kernel, the C one through its generic C++ op included, refuses the same calls
    with the same message, naming the argument, before any kernel runs."""
    change, error, message = BAD_OP_CALLS[case]
    kw = dict(nu=[torch.zeros(3)], trace=[torch.zeros(3)], started=torch.tensor([True]))
    with pytest.raises(error, match=f"rmsprop_step: {message}"):
        _op_call(kernel, monkeypatch, **{**kw, **change})


def test_pieces_are_aligned_slices_of_every_list():
    from functional_fp16._fused.plain_kernels import pieces

    a = [torch.arange(5.0), torch.arange(40.0), torch.arange(12.0).reshape(3, 4).t()]
    b = [torch.zeros_like(x) for x in a]
    got = list(pieces([a, b], 16))
    # 5 | 16 | 16 | 8 (+ the transposed 12, whole: not contiguous)
    assert [[t.numel() for t in xs] for xs, _ in got] == [[5], [16], [16], [8], [12]]
    for xs, ys in got:
        for x, y in zip(xs, ys):
            y.copy_(x)  # writing a piece writes the tensor
    assert all(torch.equal(x, y) for x, y in zip(a, b))
