"""Loss scaling: the state machine against a pure-Python model, PyTorch and jmp."""

import math

import numpy as np
import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_fp16 as ff
from tests._bad_inputs import TINY, Hyper, fits_float32, fuzz_hyperparameters, is_int, is_real

TRUE = torch.tensor(True)
FALSE = torch.tensor(False)


# --------------------------------------------------------------------------
# A pure-Python model of the rules: the oracle for the property tests.
# --------------------------------------------------------------------------
class ScaleModel:
    """DynamicLossScale's documented rules in plain Python (float64, rounded to float32)."""

    def __init__(self, init, growth, backoff, interval, lo, hi, hysteresis):
        self.scale = float(np.float32(init))
        self.growth, self.backoff, self.interval = growth, backoff, interval
        self.lo, self.hi, self.h = lo, hi, hysteresis
        self.count, self.hyst = 0, hysteresis

    def step(self, finite: bool) -> None:
        if finite:
            self.count += 1
            if self.count >= self.interval:
                grown = float(np.float32(min(self.scale * self.growth, self.hi)))
                if math.isfinite(grown):
                    self.scale = grown
                self.count = 0
                self.hyst = self.h
        else:
            self.count = 0
            self.hyst = max(self.hyst - 1, 0)
            if self.hyst <= 0:
                self.scale = float(np.float32(max(self.scale * self.backoff, self.lo)))


configs = st.fixed_dictionaries(
    {
        "growth_factor": st.sampled_from([2.0, 1.5, 3.0, 1.001, 4.0]),
        "backoff_factor": st.sampled_from([0.5, 0.25, 0.9, 0.1]),
        "growth_interval": st.integers(1, 6),
        "log2_min": st.integers(-8, 4),
        "log2_span": st.integers(0, 12),
        "init_offset": st.floats(0.0, 1.0),
        "hysteresis": st.integers(1, 4),
    }
)


def _make(cfg):
    lo = 2.0 ** cfg["log2_min"]
    hi = lo * 2.0 ** cfg["log2_span"]
    init = lo * (hi / lo) ** cfg["init_offset"]
    init = min(max(init, lo), hi)
    kwargs = dict(
        init_scale=init,
        growth_factor=cfg["growth_factor"],
        backoff_factor=cfg["backoff_factor"],
        growth_interval=cfg["growth_interval"],
        min_scale=lo,
        max_scale=hi,
        hysteresis=cfg["hysteresis"],
    )
    model = ScaleModel(
        init,
        cfg["growth_factor"],
        cfg["backoff_factor"],
        cfg["growth_interval"],
        lo,
        hi,
        cfg["hysteresis"],
    )
    return ff.DynamicLossScale(**kwargs), model


@given(cfg=configs, flags=st.lists(st.booleans(), min_size=1, max_size=80))
def test_dynamic_scale_follows_model_and_stays_in_bounds(cfg, flags):
    ls, model = _make(cfg)
    for f in flags:
        before = float(ls.loss_scale)
        ls = ls.adjust(torch.tensor(f))
        model.step(f)
        s = float(ls.loss_scale)
        # Bitwise the model's value, inside the bounds, counters in range.
        assert s == model.scale
        assert ls.min_scale <= s <= ls.max_scale
        assert int(ls.growth_count) == model.count
        assert 0 <= int(ls.growth_count) < ls.growth_interval
        assert int(ls.hysteresis_count) == model.hyst
        assert 0 <= int(ls.hysteresis_count) <= ls.hysteresis
        # The scale only moves by a configured factor or onto a bound.
        if s != before:
            candidates = {
                float(np.float32(before * ls.growth_factor)),
                float(np.float32(before * ls.backoff_factor)),
                float(np.float32(ls.min_scale)),
                float(np.float32(ls.max_scale)),
            }
            assert s in candidates
            assert (s > before) == f  # grows only on finite steps, shrinks only on overflow
        assert ls.loss_scale.dtype == torch.float32
        assert ls.growth_count.dtype == torch.int32 and ls.hysteresis_count.dtype == torch.int32


