"""masked, and add_decayed_weights(mask=...): optax's cases, torch parameter groups, optax under jit.

Fixed inputs in optax's style at the top. The bounds, stated once:

* Our own compositions are compared bitwise: a masked chain against the same
  transforms run on each group separately, and every ``impl`` of
  ``fp16_update`` against the reference.
* Against ``torch.optim.SGD`` groups: a few FP32 epsilons of the tensor's
  magnitude (``scaled_error``), because torch rounds ``p - lr * b`` once
  (``add`` with ``alpha``) where the optax composition rounds ``-lr * b``
  first (as in ``tests/test_sgd.py``); momentum buffers that do not depend on
  the parameters (no decay) are bitwise torch's.
* Against ``torch.optim.AdamW`` groups: moments bitwise; parameters within
  torch's drift from rounding ``1 - lr * wd`` to FP32 plus half an ulp per
  step, as in ``tests/test_adam.py`` (the undecayed group: a few epsilons).
* Against optax under ``jax.jit``: about one epsilon (XLA contracts
  multiply-adds into FMAs).
"""

from __future__ import annotations

import collections
import copy
import math

import optree
import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused.sgd import sgd_plan
from functional_fp16._fused.steps import fused_plan
from functional_fp16._util.tree import tree_leaves, tree_map
from functional_fp16.transforms.masking import MaskedSpec
from functional_fp16.transforms.sgd import DecaySpec
from tests.helpers import (
    assert_bitwise_unchanged,
    assert_transform_step_preserves,
    bit_snapshot,
    bits,
    scaled_error,
)

STEPS = 20
LR = 0.05
WD = 1e-2
SCALE = 1024.0
EPS32 = 2.0**-23


# optax's fixtures (tests of optax.transforms._masking), as tensors.
MASK = {"a": True, "b": [False, True], "c": {"d": True, "e": (False, True)}}


def init_params():
    return {
        "a": torch.tensor(1.0),
        "b": [torch.tensor(2.0), torch.tensor(3.0)],
        "c": {"d": torch.tensor(4.0), "e": (torch.tensor(5.0), torch.tensor(6.0))},
    }


def per_step_updates(params):
    return tree_map(lambda x: x / 10.0, params)


def layered_params(seed: int = 0):
    """Two linear layers: matrices decay, vectors (biases) do not."""
    g = torch.Generator().manual_seed(seed)
    return {
        "l1": {
            "weight": torch.randn(16, 8, generator=g) * 0.3,
            "bias": torch.randn(16, generator=g),
        },
        "l2": {
            "weight": torch.randn(4, 16, generator=g) * 0.3,
            "bias": torch.randn(4, generator=g),
        },
    }


def is_matrix(params):
    return tree_map(lambda x: x.ndim > 1, params)


def fp16_grads(params, steps: int = STEPS, seed: int = 1):
    """Gradients of a SCALE-scaled loss in FP16, fixed per seed."""
    g = torch.Generator().manual_seed(seed)
    return [
        tree_map(lambda p: (torch.randn(p.shape, generator=g) * SCALE * 0.1).half(), params)
        for _ in range(steps)
    ]


def run_ours(tx, params, grads, impl="auto"):
    state = ff.fp16_init(params, tx, ff.StaticLossScale(SCALE))
    for g in grads:
        state = ff.fp16_update(state, g, impl=impl)
    return state


def run_torch(params, grads, make_opt):
    """``make_opt(named)``, named = {path: Parameter}; returns the optimiser and the parameters."""
    paths = ["/".join(map(str, p)) for p in optree.tree_paths(params, namespace=ff.NAMESPACE)]
    named = {k: torch.nn.Parameter(p.clone()) for k, p in zip(paths, tree_leaves(params))}
    opt = make_opt(named)
    inv = ff.unscale_factor(torch.tensor(SCALE))
    for step in grads:
        for p, g in zip(named.values(), tree_leaves(step)):
            p.grad = g.float() * inv
        opt.step()
    return opt, list(named.values())


# -- optax's test cases ------------------------------------------------------------------------


def negate():
    return ff.scale_by_learning_rate(1.0)  # u * -1.0: exact


def stateful_negate():
    return ff.sgd(1.0, momentum=0.0)  # the same values, with a momentum buffer in the state


