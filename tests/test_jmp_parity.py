"""jmp's own test cases, ported to our names and run live against jmp: same inputs, same outputs.

Each test follows one of jmp's (``jmp/_src/loss_scale_test.py``,
``jmp/_src/policy_test.py``), feeds both libraries the same values and
compares what comes out: loss-scale and counter trajectories bitwise, dtypes
exactly, policies dtype by dtype. Where we differ from jmp on purpose (the
rows of "Coming from optax and jmp" in ``docs/migration.md``), the test says so
and checks our side of the difference. Skipped when jmp is not installed.

jmp's names map to ours as ``counter`` -> ``growth_count``, ``period`` ->
``growth_interval``, ``factor`` -> ``growth_factor`` with ``backoff_factor =
1 / factor``, ``min_loss_scale`` -> ``min_scale``; jmp's scale has no
ceiling, so ours gets ``max_scale=inf``.
"""

import itertools
import math
import warnings

import numpy as np
import optree
import pytest
import torch

import functional_fp16 as ff

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jmp = pytest.importorskip("jmp")
jmp_policy = pytest.importorskip("jmp._src.policy")  # the parser's name table

NS = ff.NAMESPACE
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
TORCH_OF = {"float16": F16, "bfloat16": BF16, "float32": F32, "float64": F64}
JAX_OF = {F16: jnp.float16, BF16: jnp.bfloat16, F32: jnp.float32, F64: jnp.float64}


def torch_dtype(jax_dtype) -> torch.dtype:
    return TORCH_OF[np.dtype(jax_dtype).name]


def to_jax(x: torch.Tensor):
    if x.dtype == BF16:  # NumPy has no bfloat16: through float32, exactly
        return jnp.asarray(x.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(x.numpy())


def to_torch(x) -> torch.Tensor:
    x = jnp.asarray(x)
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(x.astype(jnp.float32))).to(BF16)
    return torch.from_numpy(np.array(x))


def assert_same(ours: torch.Tensor, theirs) -> None:
    """Same dtype and the same bits."""
    theirs = to_torch(theirs)
    assert ours.dtype == theirs.dtype, (ours.dtype, theirs.dtype)
    assert ours.shape == theirs.shape
    assert torch.equal(ours.view(-1), theirs.view(-1)) and torch.equal(
        torch.signbit(ours), torch.signbit(theirs)
    ), (ours, theirs)


def ours_dynamic(scale, period=2000, factor=2, min_scale=1.0):
    """Our DynamicLossScale configured as jmp.DynamicLossScale(scale, 0, period, factor, min_scale)."""
    return ff.DynamicLossScale(
        init_scale=scale,
        growth_factor=float(factor),
        backoff_factor=1.0 / factor,
        growth_interval=period,
        min_scale=min_scale,
        max_scale=math.inf,
    )


def jmp_dynamic(scale, period=2000, factor=2, min_scale=1.0):
    return jmp.DynamicLossScale(
        jnp.asarray(scale, jnp.float32),
        jnp.zeros([], jnp.int32),
        period,
        factor,
        jnp.asarray(min_scale, jnp.float32),
    )


def assert_same_state(ours: ff.DynamicLossScale, theirs) -> None:
    assert_same(ours.loss_scale, theirs.loss_scale)
    assert_same(ours.growth_count, theirs.counter)


# -- loss scales: jmp's LossScaleTest ----------------------------------------------------


def test_no_op_loss_scale():
    tree = {"a": torch.ones(())}
    theirs_tree = {"a": jnp.ones([])}
    ours, theirs = ff.NoOpLossScale(), jmp.NoOpLossScale()
    assert theirs.scale(theirs_tree) is theirs_tree and theirs.unscale(theirs_tree) is theirs_tree
    assert ours.scale(tree) is tree
    assert ours.unscale(tree) is tree  # float32 already: the identity, as jmp's


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_no_op_unscale_gives_float32_where_jmp_keeps_the_dtype(dtype):
    """Kept on purpose: fp16_update unscales BF16/FP16 gradients into FP32 updates through it."""
    x = (torch.randn(33) * 100).to(dtype)
    theirs = jmp.NoOpLossScale().unscale(to_jax(x))
    out = ff.NoOpLossScale().unscale({"g": x})["g"]
    assert out.dtype == F32 and torch_dtype(theirs.dtype) == dtype
    assert torch.equal(out, to_torch(theirs).float())  # the same values
    assert ff.NoOpLossScale().scale(x) is x  # scale is the identity in both