@pytest.mark.parametrize("interval", [1, 2, 5])
def test_growth_on_the_interval_th_consecutive_finite_step(interval):
    ls = ff.DynamicLossScale(init_scale=8.0, growth_interval=interval)
    for i in range(1, interval):
        ls = ls.adjust(TRUE)
        assert float(ls.loss_scale) == 8.0, f"grew early at finite step {i}"
    ls = ls.adjust(TRUE)
    assert float(ls.loss_scale) == 16.0
    # An overflow in the middle of a run resets the count.
    ls = ff.DynamicLossScale(init_scale=8.0, growth_interval=3)
    for f in [True, True, False, True, True]:
        ls = ls.adjust(torch.tensor(f))
    assert float(ls.loss_scale) == 4.0
    ls = ls.adjust(TRUE)
    assert float(ls.loss_scale) == 8.0


def test_overflow_backs_off_and_clamps_at_min_scale():
    ls = ff.DynamicLossScale(init_scale=4.0, min_scale=1.0)
    seen = []
    for _ in range(4):
        ls = ls.adjust(FALSE)
        seen.append(float(ls.loss_scale))
    assert seen == [2.0, 1.0, 1.0, 1.0]


def test_growth_clamps_at_max_scale_and_never_becomes_inf():
    ls = ff.DynamicLossScale(init_scale=3.0, growth_interval=1, max_scale=8.0)
    values = []
    for _ in range(3):
        ls = ls.adjust(TRUE)
        values.append(float(ls.loss_scale))
    assert values == [6.0, 8.0, 8.0]
    big = float(torch.finfo(torch.float32).max) / 2
    ls = ff.DynamicLossScale(init_scale=big, growth_interval=1, max_scale=math.inf)
    for _ in range(3):
        ls = ls.adjust(TRUE)
        assert math.isfinite(float(ls.loss_scale))
    assert float(ls.loss_scale) == float(np.float32(big * 2))


def test_hysteresis_follows_megatron_rule():
    """h overflows are needed for the first backoff; only growth refills the counter."""
    ls = ff.DynamicLossScale(init_scale=64.0, growth_interval=2, hysteresis=3)
    trace = []
    for f in [False, False, False, False, True, False, True, True, False, False, False]:
        ls = ls.adjust(torch.tensor(f))
        trace.append((float(ls.loss_scale), int(ls.hysteresis_count)))
    assert trace == [
        (64.0, 2),  # tolerated
        (64.0, 1),  # tolerated
        (32.0, 0),  # third overflow backs off
        (16.0, 0),  # counter exhausted: every overflow backs off ...
        (16.0, 0),  # ... a finite step does not refill it ...
        (8.0, 0),
        (8.0, 0),
        (16.0, 3),  # ... growth does
        (16.0, 2),
        (16.0, 1),
        (8.0, 0),
    ]


@pytest.mark.parametrize("interval", [1, 3])
def test_trajectory_bitwise_equal_to_torch_amp_update_scale(interval):
    g = torch.Generator().manual_seed(interval)
    flags = (torch.rand(300, generator=g) > 0.3).tolist()
    ls = ff.DynamicLossScale(
        init_scale=2.0**10, growth_interval=interval, min_scale=2.0**-100, max_scale=math.inf
    )
    scale = torch.tensor(2.0**10)
    tracker = torch.tensor(0, dtype=torch.int32)
    for f in flags:
        found_inf = torch.tensor(0.0 if f else 1.0)
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, interval)
        ls = ls.adjust(torch.tensor(f))
        assert torch.equal(ls.loss_scale, scale)
        assert torch.equal(ls.growth_count, tracker)