@pytest.mark.parametrize("builder", [negate, stateful_negate])
@pytest.mark.parametrize("use_fn", [False, True], ids=["tree", "callable"])
def test_masked_transforms_masked_in_leaves_and_returns_the_others_as_they_came(builder, use_fn):
    params = init_params()
    updates = per_step_updates(params)
    tx = ff.masked(builder(), (lambda _: MASK) if use_fn else MASK)
    state = tx.init(params)

    def masked_negate(u):
        return tree_map(lambda m, x: -x if m else x, MASK, u)

    out, state = tx.update(updates, state, params)
    for o, want, m, u in zip(
        tree_leaves(out),
        tree_leaves(masked_negate(updates)),
        tree_leaves(MASK),
        tree_leaves(updates),
    ):
        assert torch.equal(bits(o), bits(want))
        if not m:
            assert o is u  # masked-out updates are the very tensors that went in
    # Repeated application, this time without params.
    again, _ = tx.update(out, state)
    for o, want in zip(tree_leaves(again), tree_leaves(updates)):
        assert torch.equal(bits(o), bits(want))


@pytest.mark.parametrize("builder", [negate, stateful_negate])
def test_a_mask_may_be_a_prefix_of_the_params(builder):
    mask = {"a": True, "b": False, "c": {"d": False, "e": True}}
    params = {
        "a": torch.tensor(1.0),
        "b": {"f": torch.tensor(2.0)},
        "c": {
            "d": torch.tensor(3.0),
            "e": ([torch.tensor(4.0), torch.tensor(5.0)], torch.tensor(6.0)),
        },
    }
    updates = per_step_updates(params)
    tx = ff.masked(builder(), mask)
    out, state = tx.update(updates, tx.init(params), params)
    want = {
        "a": -updates["a"],
        "b": updates["b"],
        "c": {"d": updates["c"]["d"], "e": tree_map(torch.neg, updates["c"]["e"])},
    }
    for o, w in zip(tree_leaves(out), tree_leaves(want)):
        assert torch.equal(bits(o), bits(w))
    again, _ = tx.update(out, state)
    for o, u in zip(tree_leaves(again), tree_leaves(updates)):
        assert torch.equal(bits(o), bits(u))


def test_masked_weight_decay_needs_params_and_decays_masked_in_leaves_only():
    params = init_params()
    updates = per_step_updates(params)
    tx = ff.masked(ff.add_decayed_weights(0.1), MASK)
    state = tx.init(params)
    out, state = tx.update(updates, state, params)
    want = tree_map(lambda m, u, p: torch.add(u, p, alpha=0.1) if m else u, MASK, updates, params)
    assert all(torch.equal(o, w) for o, w in zip(tree_leaves(out), tree_leaves(want)))
    # Repeated application on moved params; and the mask= form is the same transform.
    params = ff.apply_updates(params, out)
    via_arg = ff.add_decayed_weights(0.1, mask=MASK)
    out2, _ = tx.update(out, state, params)
    out3, _ = via_arg.update(out, via_arg.init(params), params)
    want = tree_map(lambda m, u, p: torch.add(u, p, alpha=0.1) if m else u, MASK, out, params)
    for a, b, w in zip(tree_leaves(out2), tree_leaves(out3), tree_leaves(want)):
        assert torch.equal(a, w) and torch.equal(b, w)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(updates, state)


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_empty_trees(container):
    tx = ff.masked(ff.sgd(1.0), container())
    out, _ = tx.update(container(), tx.init(container()))
    assert out == container()


@pytest.mark.parametrize("use_fn", [False, True], ids=["tree", "callable"])
@pytest.mark.parametrize("extra_key_in_mask", [False, True])
def test_a_mask_that_does_not_fit_the_params_is_named_with_its_path(extra_key_in_mask, use_fn):
    mask = copy.deepcopy(MASK)
    params = init_params()
    if extra_key_in_mask:
        mask["c"]["extra"] = True
    else:
        params["c"]["extra"] = torch.tensor(7.0)
    tx = ff.masked(ff.sgd(1.0), (lambda _: mask) if use_fn else mask)
    name = r"mask\(params\)" if use_fn else "mask"
    what = (
        r"missing keys \['extra'\], unexpected keys \[\]"
        if extra_key_in_mask
        else r"missing keys \[\], unexpected keys \['extra'\]"
    )
    with pytest.raises(
        ValueError,
        match=rf"{name} does not fit params .*: params\['c'\] against {name}\['c'\]: {what}",
    ):
        tx.init(params)


