"""Learning-rate schedules: pure functions ``step -> value`` on tensors.

A schedule takes the 0-d int32 step counter kept in a transform's state and
returns a 0-d float32 tensor on the same device. The arithmetic is done in
float64 and rounded once, with tensor operations only, so a schedule never
synchronises with the host and traces under ``torch.compile``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from functional_fp16._util import validate

__all__ = [
    "Schedule",
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "join_schedules",
    "warmup_cosine_decay_schedule",
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


def constant_schedule(value: float) -> Schedule:
    """``step -> value``.

    Args:
      value: the constant, finite and >= 0.
    """
    value = _check_value("value", value)

    def schedule(step: int | torch.Tensor) -> torch.Tensor:
        return torch.full_like(_as_step(step), value).float()

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    r"""Linear interpolation from ``init_value`` to ``end_value``.

    .. math:: v(t) = v_0 + (v_1 - v_0)\,\frac{\min(\max(t - t_b, 0), T)}{T}

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

    return schedule


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

    return schedule


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

    return schedule


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