@pytest.mark.parametrize(
    "ours_cls, theirs_cls, scale",
    [
        (ff.StaticLossScale, jmp.StaticLossScale, 2),
        (ff.StaticLossScale, jmp.StaticLossScale, 3),
        (ff.StaticLossScale, jmp.StaticLossScale, 4),
        (ff.DynamicLossScale, jmp.DynamicLossScale, 2.0),
        (ff.DynamicLossScale, jmp.DynamicLossScale, 3.0),
        (ff.DynamicLossScale, jmp.DynamicLossScale, 4.0),
    ],
)
def test_static_loss_scale(ours_cls, theirs_cls, scale):
    ours = ours_cls(scale) if ours_cls is ff.StaticLossScale else ours_cls(init_scale=scale)
    theirs = theirs_cls(scale)
    tree, scaled = {"a": torch.tensor(1.0)}, {"a": torch.tensor(1.0 * scale)}
    for ours_out, theirs_out in [
        (ours.scale(tree), theirs.scale({"a": jnp.array(1.0)})),
        (ours.unscale(scaled), theirs.unscale({"a": jnp.array(1.0 * scale)})),
    ]:
        assert_same(ours_out["a"], theirs_out["a"])
    assert torch.equal(ours.unscale(ours.scale(tree))["a"], tree["a"])


@pytest.mark.parametrize("scale", [2.0**-3, 1.0, 3.0, 1000.0, 2.0**15, 2.0**24])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, torch.int32, torch.bool])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_scale_and_unscale_dtypes_and_values_match_jmp_with_an_array_scale(kind, dtype, scale):
    """jmp multiplies by a float32 array: FP16/BF16/int/bool leaves come out float32, as ours."""
    g = torch.Generator().manual_seed(int(scale * 8) % 1000)
    x = (torch.randn(67, generator=g) * 300).to(dtype)
    if kind == "static":
        ours, theirs = (
            ff.StaticLossScale(scale),
            jmp.StaticLossScale(jnp.asarray(scale, jnp.float32)),
        )
    else:
        ours, theirs = ours_dynamic(scale, min_scale=2.0**-10), jmp_dynamic(scale)
    assert_same(ours.scale(x), theirs.scale(to_jax(x)))
    assert_same(ours.unscale(x), theirs.unscale(to_jax(x)))


def test_scale_of_a_low_precision_loss_is_float32_even_where_jmp_keeps_it():
    """jmp with a Python-number scale keeps an FP16 loss FP16 (JAX's weak types); ours promotes."""
    loss = torch.tensor(3.0, dtype=F16)
    theirs = jmp.StaticLossScale(2.0**16).scale(to_jax(loss))
    assert theirs.dtype == jnp.float16 and math.isinf(float(theirs))  # 3 * 2**16 overflows FP16
    ours = ff.StaticLossScale(2.0**16).scale(loss)
    assert ours.dtype == F32 and float(ours) == 3.0 * 2**16


@pytest.mark.parametrize("tree", [{}, [], (), None, {"a": []}, {"a": {}, "b": None}])
@pytest.mark.parametrize("kind", ["noop", "static", "dynamic"])
def test_scale_and_unscale_of_empty_trees_match_jmp(kind, tree):
    ours = {
        "noop": ff.NoOpLossScale(),
        "static": ff.StaticLossScale(4.0),
        "dynamic": ff.DynamicLossScale(init_scale=4.0),
    }[kind]
    theirs = {
        "noop": jmp.NoOpLossScale(),
        "static": jmp.StaticLossScale(jnp.asarray(4.0)),
        "dynamic": jmp_dynamic(4.0),
    }[kind]
    for method in ("scale", "unscale"):
        ours_out, theirs_out = getattr(ours, method)(tree), getattr(theirs, method)(tree)
        assert type(ours_out) is type(theirs_out) and ours_out == theirs_out
        assert ours_out == tree


