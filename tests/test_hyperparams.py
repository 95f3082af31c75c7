"""inject_hyperparams: hyperparameters as tensors in the state, as optax lays them out.

Against optax's ``inject_hyperparams`` itself (the state's ``hyperparams``,
schedules stored per step, a learning rate changed from outside), against the
transform it wraps (bitwise, for values exact in float32), across the
implementations of ``fp16_update`` (the fused path when only the learning rate
is injected), and under ``torch.compile(fullgraph=True)`` without a recompile
when a hyperparameter changes.
"""

import math

import numpy as np
import optree
import pytest
import torch

import functional_fp16 as ff
from tests.helpers import assert_states_bitwise_equal, matrices, random_tree

NS = ff.NAMESPACE


def _leaves(tree):
    return optree.tree_leaves(tree, namespace=NS)


def test_hyperparams_and_updates_follow_optax_as_the_learning_rate_changes():
    """optax's own behaviour: schedules are stored in ``hyperparams`` at the count, and a
    value set between steps is the next step's. SGD with momentum computes the same float32
    operations in both libraries (``b = g + mu b``, ``-lr b``); the schedule's value may
    differ by one float32 ulp (see below), so the updates agree to 1e-6 relative."""
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    sched_ours = ff.linear_schedule(0.1, 0.01, 10)
    sched_theirs = optax.linear_schedule(0.1, 0.01, 10)
    ours_tx = ff.inject_hyperparams(ff.sgd)(learning_rate=sched_ours, momentum=0.5)
    their_tx = optax.inject_hyperparams(optax.sgd)(learning_rate=sched_theirs, momentum=0.5)
    rng = np.random.default_rng(0)
    p = {"w": rng.standard_normal((3, 4)).astype(np.float32)}
    p_ours = {k: torch.tensor(v) for k, v in p.items()}
    ours = ours_tx.init(p_ours)
    theirs = their_tx.init({k: jnp.asarray(v) for k, v in p.items()})
    for step in range(12):
        g = {"w": rng.standard_normal((3, 4)).astype(np.float32)}
        # our sgd's weight decay is injected too (a tensor 0), so it reads the params
        u, ours = ours_tx.update({"w": torch.tensor(g["w"])}, ours, p_ours)
        ju, theirs = their_tx.update({"w": jnp.asarray(g["w"])}, theirs)
        np.testing.assert_allclose(u["w"].numpy(), np.asarray(ju["w"]), rtol=1e-6, atol=0)
        # the stored schedule value: ours is computed in float64 and rounded once, optax's
        # in float32, so they agree to one float32 ulp
        lr = float(ours.hyperparams["learning_rate"])
        jlr = np.float32(theirs.hyperparams["learning_rate"])
        assert abs(lr - float(jlr)) <= float(np.spacing(jlr))
        assert float(ours.hyperparams["momentum"]) == float(theirs.hyperparams["momentum"])
        assert int(ours.count) == int(theirs.count) == step + 1
    # a value set from outside: optax takes it, and so do we
    ours_c = ff.inject_hyperparams(ff.sgd)(learning_rate=0.1)
    theirs_c = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    s, js = ours_c.init({"w": torch.zeros(3)}), theirs_c.init({"w": jnp.zeros(3)})
    s.hyperparams["learning_rate"] = torch.tensor(0.25)
    js.hyperparams["learning_rate"] = jnp.asarray(0.25)
    u, _ = ours_c.update({"w": torch.ones(3)}, s, {"w": torch.zeros(3)})
    ju, _ = theirs_c.update({"w": jnp.ones(3)}, js)
    assert np.array_equal(u["w"].numpy(), np.asarray(ju["w"])) and float(u["w"][0]) == -0.25