def test_mask_function_of_the_params():
    params = {"a": torch.ones(1, 2), "b": (torch.ones(1), torch.ones(1, 2, 3))}
    tx = ff.masked(ff.add_decayed_weights(0.1), lambda p: tree_map(lambda x: x.ndim > 1, p))
    grads = tree_map(lambda x: x * 2, params)
    out, _ = tx.update(grads, tx.init(params), params)
    assert torch.equal(out["a"], torch.add(grads["a"], params["a"], alpha=0.1))
    assert out["b"][0] is grads["b"][0]
    assert torch.equal(out["b"][1], torch.add(grads["b"][1], params["b"][1], alpha=0.1))


@pytest.mark.parametrize("builder", [negate, stateful_negate])
def test_nested_masks(builder):
    """optax issue 271: a masked transform inside another."""
    params = {
        "linear_1": {"w": torch.zeros(1, 1), "b": torch.zeros(1)},
        "linear_2": {"w": torch.zeros(1, 2), "b": torch.zeros(2)},
        "linear_3": {"w": torch.zeros(2, 3), "b": torch.zeros(3)},
    }
    inner_mask = tree_map(lambda _: True, params)
    inner_mask["linear_2"] = False
    tx = ff.masked(ff.masked(builder(), inner_mask), is_matrix)
    updates = tree_map(torch.ones_like, params)
    out, _ = tx.update(updates, tx.init(params), params)
    want = copy.deepcopy(updates)
    want["linear_1"]["w"] = -want["linear_1"]["w"]
    want["linear_3"]["w"] = -want["linear_3"]["w"]
    for o, w in zip(tree_leaves(out), tree_leaves(want)):
        assert torch.equal(o, w)


def test_the_inner_state_holds_masked_in_leaves_only():
    """optax issue 271: MaskedNode where the mask is False, so the state stays a tree of tensors."""
    params = {
        "a": [torch.ones(1), (torch.ones(2), torch.ones(3))],
        "b": {"c": torch.ones(4), "d": torch.ones(5)},
    }
    mask = {"a": [True, (True, False)], "b": False}
    state = ff.masked(ff.sgd(1.0, momentum=0.9), mask).init(params)
    assert isinstance(state, ff.MaskedState)
    got = state.inner_state[1].trace
    expected = {"a": [torch.zeros(1), (torch.zeros(2), ff.MaskedNode())], "b": ff.MaskedNode()}
    ns = ff.NAMESPACE
    assert optree.tree_structure(got, namespace=ns) == optree.tree_structure(expected, namespace=ns)
    assert [x.shape for x in tree_leaves(got)] == [(1,), (2,)]


def test_an_ordered_dict_keeps_its_type_and_leaf_order_under_a_plain_dict_mask(impl):
    """A dict mask fits an OrderedDict (optree flattens the two in different orders):
    the updates come back as the OrderedDict, each leaf in its place."""
    params = collections.OrderedDict(w2=torch.randn(3, 2), b=torch.randn(3), a=torch.randn(2, 2))
    mask = {"a": True, "b": False, "w2": True}
    tx = ff.masked(ff.scale_by_learning_rate(0.5), mask)
    out, _ = tx.update(params, tx.init(params), params)
    assert type(out) is collections.OrderedDict and list(out) == ["w2", "b", "a"]
    assert out["b"] is params["b"] and torch.equal(out["a"], params["a"] * -0.5)
    grads = collections.OrderedDict((k, torch.ones_like(v).half()) for k, v in params.items())
    state = ff.fp16_init(params, tx, ff.StaticLossScale(1.0))
    new = ff.fp16_update(state, grads, impl=impl)
    for k, m in state.master.items():
        assert torch.equal(new.master[k], m + (-0.5 if mask[k] else 1.0)), k