def test_static_empty_trees():
    """jmp's static and no-op scales flatten to no leaves; ours to the 0-d scale (kept on purpose).

    The scale is a float32 tensor on the parameters' device, read by the fused
    kernels and stored in checkpoints, so every loss scale has the same
    ``loss_scale`` leaf.
    """
    assert jax.tree_util.tree_leaves(jmp.NoOpLossScale()) == []
    assert jax.tree_util.tree_leaves(jmp.StaticLossScale(jnp.asarray(0.0))) == []
    for ours, value in ((ff.NoOpLossScale(), 1.0), (ff.StaticLossScale(8.0), 8.0)):
        leaves, spec = optree.tree_flatten(ours, namespace=NS)
        assert [(x.dtype, x.shape, float(x)) for x in leaves] == [(F32, (), value)]
        assert optree.tree_unflatten(spec, leaves).config() == ours.config()


def test_dynamic_loss_scale_no_warnings():
    with warnings.catch_warnings(record=True) as logged:
        warnings.simplefilter("always")
        ff.DynamicLossScale(init_scale=2.0**15)
        jmp.DynamicLossScale(jnp.asarray(2.0**15))
    assert logged == []


def test_dynamic_loss_scale_tree():
    """jmp: leaves (loss_scale, counter). Ours adds hysteresis_count, the Megatron counter."""
    ours, theirs = ours_dynamic(1.0, period=3), jmp_dynamic(1.0, period=3)
    for flag in [True, True, False, True, True, True, True]:
        ours, theirs = ours.adjust(torch.tensor(flag)), theirs.adjust(jnp.bool_(flag))
        t_leaves = jax.tree_util.tree_leaves(theirs)
        o_leaves = optree.tree_leaves(ours, namespace=NS)
        assert len(t_leaves) == 2 and len(o_leaves) == 3
        for o, t in zip(o_leaves, t_leaves):
            assert_same(o, t)
        assert o_leaves[2].dtype == torch.int32 and int(o_leaves[2]) in (0, ours.hysteresis)
        mapped = optree.tree_map(lambda x: x, ours, namespace=NS)
        assert mapped.config() == ours.config()
        assert all(
            torch.equal(a, b) for a, b in zip(optree.tree_leaves(mapped, namespace=NS), o_leaves)
        )


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_increases_on_finite(period, factor):
    ours, theirs = ours_dynamic(10.0, period, factor), jmp_dynamic(10.0, period, factor)
    for i in range(1, period + 1):
        ours, theirs = ours.adjust(torch.tensor(True)), theirs.adjust(jnp.bool_(True))
        assert_same_state(ours, theirs)
        assert int(ours.growth_count) == i % period
        assert float(ours.loss_scale) == (10.0 * factor if i == period else 10.0)
    assert (ours.growth_interval, ours.growth_factor) == (theirs.period, theirs.factor)


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_reduce_on_non_finite(period, factor):
    init = 10.0
    ours, theirs = ours_dynamic(init, period, factor), jmp_dynamic(init, period, factor)
    assert init / (factor**100) < 1, "should cover max(1, S)"
    for i in range(100):
        ours, theirs = ours.adjust(torch.tensor(False)), theirs.adjust(jnp.bool_(False))
        assert_same_state(ours, theirs)  # bitwise, where jmp's own test allows rtol=1e-5
        np.testing.assert_allclose(
            float(ours.loss_scale), max(1, init / (factor ** (i + 1))), rtol=1e-5
        )


@pytest.mark.parametrize(
    "period, factor, min_loss_scale", [(20, 2, 0.3125), (30, 3, 0.37), (5, 2, 0.0)]
)
def test_dynamic_loss_scale_explicit_min_loss_scale(period, factor, min_loss_scale):
    """jmp's third case has a floor of 0, which ours rejects (1 / 0 is inf): the smallest
    normal float32 stands in, which 100 halvings from 10 never reach."""
    floor = min_loss_scale or float(torch.finfo(F32).tiny)
    init = 10.0
    ours = ours_dynamic(init, period, factor, min_scale=floor)
    theirs = jmp_dynamic(init, period, factor, min_scale=min_loss_scale)
    for i in range(100):
        ours, theirs = ours.adjust(torch.tensor(False)), theirs.adjust(jnp.bool_(False))
        assert_same_state(ours, theirs)
        np.testing.assert_allclose(
            float(ours.loss_scale), max(min_loss_scale, init / (factor ** (i + 1))), rtol=1e-5
        )
    with pytest.raises(ValueError, match="min_scale"):
        ours_dynamic(10.0, min_scale=0.0)


