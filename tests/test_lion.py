"""Lion: against optax's own ``lion``, inside ``fp16_update``, and composed.

optax computes Lion with the same float32 operations in the same order
(``(1 - b1) g + b1 m``, its sign, ``+ wd p``, ``* -lr``, ``p + u``), so its
parameters and momentum are compared **bitwise** over 30 steps. Inside
``fp16_update`` the implementations are held to the numerical contract by the
optimiser matrix (``tests/helpers.py``: ``lion``, ``clip_lion_schedule``,
``lion_masked``); here, composition with the other transforms.
"""

import math

import numpy as np
import optree
import pytest
import torch

import functional_fp16 as ff
from tests.helpers import assert_states_bitwise_equal, matrices, random_tree

NS = ff.NAMESPACE


def _fp32_tree(rng):
    return {
        "w": rng.standard_normal((8, 5)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float32),
        "s": np.float32(rng.standard_normal()),
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(learning_rate=1e-2, b1=0.8, b2=0.95, weight_decay=0.1),
        dict(learning_rate=3e-3),
        dict(learning_rate=1e-2, b1=0.0, b2=1.0, weight_decay=0.0),
    ],
    ids=["custom", "defaults", "edges"],
)
def test_lion_is_bitwise_optax_lion(kwargs):
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(0)
    p0 = _fp32_tree(rng)
    tx, otx = ff.lion(**kwargs), optax.lion(**kwargs)
    p = {k: torch.tensor(v) for k, v in p0.items()}
    jp = {k: jnp.asarray(v) for k, v in p0.items()}
    state, jstate = tx.init(p), otx.init(jp)
    for _ in range(30):
        g = {
            k: np.asarray(rng.standard_normal(np.shape(v)), dtype=np.float32) for k, v in p0.items()
        }
        u, state = tx.update({k: torch.tensor(v) for k, v in g.items()}, state, p)
        p = ff.apply_updates(p, u)
        ju, jstate = otx.update({k: jnp.asarray(v) for k, v in g.items()}, jstate, jp)
        jp = optax.apply_updates(jp, ju)
    for k in p0:
        assert np.array_equal(p[k].numpy(), np.asarray(jp[k])), k
        assert np.array_equal(state[0].mu[k].numpy(), np.asarray(jstate[0].mu[k])), k
    assert int(state[0].count) == int(jstate[0].count) == 30


@pytest.mark.parametrize("mode", ["smooth", "refined"])
def test_scale_by_lion_modes_match_optax(mode):
    """The non-sign directions: ``refined`` bitwise; ``smooth`` is a tanh, and the float32
    tanh of torch and of XLA are different approximations (on 10^5 samples in [-9, 9] they
    differ by up to 4 ulps): within 4 ulps, the momentum bitwise."""
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    rng = np.random.default_rng(1)
    tx = ff.scale_by_lion(0.7, 0.9, mode=mode, smooth_beta=3.0)
    otx = optax.scale_by_lion(0.7, 0.9, mode=mode, smooth_beta=3.0)
    x = rng.standard_normal(200).astype(np.float32) * 2
    state, jstate = tx.init(torch.tensor(x)), otx.init(jnp.asarray(x))
    for _ in range(5):
        g = rng.standard_normal(200).astype(np.float32) * 2
        u, state = tx.update(torch.tensor(g), state)
        ju, jstate = otx.update(jnp.asarray(g), jstate)
        ju = np.asarray(ju)
        if mode == "refined":
            assert np.array_equal(u.numpy(), ju)
        else:
            spacing = np.spacing(np.abs(ju).astype(np.float32))
            assert (np.abs(u.numpy() - ju) <= 4 * spacing).all()
        assert np.array_equal(state.mu.numpy(), np.asarray(jstate.mu))


