"""Overflow storms: inf/NaN injected into gradients and losses never reach the master or momentum.

A seeded random run of thousands of steps over small trees, with gradient
magnitudes swept across the whole FP16 range (natural overflows and
underflows), inf and NaN injected at random steps and leaves, non-finite
losses, and loss scales configured near the FP16 limits. After every step:
the master and every optimiser-state tensor are finite, a skipped step left
them bitwise unchanged, the working copy is the FP16 rounding of the master,
and the loss scale lies in ``[min_scale, max_scale]``. After every episode the
state equals, bitwise, a clean replay that applies only the accepted steps with
the transform alone (no loss scaling, no skipping).
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map, tree_paths
from functional_fp16.precision.loss_scale import unscale_factor
from tests.helpers import bits, implementation

EPISODES = 24
STEPS = 125  # per episode: 3000 steps per implementation and donation mode


def assert_bitwise(a, b, what: str) -> None:
    for path, x, y in zip(tree_paths(a), tree_leaves(a), tree_leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, f"{what}{path}"
        assert torch.equal(bits(x), bits(y)), f"{what}{path} differs"


def all_finite(tree) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in tree_leaves(tree) if x.is_floating_point())


class Pair(NamedTuple):
    kernel: torch.Tensor
    bias: torch.Tensor


def random_params(rng: random.Random):
    def t(shape):
        return torch.randn(shape, generator=gen) * rng.choice([0.01, 0.1, 1.0, 10.0])

    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    shapes = [(), (rng.randint(1, 9),), (rng.randint(1, 4), rng.randint(1, 5))]
    params = {"s": t(shapes[0]), "pair": Pair(t(shapes[2]), t(shapes[1]))}
    if rng.random() < 0.5:
        params["extra"] = (t((rng.randint(1, 6),)), t((0,)) if rng.random() < 0.3 else t(()))
    return params


def random_tx(rng: random.Random):
    lr = rng.choice([1e-4, 1e-3, 1e-2])
    momentum = rng.choice([0.0, 0.5, 0.9, 0.99])
    nesterov = momentum > 0 and rng.random() < 0.3
    dampening = 0.0 if nesterov else rng.choice([0.0, 0.0, 0.1])
    sgd = ff.sgd(
        lr,
        momentum=momentum,
        nesterov=nesterov,
        dampening=dampening,
        weight_decay=rng.choice([0.0, 1e-4]),
    )
    if rng.random() < 0.3:
        return ff.chain(ff.clip_by_global_norm(rng.choice([0.1, 1.0, 100.0])), sgd)
    return sgd


def random_loss_scale(rng: random.Random):
    if rng.random() < 0.15:
        return ff.StaticLossScale(2.0 ** rng.randint(-4, 24))
    lo = rng.randint(-4, 16)
    hi = rng.randint(lo, 30)
    init = rng.randint(lo, hi)
    return ff.DynamicLossScale(
        init_scale=2.0**init,
        min_scale=2.0**lo,
        max_scale=2.0**hi,
        growth_interval=rng.choice([1, 2, 3, 5, 50]),
        growth_factor=rng.choice([2.0, 4.0]),
        backoff_factor=rng.choice([0.5, 0.25]),
        hysteresis=rng.choice([1, 1, 2, 3]),
    )


def scale_bounds(loss_scale) -> tuple[float, float]:
    if isinstance(loss_scale, ff.DynamicLossScale):
        return loss_scale.min_scale, loss_scale.max_scale
    value = float(loss_scale.loss_scale)
    return value, value


class Counts:
    def __init__(self) -> None:
        self.steps = self.applied = self.injected_grads = self.injected_losses = 0
        self.natural_overflows = self.at_min = self.at_max = 0


def random_grads(rng: random.Random, gen: torch.Generator, magnitude: float, state, counts: Counts):
    """FP16 gradients of a scaled loss, from deep underflow to overflow, maybe poisoned."""
    # The true gradient's size (per episode) times the loss scale, with a wide
    # jitter: the scaled gradient ranges from FP16 subnormals to overflow.
    exponent = magnitude + math.log2(float(state.loss_scale.loss_scale)) + rng.uniform(-8.0, 6.0)
    grads = tree_map(
        lambda p: (torch.randn(p.shape, generator=gen) * 2.0**exponent).to(p.dtype), state.params
    )
    if not all(bool(torch.isfinite(g).all()) for g in tree_leaves(grads)):
        counts.natural_overflows += 1
    if rng.random() < 0.25:
        leaves = [g for g in tree_leaves(grads) if g.numel() > 0]
        victim = rng.choice(leaves)
        flat = victim.view(-1)
        flat[rng.randrange(flat.numel())] = rng.choice([math.inf, -math.inf, math.nan])
        counts.injected_grads += 1
    loss = torch.tensor(rng.uniform(0.0, 10.0))
    if rng.random() < 0.08:
        loss = torch.tensor(rng.choice([math.inf, -math.inf, math.nan]))
        counts.injected_losses += 1
    return grads, loss


def copy_tree(tree):
    return tree_map(lambda x: x.clone(), tree)


def run_episode(rng: random.Random, impl: str, donate: bool, counts: Counts) -> None:
    tx = random_tx(rng)
    init = ff.fp16_init(random_params(rng), tx, random_loss_scale(rng))
    if donate:  # the first update may reuse the initial state's memory
        init = copy_tree(init)
    lo, hi = scale_bounds(init.loss_scale)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    magnitude = rng.uniform(-16.0, 4.0)  # log2 of the unscaled gradients' size
    state = copy_tree(init) if donate else init
    applied = []  # (grads, scale used) of the steps that went through
    for _ in range(STEPS):
        grads, loss = random_grads(rng, gen, magnitude, state, counts)
        expected = all(bool(torch.isfinite(g).all()) for g in tree_leaves(grads)) and bool(
            torch.isfinite(loss)
        )
        if donate:
            # The update may write into the donated state and grads: compare
            # against copies, and never touch the donated objects again.
            old, kept = copy_tree(state), copy_tree(grads)
            new = ff.fp16_update(state, grads, loss=loss, impl=impl, donate=True)
            state, grads = old, kept
        else:
            new = ff.fp16_update(state, grads, loss=loss, impl=impl)
        counts.steps += 1

        assert bool(new.grads_finite) == expected
        assert int(new.step) == int(state.step) + 1
        assert all_finite(new.master), "inf/NaN reached the FP32 master"
        assert all_finite(new.opt_state), "inf/NaN reached the optimiser state"
        assert_bitwise(new.params, tree_map(lambda m: m.to(torch.float16), new.master), "params")
        scale, old_scale = float(new.loss_scale.loss_scale), float(state.loss_scale.loss_scale)
        assert lo <= scale <= hi and math.isfinite(scale), (scale, lo, hi)
        if expected:
            counts.applied += 1
            applied.append((grads, state.loss_scale.loss_scale))
            assert scale >= old_scale
        else:
            assert scale <= old_scale
            assert_bitwise(new.master, state.master, "skipped step changed master")
            assert_bitwise(new.opt_state, state.opt_state, "skipped step changed opt_state")
            assert_bitwise(new.params, state.params, "skipped step changed params")
        counts.at_min += scale == lo
        counts.at_max += scale == hi
        state = new

    # Clean replay: fed only the accepted steps, already unscaled, no skipping.
    # The transform alone replays the reference arithmetic; the fused kernel's
    # own arithmetic (contracted multiply-adds) is replayed by the same kernel
    # on an FP32 state without loss scaling.
    master, opt_state = init.master, init.opt_state
    replay = ff.fp16_init(init.master, tx, ff.NoOpLossScale(), param_dtype=torch.float32)
    for grads, used_scale in applied:
        inv = unscale_factor(used_scale)
        grads32 = tree_map(lambda g: g.float() * inv, grads)
        if not implementation(impl).bitwise_reference:
            replay = ff.fp16_update(replay, grads32, impl=impl)
            master, opt_state = replay.master, replay.opt_state
            continue
        updates, opt_state = tx.update(grads32, opt_state, master)
        master = ff.apply_updates(master, updates)
    assert_bitwise(state.master, master, "master vs clean replay")
    assert_bitwise(state.opt_state, opt_state, "opt_state vs clean replay")


@pytest.mark.slow
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_overflow_storm_never_corrupts_master_or_momentum(impl, donate):
    rng = random.Random(20261129)
    counts = Counts()
    for _ in range(EPISODES):
        run_episode(rng, impl, donate, counts)
    print(
        f"\n[fault injection, impl={impl}, donate={donate}] episodes={EPISODES} "
        f"steps={counts.steps} "
        f"applied={counts.applied} injected_grad_faults={counts.injected_grads} "
        f"injected_loss_faults={counts.injected_losses} "
        f"natural_fp16_overflows={counts.natural_overflows} "
        f"steps_at_min_scale={counts.at_min} steps_at_max_scale={counts.at_max}"
    )
    # The run really exercised what it claims to.
    assert counts.steps == EPISODES * STEPS
    assert (
        counts.injected_grads > 0.15 * counts.steps and counts.injected_losses > 0.04 * counts.steps
    )
    assert counts.natural_overflows > 0.05 * counts.steps
    assert 0.2 * counts.steps < counts.applied < 0.8 * counts.steps
    assert counts.at_min > 0 and counts.at_max > 0


# -- the two named failure modes, step by step ----------------------------------------


def _momentum_state():
    params = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor(0.5)}
    scale = ff.DynamicLossScale(init_scale=2.0**10, min_scale=1.0, growth_interval=1000)
    return ff.fp16_init(params, ff.sgd(0.1, momentum=0.9), scale)


def _grads(w, b):
    return {"w": torch.tensor(w, dtype=torch.float16), "b": torch.tensor(b, dtype=torch.float16)}


@pytest.mark.parametrize(
    "poison",
    [
        ("nan grad", _grads([1.0, math.nan, 1.0], 2.0), torch.tensor(1.0)),
        ("inf grad", _grads([1.0, 1.0, math.inf], 2.0), torch.tensor(1.0)),
        ("-inf grad", _grads([1.0, 1.0, 1.0], -math.inf), torch.tensor(1.0)),
        ("nan loss", _grads([1.0, 1.0, 1.0], 2.0), torch.tensor(math.nan)),
        ("inf loss", _grads([1.0, 1.0, 1.0], 2.0), torch.tensor(math.inf)),
    ],
    ids=lambda p: p[0],
)
def test_non_finite_grads_and_losses_skip_and_back_off(impl, poison):
    _, bad_grads, bad_loss = poison
    state = ff.fp16_update(_momentum_state(), _grads([1.0, 2.0, 3.0], 4.0), impl=impl)
    assert bool(state.grads_finite)
    skipped = ff.fp16_update(state, bad_grads, loss=bad_loss, impl=impl)
    assert not bool(skipped.grads_finite)
    assert float(skipped.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2
    assert_bitwise(skipped.master, state.master, "master")
    assert_bitwise(skipped.opt_state, state.opt_state, "momentum")
    assert_bitwise(skipped.params, state.params, "params")
    # The next good step continues exactly as if the bad one never happened
    # (same unscaled gradient: the scaled gradient halves with the scale).
    good = _grads([2.0, 4.0, 6.0], 8.0)
    half = _grads([1.0, 2.0, 3.0], 4.0)
    after = ff.fp16_update(skipped, half, impl=impl)
    direct = ff.fp16_update(state, good, impl=impl)
    assert_bitwise(after.master, direct.master, "master after recovery")
    assert_bitwise(after.opt_state, direct.opt_state, "momentum after recovery")
