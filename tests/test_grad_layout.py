"""The gradients' metadata read in one C++ call (``functional_fp16_layout::leaves_match``).

``fp16_update`` proves, in one op call, that the gradients are plain tensors without
gradient, shaped, typed and placed like the params and strided like the master; the
update then neither detaches nor lays them out again. Anything it does not prove goes
through the checks in Python (which name the leaf path on an error):

* every kind of difference (shape, strides, dtype, device, a gradient flag, an
  inference tensor, a tensor subclass) is not proven;
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
    if kind in ("dtype", "shape", "device"):  # refused, by the leaf's path
        with pytest.raises((TypeError, ValueError), match=r"grads\['b'\]"):
            step._grad_leaves(state, grads, check_state(state))
    else:  # accepted, but not proven: detached or laid out again by the update
        assert not _proven(state, grads)


def test_inference_tensors_and_subclasses_are_not_proven():
    state = ff.fp16_init(_params(), ff.sgd(0.1, momentum=0.9))
    with torch.inference_mode():
        frozen = {k: v.clone() for k, v in _grads().items()}
    assert not _proven(state, frozen)

    class Sub(torch.Tensor):
        pass

    sub = {k: v.as_subclass(Sub) for k, v in _grads().items()}
    assert not _proven(state, sub)  # not compared in C++ at all: the types differ


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