def test_updates_keep_their_dtype_and_the_momentum_is_float32():
    params = {"w": torch.randn(4, 3).half(), "b": torch.randn(3, dtype=torch.bfloat16)}
    tx = ff.scale_by_lion()
    state = tx.init(params)
    assert all(m.dtype == torch.float32 for m in optree.tree_leaves(state.mu, namespace=NS))
    u, state = tx.update(params, state)
    assert u["w"].dtype == torch.float16 and u["b"].dtype == torch.bfloat16
    assert u["w"].shape == (4, 3) and set(u["w"].float().unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert state.mu["w"].dtype == torch.float32 and int(state.count) == 1


def _run(tx, impl, steps=6, bad_step=3):
    state = ff.fp16_init(random_tree(7, scale=0.5), tx)
    g = torch.Generator().manual_seed(5)
    history = []
    for step in range(steps):
        grads = optree.tree_map(
            lambda p: (torch.randn(p.shape, generator=g) * 256).to(p.dtype),
            state.params,
            namespace=NS,
        )
        if step == bad_step:
            optree.tree_leaves(grads, namespace=NS)[0].view(-1)[0] = math.inf
        state = ff.fp16_update(state, grads, impl=impl)
        history.append(state)
    return history


COMPOSED = {
    "masked": lambda: ff.lion(1e-3, weight_decay=0.1, mask=matrices),
    "multi_transform": lambda: ff.multi_transform(
        {"m": ff.lion(1e-3, weight_decay=0.1), "v": ff.sgd(0.05, momentum=0.9)},
        lambda t: optree.tree_map(lambda p: "m" if p.ndim >= 2 else "v", t, namespace=NS),
    ),
    "multi_steps": lambda: ff.MultiSteps(ff.lion(1e-3, weight_decay=0.1), 2),
    "apply_if_finite": lambda: ff.apply_if_finite(ff.lion(1e-3, weight_decay=0.1), 2),
}


@pytest.mark.parametrize("name", sorted(COMPOSED))
def test_composed_lion_agrees_across_implementations(name):
    """The multi-tensor path is bitwise the reference; the default path within the
    contract (a skipped step a bitwise no-op); masked and labelled lion run fused."""
    ref = _run(COMPOSED[name](), "reference")
    for impl in ("foreach", "auto"):
        got = _run(COMPOSED[name](), impl)
        for r, s in zip(ref, got):
            assert torch.equal(r.grads_finite, s.grads_finite)
            assert_states_bitwise_equal(
                (r.loss_scale, r.step, r.opt_state), (s.loss_scale, s.step, s.opt_state)
            )
            for a, b in zip(
                optree.tree_leaves(r.master, namespace=NS),
                optree.tree_leaves(s.master, namespace=NS),
            ):
                scale = torch.maximum(a.abs(), b.abs()).clamp_min(1e-3)
                assert ((a - b).abs() <= 4 * torch.finfo(torch.float32).eps * scale).all(), name
    # An overflow at step 3: every state tensor bitwise as before it (with MultiSteps(k=2)
    # the whole window of steps 2 and 3 is skipped: as after step 1, when it opened).
    skipped, before = ref[3], ref[1] if name == "multi_steps" else ref[2]
    assert not bool(skipped.grads_finite)
    assert_states_bitwise_equal(
        (skipped.master, skipped.opt_state, skipped.params),
        (before.master, before.opt_state, before.params),
    )
    if name in ("masked", "multi_transform"):
        assert ff.update_path(ff.fp16_init(random_tree(7), COMPOSED[name]())) == "fused"


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: ff.lion(-1e-3), "learning_rate"),
        (lambda: ff.lion(1e-3, b1=1.5), "b1"),
        (lambda: ff.lion(1e-3, b2=-0.1), "b2"),
        (lambda: ff.lion(1e-3, weight_decay=math.nan), "weight_decay"),
        (lambda: ff.scale_by_lion(mode="soft"), "mode"),
        (lambda: ff.scale_by_lion(mode="smooth", smooth_beta=0.0), "smooth_beta"),
        (lambda: ff.scale_by_lion(b1="0.9"), "b1"),
    ],
)
def test_bad_hyperparameters_raise_at_construction_naming_the_argument(make, needle):
    with pytest.raises((TypeError, ValueError), match=needle):
        make()


def test_a_donated_plain_step_in_pieces_is_the_whole_one_bitwise(monkeypatch):
    """The plain kernel steps a donated state a piece at a time (its temporaries a piece's):
    cut into pieces of 16 elements (leaves of 64 and 65 cut, small ones joined), every
    state is bitwise the pure step's, through an overflow, with and without a clip."""
    from functional_fp16._fused import lion as fused

    monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", "cuda-default")  # the plain kernel
    for tx in (ff.lion(1e-3, weight_decay=0.1),
               ff.chain(ff.clip_by_global_norm(0.5), ff.lion(1e-3, weight_decay=0.0))):  # fmt: skip
        monkeypatch.setattr(fused, "PIECE", 1 << 20)
        whole = _run(tx, "auto")
        monkeypatch.setattr(fused, "PIECE", 16)
        state = ff.fp16_init(random_tree(7, scale=0.5), tx)
        g = torch.Generator().manual_seed(5)
        for step, expected in enumerate(whole):
            grads = optree.tree_map(
                lambda p: (torch.randn(p.shape, generator=g) * 256).to(p.dtype),
                state.params,
                namespace=NS,
            )
            if step == 3:
                optree.tree_leaves(grads, namespace=NS)[0].view(-1)[0] = math.inf
            state = ff.fp16_update(state, grads, donate=True)
            assert_states_bitwise_equal(
                (state.params, state.master, state.opt_state, state.loss_scale),
                (expected.params, expected.master, expected.opt_state, expected.loss_scale),
            )
