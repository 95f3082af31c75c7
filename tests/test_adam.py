"""Adam and AdamW: against torch.optim, GradScaler, optax under jax.jit, and float64.

The bounds, stated once:

* Moments: bitwise equal to ``torch.optim.Adam``'s (the same ``lerp`` and
  ``addcmul`` on the same FP32 values).
* Parameters after a long run, against ``torch.optim.Adam`` and optax: a few
  FP32 epsilons of the tensor's magnitude (``scaled_error``; per-element ulps
  are meaningless where a value passes near zero). ``scale_by_adam`` composes
  with ``scale_by_learning_rate`` as optax does, so the step ``lr / (1 -
  b1^t)`` is rounded in two products where torch rounds it once: a few ulps
  of the *update*, far below an ulp of the parameter.
* ``torch.optim.AdamW`` rounds its decay factor ``1 - lr * wd`` to FP32 every
  step, a systematic relative error of up to 2^-25 per step that our
  (optax's) ``p - lr * (u + wd * p)`` does not have: against a float64 run,
  ours stays within a few epsilons while torch's drifts by about one epsilon
  every few steps. Against torch's AdamW the bound is therefore that drift
  plus a few epsilons, and a test shows which of the two is the float64 one.
"""

from __future__ import annotations

import math

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves
from tests.helpers import bits, scaled_error

N = 20_003
STEPS = 100
LR = 1e-3
WD = 1e-2
SCALE = 1024.0
EPS32 = 2.0**-23


