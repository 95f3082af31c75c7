"""multi_transform and set_to_zero: optax's cases, torch parameter groups, optax under jit.

Fixed inputs in optax's style at the top. Bounds as in ``tests/test_masking.py``:
bitwise against our own transforms run on each group alone; a few FP32
epsilons (``scaled_error``) against ``torch.optim.SGD`` groups, whose
momentum buffers are matched bitwise; about one epsilon against optax under
``jax.jit``; frozen parameters bitwise unchanged everywhere.
"""

from __future__ import annotations

import math

import optree
import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import (
    assert_bitwise_unchanged,
    assert_transform_step_preserves,
    bit_snapshot,
    bits,
    scaled_error,
)

STEPS = 20
LR = 0.05
HEAD_LR = 0.5
WD = 1e-2
SCALE = 1024.0


# optax's fixture (tests of optax.transforms._combining), as tensors.
def init_params():
    return {
        "a1": torch.tensor(1.0),
        "b1": torch.tensor(2.0),
        "z1": {"a2": torch.tensor(3.0), "z2": {"c1": torch.tensor(4.0)}},
    }


def map_keys(fn):
    """Maps ``fn(key, value)`` over the leaves of a nested dict."""

    def apply(tree):
        return {k: apply(v) if isinstance(v, dict) else fn(k, v) for k, v in tree.items()}

    return apply


