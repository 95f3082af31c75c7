"""Tests for precision policies: parsing (with jmp's cases), casting, the default loss scale and per-module policies."""

import itertools

import pytest
import torch
from torch import nn

from functional_fp16 import (
    NORM_MODULES,
    DynamicLossScale,
    NoOpLossScale,
    Policy,
    cast_to,
    default_loss_scale,
    default_module_policies,
    get_policy,
    module_policy,
    norm_policy,
    parse_dtype,
)

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
DTYPES = (F16, BF16, F32, F64)


def mixed_tree():
    return {
        "w": torch.randn(3, 4),
        "h": torch.randn(2, dtype=F16),
        "labels": torch.tensor([1, 2, 3]),
        "mask": torch.tensor([True, False]),
        "meta": (7, "name", None, 0.5),
    }


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("params=float16,compute=float16,output=float32", (F16, F16, F32)),
        ("p=f16,c=bf16,o=f32", (F16, BF16, F32)),
        ("P = half , C = BF16 , O = full", (F16, BF16, F32)),
        ("param=fp32,compute=float64,output=double", (F32, F64, F64)),
        ("c=f16", (F32, F16, F16)),  # params default to f32, output follows compute
        ("p=f16", (F16, F16, F16)),  # compute follows params, output follows compute
        ("p=f16,c=bf16", (F16, BF16, BF16)),
        ("o=bf16,p=f16", (F16, F16, BF16)),  # order does not matter
        ("p=bf16,o=f32", (BF16, BF16, F32)),
        ("bfloat16", (BF16, BF16, BF16)),
        ("torch.float16", (F16, F16, F16)),
    ],
)
def test_get_policy_parses_long_and_short_forms(spec, expected):
    policy = get_policy(spec)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


# -- ported from jmp's policy_test.py: the same cases, in torch dtypes ------------------

JMP_NAMES = {F16: "float16", BF16: "bfloat16", F32: "float32"}


@pytest.mark.parametrize("dtype", list(JMP_NAMES))
def test_get_policy_one_name_sets_all_three(dtype):
    policy = get_policy(JMP_NAMES[dtype])
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (dtype,) * 3


def test_get_policy_almost_a_dtype_name_is_an_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype name 'compute_float16'"):
        get_policy("compute_float16")


@pytest.mark.parametrize("dtype", list(JMP_NAMES))
def test_get_policy_compute_alone_gives_full_params_and_output_follows_compute(dtype):
    policy = get_policy(f"c={JMP_NAMES[dtype]}")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, dtype, dtype)


@pytest.mark.parametrize("dtype", list(JMP_NAMES))
def test_get_policy_compute_with_full_output(dtype):
    policy = get_policy(f"c={JMP_NAMES[dtype]},o=full")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, dtype, F32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_single_dtype_policy_casts_to_its_dtype(dtype, method):
    out = getattr(Policy(dtype, dtype, dtype), method)({"a": torch.ones(())})
    assert out["a"].dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_with_output_dtype_sets_only_the_output(dtype):
    policy = Policy(F32, F32, F32).with_output_dtype(dtype)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (F32, F32, dtype)


# jmp's dtype_to_names, first names (tests/test_jmp_parity.py compares with jmp itself).
JMP_STR_NAMES = {F16: "f16", BF16: "bf16", F32: "full", F64: "f64"}


@pytest.mark.parametrize("dtype", DTYPES)
def test_str_names_each_dtype_as_jmp_does(dtype):
    pieces = str(Policy(dtype, dtype, dtype)).split(",")
    assert [piece.split("=")[0] for piece in pieces] == ["p", "c", "o"]
    for piece in pieces:
        assert piece.split("=")[1] == JMP_STR_NAMES[dtype]


# -- string form ------------------------------------------------------------------------