def test_structure_shape_and_dtype_are_preserved():
    params = {
        "w": torch.randn(3, 4),
        "b": torch.randn(4).bfloat16(),
        "h": (torch.randn(2, 2).half(), torch.randn(())),
    }
    updates = tree_map(lambda p: torch.randn(p.shape).to(p.dtype), params)
    mask = {"w": True, "b": False, "h": (True, False)}
    tx = ff.masked(ff.chain(ff.add_decayed_weights(WD), ff.sgd(LR, momentum=0.9)), mask)
    out, state = assert_transform_step_preserves(tx, params, updates)
    assert out["b"] is updates["b"] and out["h"][1] is updates["h"][1]
    assert_transform_step_preserves(ff.add_decayed_weights(WD, mask=is_matrix), params, updates)


# -- add_decayed_weights(mask=...) and the fused path --------------------------------------------


def test_a_masked_decay_declares_its_mask_and_fuses_into_groups():
    params = layered_params()
    plain = ff.chain(ff.add_decayed_weights(WD), ff.sgd(LR, momentum=0.9))
    masked = ff.chain(ff.add_decayed_weights(WD, mask=is_matrix), ff.sgd(LR, momentum=0.9))
    assert ff.add_decayed_weights(WD).spec == DecaySpec(WD)
    spec = ff.add_decayed_weights(WD, mask=is_matrix).spec
    assert (
        isinstance(spec, MaskedSpec) and spec.inner == DecaySpec(WD) and spec.mask_fn is is_matrix
    )
    assert sgd_plan(plain) is not None and sgd_plan(plain).weight_decay == WD
    assert sgd_plan(masked) is None  # not a plain chain: the groups decide
    assert ff.update_path(ff.fp16_init(params, plain)) == "fused"
    for tx in (masked, ff.adamw(1e-3, mask=is_matrix)):
        fp = fused_plan(ff.fp16_init(params, tx))
        assert ff.update_path(ff.fp16_init(params, tx)) == "fused"
        # two groups, decayed matrices and undecayed vectors, every leaf in one of them
        decays = sorted(
            getattr(g.plan, "weight_decay", getattr(g.plan, "decoupled_decay", None))
            for g in fp.groups
        )
        assert decays == [0.0, WD if tx is masked else 1e-4]
        assert sorted(i for g in fp.groups for i in g.leaves) == list(range(fp.n_leaves))


def test_an_all_true_mask_decays_exactly_as_no_mask(impl):
    params = layered_params()
    grads = fp16_grads(params, steps=5)
    ours = run_ours(ff.sgd(LR, momentum=0.9, weight_decay=WD), params, grads, impl)
    tx = ff.chain(ff.add_decayed_weights(WD, mask=True), ff.sgd(LR, momentum=0.9))
    masked = run_ours(tx, params, grads, impl)
    for a, b in zip(tree_leaves(ours.master), tree_leaves(masked.master)):
        assert torch.equal(bits(a), bits(b))


# -- against torch.optim parameter groups --------------------------------------------------------


def test_decay_mask_follows_torch_sgd_groups_without_decay_on_biases(impl):
    params = layered_params(2)
    grads = fp16_grads(params, seed=3)
    tx = ff.chain(ff.add_decayed_weights(WD, mask=is_matrix), ff.sgd(LR, momentum=0.9))
    state = run_ours(tx, params, grads, impl)

    def make(named):
        weights = [p for k, p in named.items() if k.endswith("weight")]
        biases = [p for k, p in named.items() if k.endswith("bias")]
        return torch.optim.SGD(
            [{"params": weights, "weight_decay": WD}, {"params": biases, "weight_decay": 0.0}],
            lr=LR,
            momentum=0.9,
            foreach=False,
        )

    opt, theirs = run_torch(params, grads, make)
    trace = state.opt_state[1][1].trace
    for path, ours, buf, p in zip(
        optree.tree_paths(params), tree_leaves(state.master), tree_leaves(trace), theirs
    ):
        assert scaled_error(ours, p.detach()) <= 4, path
        torch_buf = opt.state[p]["momentum_buffer"]
        if path[-1] == "bias":  # depends on the gradients only: torch's exact operations
            assert torch.equal(bits(buf), bits(torch_buf)), path
        else:
            assert scaled_error(buf, torch_buf) <= 4, path