def test_min_loss_scale_survives_a_tree_map():
    """jmp's flattening keeps (period, factor) only, so a tree_map resets min_loss_scale to 1;
    ours keeps every field of the configuration. Same inputs, no tree_map on jmp's side."""
    ours = optree.tree_map(lambda x: x.clone(), ours_dynamic(8.0, min_scale=0.25), namespace=NS)
    theirs = jmp_dynamic(8.0, min_scale=0.25)
    assert ours.min_scale == 0.25
    for _ in range(8):
        ours, theirs = ours.adjust(torch.tensor(False)), theirs.adjust(jnp.bool_(False))
        assert_same_state(ours, theirs)
    assert float(ours.loss_scale) == 0.25


@pytest.mark.parametrize(
    "init, period, factor",
    [(2.0**15, 4, 2), (2.0**15, 1, 2), (10.0, 3, 3), (2.0**120, 1, 2), (7.0, 2, 5)],
)
def test_random_trajectories_are_bitwise_jmps(init, period, factor):
    """Growth at the period-th consecutive finite step, backoff and the floor on overflow,
    the counter reset, and no growth into inf (init 2**120 reaches float32's top)."""
    g = torch.Generator().manual_seed(period * 10 + factor)
    flags = (torch.rand(300, generator=g) > 0.15).tolist()
    ours, theirs = ours_dynamic(init, period, factor), jmp_dynamic(init, period, factor)
    grew = backed_off = 0
    for flag in flags:
        before = float(ours.loss_scale)
        ours, theirs = ours.adjust(torch.tensor(flag)), theirs.adjust(jnp.bool_(flag))
        assert_same_state(ours, theirs)
        grew += float(ours.loss_scale) > before
        backed_off += float(ours.loss_scale) < before
        assert math.isfinite(float(ours.loss_scale))
    assert grew > 0 and backed_off > 0


@pytest.mark.parametrize("flag", [torch.tensor([True]), torch.ones(2, dtype=torch.bool)])
def test_dynamic_loss_scale_adjust_requires_scalar_input(flag):
    with pytest.raises(AssertionError, match="Expected boolean scalar"):
        jmp_dynamic(4.0).adjust(jnp.asarray(flag.numpy()))
    with pytest.raises(ValueError, match="grads_finite must be a 0-d bool tensor"):
        ours_dynamic(4.0).adjust(flag)


def test_integer_loss_scales():
    """jmp warns about an integer loss scale array; ours stores any number as float32."""
    with pytest.warns(Warning, match="Expected floating type for loss_scale"):
        jmp.DynamicLossScale(jnp.asarray(1, dtype=jnp.int32))
    with pytest.warns(Warning, match="Expected floating type for min_loss_scale"):
        jmp.DynamicLossScale(jnp.asarray(1.0), min_loss_scale=jnp.asarray(1, dtype=jnp.int32))
    ours = ff.DynamicLossScale(init_scale=1, min_scale=1)
    assert ours.loss_scale.dtype == F32 and ours.min_scale == 1.0
    with pytest.raises(TypeError, match="init_scale must be a real number"):
        ff.DynamicLossScale(init_scale=torch.tensor(1, dtype=torch.int32))


@pytest.mark.parametrize("non_finite", [math.inf, -math.inf, math.nan])
def test_all_finite(non_finite):
    cases = [
        None,
        {},
        {"a": torch.tensor(non_finite)},
        {"a": torch.ones(()), "b": torch.tensor(non_finite)},
        {"a": torch.tensor(non_finite), "b": torch.ones(())},
        {"a": torch.ones(()), "b": torch.ones(())},
        {"a": torch.tensor([1.0, non_finite], dtype=F16), "i": torch.arange(3)},
        {"i": torch.arange(3), "b": torch.tensor([True])},
    ]
    for tree in cases:
        theirs = jmp.all_finite(jax.tree_util.tree_map(to_jax, tree))
        ours = ff.all_finite(tree)
        assert ours.dtype == torch.bool and ours.ndim == 0
        assert bool(ours) == bool(theirs), tree


