"""The update on the plain kernels (CUDA's default) does its groups' common work itself:
one unscale, one state copy, one refresh (``_fused/across_groups.py``).

* with the sharing and with each group's op called whole (the sharing switched off),
  the same state, bit for bit, pure and donated, through skipped steps (an inf and a
  NaN gradient, working copies that are not their master's rounding) and a schedule;
  one group or several, ``MultiSteps`` (whose donated inner update rounds into the
  mean it was handed);
* a pure update leaves the old state and the gradients untouched;
* the sharing happens where it is declared (plain kernels that only read their
  gradients), and the groups' ops are then given float32 gradients and no working
  copies; a donated update refuses gradients that share memory with the copies.
"""

from __future__ import annotations

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused import across_groups
from functional_fp16._fused import device_kernels as dk
from functional_fp16._fused.steps import fused_plan
from functional_fp16._kernels import cpu as cpu_kernel
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import assert_states_bitwise_equal, optimiser_matrix

GROUPED = ("recipe", "masked_sgd_decay", "labels_sgd_adam")
SHARED = (*GROUPED, "momentum", "nesterov", "clip", "adam", "clip_l2_adam", "schedule")
WHOLE = ("dampening", "lion", "lion_masked")  # plain kernels that write their gradients
STEPS = 6
BAD = {2: float("inf"), 4: float("nan")}


def _params():
    g = torch.Generator().manual_seed(1)
    shapes = {"wte": (16, 8), "attn.w": (24, 8), "attn.b": (24,), "ln.w": (8,), "mlp.w": (8, 8)}
    return {k: (torch.randn(s, generator=g) * 0.1).half() for k, s in shapes.items()}


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    out = {k: (torch.randn(v.shape, generator=g) * 256).to(v.dtype) for k, v in params.items()}
    if step in BAD:
        out["attn.b"].view(-1)[3] = BAD[step]
    return out


def _clone(tree):
    return tree_map(lambda x: x.clone(), tree)


def _optimisers():
    return {**optimiser_matrix(), "multisteps": ff.MultiSteps(ff.sgd(0.05, momentum=0.9), 2)}


def _nudged(state):
    """``state`` with every master a little off its working copy's value (as a user's
    edit of the master leaves it), so that ``fl16(master)`` differs from the copy."""
    return state.replace(master=tree_map(lambda m: m * (1 + 2.0**-7), state.master))


@pytest.fixture
def cuda_default(monkeypatch):
    monkeypatch.setenv(dk.CPU_KERNEL_VARIABLE, "cuda-default")


