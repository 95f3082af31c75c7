"""Stored moments inside the fused step (``functional_fp16::adam_stored_step``).

Every kernel (the C kernel, and the plain kernel CUDA runs by default, forced on
the CPU) against the reference chain (``impl="reference"``), one step from the
same state at a time:

* codes, block scales and 16-bit moments **bitwise** the reference's: the
  moments' float32 arithmetic is the reference's operation for operation (the
  contractions of torch's ``lerp`` and ``addcmul``), the decode and the encode
  (a block's scale, each code, the stochastic rounding's hash) are exact
  functions of it;
* the master within the contract's one ulp of the step (the contracted
  ``m + lr * s``), the FP16 params its rounding;
* a skipped step a no-op on every byte (codes, scales, master, params);
* ``vmap`` members as each alone, ``torch.compile(fullgraph=True)`` as eager,
  donation as the pure step.
"""

from __future__ import annotations

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._fused import device_kernels as dk
from functional_fp16._fused.adam_stored import ADAM_STORED_OPS
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import (
    assert_bitwise_unchanged,
    assert_states_bitwise_equal,
    assert_within_one_operation_ulp,
    bit_snapshot,
    bits,
    count_c_kernel_calls,
    stored_step_grads,
)

KERNELS = ["c", "cuda-default"]

FORMATS = {
    "int8": dict(mu_dtype="int8", nu_dtype="int8"),
    "bf16": dict(mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
    "fp16_mu_int8_nu": dict(mu_dtype=torch.float16, nu_dtype="int8", block_size=64),
    "lion_e4m3": dict(mu_dtype="e4m3", block_size=128),
    "lion_bf16": dict(mu_dtype=torch.bfloat16),
    "sgd_e4m3": dict(momentum=0.9, nesterov=True, accumulator_dtype="e4m3"),
    "sgd_bf16_dampened": dict(momentum=0.9, dampening=0.1, accumulator_dtype=torch.bfloat16),
}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(96, 64, generator=g) * 0.1).half(),  # coded: whole blocks
        "v": (torch.randn(41, 300, generator=g) * 0.1).half(),  # a row of a block and a rest
        "t": (torch.randn(6, 8, 40, generator=g) * 0.1).half(),  # rows of 320 in 3-d
        "n": (torch.randn(5, 8, generator=g) * 0.1).half(),  # rows under 64: float32
        "b": torch.randn(64, generator=g) * 0.1,  # a vector: float32, no working copy
    }


MASK = {"w": True, "v": True, "t": True, "n": True, "b": False}


def _tx(fmt: str, rounding: str, l2: bool = False, formats: dict = FORMATS):
    kw = dict(formats[fmt], moment_rounding=rounding)
    if fmt.startswith("lion"):
        return ff.chain(ff.clip_by_global_norm(1.0), ff.lion(1e-4, weight_decay=0.1, **kw))
    if fmt.startswith("sgd"):  # SGD's trace keeps no count: it rounds to nearest
        kw = {k: v for k, v in kw.items() if k != "moment_rounding"}
        sgd = ff.sgd(0.05, **kw)
        return ff.chain(ff.clip_by_global_norm(1.0), ff.add_decayed_weights(1e-3, mask=MASK), sgd)
    if l2:
        inner = ff.chain(ff.add_decayed_weights(0.01), ff.adam(1e-3, **kw))
    else:
        inner = ff.adamw(1e-3, weight_decay=0.1, mask=MASK, **kw)
    return ff.chain(ff.clip_by_global_norm(1.0), inner)


def _use(monkeypatch, kernel):
    monkeypatch.setenv(dk.CPU_KERNEL_VARIABLE, kernel)


def _assert_step_matches(new, ref, old):
    """Moments bitwise, master within one ulp of the step, params its rounding."""
    assert_states_bitwise_equal(new.opt_state, ref.opt_state)
    assert_states_bitwise_equal(new.loss_scale, ref.loss_scale)
    for k in ref.master:
        assert_within_one_operation_ulp(new.master[k], ref.master[k], old.master[k])
        if new.params[k].dtype != torch.float32:
            assert torch.equal(bits(new.params[k]), bits(new.master[k].to(new.params[k].dtype)))


