"""The gradients' metadata read in one C++ call (``functional_fp16_layout::leaves_match``).

``fp16_update`` proves, in one op call, that the gradients are plain tensors without
gradient, shaped, typed and placed like the params and strided like the master; the
update then neither detaches nor lays them out again. Anything it does not prove goes
through the checks in Python (which name the leaf path on an error):

* every kind of difference (shape, strides, dtype, device, a gradient flag, a tensor
  subclass) is not proven, every number of the layout counts; an inference tensor (other
  autograd keys alone) is;
* the update of proven gradients is bitwise the update through the Python checks.
"""

from __future__ import annotations

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16.update import step
from functional_fp16.update.state_check import check_state
from tests.helpers import assert_states_bitwise_equal, optimiser_matrix

pytestmark = pytest.mark.skipif(not c_kernel.ops_available(), reason="no C++ op library")


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "w": (torch.randn(6, 4, generator=g) * 0.1).half(),
        "b": (torch.randn(4, generator=g) * 0.1).half(),
    }


def _grads():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(6, 4, generator=g).half(), "b": torch.randn(4, generator=g).half()}


def _proven(state, grads) -> bool:
    return step._grad_leaves(state, grads, check_state(state))[1]


def _transposed(x):
    return x.t().contiguous().t()  # the same values, column-major


VARIANTS = {
    "strides": lambda g: {**g, "w": _transposed(g["w"])},
    "dtype": lambda g: {**g, "b": g["b"].bfloat16()},
    "shape": lambda g: {**g, "b": g["b"].reshape(1, 4)},
    "rows": lambda g: {**g, "w": g["w"][:5]},  # other sizes, the master's strides
    "requires_grad": lambda g: {**g, "b": g["b"].clone().requires_grad_()},
    "device": lambda g: {**g, "b": g["b"].to("meta")},
}


def test_plain_gradients_like_the_params_are_proven():
    state = ff.fp16_init(_params(), ff.sgd(0.1, momentum=0.9))
    assert _proven(state, _grads())


@pytest.mark.parametrize("kind", sorted(VARIANTS))
def test_every_kind_of_difference_goes_through_the_python_checks(kind):
    state = ff.fp16_init(_params(), ff.sgd(0.1, momentum=0.9))
    grads = VARIANTS[kind](_grads())
    if kind in ("dtype", "shape", "rows", "device"):  # refused, by the leaf's path
        with pytest.raises((TypeError, ValueError), match=r"grads\['[bw]'\]"):
            step._grad_leaves(state, grads, check_state(state))
    else:  # accepted, but not proven: detached or laid out again by the update
        assert not _proven(state, grads)


def test_inference_tensors_are_proven_and_subclasses_are_not():
    """An inference tensor differs only in its autograd keys (it is read, never written);
    a subclass is not compared in C++ at all."""
    state = ff.fp16_init(_params(), ff.sgd(0.1, momentum=0.9))
    with torch.inference_mode():
        frozen = {k: v.clone() for k, v in _grads().items()}
    assert _proven(state, frozen)
    assert bool(ff.fp16_update(state, frozen).grads_finite)

    class Sub(torch.Tensor):
        pass

    sub = {k: v.as_subclass(Sub) for k, v in _grads().items()}
    assert not _proven(state, sub)


@pytest.mark.parametrize("name", ["momentum", "recipe", "adam", "lion", "labels_sgd_adam"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_proven_gradients_update_bitwise_as_checked_ones(name, donate, monkeypatch):
    params = _params()
    tx = optimiser_matrix()[name]
    states = [ff.fp16_init(params, tx, ff.DynamicLossScale(2.0**10)) for _ in range(2)]
    real = c_kernel.layout_op
    for i in range(4):
        grads = {k: v * (i + 1) for k, v in _grads().items()}
        if i == 2:
            grads["b"] = grads["b"].clone()
            grads["b"][0] = float("inf")
        assert _proven(states[0], grads)
        states[0] = ff.fp16_update(states[0], grads, donate=donate)
        with monkeypatch.context() as m:  # the Python checks alone
            m.setattr(
                c_kernel,
                "layout_op",
                lambda op, *a: False if op == "leaves_match" else real(op, *a),
            )
            states[1] = ff.fp16_update(states[1], grads, donate=donate)
        assert_states_bitwise_equal(states[0], states[1])


def test_the_layout_is_exact_about_its_leaves():
    """``leaves_match`` against its layout: a leaf too many or too few is not a match."""
    p, m = list(_params().values()), [x.float() for x in _params().values()]
    layout = torch.ops.functional_fp16_layout.leaves_layout(p, m)
    g = list(_grads().values())
    assert torch.ops.functional_fp16_layout.leaves_match(g, layout)
    assert not torch.ops.functional_fp16_layout.leaves_match(g[:1], layout)
    assert not torch.ops.functional_fp16_layout.leaves_match([*g, g[1]], layout)
    assert not torch.ops.functional_fp16_layout.leaves_match(g[::-1], layout)


def test_every_entry_of_a_leaf_counts():
    """Each number ``leaves_layout`` records of a leaf (its dimensions, sizes, strides,
    dtype, device type and index, dispatch keys) is compared: any one changed is not a
    match."""
    p, m = list(_params().values()), [x.float() for x in _params().values()]
    layout = torch.ops.functional_fp16_layout.leaves_layout(p, m)
    g = list(_grads().values())
    assert torch.ops.functional_fp16_layout.leaves_match(g, layout)
    for k in range(layout.numel()):
        changed = layout.clone()
        changed[k] += 1
        assert not torch.ops.functional_fp16_layout.leaves_match(g, changed), k


def test_a_state_made_in_inference_mode_does_not_stop_the_proof_for_others():
    tx = ff.sgd(0.1, momentum=0.9)
    with torch.inference_mode():
        frozen = ff.fp16_init(_params(), tx)
    state = ff.fp16_init(_params(), tx)
    assert check_state(frozen) == check_state(state)  # one signature, one cached layout
    _proven(frozen, _grads())
    assert _proven(state, _grads())


def test_the_check_builds_nothing_and_waits_for_a_step_to_load_the_library(monkeypatch):
    """A state whose steps never load the C++ op library (CUDA's) is checked in Python:
    the check neither builds the library nor remembers that it could not use it."""
    monkeypatch.setattr(step, "_FAST_LAYOUTS", {})
    monkeypatch.setattr(c_kernel, "ops_loaded", lambda: False)
    monkeypatch.setattr(c_kernel, "ops_available", lambda: pytest.fail("built the library"))
    state = ff.fp16_init(_params(), ff.sgd(0.1, momentum=0.9))
    assert not _proven(state, _grads())
    monkeypatch.undo()
    assert _proven(state, _grads())
