"""Masked and labelled optimisers on the fused path: groups, one compiled graph, bad input.

The optimiser matrix (``tests/helpers.py``) holds the recipe, a masked decay
and labelled SGD/Adam groups, so every matrix test (fused against foreach
and reference, skipped steps, signatures) covers them; this module pins what
is particular to groups.
"""

from __future__ import annotations

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused.steps import fused_plan
from functional_fp16._util.tree import tree_leaves
from tests.helpers import (
    assert_states_bitwise_equal,
    assert_within_one_operation_ulp,
    optimiser_matrix,
)

GROUPED = ("recipe", "masked_sgd_decay", "labels_sgd_adam")


def block_params():
    """A transformer block's leaf kinds: matrices and vectors, in a dict."""
    g = torch.Generator().manual_seed(0)
    shapes = {"wte": (16, 8), "attn.w": (24, 8), "attn.b": (24,), "ln.w": (8,), "mlp.w": (8, 8)}
    return {k: (torch.randn(s, generator=g) * 0.1).half() for k, s in shapes.items()}


def grads_for(params, step, bad=None):
    g = torch.Generator().manual_seed(step)
    out = {k: (torch.randn(v.shape, generator=g) * 64).half() for k, v in params.items()}
    if bad is not None:
        out[bad] = out[bad].clone()
        out[bad].view(-1)[0] = float("inf")
    return out


@pytest.mark.parametrize("name", GROUPED)
def test_masks_and_labels_resolve_into_groups_that_cover_every_leaf_once(name):
    state = ff.fp16_init(block_params(), optimiser_matrix()[name])
    assert ff.update_path(state) == "fused"
    fp = fused_plan(state)
    assert len(fp.groups) == 2  # matrices and vectors
    leaves = sorted(i for g in fp.groups for i in g.leaves)
    assert leaves == list(range(len(tree_leaves(state.params))))


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_fused_steps_follow_foreach_decisions_bitwise_master_within_one_ulp(name):
    """From the same state, one fused step and one foreach step: decisions, scale and
    counters bitwise; every master element within 1 ulp at the scale of the operation
    (the fused kernel contracts multiply-adds)."""
    params = block_params()
    state = ff.fp16_init(params, optimiser_matrix()[name], ff.DynamicLossScale(growth_interval=2))
    for step in range(8):
        bad = "attn.b" if step == 3 else None
        grads = grads_for(params, step, bad)
        fused = ff.fp16_update(state, grads, impl="fused")
        other = ff.fp16_update(state, grads, impl="foreach")
        assert bool(fused.grads_finite) == bool(other.grads_finite) == (bad is None)
        assert_states_bitwise_equal(fused.loss_scale, other.loss_scale)
        assert torch.equal(fused.step, other.step)
        counters = [x for x in tree_leaves(fused.opt_state) if x.dtype in (torch.int32, torch.bool)]
        theirs = [x for x in tree_leaves(other.opt_state) if x.dtype in (torch.int32, torch.bool)]
        assert len(counters) == len(theirs) and all(
            torch.equal(a, b) for a, b in zip(counters, theirs)
        )
        for new, ref, old in zip(
            tree_leaves(fused.master), tree_leaves(other.master), tree_leaves(state.master)
        ):
            assert_within_one_operation_ulp(new, ref, old)  # 1 ulp at the operation's scale
        if bad is not None:  # a skipped step is a no-op on every state tensor
            assert_states_bitwise_equal(fused.master, state.master)
            assert_states_bitwise_equal(fused.opt_state, state.opt_state)
            assert_states_bitwise_equal(fused.params, state.params)
        state = fused


