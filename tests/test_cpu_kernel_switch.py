"""``$FUNCTIONAL_FP16_CPU_KERNEL``: the CPU runs the compiled C kernel (``c``) or exactly
the kernel a CUDA device runs by default (``cuda-default``), so that path is tested,
profiled and counted without a GPU (``benchmarks/bench_cuda_default.py``).

* the switch makes ``kernel_for(cpu)`` what ``kernel_for`` answers for CUDA without
  opt-ins; a bad value raises, naming the variable;
* under the switch the update calls no ``functional_fp16_cpu::`` op and no C entry;
* one update of SGD-momentum and of the AdamW recipe under the switch, from the same
  state as the C kernel's: the same decisions, loss scale and counts, the master within
  one ulp at its operation's scale, the FP32 states too, the working copies the master
  rounded.
"""

import math
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import functional_fp16 as ff
from functional_fp16._fused import device_kernels as dk
from functional_fp16._fused import op_library
from functional_fp16._kernels import cpu as cpu_kernel
from functional_fp16._util.tree import tree_leaves, tree_map
from functional_fp16.update import dispatch
from tests.helpers import (
    assert_states_bitwise_equal,
    assert_within_one_operation_ulp,
    bits,
    count_c_kernel_calls,
    matrices,
    matrix_grads,
    random_tree,
)

VAR = dk.CPU_KERNEL_VARIABLE
CPU = torch.device("cpu")


def _cuda_default(monkeypatch) -> str:
    """What ``kernel_for`` answers for a CUDA device without opt-ins."""
    monkeypatch.delenv(dk.CUDA_KERNEL_VARIABLE, raising=False)
    return dk.kernel_for(torch.device("cuda", 0))


def test_the_variable_is_named_as_documented():
    assert VAR == "FUNCTIONAL_FP16_CPU_KERNEL"


def test_the_switch_makes_the_cpu_answer_cudas_default(monkeypatch):
    cuda = _cuda_default(monkeypatch)
    assert cuda == dk.CUDA_DEFAULT_KERNEL == "generic"
    monkeypatch.delenv(VAR, raising=False)
    assert dk.kernel_for(CPU) == ("c" if cpu_kernel.available() else "generic")
    for value in ("c", " C ", ""):
        monkeypatch.setenv(VAR, value)
        assert dk.kernel_for(CPU) == ("c" if cpu_kernel.available() else "generic")
    for value in ("cuda-default", "CUDA-Default"):
        monkeypatch.setenv(VAR, value)
        assert dk.kernel_for(CPU) == cuda
        assert op_library.kernel_for(CPU) == cuda  # the ops' hook asks the same function
    # the retired CUDA choice does not reach the CPU: still CUDA's default
    monkeypatch.setenv(dk.CUDA_KERNEL_VARIABLE, "triton")
    assert dk.kernel_for(CPU) == cuda
    assert dk.kernel_for(torch.device("meta")) == "generic"  # other devices: unchanged


@pytest.mark.parametrize("value", ["cuda", "generic", "triton", "cuda_default"])
def test_a_bad_value_raises_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(
        ValueError, match=f"FUNCTIONAL_FP16_CPU_KERNEL must be 'c' or 'cuda-default', got '{value}'"
    ):
        dk.kernel_for(CPU)
    state = ff.fp16_init({"w": torch.zeros(4, dtype=torch.float16)}, ff.sgd(0.1, momentum=0.9))
    with pytest.raises(ValueError, match="FUNCTIONAL_FP16_CPU_KERNEL"):
        ff.fp16_update(state, {"w": torch.ones(4, dtype=torch.float16)})


def test_the_monkeypatch_hook_still_decides_for_the_ops(monkeypatch):
    """Tests choose the ops' kernel through ``op_library.kernel_for``; the switch does not
    override it."""
    monkeypatch.setenv(VAR, "cuda-default")
    seen = []

    def choose(device):
        seen.append(device.type)
        return "generic"

    monkeypatch.setattr(op_library, "kernel_for", choose)
    state = ff.fp16_init({"w": torch.zeros(4, dtype=torch.float16)}, ff.sgd(0.1, momentum=0.9))
    ff.fp16_update(state, {"w": torch.ones(4, dtype=torch.float16)})
    assert seen and set(seen) == {"cpu"}


def _recipe():
    return ff.chain(
        ff.clip_by_global_norm(1.0),
        ff.adamw(
            ff.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 20, 1e-4),
            b1=0.9,
            b2=0.95,
            weight_decay=0.1,
            mask=matrices,
        ),
    )


OPTIMISERS = {"sgd_momentum": lambda: ff.sgd(0.05, momentum=0.9), "adamw_recipe": _recipe}
STEPS = 5
BAD = [None, math.inf, None, math.nan, None]


def _clone(state):
    return tree_map(lambda x: x.clone(), state)


def _assert_one_step_agrees(new, ref, old):
    """``new`` (CUDA's default on the CPU) against ``ref`` (the C kernel), both one update
    of ``old``: decisions, loss scale, counts and flags bitwise; the master and the FP32
    states within one ulp at their operation's scale; the working copies the new master
    rounded."""
    assert torch.equal(new.grads_finite, ref.grads_finite)
    assert_states_bitwise_equal((new.loss_scale, new.step), (ref.loss_scale, ref.step))
    if not bool(ref.grads_finite):
        assert_states_bitwise_equal(
            (new.params, new.master, new.opt_state), (old.params, old.master, old.opt_state)
        )
        return
    for a, r, o in zip(tree_leaves(new.master), tree_leaves(ref.master), tree_leaves(old.master)):
        assert_within_one_operation_ulp(a, r, o)
    for p, m in zip(tree_leaves(new.params), tree_leaves(new.master)):
        assert torch.equal(bits(p), bits(m.to(p.dtype)))
    leaves = zip(tree_leaves(new.opt_state), tree_leaves(ref.opt_state), tree_leaves(old.opt_state))
    for a, r, o in leaves:
        if a.dtype == torch.float32:
            assert_within_one_operation_ulp(a, r, o)
        else:
            assert_states_bitwise_equal(a, r)


def _cpu_ops(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("functional_fp16_cpu::")}


@pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler here: nothing to compare")
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_an_update_under_the_switch_agrees_with_the_c_kernel(monkeypatch, name, donate):
    monkeypatch.setattr(dispatch, "_warned", set())
    calls: list[str] = []
    count_c_kernel_calls(monkeypatch, calls)
    tx = OPTIMISERS[name]()
    state = ff.fp16_init(random_tree(3, scale=0.5), tx, ff.DynamicLossScale(2.0**10))
    for step in range(STEPS):
        grads = matrix_grads(state, step, 0, bad=BAD[step])
        monkeypatch.delenv(VAR, raising=False)
        ref = ff.fp16_update(_clone(state), grads)
        assert calls, "the default runs the C kernel"
        monkeypatch.setenv(VAR, "cuda-default")
        old = _clone(state)
        calls.clear()
        out = {}

        def update(state=state):
            out["new"] = ff.fp16_update(state, grads, donate=donate)

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a choice, not a missing kernel: no warning
            assert _cpu_ops(update) == set()
        assert calls == []
        assert ff.update_path(out["new"]) == "fused"
        _assert_one_step_agrees(out["new"], ref, old)
        state = ref  # both go on from the C kernel's state: one step compared at a time