# SGD's trace rounds to nearest whatever is asked: its one case is "nearest".
CASES = [(f, r) for f in sorted(FORMATS) for r in ("nearest", "stochastic")]
CASES = [(f, r) for f, r in CASES if not (f.startswith("sgd") and r == "stochastic")]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt, rounding", CASES)
def test_each_step_matches_the_reference(monkeypatch, kernel, fmt, rounding):
    _use(monkeypatch, kernel)
    state = ff.fp16_init(_params(), _tx(fmt, rounding), ff.DynamicLossScale(2.0**10))
    assert ff.update_path(state) == "fused"
    stored = {x.dtype for x in tree_leaves(state.opt_state)}
    assert stored & {torch.uint8, torch.bfloat16, torch.float16}, stored
    for step in range(5):
        grads = stored_step_grads(state, step, bad=float("inf") if step == 3 else None)
        ref = ff.fp16_update(state, grads, impl="reference")
        new = ff.fp16_update(state, grads)
        assert bool(new.grads_finite) == (step != 3)
        _assert_step_matches(new, ref, state)
        state = ref  # the next step from the reference's state


@pytest.mark.parametrize("kernel", KERNELS)
def test_adam_with_l2_decay_matches_the_reference(monkeypatch, kernel):
    """Adam's L2 term reads the master into the moments: still bitwise from one state."""
    _use(monkeypatch, kernel)
    state = ff.fp16_init(_params(1), _tx("int8", "stochastic", l2=True))
    for step in range(3):
        grads = stored_step_grads(state, step)
        ref = ff.fp16_update(state, grads, impl="reference")
        _assert_step_matches(ff.fp16_update(state, grads), ref, state)
        state = ref


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "bf16", "lion_e4m3", "sgd_e4m3"])
def test_a_skipped_step_leaves_every_byte(monkeypatch, kernel, donate, fmt):
    _use(monkeypatch, kernel)
    state = ff.fp16_init(_params(), _tx(fmt, "stochastic"), ff.DynamicLossScale(2.0**10))
    for step in range(2):
        state = ff.fp16_update(state, stored_step_grads(state, step))
    kept = (state.master, state.params, state.opt_state)
    before = bit_snapshot(kept)
    for bad in (float("inf"), float("nan")):
        copy = tree_map(torch.clone, state) if donate else state
        skipped = ff.fp16_update(copy, stored_step_grads(state, 5, bad=bad), donate=donate)
        assert not bool(skipped.grads_finite)
        assert_bitwise_unchanged((skipped.master, skipped.params, skipped.opt_state), before)
    assert_bitwise_unchanged(kept, before)


# Adam with both moments in E4M3 codes: the C kernel's decoded-inline step, in place.
DONATED_FORMATS = {**FORMATS, "adam_e4m3": dict(mu_dtype="e4m3", nu_dtype="e4m3")}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", list(DONATED_FORMATS))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("master", ["float32", "split"])
def test_donation_is_the_pure_step(monkeypatch, kernel, fmt, rounding, master):
    """A donated step (every state written in place; with a split master, the moments in
    place and the master through its float32 buffers) is bitwise the pure step, for every
    stored format and rounding."""
    _use(monkeypatch, kernel)
    tx = _tx(fmt, rounding, formats=DONATED_FORMATS)
    state = ff.fp16_init(_params(), tx, ff.DynamicLossScale(2.0**10), master=master)
    donated = tree_map(torch.clone, state)
    for step in range(3):
        grads = stored_step_grads(state, step)
        state = ff.fp16_update(state, grads)
        donated = ff.fp16_update(donated, grads, donate=True)
        assert_states_bitwise_equal(donated, state)


def test_the_c_kernel_runs_the_stored_step_once_per_group(monkeypatch):
    """One C++ op call per group of the plan (decayed and not), and no call as written."""
    calls = count_c_kernel_calls(monkeypatch, [])
    state = ff.fp16_init(_params(), _tx("int8", "stochastic"))
    ff.fp16_update(state, stored_step_grads(state, 0))
    assert calls.count("adam_stored_update") == 2, calls
    assert set(calls) <= {"adam_stored_update", "grad_stats"}, calls
    calls.clear()
    state = ff.fp16_init(_params(), _tx("lion_e4m3", "stochastic"))
    ff.fp16_update(state, stored_step_grads(state, 0))
    assert calls.count("lion_stored_update") == 1, calls
    calls.clear()
    state = ff.fp16_init(_params(), _tx("sgd_e4m3", "nearest"))
    ff.fp16_update(state, stored_step_grads(state, 0))
    assert calls.count("sgd_stored_update") == 2, calls  # decayed and not


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", ["int8", "lion_e4m3", "sgd_e4m3"])
def test_vmap_members_step_as_alone(monkeypatch, kernel, fmt):
    _use(monkeypatch, kernel)
    tx = _tx(fmt, "stochastic")
    states = [ff.fp16_init(_params(seed), tx, ff.DynamicLossScale(2.0**10)) for seed in (0, 1)]
    for step in range(2):
        grads = [stored_step_grads(s, step + 3 * i) for i, s in enumerate(states)]
        batched = torch.func.vmap(ff.fp16_update)(ff.tree_stack(states), ff.tree_stack(grads))
        states = [ff.fp16_update(s, g) for s, g in zip(states, grads)]
        for i, alone in enumerate(ff.tree_unstack(batched)):
            assert_states_bitwise_equal(alone, states[i])


