"""Learning-rate schedules: pure functions ``step -> value`` on tensors.

A schedule takes the 0-d int32 step counter kept in a transform's state and
returns a 0-d float32 tensor on the same device. The arithmetic is done in
float64 and rounded once, with tensor operations only, so a schedule never
synchronises with the host and traces under ``torch.compile``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from functional_fp16._util import validate

__all__ = [
    "Schedule",
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "exponential_decay",
    "piecewise_constant_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "warmup_cosine_decay_schedule",
    "declared_form",
]

Schedule = Callable[[torch.Tensor], torch.Tensor]
ScalarOrSchedule = float | Schedule


def _as_step(step: int | torch.Tensor) -> torch.Tensor:
    if isinstance(step, torch.Tensor):
        return step.double()
    return torch.tensor(float(step), dtype=torch.float64)


def _check_value(name: str, value: float) -> float:
    return validate.real(name, value)


def _check_steps(name: str, value: int, minimum: int = 1) -> int:
    return validate.integer(name, value, minimum)


_EXACT = 2**53  # integers beyond it have no exact float64


def _declared(schedule: Schedule, *form: Any) -> Schedule:
    """``schedule`` with its declared form: the constructor's name and normalised arguments,
    which ``_fused/step_scalars.py`` evaluates in one kernel with the same float64
    operations (see :func:`declared_form`). A form whose integers exceed float64's exact
    range is not declared (the schedule is then evaluated by its tensor operations)."""
    if all(abs(x) <= _EXACT for x in _numbers(form)):
        # with the function itself: a wrapper that copies its attributes (functools.wraps)
        # declares nothing
        schedule.declared = (schedule, form)  # type: ignore[attr-defined]
    return schedule


def _numbers(form: Any) -> list[float]:
    out: list[float] = []
    for x in form:
        if isinstance(x, tuple):
            out += _numbers(x)
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(x)
    return out


def declared_form(schedule: Any) -> tuple | None:
    """The declared form of a schedule made by this module, ``None`` for any other callable.

    ``("constant", v)``, ``("linear", v0, v1, T, tb)``, ``("polynomial", v0, v1, p, T,
    tb)``, ``("exponential", v0, T, r, tb, staircase, end)``, ``("piecewise", v0, bounds,
    values)``, ``("cosine", v0, T, alpha, p)``, ``("join", forms, boundaries)``.
    """
    found = getattr(schedule, "declared", None)
    if type(found) is tuple and len(found) == 2 and found[0] is schedule:
        return found[1]
    return None


def constant_schedule(value: float) -> Schedule:
    """``step -> value``.

    Args:
      value: the constant, finite and >= 0.
    """
    value = _check_value("value", value)

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        return torch.full_like(_as_step(step), value).float()

    return _declared(schedule, "constant", value)


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    r"""Linear interpolation from ``init_value`` to ``end_value``.

    .. math:: v(t) = v_0 + (v_1 - v_0)\,\frac{\min(\max(t - t_b, 0), T)}{T}

    This is :func:`polynomial_schedule` with ``power=1`` (which returns this
    schedule), as in optax.

    Args:
      init_value: :math:`v_0`, the value up to ``transition_begin``.
      end_value: :math:`v_1`, the value from ``transition_begin + transition_steps`` on.
      transition_steps: :math:`T`; :math:`T \le 0` gives the constant :math:`v_0`
        (optax's rule: no transition).
      transition_begin: :math:`t_b \ge 0`.
    """
    v0 = _check_value("init_value", init_value)
    v1 = _check_value("end_value", end_value)
    steps = validate.integer("transition_steps", transition_steps, -(2**63))
    begin = _check_steps("transition_begin", transition_begin, minimum=0)
    if steps <= 0:
        return constant_schedule(v0)

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_as_step(step) - begin, min=0.0, max=float(steps))
        return (v0 + (v1 - v0) * (t / steps)).float()

    return _declared(schedule, "linear", v0, v1, steps, begin)


def polynomial_schedule(
    init_value: float,
    end_value: float,
    power: float,
    transition_steps: int,
    transition_begin: int = 0,
) -> Schedule:
    r"""Polynomial transition from ``init_value`` to ``end_value`` (optax's rule).

    .. math::
        v(t) = (v_0 - v_1)\left(1 - \frac{\min(\max(t - t_b, 0), T)}{T}\right)^{p} + v_1

    that is :math:`v_0` up to :math:`t_b`, :math:`v_1` from :math:`t_b + T` on.
    With ``power=1`` this returns :func:`linear_schedule` (the same function
    of :math:`t`, written as linear interpolation).

    Args:
      init_value: :math:`v_0 \ge 0`.
      end_value: :math:`v_1 \ge 0` (above :math:`v_0` for a warmup).
      power: :math:`p \ge 0` (:math:`p = 0` gives :math:`v_0` at every step,
        as :math:`0^0 = 1`).
      transition_steps: :math:`T`; :math:`T \le 0` gives the constant
        :math:`v_0` (optax's rule: no transition).
      transition_begin: :math:`t_b \ge 0`.

    Returns:
      A schedule ``step -> value`` (a 0-d float32 tensor on the step's device).
    """
    v0 = _check_value("init_value", init_value)
    v1 = _check_value("end_value", end_value)
    power = _check_value("power", power)
    steps = validate.integer("transition_steps", transition_steps, -(2**63))
    begin = _check_steps("transition_begin", transition_begin, minimum=0)
    if power == 1.0:
        return linear_schedule(v0, v1, steps, begin)
    if steps <= 0:
        return constant_schedule(v0)

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_as_step(step) - begin, min=0.0, max=float(steps))
        return ((v0 - v1) * torch.pow(1.0 - t / steps, power) + v1).float()

    return _declared(schedule, "polynomial", v0, v1, power, steps, begin)


def exponential_decay(
    init_value: float,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    r"""Exponential decay (or growth) of ``init_value`` at ``decay_rate`` per ``transition_steps``.

    .. math::
        v(t) = \operatorname{bound}\Big(\begin{cases} v_0 & t \le t_b \\
               v_0\, r^{(t - t_b)/T} & t > t_b \end{cases}\Big)

    with the exponent rounded down to an integer when ``staircase``, and
    :math:`\operatorname{bound}(x) = \max(x, v_{end})` for :math:`r < 1`,
    :math:`\min(x, v_{end})` for :math:`r \ge 1` (every step, the ones
    before :math:`t_b` included, as optax bounds them), or :math:`x` without
    ``end_value``. As in optax, :math:`T \le 0` or :math:`r = 0` gives the
    constant :math:`v_0`, ``end_value`` ignored. With :math:`v_0 = 0` the
    value is 0 (bounded) at every step, also where :math:`r^{(t - t_b)/T}`
    overflows.

    Args:
      init_value: :math:`v_0 \ge 0`.
      transition_steps: :math:`T`, the steps over which the value is
        multiplied by :math:`r` once.
      decay_rate: :math:`r \ge 0` (above 1 the value grows).
      transition_begin: :math:`t_b \ge 0`.
      staircase: decay in steps of :math:`T` (an integer exponent) instead of continuously.
      end_value: :math:`v_{end} \ge 0`, a lower bound for :math:`r < 1`, an
        upper bound otherwise; ``None`` for no bound.

    Returns:
      A schedule ``step -> value`` (a 0-d float32 tensor on the step's device).
    """
    v0 = _check_value("init_value", init_value)
    steps = validate.integer("transition_steps", transition_steps, -(2**63))
    rate = _check_value("decay_rate", decay_rate)
    begin = _check_steps("transition_begin", transition_begin, minimum=0)
    if not isinstance(staircase, bool):
        raise TypeError(f"staircase must be a bool, got {type(staircase).__name__}")
    end = None if end_value is None else _check_value("end_value", end_value)
    if steps <= 0 or rate == 0.0:
        return constant_schedule(v0)

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        t = _as_step(step) - begin
        p = t / steps
        if staircase:
            p = torch.floor(p)
        if v0 == 0.0:
            value = torch.zeros_like(t)
        else:
            value = torch.where(t <= 0, v0, v0 * torch.pow(rate, p))
        if end is not None:
            value = torch.clamp(value, min=end) if rate < 1.0 else torch.clamp(value, max=end)
        return value.float()

    return _declared(schedule, "exponential", v0, steps, rate, begin, staircase, end)


def piecewise_constant_schedule(
    init_value: float, boundaries_and_scales: Mapping[int, float] | None = None
) -> Schedule:
    r"""``init_value`` times the product of the scales of every boundary reached (optax's rule).

    .. math:: v(t) = v_0 \prod_{b_i \le t} s_i

    The products are formed once, in float64, when the schedule is built
    (the boundaries in increasing order, whatever the mapping's order), and
    each value is rounded once to float32.

    Args:
      init_value: :math:`v_0 \ge 0`.
      boundaries_and_scales: ``{b_i: s_i}``, int steps :math:`b_i \ge 0` and
        finite scales :math:`s_i \ge 0`; ``None`` or empty for the constant
        :math:`v_0`.

    Returns:
      A schedule ``step -> value`` (a 0-d float32 tensor on the step's device).
    """
    v0 = _check_value("init_value", init_value)
    if boundaries_and_scales is None:
        boundaries_and_scales = {}
    if not isinstance(boundaries_and_scales, Mapping):
        raise TypeError(
            "boundaries_and_scales must be a mapping {step: scale} or None, "
            f"got {type(boundaries_and_scales).__name__}"
        )
    pairs = sorted(
        (
            validate.integer(f"boundaries_and_scales key {b!r}", b, 0),
            validate.real(f"boundaries_and_scales[{b!r}]", s),
        )
        for b, s in boundaries_and_scales.items()
    )
    if not pairs:
        return constant_schedule(v0)
    values, value = [], v0
    for b, s in pairs:
        value *= s
        if not math.isfinite(float(torch.tensor(value, dtype=torch.float32))):
            raise ValueError(
                f"boundaries_and_scales: the value from step {b} on, {value}, overflows float32"
            )
        values.append(value)
    # A boundary beyond any int32 step is never reached; clamped so that it converts to float.
    return piecewise_values(v0, tuple(float(min(b, 2**53)) for b, _ in pairs), tuple(values))


def piecewise_values(v0: float, bounds: tuple[float, ...], values: tuple[float, ...]) -> Schedule:
    r"""``values[i]`` from step ``bounds[i]`` on (the last reached), ``v0`` before the
    first: :func:`piecewise_constant_schedule` once its products are formed."""

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        t = _as_step(step)
        out = torch.full_like(t, v0)
        for b, v in zip(bounds, values):
            out = torch.where(t >= b, v, out)
        return out.float()

    return _declared(schedule, "piecewise", v0, bounds, values)


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    r"""Cosine decay from ``init_value`` to ``alpha * init_value`` (optax's rule).

    .. math:: v(t) = v_0\left[(1-\alpha)\left(\tfrac12\big(1+\cos\tfrac{\pi \min(t, T)}{T}\big)\right)^{p} + \alpha\right]

    Args:
      init_value: :math:`v_0`.
      decay_steps: :math:`T \ge 1`.
      alpha: final fraction :math:`\alpha \in [0, 1]`.
      exponent: :math:`p > 0`.
    """
    v0 = _check_value("init_value", init_value)
    steps = _check_steps("decay_steps", decay_steps)
    alpha = _check_value("alpha", alpha)
    if alpha > 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    exponent = validate.real("exponent", exponent, positive=True)

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        t = torch.clamp(_as_step(step), min=0.0, max=float(steps))
        cosine = 0.5 * (1.0 + torch.cos(math.pi * t / steps))
        return (v0 * ((1.0 - alpha) * cosine**exponent + alpha)).float()

    return _declared(schedule, "cosine", v0, steps, alpha, exponent)


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    r"""Runs ``schedules[i]`` between ``boundaries[i-1]`` and ``boundaries[i]``.

    Each schedule after the first sees the step counted from its own boundary:
    :math:`v(t) = s_i(t - b_{i-1})` for :math:`b_{i-1} \le t < b_i`.

    Args:
      schedules: ``n`` schedules.
      boundaries: ``n - 1`` increasing step numbers.
    """
    if not isinstance(schedules, Sequence) or not isinstance(boundaries, Sequence):
        raise TypeError(
            "join_schedules takes a sequence of schedules and a sequence of boundaries, got "
            f"{type(schedules).__name__} and {type(boundaries).__name__}"
        )
    schedules = list(schedules)
    for i, s in enumerate(schedules):
        if not callable(s):
            raise TypeError(
                f"schedules[{i}] must be a schedule (a function of the step), got "
                f"{type(s).__name__}; constant_schedule(v) makes one of a number"
            )
    boundaries = [_check_steps(f"boundaries[{i}]", b, 0) for i, b in enumerate(boundaries)]
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(
            f"join_schedules needs len(boundaries) == len(schedules) - 1, got "
            f"{len(boundaries)} boundaries for {len(schedules)} schedules"
        )
    if any(b1 <= b0 for b0, b1 in zip(boundaries, boundaries[1:])):
        raise ValueError(f"boundaries must be strictly increasing, got {boundaries}")

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        t = step if isinstance(step, torch.Tensor) else torch.tensor(step)
        value = schedules[0](t)
        for b, s in zip(boundaries, schedules[1:]):
            value = torch.where(t >= b, s(t - b), value)
        return value

    forms = tuple(declared_form(s) for s in schedules)
    if any(f is None or f[0] == "join" for f in forms) or any(b >= 2**31 for b in boundaries):
        return schedule  # a join of joins, an undeclared part, a boundary past int32 steps
    return _declared(schedule, "join", forms, tuple(boundaries))


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    r"""Linear warmup to ``peak_value``, then cosine decay to ``end_value``.

    Linear from :math:`v_0` to :math:`v_p` over ``warmup_steps``, then
    :func:`cosine_decay_schedule` from :math:`v_p` with
    :math:`\alpha = v_{end}/v_p` and ``exponent`` :math:`p` over
    ``decay_steps - warmup_steps`` steps (``decay_steps`` counts the warmup,
    as in optax):

    .. math:: v(t) = v_p\left[(1-\alpha)\left(\tfrac12\big(1+\cos\tfrac{\pi (t - W)}{S - W}\big)\right)^{p} + \alpha\right], \quad W \le t \le S
    """
    _check_value("init_value", init_value)  # also when there is no warmup to use it
    peak = _check_value("peak_value", peak_value)
    warmup = _check_steps("warmup_steps", warmup_steps, 0)
    total = _check_steps("decay_steps", decay_steps)
    if total <= warmup:
        raise ValueError(f"decay_steps ({total}) must exceed warmup_steps ({warmup})")
    end = _check_value("end_value", end_value)
    if end > peak:
        raise ValueError(f"end_value ({end}) must not exceed peak_value ({peak})")
    alpha = end / peak if peak > 0 else 0.0
    decay = cosine_decay_schedule(peak, total - warmup, alpha=alpha, exponent=exponent)
    if warmup == 0:
        return decay
    return join_schedules([linear_schedule(init_value, peak, warmup), decay], [warmup])