def test_odd_factors_round_like_torch():
    """Products are formed in float64 and rounded once, like PyTorch's kernel."""
    ls = ff.DynamicLossScale(
        init_scale=3.0,
        growth_factor=1.1,
        backoff_factor=0.3,
        growth_interval=1,
        min_scale=1e-30,
        max_scale=math.inf,
    )
    scale = torch.tensor(3.0)
    tracker = torch.tensor(0, dtype=torch.int32)
    for f in [True] * 7 + [False] * 5 + [True] * 3:
        torch._amp_update_scale_(scale, tracker, torch.tensor(0.0 if f else 1.0), 1.1, 0.3, 1)
        ls = ls.adjust(torch.tensor(f))
        assert torch.equal(ls.loss_scale, scale)


def test_unscale_is_bitwise_gradscaler_unscale():
    g = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=g) * 1000).half() for n in (1, 7, 8, 9, 64, 65)]
    for scale in [2.0**-3, 1.0, 2.0**13, 2.0**16, 2.0**24, 3.0, 1000.0]:
        ls = ff.StaticLossScale(scale)
        ours = ls.unscale(grads)
        theirs = [x.float() for x in grads]
        inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, torch.zeros(()), inv)
        for a, b in zip(ours, theirs):
            assert a.dtype == torch.float32
            assert torch.equal(a, b)
        assert torch.equal(ff.unscale_factor(ls.loss_scale), inv)


def test_scale_promotes_low_precision_losses():
    ls = ff.DynamicLossScale()  # 2**16 is inf in FP16
    loss16 = torch.tensor(1.5, dtype=torch.float16)
    out = ls.scale(loss16)
    assert out.dtype == torch.float32 and float(out) == 1.5 * 2**16
    loss32 = torch.tensor(0.25)
    assert float(ls.scale({"l": loss32})["l"]) == 0.25 * 2**16


def test_static_and_noop_scales():
    st_ = ff.StaticLossScale(128.0)
    assert st_.adjust(FALSE) is st_ and float(st_.loss_scale) == 128.0
    assert float(st_.scale(torch.tensor(2.0))) == 256.0
    noop = ff.NoOpLossScale()
    x = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert noop.scale(x) is x
    assert noop.unscale(x).dtype == torch.float32
    assert torch.equal(noop.unscale(x), x.float())
    assert noop.adjust(FALSE) is noop
    tree32 = {"a": torch.ones(3), "b": [torch.zeros(())]}
    assert noop.unscale(tree32) is tree32  # nothing to cast: the tree itself, as jmp's


def test_scale_of_integer_and_bool_leaves_is_float32_and_not_truncated():
    """As jmp's float32 array scale promotes them: a scale below one keeps its fraction."""
    ls = ff.DynamicLossScale(init_scale=0.5, min_scale=0.25)
    out = ls.scale(
        {"i": torch.tensor([3, -5], dtype=torch.int32), "b": torch.tensor([True, False])}
    )
    assert out["i"].dtype == torch.float32 and out["i"].tolist() == [1.5, -2.5]
    assert out["b"].dtype == torch.float32 and out["b"].tolist() == [0.5, 0.0]
    x64 = torch.tensor([1.0 + 2.0**-40], dtype=torch.float64)
    assert ls.scale(x64).dtype == torch.float64 and ls.scale(x64).item() == (1.0 + 2.0**-40) / 2


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (
            ff.DynamicLossScale,
            dict(
                init_scale=8.0,
                growth_interval=7,
                min_scale=0.5,
                max_scale=1024.0,
                hysteresis=2,
                growth_factor=3.0,
                backoff_factor=0.25,
            ),
        ),
        (ff.StaticLossScale, dict(scale=32.0)),
        (ff.NoOpLossScale, {}),
    ],
)
def test_state_survives_flatten_unflatten_and_compile(cls, kwargs):
    ls = cls(**kwargs)
    leaves, spec = optree.tree_flatten(ls, namespace=ff.NAMESPACE)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    back = optree.tree_unflatten(spec, leaves)
    assert type(back) is cls and back.config() == ls.config()
    for a, b in zip(leaves, optree.tree_leaves(back, namespace=ff.NAMESPACE)):
        assert a is b
    # Through a tree_map and through torch.compile, the configuration is kept.
    mapped = optree.tree_map(lambda x: x.clone(), ls, namespace=ff.NAMESPACE)
    assert mapped.config() == ls.config()
    compiled = torch.compile(lambda s, f: s.adjust(f), fullgraph=True, backend="eager")
    flags = [True, False, True, True, True, True, True, True, False]
    eager = ls
    for f in flags:
        eager = eager.adjust(torch.tensor(f))
        ls = compiled(ls, torch.tensor(f))
        assert ls.config() == eager.config()
        for a, b in zip(
            optree.tree_leaves(ls, namespace=ff.NAMESPACE),
            optree.tree_leaves(eager, namespace=ff.NAMESPACE),
        ):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(growth_factor=math.inf), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=-0.5), "backoff_factor"),
        (dict(backoff_factor=math.nan), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
        (dict(growth_interval=2.5), "growth_interval"),
        (dict(min_scale=4.0, max_scale=2.0, init_scale=3.0), "min_scale"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(init_scale=0.5), "init_scale"),
        (dict(init_scale=math.nan), "init_scale"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(max_scale=math.inf, init_scale=1e39), "init_scale"),
    ],
)
def test_bad_dynamic_config_is_rejected_by_name(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ff.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, 1e39, "2"])
def test_bad_static_scale_is_rejected(bad):
    with pytest.raises((ValueError, TypeError), match="scale"):
        ff.StaticLossScale(bad)