def test_decay_mask_is_bitwise_the_two_groups_run_separately(impl):
    params = layered_params(4)
    grads = fp16_grads(params, seed=5)
    tx = ff.chain(ff.add_decayed_weights(WD, mask=is_matrix), ff.sgd(LR, momentum=0.9))
    state = run_ours(tx, params, grads, impl)
    for name, group_tx in [
        ("weight", ff.sgd(LR, momentum=0.9, weight_decay=WD)),
        ("bias", ff.sgd(LR, momentum=0.9)),
    ]:
        sub = {k: {name: v[name]} for k, v in params.items()}
        sub_grads = [{k: {name: v[name]} for k, v in g.items()} for g in grads]
        alone = run_ours(group_tx, sub, sub_grads, impl)  # the same implementation
        for k in params:
            assert torch.equal(bits(alone.master[k][name]), bits(state.master[k][name]))
            assert torch.equal(bits(alone.params[k][name]), bits(state.params[k][name]))


def test_adamw_mask_follows_torch_adamw_groups_without_decay_on_biases(impl):
    lr = 1e-3
    params = layered_params(6)
    grads = fp16_grads(params, seed=7)
    state = run_ours(ff.adamw(lr, weight_decay=WD, mask=is_matrix), params, grads, impl)

    def make(named):
        weights = [p for k, p in named.items() if k.endswith("weight")]
        biases = [p for k, p in named.items() if k.endswith("bias")]
        return torch.optim.AdamW(
            [{"params": weights}, {"params": biases, "weight_decay": 0.0}],
            lr=lr,
            weight_decay=WD,
            foreach=False,
        )

    opt, theirs = run_torch(params, grads, make)
    adam_state = state.opt_state[0]
    factor_error = abs(float(torch.tensor(1.0 - lr * WD, dtype=torch.float32)) - (1.0 - lr * WD))
    drift = STEPS * factor_error / EPS32 + STEPS / 2
    for path, ours, mu, nu, p in zip(
        optree.tree_paths(params),
        tree_leaves(state.master),
        tree_leaves(adam_state.mu),
        tree_leaves(adam_state.nu),
        theirs,
    ):
        assert torch.equal(bits(mu), bits(opt.state[p]["exp_avg"])), path
        assert torch.equal(bits(nu), bits(opt.state[p]["exp_avg_sq"])), path
        bound = 4.0 if path[-1] == "bias" else drift + 4.0
        assert scaled_error(ours, p.detach()) <= bound, path


# -- inside fp16_update: skipped steps, checkpoints, bad input ------------------------------------


def test_a_skipped_step_leaves_the_whole_state_bitwise_unchanged(impl):
    params = layered_params(8)
    tx = ff.chain(ff.add_decayed_weights(WD, mask=is_matrix), ff.sgd(LR, momentum=0.9))
    grads = fp16_grads(params, steps=4, seed=9)
    state = run_ours(tx, params, grads[:3], impl)
    bad = tree_map(torch.clone, grads[3])
    bad["l2"]["bias"][1] = math.inf
    before = bit_snapshot((state.params, state.master, state.opt_state))
    after = ff.fp16_update(state, bad, impl=impl)
    assert not bool(after.grads_finite)
    assert_bitwise_unchanged((after.params, after.master, after.opt_state), before)
    assert_bitwise_unchanged((state.params, state.master, state.opt_state), before)


def test_a_masked_state_round_trips_through_a_checkpoint(tmp_path):
    params = layered_params(10)
    grads = fp16_grads(params, steps=6, seed=11)

    def tx():
        return ff.chain(ff.add_decayed_weights(WD, mask=is_matrix), ff.sgd(LR, momentum=0.9))

    state = run_ours(tx(), params, grads[:3])
    ff.save_checkpoint(tmp_path / "m.ckpt", state)
    like = ff.fp16_init(tree_map(torch.zeros_like, params), tx(), ff.StaticLossScale(SCALE))
    resumed = ff.load_checkpoint(tmp_path / "m.ckpt", like)
    assert isinstance(resumed.opt_state[0], ff.MaskedState)
    for g in grads[3:]:
        state = ff.fp16_update(state, g)
        resumed = ff.fp16_update(resumed, g)
    for a, b in zip(tree_leaves(state), tree_leaves(resumed), strict=True):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize(
    "mask, where",
    [
        ({**MASK, "a": 1}, r"mask\['a'\]: expected a Python bool .* got int 1"),
        ({**MASK, "b": [torch.tensor(True), True]}, r"mask\['b'\]\[0\]: expected a Python bool"),
        ({**MASK, "c": {"d": "yes", "e": (False, True)}}, r"mask\['c'\]\['d'\]"),
        (0, r"mask: expected a Python bool"),
    ],
)
def test_a_mask_leaf_that_is_not_a_bool_is_refused_with_its_path(mask, where):
    with pytest.raises(TypeError, match=where):
        ff.masked(ff.sgd(1.0), mask)
    with pytest.raises(TypeError, match=where):
        ff.add_decayed_weights(WD, mask=mask)
    fn = ff.masked(ff.sgd(1.0), lambda _: mask)
    with pytest.raises(TypeError, match=where.replace("mask", r"mask\(params\)", 1)):
        fn.init(init_params())


