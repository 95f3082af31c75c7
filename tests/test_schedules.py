"""Learning-rate schedules: values at the boundaries against the documented formulas.

Every expected value below is the docstring's formula evaluated by hand (in
Python floats, i.e. float64) and rounded once to float32, as the schedules
promise; the optax comparison lives in ``test_references.py``.
"""

import math

import pytest
import torch

import functional_fp16 as ff
from tests.helpers import no_host_sync

STEPS = 40  # every schedule below is evaluated on 0 .. STEPS - 1 where it matters


def at(schedule, t):
    return schedule(torch.tensor(t, dtype=torch.int32))


def f32(x: float) -> float:
    """``x`` rounded once to float32."""
    return float(torch.tensor(x, dtype=torch.float64).float())


def cosine_by_hand(v0, t, T, alpha=0.0, p=1.0):
    c = 0.5 * (1.0 + math.cos(math.pi * min(max(t, 0), T) / T))
    return v0 * ((1.0 - alpha) * c**p + alpha)


@pytest.mark.parametrize("step", [0, 1, 123, 2**31 - 1])
def test_constant_schedule(step):
    const = ff.constant_schedule(0.3)
    out = at(const, step)
    assert out.shape == () and out.dtype == torch.float32
    assert float(out) == f32(0.3)


