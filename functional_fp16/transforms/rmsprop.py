"""RMSProp as a chain of small transforms, as optax composes it.

::

    rmsprop(lr)                = chain(scale_by_rms(decay, eps, initial_scale),
                                       scale_by_learning_rate(lr),    # u <- -lr * u
                                       identity())                    # no momentum
    rmsprop(lr, centered=True) = chain(scale_by_stddev(...), ...)
    rmsprop(lr, momentum=m)    = chain(..., trace(m, nesterov=...))   # after the lr, as optax

The moving averages are FP32 whatever the updates' dtype, computed with
``torch.optim.RMSprop``'s operations (``addcmul`` for the squares, ``lerp``
for the centred mean), so that with ``eps_in_sqrt=False`` and ``decay =
alpha`` the averages are bitwise torch's and the step is torch's up to the
rounding of the learning-rate product. The step count is the number of
*applied* steps: inside :func:`~functional_fp16.fp16_update` a skipped step
leaves the whole state as it was.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import PyTree, check_same_structure, tree_flatten, tree_unflatten
from functional_fp16.transforms.adam import sqrt_rn
from functional_fp16.transforms.base import (
    GradientTransformation,
    chain,
    identity,
    saturating_increment,
)
from functional_fp16.transforms.schedules import Schedule
from functional_fp16.transforms.sgd import scale_by_learning_rate, trace

__all__ = [
    "RmsSpec",
    "ScaleByRmsState",
    "ScaleByRStdDevState",
    "scale_by_rms",
    "scale_by_stddev",
    "rmsprop",
]


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms`."""

    count: torch.Tensor  # 0-d int32: the number of updates produced (applied steps)
    nu: PyTree  # moving average of the squared updates, float32, shaped like the parameters


class ScaleByRStdDevState(NamedTuple):
    """State of :func:`scale_by_stddev`."""

    count: torch.Tensor  # 0-d int32: the number of updates produced (applied steps)
    mu: PyTree  # moving average of the updates, float32, shaped like the parameters
    nu: PyTree  # moving average of the squared updates, float32, shaped like the parameters


class RmsSpec(NamedTuple):
    """Declared form of :func:`scale_by_rms`: its hyperparameters, from which
    :func:`~functional_fp16.fp16_update` builds its fused step."""

    decay: float
    eps: float
    initial_scale: float
    eps_in_sqrt: bool
    bias_correction: bool