def fixed_grads(seed: int, steps: int = STEPS, n: int = N, scale: float = SCALE):
    """FP16 gradients of a scaled loss, fixed per seed, of mixed magnitudes."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * scale * 0.1 * (1 + i % 5)).half() for i in range(steps)]


def run_ours(tx, grads, m0, impl="auto", loss_scale=None):
    state = ff.fp16_init({"w": m0.clone()}, tx, loss_scale or ff.StaticLossScale(SCALE))
    for g in grads:
        state = ff.fp16_update(state, {"w": g}, impl=impl)
    return state


def run_torch(make_opt, grads, m0, scale=SCALE):
    param = torch.nn.Parameter(m0.clone())
    opt = make_opt([param])
    inv = ff.unscale_factor(torch.tensor(scale)).to(m0.dtype)
    for g in grads:
        param.grad = g.to(m0.dtype) * inv
        opt.step()
    return param.detach(), opt.state[param]


def test_adam_follows_torch_adam(impl):
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(1)) * 0.05
    grads = fixed_grads(2)
    state = run_ours(ff.adam(LR), grads, m0, impl)
    param, tstate = run_torch(lambda p: torch.optim.Adam(p, lr=LR), grads, m0)
    adam_state = state.opt_state[0]
    assert isinstance(adam_state, ff.ScaleByAdamState)
    assert int(adam_state.count) == STEPS == int(tstate["step"])
    assert torch.equal(bits(adam_state.mu["w"]), bits(tstate["exp_avg"]))
    assert torch.equal(bits(adam_state.nu["w"]), bits(tstate["exp_avg_sq"]))
    assert scaled_error(state.master["w"], param) <= 4.0


def test_adam_with_l2_decay_follows_torch_adam_weight_decay(impl):
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(3)) * 0.05
    grads = fixed_grads(4)
    tx = ff.chain(ff.add_decayed_weights(WD), ff.adam(LR))
    state = run_ours(tx, grads, m0, impl)
    param, tstate = run_torch(lambda p: torch.optim.Adam(p, lr=LR, weight_decay=WD), grads, m0)
    assert scaled_error(state.master["w"], param) <= 4.0
    # The decayed gradient depends on the parameters, so the moments follow them closely.
    assert scaled_error(state.opt_state[1][0].mu["w"], tstate["exp_avg"]) <= 4.0


def test_adamw_follows_torch_adamw_up_to_torchs_rounding_of_the_decay_factor(impl):
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(5)) * 0.05
    grads = fixed_grads(6)
    state = run_ours(ff.adamw(LR, weight_decay=WD), grads, m0, impl)
    param, _ = run_torch(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD), grads, m0)
    # torch multiplies by fl32(1 - lr*wd): each step's decay is off by
    # |p| * |fl32(1 - lr*wd) - (1 - lr*wd)|, always the same way; and that
    # product is one more rounding per step (at most half an ulp) than ours.
    factor_error = abs(float(torch.tensor(1.0 - LR * WD, dtype=torch.float32)) - (1.0 - LR * WD))
    drift = STEPS * factor_error / EPS32
    assert scaled_error(state.master["w"], param) <= drift + STEPS / 2


def test_adamw_is_the_float64_one_of_the_two():
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(7))
    grads = fixed_grads(8, steps=300, scale=1.0)
    state = run_ours(ff.adamw(LR, weight_decay=WD), grads, m0, loss_scale=ff.NoOpLossScale())
    param32, _ = run_torch(lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD), grads, m0, 1.0)
    param64, _ = run_torch(
        lambda p: torch.optim.AdamW(p, lr=LR, weight_decay=WD),
        [g.double() for g in grads],
        m0.double(),
        1.0,
    )
    truth = param64.float()  # within half an ulp of the float64 run
    ours = scaled_error(state.master["w"], truth)
    theirs = scaled_error(param32, truth)
    assert ours <= 16.0 and theirs > 4 * ours


def test_skipped_steps_leave_count_and_moments_bitwise_and_follow_gradscaler():
    """An overflow skips the step: the count does not advance, as GradScaler skips
    ``optimizer.step()`` (torch's step counter advances only in step())."""
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(9)) * 0.05
    grads = fixed_grads(10, steps=40)
    for i in (3, 4, 17):
        grads[i] = grads[i].clone()
        grads[i][i] = math.inf if i != 4 else math.nan
    ls = ff.DynamicLossScale(init_scale=SCALE, growth_interval=5)
    state = ff.fp16_init({"w": m0.clone()}, ff.adamw(LR, weight_decay=WD), ls)
    param = torch.nn.Parameter(m0.clone())
    opt = torch.optim.AdamW([param], lr=LR, weight_decay=WD)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=5)
    scaler.scale(torch.ones(()))  # GradScaler creates its scale lazily
    for g in grads:
        before = state
        state = ff.fp16_update(state, {"w": g})
        param.grad = g.float()
        scaler.step(opt)
        scaler.update()
        assert float(state.loss_scale.loss_scale) == scaler.get_scale()
        if not bool(state.grads_finite):
            for old, new in zip(tree_leaves(before.opt_state), tree_leaves(state.opt_state)):
                assert torch.equal(bits(old), bits(new))
            assert torch.equal(bits(before.master["w"]), bits(state.master["w"]))
    assert int(state.opt_state[0].count) == 37 == int(opt.state[param]["step"])
    # As above: torch's decay factor, and one more rounding per applied step.
    factor_error = abs(float(torch.tensor(1.0 - LR * WD, dtype=torch.float32)) - (1.0 - LR * WD))
    assert scaled_error(state.master["w"], param.detach()) <= 37 * (factor_error / EPS32 + 0.5)


def test_optax_adam_and_adamw_under_jit_agree():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    import numpy as np

    m0 = torch.randn(N, generator=torch.Generator().manual_seed(11)) * 0.05
    grads = fixed_grads(12, steps=60, scale=1.0)

    def run_optax(tx):
        @jax.jit
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = jnp.asarray(m0.numpy())
        s = tx.init(p)
        for g in grads:
            p, s = step(p, s, jnp.asarray(g.float().numpy()))
        return torch.from_numpy(np.asarray(p).copy())

    # optax rounds the bias corrections 1 - b^t in float32, torch and we in
    # float64: its distance from torch.optim.Adam is the yardstick.
    optax_adam = run_optax(optax.adam(LR))
    torch_adam, _ = run_torch(lambda p: torch.optim.Adam(p, lr=LR), grads, m0, 1.0)
    yardstick = scaled_error(optax_adam, torch_adam)
    for ours_tx, theirs in [
        (ff.adam(LR), optax_adam),
        (ff.adam(LR, eps_root=1e-8), run_optax(optax.adam(LR, eps_root=1e-8))),
        (ff.adamw(LR, weight_decay=WD), run_optax(optax.adamw(LR, weight_decay=WD))),
    ]:
        state = run_ours(ours_tx, grads, m0, loss_scale=ff.NoOpLossScale())
        assert scaled_error(state.master["w"], theirs) <= yardstick + 4.0