def test_str_round_trips_every_policy():
    for p, c, o in itertools.product(DTYPES, repeat=3):
        policy = Policy(p, c, o)
        assert get_policy(str(policy)) == policy
    assert str(Policy(F16, BF16, F32)) == "p=f16,c=bf16,o=full"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("", "empty"),
        ("   ", "empty"),
        ("float8", "unknown dtype name 'float8'"),
        ("p=f16,x=f32", "unknown key 'x'"),
        ("p=f16,c=int8", "c: unknown dtype name 'int8'"),
        ("p=f16,p=f32", "param_dtype is given more than once"),
        ("params=f16,p=f32", "param_dtype is given more than once"),
        ("p=f16,c", "'c' is not of the form key=dtype"),
        ("p=f16=f32", "is not of the form key=dtype"),
        ("p=f16,,c=f32", "'' is not of the form key=dtype"),
    ],
)
def test_get_policy_rejects_bad_strings_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match="policy") as info:
        get_policy(spec)
    assert message in str(info.value)


def test_get_policy_rejects_non_strings():
    with pytest.raises(TypeError, match="policy must be a str"):
        get_policy(torch.float16)


def test_parse_dtype_lists_the_accepted_names():
    assert parse_dtype(" F16 ") is F16
    with pytest.raises(ValueError, match="bfloat16") as info:
        parse_dtype("fp8")
    assert "float16" in str(info.value)


def test_policy_fields_accept_names_and_reject_non_floating_dtypes():
    assert Policy("f16", "bf16", "f32") == Policy(F16, BF16, F32)
    with pytest.raises(TypeError, match="compute_dtype"):
        Policy(F16, torch.int64, F32)
    with pytest.raises(ValueError, match="unknown dtype name 'f8'"):
        Policy(F16, F16, "f8")


def test_policy_is_immutable_and_hashable():
    policy = get_policy("p=f16,c=f16,o=f32")
    with pytest.raises(AttributeError):
        policy.param_dtype = F32
    assert {policy: 1}[Policy(F16, F16, F32)] == 1
    assert policy.with_compute_dtype("f32") == Policy(F16, F32, F32)
    assert policy.with_param_dtype(BF16) == Policy(BF16, F16, F32)
    assert policy.with_output_dtype(F16) == Policy(F16, F16, F16)
    assert policy == Policy(F16, F16, F32)  # unchanged by the with_* copies


@pytest.mark.parametrize(
    "method, field",
    [
        ("cast_to_param", "param_dtype"),
        ("cast_to_compute", "compute_dtype"),
        ("cast_to_output", "output_dtype"),
    ],
)
def test_casts_change_only_floating_tensor_leaves(method, field):
    policy = Policy(BF16, F16, F64)
    tree = mixed_tree()
    out = getattr(policy, method)(tree)
    target = getattr(policy, field)
    assert out["w"].dtype == target and out["h"].dtype == target
    torch.testing.assert_close(out["w"], tree["w"].to(target), rtol=0, atol=0)
    assert out["labels"] is tree["labels"] and out["labels"].dtype == torch.int64
    assert out["mask"] is tree["mask"]
    assert out["meta"] == (7, "name", None, 0.5)
    assert tree["w"].dtype == F32 and tree["h"].dtype == F16  # input untouched


def test_cast_to_returns_leaves_already_in_dtype_without_copying():
    x = torch.randn(4)
    assert cast_to({"x": x}, F32)["x"] is x
    assert cast_to({"x": x}, F16)["x"].dtype == F16


def test_cast_to_rejects_a_non_dtype():
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        cast_to({"x": torch.randn(2)}, torch.int32)


def test_gradients_flow_back_through_a_cast_in_the_leaf_dtype():
    # FP16 parameters computed in FP32: the gradient comes back as FP16.
    policy = get_policy("p=f16,c=f32,o=f32")
    w = torch.tensor([1.0, -2.0, 3.0], dtype=F16, requires_grad=True)
    y = policy.cast_to_compute({"w": w})["w"]
    assert y.dtype == F32
    (y * torch.tensor([0.5, 0.25, 2.0])).sum().backward()
    assert w.grad.dtype == F16
    assert w.grad.tolist() == [0.5, 0.25, 2.0]