@pytest.mark.parametrize(
    "flag, match",
    [
        (True, "0-d bool tensor"),
        (torch.tensor([True]), "0-d bool"),
        (torch.tensor(1.0), "0-d bool"),
    ],
)
def test_adjust_rejects_non_flags(flag, match):
    ls = ff.DynamicLossScale()
    with pytest.raises((TypeError, ValueError), match=match):
        ls.adjust(flag)
    assert float(ls.loss_scale) == 2.0**16 and int(ls.growth_count) == 0


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: ff.DynamicLossScale(init_scale=4.0, min_scale=8.0),
            r"init_scale \(4.0\) must lie in \[min_scale, max_scale\]",
        ),
        (
            lambda: ff.DynamicLossScale(min_scale=2.0, max_scale=1.0, init_scale=2.0),
            r"min_scale \(2.0\) must be <= max_scale \(1.0\)",
        ),
        (
            lambda: ff.DynamicLossScale(init_scale=1e39, max_scale=math.inf),
            "init_scale .* overflows float32",
        ),
    ],
)
def test_combinations_of_hyperparameters(build, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build()


HYPER = {
    "DynamicLossScale.init_scale": Hyper(
        lambda v: ff.DynamicLossScale(init_scale=v),
        lambda v: is_real(v) and 1.0 <= v <= 2.0**24,
        "init_scale",
    ),
    "DynamicLossScale.growth_factor": Hyper(
        lambda v: ff.DynamicLossScale(growth_factor=v),
        lambda v: is_real(v) and 1.0 < v < math.inf,
        "growth_factor",
    ),
    "DynamicLossScale.backoff_factor": Hyper(
        lambda v: ff.DynamicLossScale(backoff_factor=v),
        lambda v: is_real(v) and 0.0 < v < 1.0,
        "backoff_factor",
    ),
    "DynamicLossScale.growth_interval": Hyper(
        lambda v: ff.DynamicLossScale(growth_interval=v),
        lambda v: is_int(v) and 1 <= v < 2**31,
        "growth_interval",
    ),
    "DynamicLossScale.min_scale": Hyper(
        lambda v: ff.DynamicLossScale(min_scale=v),
        lambda v: is_real(v) and TINY <= v <= 2.0**16,
        "min_scale",
    ),
    "DynamicLossScale.max_scale": Hyper(
        lambda v: ff.DynamicLossScale(max_scale=v),
        lambda v: is_real(v) and v >= 2.0**16,
        "max_scale",
    ),
    "DynamicLossScale.hysteresis": Hyper(
        lambda v: ff.DynamicLossScale(hysteresis=v),
        lambda v: is_int(v) and 1 <= v < 2**31,
        "hysteresis",
    ),
    "StaticLossScale.scale": Hyper(
        lambda v: ff.StaticLossScale(v),
        lambda v: is_real(v) and TINY <= v and fits_float32(v),
        "scale",
    ),
}


def test_fuzz_hyperparameters():
    """Random values (NaN, inf, negative, wrong type) for every argument: accepted or named."""
    seen = fuzz_hyperparameters(HYPER, "loss scales")
    assert seen["rejected"] >= 100 and seen["accepted"] >= 40  # both branches, many times


# --------------------------------------------------------------------------
# The JAX original, run live when jmp is installed.
# --------------------------------------------------------------------------
def test_trajectory_equal_to_jmp_dynamic_loss_scale():
    jmp = pytest.importorskip("jmp")
    jnp = pytest.importorskip("jax.numpy")
    g = torch.Generator().manual_seed(7)
    flags = (torch.rand(400, generator=g) > 0.2).tolist()
    period = 4
    theirs = jmp.DynamicLossScale(jnp.asarray(2.0**15, dtype=jnp.float32), period=period, factor=2)
    ours = ff.DynamicLossScale(init_scale=2.0**15, growth_interval=period, max_scale=math.inf)
    for f in flags:
        theirs = theirs.adjust(jnp.asarray(f))
        ours = ours.adjust(torch.tensor(f))
        assert float(ours.loss_scale) == float(theirs.loss_scale)
        assert int(ours.growth_count) == int(theirs.counter)


_F32_MAX = float(np.finfo(np.float32).max)
edge_configs = st.fixed_dictionaries(
    {
        "growth_factor": st.sampled_from([2.0, 4.0, 2.0**20, 1.5, 3.0, 1.0000001]),
        "backoff_factor": st.sampled_from([0.5, 0.25, 2.0**-20, 0.3, 0.9999999]),
        "growth_interval": st.integers(1, 3),
        "min_scale": st.sampled_from([float(np.finfo(np.float32).tiny), 2.0**-100, 1.0]),
        # float32's top: its largest value, numbers that round to it or to inf, beyond it
        "max_scale": st.sampled_from(
            [
                2.0**24,
                _F32_MAX,
                3.4028235e38,
                3.4028235677973362e38,
                3.4028235677973366e38,
                3.5e38,
                1e300,
                math.inf,
            ]
        ),  # fmt: skip
        "init": st.sampled_from([2.0**-126, 1.0, 2.0**120, 1.5 * 2.0**127, _F32_MAX]),
        "hysteresis": st.integers(1, 3),
    }
)


@given(cfg=edge_configs, flags=st.lists(st.booleans(), min_size=1, max_size=24))
def test_dynamic_scale_follows_model_at_float32s_edges(cfg, flags):
    """Near float32's overflow and underflow, with factors that are powers of two (whose
    products are formed in float32) and odd ones (formed in float64): the model's values."""
    hi = cfg["max_scale"]
    lo = cfg["min_scale"]
    init = min(max(cfg["init"], lo), min(hi, _F32_MAX))
    args = (init, cfg["growth_factor"], cfg["backoff_factor"], cfg["growth_interval"], lo, hi)
    ls = ff.DynamicLossScale(*args, cfg["hysteresis"])
    model = ScaleModel(*args, cfg["hysteresis"])
    with np.errstate(over="ignore"):
        for f in flags:
            ls = ls.adjust(torch.tensor(f))
            model.step(f)
            assert float(ls.loss_scale) == model.scale
            assert math.isfinite(float(ls.loss_scale))
            assert int(ls.growth_count) == model.count
            assert int(ls.hysteresis_count) == model.hyst
