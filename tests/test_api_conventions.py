"""One convention for the public API, and the old call shapes still working for one release.

Hyperparameters are positional only where optax has them positional, flags
keyword-only; the tree comes first; in checkpoint functions the path comes
first. Every old signature that changed warns with a ``DeprecationWarning``
and does what it used to.
"""

import inspect
import warnings

import pytest
import torch

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16._fused.sgd import sgd_plan
from functional_fp16.checkpoint.save_load import atomic_torch_save


def _kinds(fn):
    return {n: p.kind for n, p in inspect.signature(fn).parameters.items()}


KW = inspect.Parameter.KEYWORD_ONLY


def test_flags_and_process_groups_are_keyword_only():
    assert _kinds(ff.sgd)["nesterov"] == KW and _kinds(ff.sgd)["weight_decay"] == KW
    assert _kinds(ff.trace)["nesterov"] == KW and _kinds(ff.trace)["dampening"] == KW
    for fn in (
        ffd.broadcast_state,
        ffd.tree_all_reduce_mean,
        ffd.agree_finite,
    ):
        assert _kinds(fn)["group"] == KW, fn.__name__
    # A sharded state carries its mesh; only shard_state is told one.
    assert _kinds(ffd.shard_state)["mesh"] == KW
    assert "group" not in _kinds(ffd.sharded_update) and "group" not in _kinds(ffd.unshard_state)
    assert _kinds(ffd.broadcast_state)["src"] == KW
    assert list(_kinds(ff.cast_to))[:2] == ["tree", "dtype"]
    assert list(_kinds(atomic_torch_save))[:2] == ["path", "obj"]
    assert list(_kinds(ff.save_checkpoint))[:2] == ["path", "tree"]


def test_old_positional_flags_warn_and_mean_the_same():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = sgd_plan(ff.sgd(0.1, 0.9, nesterov=True, weight_decay=1e-3))
    with pytest.warns(DeprecationWarning, match=r"sgd\(\): passing nesterov, dampening"):
        old = sgd_plan(ff.sgd(0.1, 0.9, True, 0.0, 1e-3))
    assert old == new
    with pytest.warns(DeprecationWarning, match="trace"):
        assert ff.trace(0.9, True).spec == ff.trace(0.9, nesterov=True).spec
    with pytest.raises(TypeError, match="multiple values"):
        ff.sgd(0.1, 0.9, True, nesterov=False)


def test_cast_to_old_order_warns_and_casts():
    tree = {"x": torch.ones(2)}
    with pytest.warns(DeprecationWarning, match="cast_to"):
        old = ff.cast_to(torch.float16, tree)
    assert old["x"].dtype == torch.float16
    assert ff.cast_to(tree, torch.float16)["x"].dtype == torch.float16


def test_atomic_torch_save_old_order_warns_and_saves(tmp_path):
    with pytest.warns(DeprecationWarning, match="atomic_torch_save"):
        atomic_torch_save({"a": torch.ones(1)}, tmp_path / "x.pt")
    atomic_torch_save(tmp_path / "y.pt", {"a": torch.ones(1)})
    for name in ("x.pt", "y.pt"):
        assert torch.equal(torch.load(tmp_path / name)["a"], torch.ones(1))


def test_group_passed_positionally_warns_before_anything_else():
    with pytest.warns(DeprecationWarning, match="group"), pytest.raises(RuntimeError):
        ffd.tree_all_reduce_mean({"x": torch.ones(1)}, None)  # no process group here


def test_loss_scales_replace_fields_and_check_them():
    scale = ff.DynamicLossScale(init_scale=2.0**8)
    moved = scale.replace(loss_scale=2.0**10, growth_count=7, growth_interval=50)
    assert float(moved.loss_scale) == 2.0**10 and int(moved.growth_count) == 7
    assert moved.growth_interval == 50 and moved.loss_scale.dtype == torch.float32
    assert float(scale.loss_scale) == 2.0**8 and scale.growth_interval == 2000  # untouched
    with pytest.raises(ValueError, match="growth_interval"):
        scale.replace(growth_interval=0)
    with pytest.raises(TypeError, match="no field"):
        scale.replace(scale=1.0)
    with pytest.raises(TypeError, match="growth_count must be a 0-d torch.int32"):
        scale.replace(growth_count=torch.zeros(2, dtype=torch.int32))
    assert float(ff.StaticLossScale(8.0).replace(loss_scale=4.0).loss_scale) == 4.0