def _check(decay, eps, initial_scale, eps_in_sqrt, bias_correction) -> tuple[float, float, float]:
    decay = validate.real("decay", decay, upper=1.0)
    eps = validate.real("eps", eps)
    initial_scale = validate.real("initial_scale", initial_scale)
    for name, flag in (("eps_in_sqrt", eps_in_sqrt), ("bias_correction", bias_correction)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if bias_correction and decay == 1.0:
        raise ValueError("decay must be < 1 with bias_correction (1 - decay^t would be 0)")
    return decay, eps, initial_scale


def _init_moments(params: PyTree, fill: float):
    """``(count, [moment filled with fill], spec)`` for ``params``: FP32, on each leaf's device."""
    leaves, spec = tree_flatten(params)
    device = leaves[0].device if leaves else None
    count = torch.zeros((), dtype=torch.int32, device=device)
    return count, [torch.full_like(p, fill, dtype=torch.float32) for p in leaves], spec


def _square_average(nu: list[torch.Tensor], g32: list[torch.Tensor], decay: float):
    """``decay * nu + (1 - decay) * g * g``, rounded as ``torch.optim.RMSprop`` rounds it."""
    return [torch.addcmul(v * decay, g, g, value=1.0 - decay) for v, g in zip(nu, g32)]


def _correction(count: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(1 - decay^t, sqrt(1 - decay^t))`` for ``t = count``: float64 on the count's device,
    each rounded once to float32 (as :func:`~functional_fp16.transforms.adam.bias_corrections`)."""
    t = count.to(torch.float64)
    one = torch.ones((), dtype=torch.float64, device=count.device)
    c = one - torch.pow(torch.full_like(one, decay), t)
    return c.to(torch.float32), c.sqrt().to(torch.float32)


def _scaled(
    g32: list[torch.Tensor],
    second: list[torch.Tensor],
    eps: float,
    eps_in_sqrt: bool,
    sqrt_c: torch.Tensor | None,
) -> list[torch.Tensor]:
    r"""``g / sqrt(s + eps)`` or ``g / (sqrt(s) + eps)``; with ``sqrt_c`` (the bias
    correction's root, eps outside), ``g / (sqrt(s) / sqrt_c + eps)``, Adam's form."""
    if eps_in_sqrt:
        return [g / sqrt_rn(s + eps) for g, s in zip(g32, second)]
    if sqrt_c is None:
        return [g / (sqrt_rn(s) + eps) for g, s in zip(g32, second)]
    return [g / (sqrt_rn(s) / sqrt_c + eps) for g, s in zip(g32, second)]


def scale_by_rms(
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    *,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    r"""Divides the updates by the root of a moving average of their squares (optax's ``scale_by_rms``).

    With :math:`t` the number of this transform's previous updates plus one
    and :math:`\nu_0` = ``initial_scale``:

    .. math::
        \nu_t &= \rho\, \nu_{t-1} + (1 - \rho)\, g^2 \\
        \hat\nu_t &= \nu_t \text{, or } \nu_t / (1 - \rho^t) \text{ with bias correction} \\
        u &= \frac{g}{\sqrt{\hat\nu_t + \epsilon}} \quad (\texttt{eps\_in\_sqrt}) \qquad\text{or}\qquad
             u = \frac{g}{\sqrt{\hat\nu_t} + \epsilon}

    The average is formed as ``torch.optim.RMSprop`` forms it
    (``addcmul(decay * nu, g, g, value=1 - decay)``) in FP32, the square
    root correctly rounded (see :func:`~functional_fp16.transforms.adam.sqrt_rn`)
    and the quotient rounded once. With ``eps_in_sqrt=False`` the bias-corrected
    denominator is written :math:`\sqrt{\nu_t} / \sqrt{1 - \rho^t} + \epsilon`
    with :math:`1 - \rho^t` in float64 rounded once, as
    :func:`~functional_fp16.transforms.adam.scale_by_adam` writes it, so that
    ``scale_by_rms(b2, eps, eps_in_sqrt=False, bias_correction=True)`` is
    bitwise ``scale_by_adam(b1=0, b2=b2, eps=eps)`` without the first moment.

    Args:
      decay: :math:`\rho \in [0, 1]` (``< 1`` with ``bias_correction``).
      eps: :math:`\epsilon \ge 0`.
      initial_scale: :math:`\nu_0 \ge 0` (PyTorch starts from 0, TF1 from 1).
      eps_in_sqrt: add :math:`\epsilon` inside the square root (optax's
        default) or outside it (``torch.optim.RMSprop``'s rule).
      bias_correction: divide :math:`\nu_t` by :math:`1 - \rho^t`.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`ScaleByRmsState` (an FP32 average whatever the updates' dtype,
      and the count, present with or without bias correction).
    """
    decay, eps, initial_scale = _check(decay, eps, initial_scale, eps_in_sqrt, bias_correction)

    def init(params: PyTree) -> ScaleByRmsState:
        count, nu, spec = _init_moments(params, initial_scale)
        return ScaleByRmsState(count=count, nu=tree_unflatten(spec, nu))

    def update(updates: PyTree, state: ScaleByRmsState, params: PyTree | None = None):
        del params
        g_leaves, spec = tree_flatten(updates)
        nu = check_same_structure(updates, state.nu, name="nu", reference_name="updates")
        count = saturating_increment(state.count)
        if not g_leaves:
            return updates, ScaleByRmsState(count, state.nu)
        g32 = [g.to(torch.float32) for g in g_leaves]
        new_nu = _square_average(nu, g32, decay)
        second, sqrt_c = new_nu, None
        if bias_correction:
            c, sqrt_c = _correction(count, decay)
            if eps_in_sqrt:
                second = [v / c for v in new_nu]
        out = _scaled(g32, second, eps, eps_in_sqrt, sqrt_c)
        out = [u.to(g.dtype) for u, g in zip(out, g_leaves)]
        return tree_unflatten(spec, out), ScaleByRmsState(count, tree_unflatten(spec, new_nu))

    declared = RmsSpec(decay, eps, initial_scale, eps_in_sqrt, bias_correction)
    return GradientTransformation(init, update, declared)


def scale_by_stddev(
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    *,
    eps_in_sqrt: bool = True,
    bias_correction: bool = False,
) -> GradientTransformation:
    r"""Divides the updates by a moving estimate of their standard deviation (optax's ``scale_by_stddev``).

    With :math:`t` the number of this transform's previous updates plus one,
    :math:`\mu_0 = 0` and :math:`\nu_0` = ``initial_scale``:

    .. math::
        \mu_t &= \mu_{t-1} + (1 - \rho)(g - \mu_{t-1})  \qquad (\text{torch's } \operatorname{lerp}) \\
        \nu_t &= \rho\, \nu_{t-1} + (1 - \rho)\, g^2 \\
        \sigma^2_t &= \hat\nu_t - \hat\mu_t^2 \qquad
            (\hat x = x, \text{ or } x / (1 - \rho^t) \text{ with bias correction}) \\
        u &= \frac{g}{\sqrt{\sigma^2_t + \epsilon}} \quad (\texttt{eps\_in\_sqrt}) \qquad\text{or}\qquad
             u = \frac{g}{\sqrt{\sigma^2_t} + \epsilon}

    The averages and the variance are formed with ``torch.optim.RMSprop``'s
    (``centered=True``) operations in FP32. As there, the variance is not
    clamped: rounding can make it slightly negative when every update so far
    was the same, and the root then NaN.

    Args:
      decay: :math:`\rho \in [0, 1]` (``< 1`` with ``bias_correction``).
      eps: :math:`\epsilon \ge 0`.
      initial_scale: :math:`\nu_0 \ge 0`.
      eps_in_sqrt: add :math:`\epsilon` inside the square root or outside it.
      bias_correction: divide both averages by :math:`1 - \rho^t`.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`ScaleByRStdDevState` (FP32 averages whatever the updates' dtype).
    """
    decay, eps, initial_scale = _check(decay, eps, initial_scale, eps_in_sqrt, bias_correction)

    def init(params: PyTree) -> ScaleByRStdDevState:
        count, nu, spec = _init_moments(params, initial_scale)
        mu = [torch.zeros_like(v) for v in nu]
        return ScaleByRStdDevState(
            count=count, mu=tree_unflatten(spec, mu), nu=tree_unflatten(spec, nu)
        )

    def update(updates: PyTree, state: ScaleByRStdDevState, params: PyTree | None = None):
        del params
        g_leaves, spec = tree_flatten(updates)
        mu = check_same_structure(updates, state.mu, name="mu", reference_name="updates")
        nu = check_same_structure(updates, state.nu, name="nu", reference_name="updates")
        count = saturating_increment(state.count)
        if not g_leaves:
            return updates, ScaleByRStdDevState(count, state.mu, state.nu)
        g32 = [g.to(torch.float32) for g in g_leaves]
        new_mu = [torch.lerp(m, g, 1.0 - decay) for m, g in zip(mu, g32)]
        new_nu = _square_average(nu, g32, decay)
        mu_hat, nu_hat = new_mu, new_nu
        if bias_correction:
            c = _correction(count, decay)[0]
            mu_hat = [m / c for m in new_mu]
            nu_hat = [v / c for v in new_nu]
        variance = [torch.addcmul(v, m, m, value=-1.0) for v, m in zip(nu_hat, mu_hat)]
        out = _scaled(g32, variance, eps, eps_in_sqrt, None)
        out = [u.to(g.dtype) for u, g in zip(out, g_leaves)]
        new_state = ScaleByRStdDevState(
            count, tree_unflatten(spec, new_mu), tree_unflatten(spec, new_nu)
        )
        return tree_unflatten(spec, out), new_state

    return GradientTransformation(init, update)


def rmsprop(
    learning_rate: float | Schedule,
    decay: float = 0.9,
    eps: float = 1e-8,
    initial_scale: float = 0.0,
    *,
    eps_in_sqrt: bool = True,
    centered: bool = False,
    momentum: float | None = None,
    nesterov: bool = False,
    bias_correction: bool = False,
) -> GradientTransformation:
    r"""RMSProp (Hinton, 2012; centred: Graves, 2013) with optax's options.

    With :math:`s_t` the output of :func:`scale_by_rms` (or, centred, of
    :func:`scale_by_stddev`) and :math:`\eta_t` the learning rate:

    .. math::
        v_t = -\eta_t\, s_t, \qquad
        u = v_t \text{ (no momentum)}, \quad
        b_t = \mu\, b_{t-1} + v_t,\ u = b_t \text{ (momentum)}, \quad
        u = v_t + \mu\, b_t \text{ (Nesterov)}

    The learning rate is applied before the momentum, as optax does; with a
    constant rate this is ``torch.optim.RMSprop``'s momentum up to rounding.
    ``torch.optim.RMSprop(lr, alpha, eps, centered=c)`` is
    ``rmsprop(lr, decay=alpha, eps=eps, eps_in_sqrt=False, centered=c)``.

    Args:
      learning_rate: :math:`\eta`, a float >= 0 or a schedule of the applied-step count.
      decay, eps, initial_scale, eps_in_sqrt, bias_correction: see :func:`scale_by_rms`
        (with ``centered``, :func:`scale_by_stddev`).
      centered: divide by the estimated standard deviation instead of the root mean square.
      momentum: :math:`\mu \ge 0`, or ``None`` for no momentum buffer.
      nesterov: Nesterov momentum (needs ``momentum > 0``).

    Returns:
      ``chain(scale_by_rms(...) or scale_by_stddev(...), scale_by_learning_rate(lr),
      trace(momentum, nesterov=nesterov) or identity())``: three parts whatever the
      settings, as optax's chain, so each part's state keeps its index.
    """
    if not isinstance(centered, bool):
        raise TypeError(f"centered must be a bool, got {type(centered).__name__}")
    if not isinstance(nesterov, bool):
        raise TypeError(f"nesterov must be a bool, got {type(nesterov).__name__}")
    scale = scale_by_stddev if centered else scale_by_rms
    scaling = scale(
        decay, eps, initial_scale, eps_in_sqrt=eps_in_sqrt, bias_correction=bias_correction
    )
    if momentum is None:
        if nesterov:
            raise ValueError("nesterov momentum requires momentum > 0, got momentum=None")
        velocity = identity()
    else:
        momentum = validate.real("momentum", momentum)
        velocity = trace(momentum, nesterov=nesterov)
    return chain(scaling, scale_by_learning_rate(learning_rate), velocity)