def _spy(monkeypatch) -> list[bool]:
    seen: list[bool] = []
    real = across_groups.applies

    def applies(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(across_groups, "applies", applies)
    return seen


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize(
    "name, dtype",
    [(n, torch.float16) for n in (*SHARED, "multisteps")]
    + [("recipe", torch.bfloat16), ("multisteps", torch.bfloat16)]
    + [("recipe", torch.float32)],  # FP32: no copies
)
def test_shared_work_is_bitwise_each_groups_op_called_whole(
    cuda_default, monkeypatch, name, dtype, donate
):
    params = _params()
    tx = _optimisers()[name]
    scale = ff.DynamicLossScale(2.0**12, growth_interval=2)
    shared = ff.fp16_init(params, tx, scale, param_dtype=dtype)
    params = {k: v.to(dtype) for k, v in params.items()}
    whole = _clone(shared)
    seen = _spy(monkeypatch)
    skipped = 0
    for step in range(STEPS):
        grads = _grads(params, step)
        if step in BAD:  # a skipped step keeps working copies that are not the master's
            shared, whole = _nudged(shared), _nudged(whole)  # rounding bit for bit
        shared = ff.fp16_update(shared, grads, donate=donate)
        with monkeypatch.context() as m:
            m.setattr(across_groups, "applies", lambda *a: False)
            whole = ff.fp16_update(whole, grads, donate=donate)
        assert_states_bitwise_equal(shared, whole)
        skipped += not bool(shared.grads_finite)
    assert seen and all(seen)  # the sharing ran, every step (MultiSteps: each micro-batch)
    assert skipped >= len(BAD)  # both kinds of skip were seen (and MultiSteps' windows)


@pytest.mark.parametrize("name", GROUPED)
def test_a_pure_shared_update_leaves_its_inputs_untouched(cuda_default, monkeypatch, name):
    params = _params()
    state = ff.fp16_init(params, optimiser_matrix()[name], ff.DynamicLossScale(2.0**12))
    seen = _spy(monkeypatch)
    for step in (0, 2):  # an applied step, then a skipped one
        grads = _grads(params, step)
        before, grads_before = _clone(state), _clone(grads)
        new = ff.fp16_update(state, grads)
        assert_states_bitwise_equal(state, before)
        assert_states_bitwise_equal(grads, grads_before)
        new_leaves = tree_leaves((new.params, new.master, new.opt_state))
        old_ptrs = {
            x.data_ptr() for x in tree_leaves((state.params, state.master, state.opt_state))
        }
        assert not any(x.data_ptr() in old_ptrs for x in new_leaves if x.numel())
        state = new
    assert seen == [True, True]


def test_the_groups_ops_step_masters_from_float32_gradients(cuda_default, monkeypatch):
    """What the groups' ops are given when the work is shared: the unscaled float32
    gradients (nothing left to unscale or clip) and no working copies."""
    from functional_fp16._fused import adam

    given = []
    real = adam.ADAM_OPS.call

    def call(donated, a):
        given.append((donated, a))
        return real(donated, a)

    monkeypatch.setattr(adam, "ADAM_OPS", adam.ADAM_OPS._replace(call=call))
    params = _params()
    state = ff.fp16_init(params, optimiser_matrix()["recipe"])
    assert len(fused_plan(state).groups) == 2
    ff.fp16_update(state, _grads(params, 0))
    assert len(given) == 2
    for donated, a in given:
        assert donated  # on the pure update's own copies
        assert {g.dtype for g in a["grads"]} == {torch.float32}
        assert a["inv"] is None and a["clip_div"] is None and a["clip_mul"] is None
        assert a["params"] == [] and not any(a["separate"])


@pytest.mark.parametrize("name", WHOLE)
def test_plain_kernels_that_write_their_gradients_call_each_op_whole(
    cuda_default, monkeypatch, name
):
    seen = _spy(monkeypatch)
    params = _params()
    ff.fp16_update(ff.fp16_init(params, optimiser_matrix()[name]), _grads(params, 0))
    assert seen == [False]


def test_the_c_kernel_calls_each_op_whole(monkeypatch):
    if not cpu_kernel.available():
        pytest.skip("no C compiler here: the CPU runs the plain kernels")
    seen = _spy(monkeypatch)
    monkeypatch.setenv(dk.CPU_KERNEL_VARIABLE, "c")
    params = _params()
    ff.fp16_update(ff.fp16_init(params, optimiser_matrix()["recipe"]), _grads(params, 0))
    assert seen == [False]


def test_donated_gradients_that_share_memory_with_a_copy_are_refused():
    """``MultiSteps`` hands its donated inner update float32 gradients, whose memory the
    refresh then writes: one that overlaps a working copy or another such gradient is
    refused, naming both leaves; without working copies nothing is written there."""
    state = ff.fp16_init(_params(), ff.sgd(0.05, momentum=0.9))
    fp, copies = fused_plan(state), tree_leaves(state.params)
    grads = [torch.zeros(p.shape) for p in copies]
    assert across_groups.donated_room(fp, grads, copies) is grads
    on_copy = list(grads)
    on_copy[1] = copies[1].view(torch.float32)  # the copy's own memory
    with pytest.raises(ValueError, match=r"grads\[1\] and params\[1\] share memory"):
        across_groups.donated_room(fp, on_copy, copies)
    shared = list(grads)
    shared[3] = grads[2]
    with pytest.raises(ValueError, match=r"grads\[2\] and grads\[3\] share memory"):
        across_groups.donated_room(fp, shared, copies)
    fp32 = ff.fp16_init(_params(), ff.sgd(0.05, momentum=0.9), param_dtype=torch.float32)
    assert across_groups.donated_room(fused_plan(fp32), shared, copies) is None


def test_a_pure_update_takes_float32_gradients_that_share_memory(cuda_default, monkeypatch):
    """The ops only read their gradients: float32 leaves given the same gradient tensor
    (nothing to unscale, so the ops read them as given) are accepted, left untouched, and
    step as each op called whole does."""
    params = {"a": torch.zeros(8), "b": torch.ones(8)}
    grads = (lambda z: {"a": z, "b": z})(torch.full((8,), 0.5))
    for tx in (ff.sgd(0.1, momentum=0.9), ff.adam(1e-3)):
        state = ff.fp16_init(params, tx, ff.NoOpLossScale(), param_dtype=torch.float32)
        seen = _spy(monkeypatch)
        shared = ff.fp16_update(state, grads)
        with monkeypatch.context() as m:
            m.setattr(across_groups, "applies", lambda *a: False)
            whole = ff.fp16_update(state, grads)
        assert seen == [True]
        assert_states_bitwise_equal(shared, whole)
        assert torch.equal(grads["a"], torch.full((8,), 0.5))