def test_select_tree():
    a = {"a": torch.ones(()), "b": torch.zeros(())}
    b = {"a": torch.zeros(()), "b": torch.ones(())}
    assert ff.select_tree(torch.tensor(True), None, None) is None
    assert jmp.select_tree(jnp.bool_(True), None, None) is None
    for pred in (True, False):
        theirs = jmp.select_tree(
            jnp.bool_(pred), jax.tree_util.tree_map(to_jax, a), jax.tree_util.tree_map(to_jax, b)
        )
        ours = ff.select_tree(torch.tensor(pred), a, b)
        assert ours.keys() == theirs.keys()
        for k in ours:
            assert_same(ours[k], theirs[k])
        assert all(x is not y for x, y in zip(ours.values(), (a if pred else b).values()))


def test_select_tree_takes_signed_zeros_and_nans_bitwise():
    a = {"x": torch.tensor([-0.0, math.nan, 1.0], dtype=F16)}
    b = {"x": torch.tensor([0.0, -math.inf, 2.0], dtype=F16)}
    for pred in (True, False):
        theirs = jmp.select_tree(jnp.bool_(pred), {"x": to_jax(a["x"])}, {"x": to_jax(b["x"])})
        ours = ff.select_tree(torch.tensor(pred), a, b)
        assert torch.equal(ours["x"].view(torch.int16), to_torch(theirs["x"]).view(torch.int16))


@pytest.mark.parametrize("pred", [torch.ones([1]), torch.tensor([True]), torch.tensor(1.0), True])
def test_select_tree_rejects_non_scalar(pred):
    theirs = jnp.asarray(pred.numpy()) if isinstance(pred, torch.Tensor) else pred
    if isinstance(pred, torch.Tensor):  # jmp asserts on arrays; a Python bool has no ndim
        with pytest.raises(AssertionError, match="expected boolean scalar"):
            jmp.select_tree(theirs, None, None)
    with pytest.raises(TypeError, match="pred must be a 0-d bool tensor"):
        ff.select_tree(pred, None, None)


def test_select_tree_refuses_to_broadcast():
    with pytest.raises(ValueError, match=r"b\['a'\]: shape \(1,\) does not match"):
        ff.select_tree(torch.tensor(True), {"a": torch.ones(3)}, {"a": torch.ones(1)})


# -- policies: jmp's PolicyTest -----------------------------------------------------------

JMP_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
NAMES = {jnp.float16: "float16", jnp.bfloat16: "bfloat16", jnp.float32: "float32"}