CASES = {
    "sgd": (lambda: ff.sgd, dict(learning_rate=0.0625, momentum=0.5, weight_decay=0.25)),
    "nesterov": (lambda: ff.sgd, dict(learning_rate=0.0625, momentum=0.75, nesterov=True)),
    "adamw": (lambda: ff.adamw, dict(learning_rate=2.0**-10, b1=0.5, b2=0.75, weight_decay=0.25)),
    "lion": (lambda: ff.lion, dict(learning_rate=2.0**-10, b1=0.5, b2=0.75, weight_decay=0.5)),
    "clip": (lambda: ff.clip_by_global_norm, dict(max_norm=0.5)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_float_injected_is_bitwise_the_plain_transform(name):
    """With values exact in float32, the tensor form computes what the float form does."""
    factory, kwargs = CASES[name]
    tx, plain = ff.inject_hyperparams(factory())(**kwargs), factory()(**kwargs)
    params = random_tree(3)
    s, s_plain = tx.init(params), plain.init(params)
    assert set(s.hyperparams) >= {k for k, v in kwargs.items() if isinstance(v, float)}
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        grads = optree.tree_map(lambda x: torch.randn(x.shape, generator=g), params, namespace=NS)
        u, s = tx.update(grads, s, params)
        u2, s_plain = plain.update(grads, s_plain, params)
        assert_states_bitwise_equal(u, u2)
        assert_states_bitwise_equal(s.inner_state, s_plain)


def _recipe(**static):
    return ff.inject_hyperparams(ff.adamw, static_args=("b1", "b2", "eps", "weight_decay", "mask"))(
        1e-3, b2=0.95, weight_decay=0.1, mask=matrices
    )


def _train(make, impl, steps=6):
    state = ff.fp16_init(random_tree(5, scale=0.5), make())
    g = torch.Generator().manual_seed(2)
    out = []
    for step in range(steps):
        grads = optree.tree_map(
            lambda p: (torch.randn(p.shape, generator=g) * 300).half(), state.params, namespace=NS
        )
        if step == 2:
            _leaves(grads)[1].view(-1)[0] = math.nan
        if step == 4:  # an LR finder or a manual decay: a new value from outside
            hp = {**state.opt_state.hyperparams, "learning_rate": torch.tensor(4e-3)}
            state = state.replace(opt_state=state.opt_state._replace(hyperparams=hp))
        state = ff.fp16_update(state, grads, impl=impl)
        out.append(state)
    return out


def test_an_injected_learning_rate_runs_fused_and_every_implementation_agrees():
    assert ff.update_path(ff.fp16_init(random_tree(5), _recipe())) == "fused"
    ref = _train(_recipe, "reference")
    for impl in ("foreach", "fused"):
        got = _train(_recipe, impl)
        for r, s in zip(ref, got):
            assert_states_bitwise_equal(
                (r.opt_state, r.loss_scale, r.step, r.grads_finite),
                (s.opt_state, s.loss_scale, s.step, s.grads_finite),
            )
            for a, b in zip(_leaves(r.master), _leaves(s.master)):
                step = (a - b).abs()
                assert (step <= 2 * torch.finfo(torch.float32).eps * a.abs().clamp_min(1e-2)).all()
    # the skipped step (2) left the injection's count and every tensor as they were
    assert int(ref[2].opt_state.count) == int(ref[1].opt_state.count) == 2
    assert_states_bitwise_equal(ref[2].opt_state, ref[1].opt_state)
    # the new learning rate took effect: a step 8x larger than with the old one
    moved = [(b - a).abs().max() for a, b in zip(_leaves(ref[3].master), _leaves(ref[4].master))]
    before = [(b - a).abs().max() for a, b in zip(_leaves(ref[2].master), _leaves(ref[3].master))]
    assert max(moved) > 4 * max(before)


def test_other_injected_values_run_the_multi_tensor_path_and_say_why():
    state = ff.fp16_init(random_tree(5), ff.inject_hyperparams(ff.adamw, "mask")(1e-3))
    assert ff.update_path(state) == "foreach"
    from functional_fp16._fused.steps import why_not_fused

    assert "b1, b2, eps, weight_decay" in why_not_fused(state)


def test_compiled_step_does_not_recompile_when_the_learning_rate_changes():
    """The learning rate set from outside between steps (in place, as with optax) reaches the
    compiled step without a recompile, and steers it: two runs over the same gradients with
    two learning-rate sequences part, and each is bitwise the plain (uncompiled) run with its
    sequence, at every step."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def step(s, grads):
        return ff.fp16_update(s, grads)

    sequences = {"a": [1e-3 * (i + 1) for i in range(5)], "b": [3e-3 / (i + 1) for i in range(5)]}
    final = {}
    with torch._dynamo.config.patch(error_on_recompile=True):
        for name, lrs in sequences.items():  # one compiled function for both runs
            state = ff.fp16_init(random_tree(5), _recipe())
            eager = ff.fp16_init(random_tree(5), _recipe())
            g = torch.Generator().manual_seed(3)
            for lr in lrs:
                grads = optree.tree_map(
                    lambda p: (torch.randn(p.shape, generator=g) * 300).half(),
                    state.params,
                    namespace=NS,
                )
                for s in (state, eager):
                    s.opt_state.hyperparams["learning_rate"] = torch.tensor(lr)
                state = step(state, grads)
                eager = ff.fp16_update(eager, grads)
                assert bool(state.grads_finite)
                assert_states_bitwise_equal(state, eager)
            final[name] = state
    # the same gradients, another learning rate: every master leaf moved elsewhere
    init = _leaves(ff.fp16_init(random_tree(5), _recipe()).master)
    for m0, a, b in zip(init, _leaves(final["a"].master), _leaves(final["b"].master)):
        assert not torch.equal(a, b)
        assert not torch.equal(a, m0) and not torch.equal(b, m0)
    torch._dynamo.reset()


def test_composes_with_multi_transform_multisteps_and_apply_if_finite():
    injected = ff.inject_hyperparams(ff.sgd)(0.0625, momentum=0.5)
    for tx in (
        ff.multi_transform(
            {"a": injected, "b": ff.adam(1e-3)},
            lambda t: optree.tree_map(lambda p: "a" if p.ndim >= 2 else "b", t, namespace=NS),
        ),
        ff.MultiSteps(ff.inject_hyperparams(ff.lion)(1e-3), 2),
        ff.apply_if_finite(ff.inject_hyperparams(ff.adamw)(1e-3), 2),
    ):
        ref = _train(lambda tx=tx: tx, "reference", steps=4)
        got = _train(lambda tx=tx: tx, "foreach", steps=4)
        for r, s in zip(ref, got):
            assert_states_bitwise_equal(r, s)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="inner_factory"):
        ff.inject_hyperparams(3)
    with pytest.raises(ValueError, match="static_args"):
        ff.inject_hyperparams(ff.sgd, static_args=("lr",))
    with pytest.raises(ValueError, match="b1"):
        ff.inject_hyperparams(ff.adamw)(1e-3, b1=1.5)  # checked at construction
    state = ff.fp16_init(random_tree(5), ff.inject_hyperparams(ff.sgd)(0.1))
    hp = {**state.opt_state.hyperparams, "learning_rate": torch.tensor([0.1, 0.2])}
    bad = state.replace(opt_state=state.opt_state._replace(hyperparams=hp))
    grads = optree.tree_map(torch.zeros_like, state.params, namespace=NS)
    with pytest.raises((TypeError, ValueError), match="learning_rate"):
        ff.fp16_update(bad, grads)


def test_vmapped_members_keep_their_own_learning_rates_and_checkpoints_keep_them(tmp_path):
    tx = _recipe()
    members = [ff.fp16_init(random_tree(k), tx) for k in range(3)]
    for i, m in enumerate(members):
        m.opt_state.hyperparams["learning_rate"].fill_(1e-3 * (i + 1))
    g = torch.Generator().manual_seed(0)
    grads = [
        optree.tree_map(
            lambda p: (torch.randn(p.shape, generator=g) * 100).half(), m.params, namespace=NS
        )
        for m in members
    ]
    stacked = torch.func.vmap(ff.fp16_update)(ff.tree_stack(members), ff.tree_stack(grads))
    alone = [ff.fp16_update(m, gr) for m, gr in zip(members, grads)]
    assert_states_bitwise_equal(stacked, ff.tree_stack(alone))
    path = tmp_path / "state.ckpt"
    ff.save_checkpoint(path, alone[1])
    back = ff.load_checkpoint(path, like=ff.fp16_init(random_tree(9), tx))
    assert_states_bitwise_equal(back, alone[1])
    assert float(back.opt_state.hyperparams["learning_rate"]) == float(torch.tensor(2e-3))
