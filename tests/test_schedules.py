"""Learning-rate schedules: values at the boundaries against the documented formulas.

Every expected value below is the docstring's formula evaluated by hand (in
Python floats, i.e. float64) and rounded once to float32, as the schedules
promise; the optax comparison lives in ``test_references.py``.
"""

import math

import pytest
import torch

import functional_fp16 as ff

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
    ],
    ids=["constant", "linear", "cosine", "warmup_cosine", "join"],
)
def test_schedules_return_a_0d_float32_tensor_on_the_steps_device(make):
    schedule = make()
    for step in (torch.tensor(3, dtype=torch.int32), torch.tensor(3), 3):
        out = schedule(step)
        assert isinstance(out, torch.Tensor)
        assert out.shape == () and out.dtype == torch.float32 and out.device.type == "cpu"
    meta = schedule(torch.tensor(3, dtype=torch.int32, device="meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.float32


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
