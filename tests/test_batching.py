"""Ensembles under torch.func.vmap: torch's pytree view, tree_stack, and a vmapped update
that is bitwise K unbatched updates, member by member."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_paths
from tests.helpers import bits

K = 4
SHAPES = {"w": (6, 5), "b": (5,), "s": ()}


def member_state(seed: int, tx, scale: float = 2.0**10):
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(s, generator=g) * 0.1 for k, s in SHAPES.items()}
    return ff.fp16_init(params, tx, ff.DynamicLossScale(scale, growth_interval=2))


def member_grads(seed: int, bad: float | None = None):
    g = torch.Generator().manual_seed(1000 + seed)
    grads = {k: (torch.randn(s, generator=g) * 50).half() for k, s in SHAPES.items()}
    if bad is not None:
        grads["b"][seed % 5] = bad
    return grads


def assert_member_bitwise(stacked, k, single):
    for path, a, b in zip(tree_paths(single), tree_leaves(single), tree_leaves(stacked)):
        assert a.dtype == b.dtype and a.shape == b[k].shape, path
        assert torch.equal(bits(a), bits(b[k])), f"member {k}{path}"


def test_the_library_containers_are_torch_pytrees_with_the_same_leaves():
    state = member_state(0, ff.adamw(1e-3))
    torch_leaves, spec = torch_pytree.tree_flatten(state)
    # the same tensors (torch keeps dicts in insertion order, optree sorts their keys)
    assert sorted(map(id, torch_leaves)) == sorted(map(id, tree_leaves(state)))
    back = torch_pytree.tree_unflatten(torch_leaves, spec)
    assert isinstance(back, ff.FP16State) and back.tx is state.tx
    assert back.loss_scale.config() == state.loss_scale.config()
    keyed = torch_pytree.tree_flatten_with_path(state)[0]
    assert sorted(torch_pytree.keystr(p) for p, _ in keyed) == sorted(tree_paths(state))


@pytest.mark.parametrize("kernel", ["c", "cuda-default"])
@pytest.mark.parametrize("opt", ["sgd", "adamw", "lion", "rmsprop", "multisteps"])
def test_vmapped_update_is_bitwise_k_unbatched_updates(opt, kernel, impl, monkeypatch):
    monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", kernel)  # and CUDA's default kernel
    tx = {
        "sgd": ff.sgd(0.05, momentum=0.9, weight_decay=1e-3),
        "adamw": ff.adamw(1e-3, weight_decay=1e-2),
        "lion": ff.lion(1e-3, weight_decay=1e-2),
        "rmsprop": ff.rmsprop(1e-3, momentum=0.9),
        "multisteps": ff.MultiSteps(ff.adam(1e-3), every_k_schedule=2),
    }[opt]
    states = [member_state(k, tx) for k in range(K)]
    stacked = ff.tree_stack(states)
    update = torch.func.vmap(lambda s, g: ff.fp16_update(s, g, impl=impl))
    for step in range(5):
        grads = [member_grads(k, math.inf if k == step % K else None) for k in range(K)]
        stacked = update(stacked, ff.tree_stack(grads))
        states = [ff.fp16_update(s, g, impl=impl) for s, g in zip(states, grads)]
        for k in range(K):
            assert_member_bitwise(stacked, k, states[k])
    # each member overflowed once, at its own step: its own decision and scale
    assert isinstance(stacked, ff.FP16State) and stacked.step.shape == (K,)


@settings(max_examples=15, deadline=None)
@given(pattern=st.lists(st.lists(st.booleans(), min_size=K, max_size=K), min_size=1, max_size=4))
def test_members_overflow_and_back_off_alone(pattern):
    tx = ff.sgd(0.05, momentum=0.9)
    states = [member_state(k, tx, scale=2.0 ** (8 + k)) for k in range(K)]
    stacked = ff.tree_stack(states)
    update = torch.func.vmap(ff.fp16_update)
    for step, overflow in enumerate(pattern):
        grads = [
            member_grads(k + 10 * step, math.nan if o else None) for k, o in enumerate(overflow)
        ]
        stacked = update(stacked, ff.tree_stack(grads))
        states = [ff.fp16_update(s, g) for s, g in zip(states, grads)]
        assert stacked.grads_finite.tolist() == [not o for o in overflow]
    for k in range(K):
        assert_member_bitwise(stacked, k, states[k])


def test_vmapped_loss_gradients_and_update_train_each_member_as_alone():
    """The whole step under vmap: forward, scaled gradients, update."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 6), torch.randint(0, 5, (32,))
    tx = ff.sgd(0.1, momentum=0.9)
    # member 1 starts with a scale that overflows FP16 gradients: it alone backs off
    states = [member_state(k, tx, scale=2.0 ** (24 if k == 1 else 8)) for k in range(K)]

    def loss_fn(params, x, y):
        logits = x.half() @ params["w"] + params["b"] + params["s"]
        return F.cross_entropy(logits.float(), y)

    def train_step(state, x, y):
        def scaled(params):
            loss = loss_fn(params, x, y)
            return state.loss_scale.scale(loss), loss

        grads, loss = torch.func.grad(scaled, has_aux=True)(state.params)
        return ff.fp16_update(state, grads, loss=loss), loss

    stacked, losses = torch.func.vmap(train_step, in_dims=(0, None, None))(
        ff.tree_stack(states), x, y
    )
    alone = [train_step(s, x, y) for s in states]
    assert stacked.grads_finite.tolist() == [bool(s.grads_finite) for s, _ in alone]
    assert not bool(stacked.grads_finite[1]) and bool(stacked.grads_finite[0])
    assert stacked.loss_scale.loss_scale.tolist() == [
        float(s.loss_scale.loss_scale) for s, _ in alone
    ]
    for k, (s, loss) in enumerate(alone):
        # batched and unbatched matmuls may round differently; the steps agree closely
        torch.testing.assert_close(stacked.master["w"][k], s.master["w"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(losses[k], loss)


def test_tree_stack_and_unstack_round_trip_and_name_what_differs():
    tx = ff.adam(1e-3)
    states = [member_state(k, tx) for k in range(3)]
    back = ff.tree_unstack(ff.tree_stack(states))
    for a, b in zip(back, states):
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(tree_leaves(a), tree_leaves(b)))
        assert a.tx is tx
    with pytest.raises(ValueError, match=r"trees\[1\] differs from trees\[0\].*share it"):
        ff.tree_stack([member_state(0, ff.adam(1e-3)), member_state(1, ff.adam(1e-3))])
    with pytest.raises(ValueError, match="at least one tree"):
        ff.tree_stack([])
    with pytest.raises(ValueError, match="leading"):
        ff.tree_unstack({"a": torch.zeros(2), "b": torch.zeros(3)})
