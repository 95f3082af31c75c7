"""Module paths of release 0.1 that moved into subpackages keep working for one release.

``import functional_fp16.policy``, ``from functional_fp16.sgd import trace`` and
``functional_fp16.loss_scale`` (as an attribute) give the moved module's
objects; reading one warns with a ``DeprecationWarning`` that points at the
reading line and names the new path. Importing an old path never rebinds the
package attribute of the same name (``ff.sgd`` stays the function). Paths
that did not move (``functional_fp16.bridge``, ``functional_fp16.checkpoint``
as a package) import without a warning.
"""

from __future__ import annotations

import importlib
import warnings

import pytest

import functional_fp16 as ff

MOVED = sorted(ff._MOVED.items())


@pytest.mark.parametrize("old, new", MOVED, ids=[old for old, _ in MOVED])
def test_an_old_path_gives_the_new_module_objects_with_a_warning(old, new):
    moved = importlib.import_module(old)
    target = importlib.import_module(new)
    names = [n for n in dir(target) if not n.startswith("_")]
    assert names and set(names) <= set(dir(moved))
    for name in names:
        with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}; import from") as w:
            got = getattr(moved, name)
        assert got is getattr(target, name), name
        assert [x.filename for x in w] == [__file__]  # the reading line
    with warnings.catch_warnings():  # probing a name it lacks is an ordinary miss
        warnings.simplefilter("error")
        assert not hasattr(moved, "no_such_name")


def test_from_import_of_an_old_path_warns_at_the_user_line():
    code = compile("\nfrom functional_fp16.sgd import trace\n", "user_script.py", "exec")
    namespace: dict = {}
    with pytest.warns(DeprecationWarning, match="functional_fp16.transforms.sgd") as caught:
        exec(code, namespace)
    assert namespace["trace"] is ff.trace
    assert [(w.filename, w.lineno) for w in caught] == [("user_script.py", 2)]


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_importing_an_old_path_keeps_the_function_of_the_same_name(name):
    function = getattr(ff, name)
    importlib.import_module(f"functional_fp16.{name}")
    exec(f"import functional_fp16.{name}", {})
    assert getattr(ff, name) is function and callable(function)


def test_an_old_module_as_an_attribute_of_the_package_warns_on_use():
    module = ff.loss_scale
    with pytest.warns(DeprecationWarning, match="functional_fp16.precision.loss_scale"):
        assert module.DynamicLossScale is ff.DynamicLossScale
    with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
        ff.not_a_module  # noqa: B018


@pytest.mark.parametrize(
    "path, name",
    [
        ("functional_fp16.bridge", "split_module"),
        ("functional_fp16.checkpoint", "atomic_torch_save"),
        ("functional_fp16.checkpoint", "save_checkpoint"),
        ("functional_fp16.allocator", "tune_malloc"),
        ("functional_fp16.distributed", "shard_state"),
        ("functional_fp16.precision.policy", "Policy"),
    ],
)
def test_paths_that_did_not_move_import_without_a_warning(path, name):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        module = importlib.import_module(path)
        assert callable(getattr(module, name))


def test_star_import_of_an_old_path_binds_the_public_names():
    namespace: dict = {}
    with pytest.warns(DeprecationWarning, match="functional_fp16.precision.loss_scale"):
        exec("from functional_fp16.loss_scale import *", namespace)
    from functional_fp16.precision import loss_scale

    assert {k for k in namespace if not k.startswith("__")} == set(loss_scale.__all__)
    assert namespace["DynamicLossScale"] is ff.DynamicLossScale


def test_patching_through_an_old_path_patches_the_module_the_library_reads():
    from unittest import mock

    from functional_fp16.transforms import clipping

    original = clipping.global_norm
    with pytest.warns(DeprecationWarning, match="functional_fp16.transforms.clipping"):
        with mock.patch("functional_fp16.clipping.global_norm", lambda *a, **k: "patched"):
            assert clipping.global_norm({}) == "patched"
    assert clipping.global_norm is original