def test_compiled_update_is_eager():
    """One compiled graph runs the three stored steps (a group each, by label) as eager
    mode does, bitwise."""
    labels = {"w": "adam", "v": "lion", "t": "sgd", "n": "adam", "b": "adam"}
    tx = ff.multi_transform(
        {
            "adam": ff.adamw(1e-3, weight_decay=0.1, mu_dtype="e4m3", nu_dtype="e4m3"),
            "lion": ff.lion(1e-4, mu_dtype=torch.bfloat16),
            "sgd": ff.sgd(0.05, momentum=0.9, accumulator_dtype="e4m3"),
        },
        labels,
    )
    state = ff.fp16_init(_params(), tx, ff.DynamicLossScale(2.0**10))
    assert ff.update_path(state) == "fused"
    torch._dynamo.reset()  # no dynamic shapes carried over from an earlier test's compiles
    step = torch.compile(ff.fp16_update, fullgraph=True)
    for i in range(2):
        grads = stored_step_grads(state, i)
        eager = ff.fp16_update(state, grads)
        assert_states_bitwise_equal(step(state, grads), eager)
        state = eager


def _op_args(**change):
    g = [torch.randn(8, 128).half(), torch.randn(8).half()]
    a = dict(
        grads=g,
        master=[x.float() for x in g],
        mu=[torch.zeros(8, 128, dtype=torch.uint8), torch.zeros(8)],
        nu=[torch.zeros(8, 128, dtype=torch.bfloat16), torch.zeros(8)],
        mu_scales=[torch.ones(8, 2)],
        nu_scales=[],
        params=[x.clone() for x in g],
        separate=[True, True],
        inv=None,
        clip_div=None,
        clip_mul=None,
        lr=torch.full((1,), -1e-3),
        apply=None,
        require=None,
        inv_c1=torch.ones(1),
        sqrt_c2=torch.ones(1),
        count=torch.ones(1, dtype=torch.int64),
        l2=0.0,
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        decoupled=0.0,
        block_size=64,
        rounding=1,
        salt_ids=[0, 1],
        members=1,
    )
    a.update(change)
    return a


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "change, message",
    [
        ({"mu_scales": [torch.ones(8, 3)]}, r"mu_scales\[0\] \(of mu\[0\]\) must be contiguous"),
        ({"mu_scales": []}, r"mu_scales has 0 tensors, expected 1"),
        ({"nu_scales": [torch.ones(8, 2)]}, r"nu_scales has 1 tensors, expected 0"),
        ({"mu_scales": [torch.ones(8, 2, dtype=torch.float64)]}, r"mu_scales\[0\]"),
        ({"nu": [torch.zeros(8, 128, dtype=torch.int16), torch.zeros(8)]}, r"nu\[0\] has dtype"),
        ({"count": None}, "count is required"),
        ({"count": torch.ones(1)}, "count must be torch.int64"),
        ({"salt_ids": [0]}, "salt_ids has 1 entries"),
        ({"rounding": 2}, "rounding must be 0"),
        ({"block_size": 48}, "block_size must be a positive power of two"),
        ({"mu": [torch.zeros(8, 128, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)]},
         "mu_scales has 1 tensors, expected 2"),
    ],
)  # fmt: skip
def test_the_op_refuses_bad_arguments_by_name(monkeypatch, kernel, change, message):
    """Checked in Python before any kernel, naming the argument and the leaf; nothing
    written."""
    _use(monkeypatch, kernel)
    a = _op_args(**change)
    before = bit_snapshot([a["master"], a["params"], a["mu"], a["nu"]])
    for donated in (False, True):
        with pytest.raises((ValueError, TypeError), match=message):
            ADAM_STORED_OPS.call(donated, dict(a))
    assert_bitwise_unchanged([a["master"], a["params"], a["mu"], a["nu"]], before)