def test_schedules_values():
    cos = ff.cosine_decay_schedule(1.0, 10, alpha=0.1)
    assert float(cos(torch.tensor(0, dtype=torch.int32))) == 1.0
    assert math.isclose(float(cos(torch.tensor(5))), 0.55, rel_tol=1e-6)
    assert math.isclose(float(cos(torch.tensor(10))), 0.1, rel_tol=1e-6)
    assert math.isclose(float(cos(torch.tensor(100))), 0.1, rel_tol=1e-6)
    warm = ff.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14)
    assert [round(float(warm(torch.tensor(t))), 6) for t in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert math.isclose(float(warm(torch.tensor(9))), 0.5, rel_tol=1e-6)
    const = ff.constant_schedule(0.3)
    assert float(const(torch.tensor(123))) == pytest.approx(0.3)
    assert const(torch.tensor(1)).dtype == torch.float32


def test_linear_schedule_at_and_around_its_boundaries():
    """Flat at v0 up to t_b, linear for T steps, flat at v1 after: each side of each corner."""
    v0, v1, T, begin = 0.1, 0.7, 3, 5
    lin = ff.linear_schedule(v0, v1, transition_steps=T, transition_begin=begin)
    for t in [-3, 0, begin - 1, begin, begin + 1, begin + 2, begin + T, begin + T + 1, 10**6]:
        frac = min(max(t - begin, 0), T) / T
        # In float64 and rounded once: v0 + (v1 - v0) * 1/3 is not what float32 arithmetic gives.
        assert float(at(lin, t)) == f32(v0 + (v1 - v0) * frac), t
    assert float(at(lin, begin)) == f32(v0) and float(at(lin, begin + T)) == f32(v1)


def test_linear_schedule_counts_from_transition_begin():
    lin = ff.linear_schedule(2.0, 4.0, transition_steps=8, transition_begin=3)
    assert [float(at(lin, t)) for t in (0, 3, 5, 7, 11, 12)] == [2.0, 2.0, 2.5, 3.0, 4.0, 4.0]


@pytest.mark.parametrize("alpha, exponent", [(0.0, 1.0), (0.1, 1.0), (0.25, 2.0), (1.0, 1.0)])
def test_cosine_decay_at_and_around_its_boundaries(alpha, exponent):
    v0, T = 0.5, 12
    cos = ff.cosine_decay_schedule(v0, T, alpha=alpha, exponent=exponent)
    for t in [-1, 0, 1, T // 3, T // 2, T - 1, T, T + 1, STEPS]:
        expected = cosine_by_hand(v0, t, T, alpha, exponent)
        # torch.cos and math.cos may differ in the last float64 bit: within one float32 ulp.
        assert float(at(cos, t)) == pytest.approx(expected, rel=2**-23, abs=0.0), t
    assert float(at(cos, 0)) == v0
    assert float(at(cos, T)) == f32(alpha * v0)
    assert float(at(cos, T // 2)) == pytest.approx(v0 * ((1 - alpha) * 0.5**exponent + alpha))


def test_cosine_decay_holds_its_final_value_up_to_the_largest_int32_step():
    cos = ff.cosine_decay_schedule(1.0, 10, alpha=0.1)
    top = torch.iinfo(torch.int32).max
    assert float(at(cos, top)) == float(at(cos, 10)) == f32(0.1)


def test_join_schedules_restarts_the_step_at_each_boundary():
    joined = ff.join_schedules(
        [ff.constant_schedule(1.0), ff.linear_schedule(0.0, 1.0, 4), ff.constant_schedule(3.0)],
        [3, 9],
    )
    values = [float(at(joined, t)) for t in range(12)]
    # t < 3: the first; 3 <= t < 9: the linear one at t - 3 (0, 1/4, ... held at 1); then 3.
    assert values == [1.0, 1.0, 1.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 3.0, 3.0, 3.0]
    assert float(joined(5)) == 0.5  # a Python int step as well


@pytest.mark.parametrize("warmup", [0, 4])
def test_warmup_cosine_decay_at_and_around_its_boundaries(warmup):
    v0, peak, total, end = 0.05, 1.0, 24, 0.125
    sched = ff.warmup_cosine_decay_schedule(v0, peak, warmup, total, end_value=end)

    def by_hand(t):
        if t < warmup:
            return v0 + (peak - v0) * max(t, 0) / warmup
        return cosine_by_hand(peak, t - warmup, total - warmup, alpha=end / peak)

    for t in sorted({0, 1, warmup - 1, warmup, warmup + 1, total - 1, total, total + 1, STEPS}):
        if t < 0:
            continue
        assert float(at(sched, t)) == pytest.approx(by_hand(t), rel=2**-23, abs=1e-9), t
    assert float(at(sched, warmup)) == peak  # the peak is reached at the end of the warmup
    assert float(at(sched, total)) == end  # decay_steps counts the warmup, as in optax
    # Halfway through the decay the cosine is 0: the mean of peak and end.
    assert float(at(sched, warmup + (total - warmup) // 2)) == pytest.approx((peak + end) / 2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ff.constant_schedule(0.5),
        lambda: ff.linear_schedule(0.0, 1.0, 5),
        lambda: ff.cosine_decay_schedule(1.0, 5),
        lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 2, 6),
        lambda: ff.join_schedules([ff.constant_schedule(1.0), ff.constant_schedule(2.0)], [2]),
        lambda: ff.polynomial_schedule(1.0, 0.1, 2.0, 5),
        lambda: ff.exponential_decay(1.0, 2, 0.5, staircase=True, end_value=0.1),
        lambda: ff.piecewise_constant_schedule(1.0, {2: 0.5}),
    ],
    ids=[
        "constant",
        "linear",
        "cosine",
        "warmup_cosine",
        "join",
        "polynomial",
        "exponential",
        "piecewise",
    ],
)
def test_schedules_return_a_0d_float32_tensor_on_the_steps_device(make):
    schedule = make()
    for step in (torch.tensor(3, dtype=torch.int32), torch.tensor(3), 3):
        out = schedule(step)
        assert isinstance(out, torch.Tensor)
        assert out.shape == () and out.dtype == torch.float32 and out.device.type == "cpu"
    meta = schedule(torch.tensor(3, dtype=torch.int32, device="meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.float32


# -- polynomial, exponential, piecewise constant ----------------------------------------------


@pytest.mark.parametrize("power", [0.5, 2.0, 3.0])
def test_polynomial_at_and_around_its_boundaries(power):
    v0, v1, T, begin = 0.8, 0.05, 10, 4
    sched = ff.polynomial_schedule(v0, v1, power, T, begin)
    for t in [0, begin - 1, begin, begin + 1, begin + T // 2, begin + T - 1, begin + T, STEPS]:
        frac = 1.0 - min(max(t - begin, 0), T) / T
        assert float(at(sched, t)) == f32((v0 - v1) * frac**power + v1), t
    assert float(at(sched, begin)) == f32(v0) and float(at(sched, begin + T)) == f32(v1)
    assert float(at(sched, begin + T // 2)) == f32((v0 - v1) * 0.5**power + v1)


def test_polynomial_of_power_1_is_linear_schedule_and_power_0_is_constant():
    poly = ff.polynomial_schedule(0.1, 0.7, 1.0, 3, 5)
    lin = ff.linear_schedule(0.1, 0.7, 3, 5)
    assert all(float(at(poly, t)) == float(at(lin, t)) for t in range(STEPS))
    flat = ff.polynomial_schedule(0.1, 0.7, 0.0, 3, 5)
    assert [float(at(flat, t)) for t in (0, 5, 7, 8, 100)] == [f32(0.1)] * 5
    # A warmup: end above init, the square root rises fastest at first.
    warm = ff.polynomial_schedule(0.0, 1.0, 0.5, 4)
    assert [float(at(warm, t)) for t in range(6)] == [
        f32(1.0 - math.sqrt(1.0 - t / 4)) if t < 4 else 1.0 for t in range(6)
    ]


@pytest.mark.parametrize("steps", [0, -1, -100])
def test_polynomial_and_exponential_without_transition_steps_are_the_init_value(steps):
    for sched in (
        ff.polynomial_schedule(0.25, 4.0, 2.0, steps, transition_begin=3),
        ff.exponential_decay(0.25, steps, 0.5, transition_begin=3, end_value=1.0),
    ):
        assert [float(at(sched, t)) for t in (0, 3, 10, 1000)] == [0.25] * 4


def test_exponential_decay_continuous_and_staircase():
    v0, T, r, begin = 2.0, 4, 0.5, 3
    smooth = ff.exponential_decay(v0, T, r, begin)
    stairs = ff.exponential_decay(v0, T, r, begin, staircase=True)
    for t in range(STEPS):
        p = (t - begin) / T
        want = v0 if t <= begin else v0 * r**p
        assert float(at(smooth, t)) == f32(want), t
        want = v0 if t <= begin else v0 * r ** math.floor(p)
        assert float(at(stairs, t)) == f32(want), t
    assert [float(at(stairs, t)) for t in (3, 6, 7, 10, 11)] == [2.0, 2.0, 1.0, 1.0, 0.5]


def test_exponential_end_value_bounds_every_step_as_optax():
    """A lower bound for r < 1, an upper one for r >= 1, before transition_begin too."""
    floor = ff.exponential_decay(1.0, 1, 0.5, transition_begin=2, end_value=0.125)
    assert [float(at(floor, t)) for t in range(7)] == [1.0, 1.0, 1.0, 0.5, 0.25, 0.125, 0.125]
    cap = ff.exponential_decay(1.0, 1, 2.0, end_value=5.0)
    assert [float(at(cap, t)) for t in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    above = ff.exponential_decay(0.4, 10, 0.9, end_value=0.5)  # the bound is above init
    assert [float(at(above, t)) for t in (0, 5, 50)] == [0.5] * 3
    flat = ff.exponential_decay(0.2, 5, 1.0, end_value=0.1)  # r = 1: min(0.2, 0.1)
    assert [float(at(flat, t)) for t in (0, 10)] == [f32(0.1)] * 2
    zero_rate = ff.exponential_decay(0.3, 10, 0.0, end_value=0.1)  # r = 0: no decay, no bound
    assert [float(at(zero_rate, t)) for t in (0, 10, 100)] == [f32(0.3)] * 3


def test_exponential_growth_overflows_to_inf_but_a_zero_init_stays_zero():
    top = torch.iinfo(torch.int32).max
    grow = ff.exponential_decay(1.0, 1, 2.0)
    assert float(at(grow, 200)) == math.inf and float(at(grow, 100)) == f32(2.0**100)
    assert float(at(ff.exponential_decay(1.0, 1, 2.0, end_value=3.0), top)) == 3.0
    zero = ff.exponential_decay(0.0, 1, 2.0)
    assert [float(at(zero, t)) for t in (0, 5, 2000, top)] == [0.0] * 4  # not 0 * inf = NaN
    assert float(at(ff.exponential_decay(0.0, 1, 0.5, end_value=0.25), top)) == 0.25


def test_piecewise_constant_multiplies_the_scales_of_the_boundaries_reached():
    sched = ff.piecewise_constant_schedule(0.1, {5: 0.5, 15: 0.1, 25: 3.0})
    for t in range(STEPS):
        want = 0.1 * (0.5 if t >= 5 else 1) * (0.1 if t >= 15 else 1) * (3.0 if t >= 25 else 1)
        assert float(at(sched, t)) == f32(want), t
    assert float(at(sched, 4)) == f32(0.1) and float(at(sched, 5)) == f32(0.05)
    # A dict's order does not matter (two equal dicts), a boundary at 0 applies from the start.
    shuffled = ff.piecewise_constant_schedule(0.1, {25: 3.0, 5: 0.5, 15: 0.1})
    assert all(float(at(shuffled, t)) == float(at(sched, t)) for t in range(STEPS))
    start = ff.piecewise_constant_schedule(2.0, {0: 0.25, 2: 0.0})
    assert [float(at(start, t)) for t in range(4)] == [0.5, 0.5, 0.0, 0.0]
    for none in (None, {}):
        assert float(at(ff.piecewise_constant_schedule(0.3, none), 7)) == f32(0.3)
    far = ff.piecewise_constant_schedule(1.0, {2**40: 0.5})  # beyond any int32 step
    assert float(at(far, torch.iinfo(torch.int32).max)) == 1.0


NEW_SCHEDULES = {
    "polynomial": lambda: ff.polynomial_schedule(0.5, 0.01, 1.5, 20, 3),
    "exponential": lambda: ff.exponential_decay(0.5, 4, 0.8, 2, False, 0.05),
    "staircase": lambda: ff.exponential_decay(0.5, 4, 0.8, 2, True),
    "piecewise": lambda: ff.piecewise_constant_schedule(0.5, {3: 0.5, 9: 0.2}),
}


@pytest.mark.parametrize("name", sorted(NEW_SCHEDULES))
def test_new_schedules_compile_with_fullgraph_and_never_read_the_step(name):
    sched = NEW_SCHEDULES[name]()
    torch._dynamo.reset()
    compiled = torch.compile(sched, fullgraph=True, dynamic=True)
    steps = [torch.tensor(t, dtype=torch.int32) for t in range(0, 30, 2)]
    eager = [sched(t) for t in steps]
    with no_host_sync():
        for t in steps:
            sched(t)  # eager: tensor operations only
    for t, e in zip(steps, eager):
        c = compiled(t)
        assert c.dtype == torch.float32 and c.shape == ()
        # Inductor may evaluate pow in float64 with other roundings than eager's last
        # float64 bit: after the one rounding to float32, within one float32 ulp.
        assert float(c) == pytest.approx(float(e), rel=2**-23, abs=0.0), int(t)
    assert len({float(e) for e in eager}) > 2  # the fixture moves


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: ff.cosine_decay_schedule(0.1, 0), "decay_steps"),
        (lambda: ff.cosine_decay_schedule(0.1, 10, alpha=1.5), "alpha"),
        (lambda: ff.cosine_decay_schedule(0.1, 10, exponent=0.0), "exponent"),
        (lambda: ff.linear_schedule(-1.0, 0.0, 3), "init_value"),
        (lambda: ff.linear_schedule(0.0, 1.0, 2.5), "transition_steps"),
        (lambda: ff.linear_schedule(0.0, 1.0, 3, transition_begin=-1), "transition_begin"),
        (lambda: ff.constant_schedule(math.nan), "value"),
        (lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5), "decay_steps"),
        (lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10), "decay_steps"),
        (lambda: ff.warmup_cosine_decay_schedule(0.0, 0.1, 10, 50, end_value=0.5), "end_value"),
        (lambda: ff.warmup_cosine_decay_schedule(0.0, 0.0, 10, 50, end_value=0.1), "end_value"),
        (lambda: ff.polynomial_schedule(0.1, -0.1, 2.0, 10), "end_value"),
        (lambda: ff.polynomial_schedule(0.1, 0.0, -1.0, 10), "power"),
        (lambda: ff.polynomial_schedule(0.1, 0.0, "2", 10), "power"),
        (lambda: ff.polynomial_schedule(0.1, 0.0, 2.0, 10.0), "transition_steps"),
        (lambda: ff.polynomial_schedule(0.1, 0.0, 2.0, 10, -1), "transition_begin"),
        (lambda: ff.exponential_decay(math.inf, 10, 0.5), "init_value"),
        (lambda: ff.exponential_decay(0.1, 10, -0.5), "decay_rate"),
        (lambda: ff.exponential_decay(0.1, 10, math.nan), "decay_rate"),
        (lambda: ff.exponential_decay(0.1, 10, 0.5, -2), "transition_begin"),
        (lambda: ff.exponential_decay(0.1, 10, 0.5, staircase=1), "staircase"),
        (lambda: ff.exponential_decay(0.1, 10, 0.5, end_value=-1.0), "end_value"),
        (lambda: ff.exponential_decay(0.1, None, 0.5), "transition_steps"),
        (lambda: ff.piecewise_constant_schedule(0.1, {10: -0.5}), "boundaries_and_scales"),
        (lambda: ff.piecewise_constant_schedule(0.1, {10: math.inf}), "boundaries_and_scales"),
        (lambda: ff.piecewise_constant_schedule(0.1, {10: math.nan}), "boundaries_and_scales"),
        (lambda: ff.piecewise_constant_schedule(0.1, {2.5: 0.5}), "boundaries_and_scales"),
        (lambda: ff.piecewise_constant_schedule(0.1, {True: 0.5}), "boundaries_and_scales"),
        (lambda: ff.piecewise_constant_schedule(0.1, {-1: 0.5}), "boundaries_and_scales"),
        (lambda: ff.piecewise_constant_schedule(0.1, {1: "x"}), "boundaries_and_scales"),
        (lambda: ff.piecewise_constant_schedule(0.1, [(10, 0.5)]), "boundaries_and_scales"),
        (
            lambda: ff.piecewise_constant_schedule(1.0, {1: 1e20, 2: 1e20}),
            "boundaries_and_scales: the value from step 2 on",
        ),
        (lambda: ff.piecewise_constant_schedule(-0.1), "init_value"),
        (
            lambda: ff.join_schedules([ff.constant_schedule(1.0)] * 2, [1, 2]),
            "len\\(boundaries\\) == len\\(schedules\\) - 1",
        ),
        (
            lambda: ff.join_schedules([ff.constant_schedule(1.0)] * 3, [4, 4]),
            "strictly increasing",
        ),
    ],
)
def test_bad_hyperparameters_are_named(factory, match):
    with pytest.raises((ValueError, TypeError), match=match):
        factory()


@pytest.mark.parametrize("steps", [0, -1, -100])
def test_linear_without_transition_steps_is_the_constant_init_value(steps):
    # optax's rule (a warning there): no transition, the initial value at every step.
    sched = ff.linear_schedule(0.25, 4.0, steps, transition_begin=3)
    assert [float(sched(torch.tensor(t))) for t in (0, 3, 10, 1000)] == [0.25] * 4