@pytest.mark.parametrize(
    "spec, kind",
    [
        ("p=f16,c=f16,o=f32", DynamicLossScale),
        ("p=f16,c=f32,o=f32", DynamicLossScale),  # FP16 params still get FP16 grads
        ("p=f32,c=f16,o=f32", DynamicLossScale),
        ("p=f32,c=f32,o=f16", DynamicLossScale),
        ("p=bf16,c=bf16,o=f32", NoOpLossScale),
        ("p=f16,c=bf16,o=f32", DynamicLossScale),
        ("p=f32,c=bf16,o=bf16", NoOpLossScale),
        ("float32", NoOpLossScale),
    ],
)
def test_default_loss_scale_scales_only_float16_policies(spec, kind):
    assert type(default_loss_scale(get_policy(spec))) is kind


def test_default_loss_scale_rejects_non_policies():
    with pytest.raises(TypeError, match="policy must be a Policy"):
        default_loss_scale("p=f16")


# -- per-module policies ----------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("p=f16,c=bf16,o=f32", (F16, F32, BF16)),  # FP32 inside, the compute dtype out
        ("p=f16,c=f16,o=f32", (F16, F32, F16)),
        ("p=bf16,c=bf16,o=bf16", (BF16, F32, BF16)),
        ("p=f16,c=f32,o=f32", (F16, F32, F32)),  # already FP32: nothing changes
        ("float64", (F64, F64, F64)),  # never lowered
    ],
)
def test_norm_policy_computes_reduced_precision_in_float32(spec, expected):
    policy = norm_policy(get_policy(spec))
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


def test_default_module_policies_cover_the_norms_only_for_reduced_compute():
    policy = get_policy("p=f16,c=bf16,o=f32")
    defaults = default_module_policies(policy)
    assert set(defaults) == set(NORM_MODULES)
    assert set(defaults.values()) == {norm_policy(policy)}
    assert default_module_policies(get_policy("p=f16,c=f32,o=f32")) == {}
    assert default_module_policies(get_policy("float32")) == {}
    defaults[nn.Linear] = policy  # a fresh dict each call
    assert nn.Linear not in default_module_policies(policy)


@pytest.mark.parametrize(
    "module",
    [
        nn.BatchNorm1d(3),
        nn.BatchNorm2d(3),
        nn.SyncBatchNorm(3),
        nn.InstanceNorm2d(3),
        nn.GroupNorm(1, 3),
        nn.LayerNorm(3),
        nn.RMSNorm(3),
        nn.LocalResponseNorm(2),
    ],
    ids=lambda m: type(m).__name__,
)
def test_every_torch_norm_layer_is_covered_by_the_defaults(module):
    policy = get_policy("p=f16,c=f16,o=f32")
    assert module_policy(module, default_module_policies(policy)) == norm_policy(policy)


def test_module_policy_follows_the_mro_and_the_nearest_class_wins():
    class MyNorm(nn.BatchNorm2d):
        pass

    base, own = get_policy("float32"), get_policy("p=f16,c=f16,o=f16")
    assert module_policy(MyNorm(3), {nn.BatchNorm2d: base}) == base
    assert module_policy(MyNorm(3), {nn.BatchNorm2d: base, MyNorm: own}) == own
    assert module_policy(nn.BatchNorm2d(3), {MyNorm: own}) is None
    assert module_policy(nn.Linear(2, 2), default_module_policies(own)) is None


def test_module_policy_helpers_reject_non_policies():
    with pytest.raises(TypeError, match="policy must be a Policy"):
        norm_policy("p=f16")
    with pytest.raises(TypeError, match="policy must be a Policy"):
        default_module_policies(None)