def network_params(seed: int = 0):
    """An embedding (frozen in some tests), a body and a head, each with a bias."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.3 + 0.1  # no exact zeros

    return {
        "embed": {"weight": r(10, 8)},
        "body": {"weight": r(16, 8), "bias": r(16)},
        "head": {"weight": r(3, 16), "bias": r(3)},
    }


LABELS = {"embed": "frozen", "body": "body", "head": "head"}  # a prefix of the params


def fp16_grads(params, steps: int = STEPS, seed: int = 1):
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
    """``make_opt(named)`` with named = {top-level key: [Parameters]}; leaves in flattening order."""
    named = {k: [torch.nn.Parameter(p.clone()) for p in tree_leaves(v)] for k, v in params.items()}
    opt = make_opt(named)
    inv = ff.unscale_factor(torch.tensor(SCALE))
    for step in grads:
        for k, ps in named.items():
            for p, g in zip(ps, tree_leaves(step[k])):
                p.grad = g.float() * inv
        opt.step()
    return opt, named


# -- optax's test cases ------------------------------------------------------------------------


@pytest.mark.parametrize("use_fn", [False, True], ids=["tree", "callable"])
def test_each_label_gets_its_transform(use_fn):
    params = init_params()
    updates = tree_map(lambda x: x / 10.0, params)
    transforms = {
        "a": ff.scale_by_learning_rate(1.0),  # u * -1
        "b": ff.trace(0.0),  # stateful, passes through
        "c": ff.scale_by_learning_rate(2.0, flip_sign=False),  # u * 2
    }
    labels = map_keys(lambda k, _: k[0])
    tx = ff.multi_transform(transforms, labels if use_fn else labels(params))
    state = tx.init(params)
    expected = map_keys(lambda k, v: {"a": -v, "b": v, "c": 2.0 * v}[k[0]])

    out, state = tx.update(updates, state, params)
    for o, w in zip(tree_leaves(out), tree_leaves(expected(updates))):
        assert torch.equal(o, w)
    again, _ = tx.update(out, state)  # repeated, without params
    for o, w in zip(tree_leaves(again), tree_leaves(expected(expected(updates)))):
        assert torch.equal(o, w)


@pytest.mark.parametrize("container", [list, tuple, dict])
def test_empty_trees(container):
    tx = ff.multi_transform({0: ff.sgd(1.0)}, lambda _: 0)
    out, _ = tx.update(container(), tx.init(container()))
    assert out == container()


@pytest.mark.parametrize("use_fn", [False, True], ids=["tree", "callable"])
@pytest.mark.parametrize("extra_label", [False, True])
def test_labels_may_be_a_prefix_and_must_all_have_a_transform(extra_label, use_fn):
    params = {
        "a": torch.tensor(1.0),
        "b": [torch.tensor(2.0), torch.tensor(3.0)],
        "c": {"d": torch.tensor(4.0), "e": (torch.tensor(5.0), torch.tensor(6.0))},
    }
    labels = {"a": 0, "b": [1, 0], "c": 1}  # a prefix of params
    if extra_label:
        labels["a"] = 3
    transforms = {0: ff.sgd(1.0), 1: ff.adam(1.0, b1=0.0, b2=0.0), 2: ff.trace(1.0)}

    def build():
        return ff.multi_transform(transforms, (lambda _: labels) if use_fn else labels)

    if not extra_label:
        tx = build()
        _, state = tx.update(tree_map(lambda x: x / 10.0, params), tx.init(params))
        assert set(state.inner_states) == {0, 1, 2}
        return
    name = r"param_labels\(params\)" if use_fn else "param_labels"
    match = rf"{name}\['a'\]: label 3 has no transform; transforms has labels \[0, 1, 2\]"
    with pytest.raises(ValueError, match=match):
        build().init(params)  # a fixed tree is refused when the transform is built


def test_the_state_holds_each_labels_state_on_its_leaves_only():
    params = network_params()
    tx = ff.multi_transform(
        {"body": ff.sgd(LR, momentum=0.9), "head": ff.adam(1e-3), "frozen": ff.set_to_zero()},
        LABELS,
    )
    state = tx.init(params)
    assert isinstance(state, ff.MultiTransformState)
    assert list(state.inner_states) == ["body", "head", "frozen"]
    assert all(isinstance(s, ff.MaskedState) for s in state.inner_states.values())
    body_trace = state.inner_states["body"].inner_state[1].trace
    assert body_trace["embed"] == ff.MaskedNode() and body_trace["head"] == ff.MaskedNode()
    assert body_trace["body"]["weight"].shape == (16, 8)
    mu = state.inner_states["head"].inner_state[0].mu
    assert [x.shape for x in tree_leaves(mu)] == [(3,), (3, 16)]
    assert tree_leaves(state.inner_states["frozen"]) == []
    # A label no parameter carries keeps no parameter-shaped tensors (trace keeps its flag).
    unused = ff.multi_transform({"x": ff.sgd(LR, momentum=0.9), "y": ff.sgd(LR)}, "x")
    assert [x.ndim for x in tree_leaves(unused.init(params).inner_states["y"])] == [0]  # a flag


def test_structure_shape_and_dtype_are_preserved():
    params = {
        "w": torch.randn(3, 4),
        "b": torch.randn(4).bfloat16(),
        "h": (torch.randn(2, 2).half(), torch.randn(())),
    }
    updates = tree_map(lambda p: torch.randn(p.shape).to(p.dtype), params)
    labels = {"w": "sgd", "b": "zero", "h": ("adam", "sgd")}
    tx = ff.multi_transform(
        {"sgd": ff.sgd(LR, momentum=0.9), "adam": ff.adam(1e-3), "zero": ff.set_to_zero()}, labels
    )
    assert_transform_step_preserves(tx, params, updates)
    out, _ = assert_transform_step_preserves(ff.set_to_zero(), params, updates)
    assert all(torch.equal(bits(o), bits(torch.full_like(o, -0.0))) for o in tree_leaves(out))


# -- set_to_zero: frozen means bitwise unchanged ----------------------------------------------


def test_frozen_leaves_stay_bitwise_as_they_were_negative_zeros_included(impl):
    params = network_params(1)
    params["embed"]["weight"][0, :3] = torch.tensor([-0.0, 0.0, -1e-30])
    tx = ff.multi_transform(
        {"frozen": ff.set_to_zero(), "body": ff.sgd(LR), "head": ff.sgd(LR)}, LABELS
    )
    state = run_ours(tx, params, fp16_grads(params, steps=3), impl)
    master0 = params["embed"]["weight"].float()
    assert torch.equal(bits(state.master["embed"]["weight"]), bits(master0))
    assert torch.equal(bits(state.params["embed"]["weight"]), bits(master0.half()))


# -- against torch.optim parameter groups --------------------------------------------------------


def test_a_faster_head_follows_torch_sgd_groups_with_their_own_lr(impl):
    params = network_params(2)
    grads = fp16_grads(params, seed=3)
    labels = {"embed": "body", "body": "body", "head": "head"}
    tx = ff.multi_transform(
        {"body": ff.sgd(LR, momentum=0.9), "head": ff.sgd(HEAD_LR, momentum=0.9)}, labels
    )
    state = run_ours(tx, params, grads, impl)

    def make(named):
        body = named["embed"] + named["body"]
        return torch.optim.SGD(
            [{"params": body}, {"params": named["head"], "lr": HEAD_LR}],
            lr=LR,
            momentum=0.9,
            foreach=False,
        )

    opt, named = run_torch(params, grads, make)
    traces = {k: s.inner_state[1].trace for k, s in state.opt_state.inner_states.items()}
    for k, ps in named.items():
        buffers = tree_leaves(traces[labels[k]][k])
        for ours, buf, p in zip(tree_leaves(state.master[k]), buffers, ps, strict=True):
            assert scaled_error(ours, p.detach()) <= 4, k
            assert torch.equal(bits(buf), bits(opt.state[p]["momentum_buffer"])), k


def test_groups_are_bitwise_the_groups_run_separately(impl):
    params = network_params(4)
    grads = fp16_grads(params, seed=5)
    groups = {
        "body": ff.sgd(LR, momentum=0.9, weight_decay=WD),
        "head": ff.sgd(HEAD_LR, momentum=0.9, nesterov=True),
        "frozen": ff.set_to_zero(),
    }
    state = run_ours(ff.multi_transform(groups, LABELS), params, grads, impl)
    for k, label in LABELS.items():
        alone = run_ours(groups[label], {k: params[k]}, [{k: g[k]} for g in grads], "reference")
        for a, b in zip(tree_leaves(alone.master), tree_leaves(state.master[k]), strict=True):
            assert torch.equal(bits(a), bits(b)), k


@pytest.mark.parametrize("how", ["excluded", "lr=0"])
def test_a_frozen_layer_follows_torch_with_the_layer_excluded_or_at_lr_0(impl, how):
    params = network_params(6)
    grads = fp16_grads(params, seed=7)
    tx = ff.multi_transform(
        {
            "frozen": ff.set_to_zero(),
            "body": ff.sgd(LR, momentum=0.9),
            "head": ff.sgd(LR, momentum=0.9),
        },
        LABELS,
    )
    state = run_ours(tx, params, grads, impl)

    def make(named):
        trained = named["body"] + named["head"]
        if how == "excluded":
            return torch.optim.SGD(trained, lr=LR, momentum=0.9, foreach=False)
        return torch.optim.SGD(
            [{"params": trained}, {"params": named["embed"], "lr": 0.0}],
            lr=LR,
            momentum=0.9,
            foreach=False,
        )

    _, named = run_torch(params, grads, make)
    for k, ps in named.items():
        for ours, p in zip(tree_leaves(state.master[k]), ps, strict=True):
            if k == "embed":
                assert torch.equal(bits(ours), bits(p.detach())), k  # both untouched
            else:
                assert scaled_error(ours, p.detach()) <= 4, k


def test_per_group_decay_is_bitwise_the_masked_decay():
    """Two groups differing only in weight decay == one masked decay before one sgd."""
    params = network_params(8)
    grads = fp16_grads(params, steps=8, seed=9)
    labels = tree_map(lambda p: "decay" if p.ndim > 1 else "no_decay", params)
    groups = ff.multi_transform(
        {"decay": ff.sgd(LR, momentum=0.9, weight_decay=WD), "no_decay": ff.sgd(LR, momentum=0.9)},
        labels,
    )
    mask = tree_map(lambda p: p.ndim > 1, params)
    masked = ff.chain(ff.add_decayed_weights(WD, mask=mask), ff.sgd(LR, momentum=0.9))
    a, b = run_ours(groups, params, grads), run_ours(masked, params, grads)
    for x, y in zip(tree_leaves(a.master), tree_leaves(b.master), strict=True):
        assert torch.equal(bits(x), bits(y))


# -- inside fp16_update: skipped steps, checkpoints, bad input ------------------------------------


def network_tx():
    return ff.multi_transform(
        {"body": ff.sgd(LR, momentum=0.9), "head": ff.adam(1e-3), "frozen": ff.set_to_zero()},
        LABELS,
    )


def test_a_skipped_step_leaves_the_whole_state_bitwise_unchanged(impl):
    params = network_params(10)
    grads = fp16_grads(params, steps=4, seed=11)
    state = run_ours(network_tx(), params, grads[:3], impl)
    bad = tree_map(torch.clone, grads[3])
    bad["embed"]["weight"][2, 2] = math.nan  # even in a frozen leaf: the step is skipped
    before = bit_snapshot((state.params, state.master, state.opt_state))
    after = ff.fp16_update(state, bad, impl=impl)
    assert not bool(after.grads_finite)
    assert_bitwise_unchanged((after.params, after.master, after.opt_state), before)
    assert_bitwise_unchanged((state.params, state.master, state.opt_state), before)


def test_a_multi_transform_state_round_trips_through_a_checkpoint(tmp_path):
    params = network_params(12)
    grads = fp16_grads(params, steps=6, seed=13)
    state = run_ours(network_tx(), params, grads[:3])
    ff.save_checkpoint(tmp_path / "g.ckpt", state)
    like = ff.fp16_init(tree_map(torch.zeros_like, params), network_tx(), ff.StaticLossScale(SCALE))
    resumed = ff.load_checkpoint(tmp_path / "g.ckpt", like)
    assert isinstance(resumed.opt_state, ff.MultiTransformState)
    for g in grads[3:]:
        state = ff.fp16_update(state, g)
        resumed = ff.fp16_update(resumed, g)
    for a, b in zip(tree_leaves(state), tree_leaves(resumed), strict=True):
        assert torch.equal(bits(a), bits(b))


def test_bad_arguments_are_named_and_the_callers_state_is_left_untouched():
    params = network_params()
    with pytest.raises(TypeError, match="transforms must be a mapping"):
        ff.multi_transform([ff.sgd(LR)], LABELS)
    with pytest.raises(TypeError, match=r"transforms\['body'\] must be a GradientTransformation"):
        ff.multi_transform({"body": ff.sgd, "head": ff.sgd(LR)}, LABELS)
    with pytest.raises(TypeError, match=r"param_labels\['head'\]: a label must be hashable"):
        ff.multi_transform(
            {"body": ff.sgd(LR), "frozen": ff.set_to_zero()}, {**LABELS, "head": bytearray(b"x")}
        )
    with pytest.raises(ValueError, match=r"param_labels\['head'\]: label 'Head' has no transform"):
        ff.multi_transform(
            {"body": ff.sgd(LR), "head": ff.sgd(LR), "frozen": ff.set_to_zero()},
            {**LABELS, "head": "Head"},
        )
    with pytest.raises(ValueError, match=r"param_labels does not fit params .*: params against "):
        ff.multi_transform({"x": ff.sgd(LR)}, {"body": "x", "head": "x"}).init(params)

    # A label function that turns bad between steps: the update refuses, the state stays.
    calls = []

    def labels_fn(tree):
        calls.append(1)
        return {**LABELS, "head": "body" if len(calls) < 3 else "nobody"}

    tx = ff.multi_transform(
        {"body": ff.sgd(LR, momentum=0.9), "frozen": ff.set_to_zero()}, labels_fn
    )
    state = tx.init(params)
    _, state = tx.update(tree_map(torch.ones_like, params), state, params)
    before = bit_snapshot(state)
    with pytest.raises(ValueError, match=r"param_labels\(updates\)\['head'\]: label 'nobody'"):
        tx.update(tree_map(torch.ones_like, params), state, params)
    assert_bitwise_unchanged(state, before)
    with pytest.raises(ValueError, match="state must be a MultiTransformState"):
        network_tx().update(params, state)


# -- optax, live, under jax.jit ------------------------------------------------------------------


def test_multi_transform_agrees_with_optax_under_jit():
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")
    import numpy as np

    params = network_params(14)
    g = torch.Generator().manual_seed(15)
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

    def labels_fn(p):  # labels as a function, in both libraries
        return {k: LABELS[k] for k in p}

    theirs, their_state = run_optax(
        optax.multi_transform(
            {
                "body": optax.sgd(LR, momentum=0.9),
                "head": optax.chain(optax.add_decayed_weights(WD), optax.sgd(HEAD_LR, 0.9)),
                "frozen": optax.set_to_zero(),
            },
            labels_fn,
        )
    )
    ours, our_state = run_tx(
        ff.multi_transform(
            {
                "body": ff.sgd(LR, momentum=0.9),
                "head": ff.sgd(HEAD_LR, momentum=0.9, weight_decay=WD),
                "frozen": ff.set_to_zero(),
            },
            labels_fn,
        )
    )
    paths = optree.tree_paths(params)
    for path, a, b in zip(paths, ours, theirs, strict=True):
        if path[0] == "embed":
            assert torch.equal(a, b) and torch.equal(a, params["embed"]["weight"])
        else:
            assert scaled_error(a, b) <= 4.0, path
    # The same layout: momentum buffers for the body's and the head's leaves only.
    for label in ("body", "head"):
        ours_n = len(tree_leaves(our_state.inner_states[label]))
        theirs_n = len(jax.tree.leaves(their_state.inner_states[label]))
        assert ours_n - 1 == theirs_n  # our trace also holds its `initialized` flag