def same_policy(ours: ff.Policy, theirs) -> bool:
    return (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == tuple(
        torch_dtype(d) for d in (theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
    )


@pytest.mark.parametrize("dtype", JMP_DTYPES)
@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_policy_cast_to_each_dtype(method, dtype):
    ours = ff.Policy(*(torch_dtype(dtype),) * 3)
    theirs = jmp.Policy(dtype, dtype, dtype)
    out = getattr(ours, method)({"a": torch.ones(())})["a"]
    assert out.dtype == torch_dtype(getattr(theirs, method)({"a": jnp.ones([])})["a"].dtype)


@pytest.mark.parametrize("dtype", JMP_DTYPES)
def test_policy_with_output_dtype(dtype):
    ours = ff.Policy(F32, F32, F32).with_output_dtype(torch_dtype(dtype))
    theirs = jmp.Policy(jnp.float32, jnp.float32, jnp.float32).with_output_dtype(dtype)
    assert same_policy(ours, theirs)


@pytest.mark.parametrize("dtype", JMP_DTYPES)
def test_get_policy(dtype):
    assert same_policy(ff.get_policy(NAMES[dtype]), jmp.get_policy(NAMES[dtype]))


def test_get_policy_almost_dtype():
    with pytest.raises(ValueError, match="Unknown dtype"):
        jmp.get_policy("compute_float16")
    with pytest.raises(ValueError, match="unknown dtype name 'compute_float16'"):
        ff.get_policy("compute_float16")


@pytest.mark.parametrize("dtype", JMP_DTYPES)
@pytest.mark.parametrize("spec", ["c={}", "c={},o=full"])
def test_get_policy_mixed_and_compute(spec, dtype):
    text = spec.format(NAMES[dtype])
    assert same_policy(ff.get_policy(text), jmp.get_policy(text))


# Every dtype name jmp's parser knows, and "half" (float16 off TPUs).
JMP_NAMES = sorted(jmp_policy.name_to_dtype) + ["half"]


@pytest.mark.parametrize("name", JMP_NAMES)
def test_every_jmp_dtype_name_means_the_same(name):
    assert same_policy(ff.get_policy(name), jmp.get_policy(name))
    assert ff.parse_dtype(name) == torch_dtype(jmp_policy.parse_dtype(name))


def test_every_jmp_key_spelling_and_default_means_the_same():
    keys = {"p": ("p", "params"), "c": ("c", "compute"), "o": ("o", "output")}
    names = ["f16", "bf16", "full", "half", "float32", "bfloat16"]
    checked = 0
    for present in itertools.chain.from_iterable(
        itertools.combinations("pco", n) for n in (1, 2, 3)
    ):
        for spellings in itertools.product(*(keys[k] for k in present)):
            for values in itertools.product(names, repeat=len(present)):
                text = ",".join(f"{k}={v}" for k, v in zip(spellings, values))
                assert same_policy(ff.get_policy(text), jmp.get_policy(text)), text
                checked += 1
    assert checked > 500


@pytest.mark.parametrize(
    "spec", ["compute_float16", "p=f8", "x=f16", "p=f16,q=f32", "float8", "int8"]
)
def test_strings_jmp_rejects_are_rejected(spec):
    with pytest.raises(ValueError):
        jmp.get_policy(spec)
    with pytest.raises(ValueError, match="policy"):
        ff.get_policy(spec)


@pytest.mark.parametrize("dtypes", list(itertools.product(JAX_OF, repeat=3)))
def test_str_is_jmps_and_round_trips_through_both_parsers(dtypes):
    ours = ff.Policy(*dtypes)
    theirs = jmp.Policy(*(JAX_OF[d] for d in dtypes))
    assert str(ours) == str(theirs)
    assert same_policy(ours, jmp.get_policy(str(ours)))
    assert ff.get_policy(str(theirs)) == ours


def test_cast_to_full_and_half():
    """jmp.cast_to_full / cast_to_half are cast_to(tree, float32 / float16) (half off TPUs)."""
    half = torch_dtype(jmp.half_dtype())
    obj = object()
    tree = {
        "o": obj,
        "h": torch.ones((), dtype=half),
        "f": torch.ones(()),
        "i": torch.ones((), dtype=torch.int16),
    }
    jtree = {**{k: to_jax(v) for k, v in tree.items() if k != "o"}, "o": obj}
    for ours_out, theirs_out in (
        (ff.cast_to(tree, F32), jmp.cast_to_full(jtree)),
        (ff.cast_to(tree, half), jmp.cast_to_half(jtree)),
    ):
        assert ours_out["o"] is obj and theirs_out["o"] is obj
        for k in ("h", "f", "i"):
            assert_same(ours_out[k], theirs_out[k])


@pytest.mark.parametrize("method", ["cast_to_param", "cast_to_compute", "cast_to_output"])
def test_casts_pass_non_floating_leaves_through(method):
    """Integer, bool and complex tensors and Python numbers pass through, as in jmp."""
    ours = ff.get_policy("p=f16,c=bf16,o=f16")
    theirs = jmp.get_policy("p=f16,c=bf16,o=f16")
    tree = {
        "i": torch.arange(3, dtype=torch.int32),
        "b": torch.tensor([True, False]),
        "z": torch.ones(2, dtype=torch.complex64),
        "x": torch.linspace(-1, 1, 5),
        "n": 1.5,
        "k": 3,
    }
    jtree = {k: (to_jax(v) if isinstance(v, torch.Tensor) else v) for k, v in tree.items()}
    ours_out = getattr(ours, method)(tree)
    theirs_out = getattr(theirs, method)(jtree)
    for k in ("i", "b", "z"):
        assert ours_out[k] is tree[k]
        assert ours_out[k].dtype == to_torch(theirs_out[k]).dtype
    assert_same(ours_out["x"], theirs_out["x"])
    assert ours_out["n"] == theirs_out["n"] == 1.5 and ours_out["k"] == theirs_out["k"] == 3