def test_bad_arguments_are_named_and_the_callers_state_is_left_untouched():
    with pytest.raises(TypeError, match="inner must be a GradientTransformation"):
        ff.masked(lambda u: u, MASK)
    params = init_params()
    tx = ff.masked(ff.sgd(1.0, momentum=0.9), lambda p: tree_map(lambda x: True, p))
    state = tx.init(params)
    _, state = tx.update(per_step_updates(params), state, params)
    before = bit_snapshot(state)
    wrong = {**per_step_updates(params), "extra": torch.ones(())}
    fixed = ff.masked(ff.sgd(1.0, momentum=0.9), MASK)
    with pytest.raises(
        ValueError,
        match=r"mask does not fit updates .*: updates against mask: .*unexpected keys \['extra'\]",
    ):
        fixed.update(wrong, fixed.init(params), params)
    with pytest.raises(ValueError, match="does not fit params"):
        tx.update(per_step_updates(params), state, {"a": torch.ones(())})
    with pytest.raises(TypeError, match="state must be a MaskedState"):
        tx.update(per_step_updates(params), state.inner_state, params)
    assert_bitwise_unchanged(state, before)


# -- optax, live, under jax.jit ------------------------------------------------------------------


def test_masked_decay_and_adamw_mask_agree_with_optax_under_jit():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    import numpy as np

    params = layered_params(12)
    g = torch.Generator().manual_seed(13)
    grads = [tree_map(lambda p: torch.randn(p.shape, generator=g), params) for _ in range(STEPS)]

    def run_optax(tx):
        @jax.jit
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        p = tree_map(lambda x: jnp.asarray(x.numpy()), params)
        s = tx.init(p)
        for gr in grads:
            p, s = step(p, s, tree_map(lambda x: jnp.asarray(x.numpy()), gr))
        return [torch.from_numpy(np.asarray(x).copy()) for x in jax.tree.leaves(p)], s

    def run_tx(tx):
        p, s = params, tx.init(params)
        for gr in grads:
            u, s = tx.update(gr, s, p)
            p = ff.apply_updates(p, u)
        return tree_leaves(p), s

    jmask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731
    theirs, their_state = run_optax(
        optax.chain(optax.masked(optax.add_decayed_weights(WD), jmask), optax.sgd(LR, 0.9))
    )
    ours, our_state = run_tx(
        ff.chain(ff.masked(ff.add_decayed_weights(WD), is_matrix), ff.sgd(LR, momentum=0.9))
    )
    assert max(scaled_error(a, b) for a, b in zip(ours, theirs)) <= 2.0
    # The same state layout: the decay keeps nothing, masked or not.
    assert len(jax.tree.leaves(their_state[0])) == len(tree_leaves(our_state[0])) == 0

    # adamw: optax rounds its bias corrections in float32 (we, like torch, in
    # float64), so its distance from plain Adam's run is the yardstick.
    lr = 1e-3
    theirs, _ = run_optax(optax.adamw(lr, weight_decay=WD, mask=jmask))
    ours, _ = run_tx(ff.adamw(lr, weight_decay=WD, mask=is_matrix))
    their_adam, _ = run_optax(optax.adam(lr))
    our_adam, _ = run_tx(ff.adam(lr))
    yardstick = max(scaled_error(a, b) for a, b in zip(our_adam, their_adam))
    assert max(scaled_error(a, b) for a, b in zip(ours, theirs)) <= yardstick + 4.0
    # The masked-out biases moved exactly as plain Adam moves them.
    for path, a, b in zip(optree.tree_paths(params), ours, our_adam):
        if path[-1] == "bias":
            assert torch.equal(bits(a), bits(b)), path