def test_the_recipe_compiles_to_one_graph_without_recompiles_and_matches_eager():
    params = block_params()
    tx = optimiser_matrix()["recipe"]
    state = ff.fp16_init(params, tx, ff.DynamicLossScale(growth_interval=5))
    explained = torch._dynamo.explain(ff.fp16_update)(state, grads_for(params, 0))
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    graph = explained.graphs[0].code
    assert "functional_fp16.adam_step" in graph and "functional_fp16.grad_stats" in graph
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    compiled = torch.compile(ff.fp16_update, fullgraph=True, backend=backend)
    eager = state
    grew = skipped = False
    for step in range(24):
        bad = "mlp.w" if step in (4, 13) else None
        grads = grads_for(params, step, bad)
        before = float(eager.loss_scale.loss_scale)
        state = compiled(state, grads)
        eager = ff.fp16_update(eager, grads)
        grew |= float(eager.loss_scale.loss_scale) > before
        skipped |= not bool(eager.grads_finite)
        assert bool(state.grads_finite) == bool(eager.grads_finite)
        assert_states_bitwise_equal(state.loss_scale, eager.loss_scale)
        for a, b in zip(tree_leaves(state.master), tree_leaves(eager.master)):
            assert torch.allclose(a, b, rtol=1e-6, atol=0)
    assert grew and skipped
    assert len(frames) == 1  # no recompiles over 24 steps with skips and a growth


def test_multisteps_over_the_recipe_takes_the_fused_path():
    params = block_params()
    tx = ff.MultiSteps(optimiser_matrix()["recipe"], every_k_schedule=2)
    state = ff.fp16_init(params, tx)
    assert ff.update_path(state) == "fused"
    reference = state
    for step in range(4):
        grads = grads_for(params, step)
        state = ff.fp16_update(state, grads)
        reference = ff.fp16_update(reference, grads, impl="reference")
        assert bool(state.grads_finite) == bool(reference.grads_finite)
    for a, b in zip(tree_leaves(state.master), tree_leaves(reference.master)):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)  # two applied steps, contracted


def test_bad_masks_and_labels_are_refused_at_init_naming_the_path():
    params = block_params()
    with pytest.raises(TypeError, match=r"mask\['ln.w'\]"):
        ff.adamw(1e-3, mask={**{k: True for k in params}, "ln.w": 1})
    with pytest.raises(ValueError, match="mask does not fit params"):
        ff.fp16_init(params, ff.adamw(1e-3, mask={"wte": True}))
    with pytest.raises(ValueError, match="label 'head' has no transform"):
        ff.multi_transform({"body": ff.sgd(0.1)}, {k: "head" for k in params})
    labels = lambda tree: {k: "head" for k in tree}  # noqa: E731
    with pytest.raises(ValueError, match="has no transform"):
        ff.fp16_init(params, ff.multi_transform({"body": ff.sgd(0.1)}, labels))


def _ops_run(fn) -> set[str]:
    """The ``functional_fp16`` step ops (outer and C++) that ``fn()`` dispatched (not the
    gradients' metadata check, ``functional_fp16_layout``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    kinds = ("functional_fp16::", "functional_fp16_cpu::")
    return {e.name for e in prof.events() if e.name.startswith(kinds)}


@pytest.mark.parametrize("name", ["sgd_momentum", "recipe", "labels_sgd_adam"])
@pytest.mark.parametrize("donate", [False, True])
def test_the_direct_eager_call_is_the_op_call_bitwise(name, donate, monkeypatch):
    """In plain eager mode the fused update calls the C++ op without the outer op's
    dispatch; forcing every call through ``functional_fp16::*`` gives the same state,
    bit for bit, through a skipped step."""
    from functional_fp16._fused import op_library
    from functional_fp16._kernels import cpu

    if not cpu.ops_available():
        pytest.skip(cpu.ops_reason())
    tx = optimiser_matrix().get(name) or ff.sgd(0.05, momentum=0.9)
    params = block_params()
    states = [ff.fp16_init(params, tx, ff.DynamicLossScale(growth_interval=2)) for _ in range(2)]
    for step in range(5):
        grads = grads_for(params, step, bad="attn.b" if step == 2 else None)

        def direct():
            states[0] = ff.fp16_update(states[0], grads, donate=donate)

        def through_op():
            states[1] = ff.fp16_update(states[1], grads, donate=donate)

        ran = _ops_run(direct)
        assert ran and all(n.startswith("functional_fp16_cpu::") for n in ran), ran
        with monkeypatch.context() as m:
            m.setattr(op_library, "_transformed", lambda: True)
            ran = _ops_run(through_op)
        assert any(n.startswith("functional_fp16::") for n in ran), ran
        assert_states_bitwise_equal(states[0], states[1])
    assert [bool(s.grads_finite) for s in states] == [True, True]