def test_shapes_dtypes_and_state_layout():
    params = {"a": torch.randn(3, 4), "b": (torch.randn(5).bfloat16(),)}
    tx = ff.scale_by_adam()
    st = tx.init(params)
    assert st.count.dtype == torch.int32 and int(st.count) == 0
    assert all(x.dtype == torch.float32 for x in tree_leaves(st.mu) + tree_leaves(st.nu))
    updates, st2 = tx.update(params, st)
    assert updates["a"].shape == (3, 4) and updates["b"][0].dtype == torch.bfloat16
    assert int(st2.count) == 1 and int(st.count) == 0  # the input state is untouched
    # The first step's bias-corrected moments give |u| = |g| / (|g| + eps) ~ 1.
    assert torch.allclose(updates["a"].abs(), torch.ones(3, 4), atol=1e-6)


def test_state_round_trips_through_a_checkpoint(tmp_path):
    m0 = torch.randn(N, generator=torch.Generator().manual_seed(13)) * 0.05
    grads = fixed_grads(14, steps=6)
    state = run_ours(ff.adamw(LR), grads[:3], m0)
    ff.save_checkpoint(tmp_path / "a.ckpt", state)
    like = ff.fp16_init({"w": torch.zeros(N)}, ff.adamw(LR), ff.StaticLossScale(SCALE))
    resumed = ff.load_checkpoint(tmp_path / "a.ckpt", like)
    for g in grads[3:]:
        state = ff.fp16_update(state, {"w": g})
        resumed = ff.fp16_update(resumed, {"w": g})
    for a, b in zip(tree_leaves(state), tree_leaves(resumed)):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(b1=1.0), r"b1 must be in \[0, 1\), got 1.0"),
        (dict(b2=-0.1), "b2"),
        (dict(eps=float("nan")), "eps"),
        (dict(eps_root=-1.0), "eps_root"),
    ],
)
def test_bad_hyperparameters_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ff.scale_by_adam(**kwargs)


def test_the_fused_kernel_runs_adam_adamw_and_l2_adam_but_not_eps_root():
    params = {"w": torch.zeros(3)}
    for tx in (
        ff.adam(LR),
        ff.adamw(LR),
        ff.chain(ff.add_decayed_weights(WD), ff.adam(LR)),
        ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(ff.linear_schedule(LR, 0.0, 10))),
    ):
        assert ff.update_path(ff.fp16_init(params, tx)) == "fused"
    # eps_root's denominator is optax's, which the kernel does not compute
    assert ff.update_path(ff.fp16_init(params, ff.adam(LR, eps_root=1e-8))) == "foreach"
    # L2 and decoupled decay together are a declared form; momentum on Adam is not
    both = ff.chain(ff.add_decayed_weights(WD), ff.adamw(LR, weight_decay=WD))
    assert ff.update_path(ff.fp16_init(params, both)) == "fused"
    other = ff.chain(ff.scale_by_adam(), ff.trace(0.9), ff.scale_by_learning_rate(LR))
    assert ff.update_path(ff.fp16_init(params, other)) == "foreach"


@pytest.mark.parametrize("batch", [1, 7, 1 << 20])
def test_the_plain_kernels_square_root_is_correctly_rounded_in_bounded_batches(batch, monkeypatch):
    """The CPU's float64 square root runs a bounded batch at a time (cut through tensors and
    across them), with the same bits as one conversion, into new tensors or in place."""
    from functional_fp16._fused import plain_kernels as pk

    monkeypatch.setattr(pk, "SQRT_BATCH", batch)
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(5, 3, generator=g) * 1e3, torch.rand(0), torch.rand(2), torch.rand(20)]
    want = [x.double().sqrt().float() for x in xs]
    got = pk.correct_sqrt(xs)
    inplace = [x.clone() for x in xs]
    pk.correct_sqrt(inplace, out=inplace)
    for w, a, b in zip(want, got, inplace):
        assert torch.equal(a, w) and torch.equal(b, w)
