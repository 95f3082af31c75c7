r"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") as a chain.

::

    lion(lr, b1, b2, wd) = chain(scale_by_lion(b1, b2),
                                 add_decayed_weights(wd, mask),   # u <- u + wd * p
                                 scale_by_learning_rate(lr))      # u <- -lr * u

as optax composes it. By default the momentum is FP32 whatever the updates'
dtype (``mu_dtype`` stores it in fewer bytes,
:mod:`~functional_fp16.precision.moment_storage`; the arithmetic is float32
either way), and the state's count is the number of *applied* steps (inside
:func:`~functional_fp16.fp16_update` a skipped step leaves the whole state as
it was). The chain declares its hyperparameters, so ``fp16_update`` runs it as
one fused kernel (:mod:`functional_fp16._fused.lion`) where the momentum is FP32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import PyTree, check_same_structure, tree_flatten, tree_unflatten
from functional_fp16.precision.moment_storage import (
    DEFAULT_BLOCK,
    FLOAT32,
    MomentFormat,
    decode_all,
    encode_all,
    moment_format,
    zeros_like_moments,
)
from functional_fp16.transforms.base import GradientTransformation, chain, saturating_increment
from functional_fp16.transforms.schedules import Schedule
from functional_fp16.transforms.sgd import add_decayed_weights, scale_by_learning_rate

__all__ = ["ScaleByLionState", "LionSpec", "scale_by_lion", "lion"]

_MODES = ("hard", "smooth", "refined")


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion`."""

    count: torch.Tensor  # 0-d int32: the number of updates produced (applied steps)
    mu: PyTree  # the momentum shaped like the parameters: float32 (or as mu_dtype stores it)


class LionSpec(NamedTuple):
    """Declared form of :func:`scale_by_lion`."""

    b1: float
    b2: float
    mode: str
    smooth_beta: float
    mu_format: MomentFormat = FLOAT32


def _direction(c: torch.Tensor, mode: str, smooth_beta: float) -> torch.Tensor:
    if mode == "hard":
        return torch.sign(c)
    if mode == "smooth":
        return torch.tanh(c * smooth_beta)
    return torch.where(c.abs() < 1.0, c, torch.sign(c))


def scale_by_lion(
    b1: float = 0.9,
    b2: float = 0.99,
    *,
    mode: str = "hard",
    smooth_beta: float = 1.0,
    mu_dtype: torch.dtype | str | None = None,
    block_size: int = DEFAULT_BLOCK,
    moment_rounding: str = "stochastic",
) -> GradientTransformation:
    r"""Rescales updates to Lion's sign direction.

    With :math:`g` the incoming update and :math:`m` the momentum:

    .. math::
        c &= \operatorname{fl}((1 - \beta_1)\, g) + \operatorname{fl}(\beta_1 m) \\
        u &= \operatorname{sign}(c) \qquad (\tanh(\beta_s c) \text{ with } \texttt{mode="smooth"};
             \; c \text{ where } |c| < 1 \text{ with } \texttt{mode="refined"}) \\
        m' &= \operatorname{fl}((1 - \beta_2)\, g) + \operatorname{fl}(\beta_2 m)

    each product rounded to float32 on its own, as optax computes it. The sign
    is ``torch.sign``'s: :math:`+0` for :math:`\pm 0` and NaN.

    Args:
      b1: :math:`\beta_1 \in [0, 1]`, how much of the momentum the direction takes.
      b2: :math:`\beta_2 \in [0, 1]`, the momentum's decay.
      mode: ``"hard"`` (the sign; the paper's rule), ``"smooth"`` or ``"refined"``, as optax.
      smooth_beta: :math:`\beta_s > 0`, the slope of ``"smooth"``.
      mu_dtype: how the momentum is stored: ``None``/``torch.float32`` (the
        default), ``torch.bfloat16``, ``torch.float16`` or ``"e4m3"`` (``"int8"``, an alias); see
        :mod:`functional_fp16.precision.moment_storage`. The arithmetic is float32.
      block_size: elements per block of an ``"e4m3"`` momentum (a power of two).
      moment_rounding: ``"stochastic"`` (the default) or ``"nearest"``; see
        :func:`~functional_fp16.transforms.adam.scale_by_adam`.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`ScaleByLionState` (the momentum as stored, whatever the updates' dtype).
    """
    b1 = validate.real("b1", b1, upper=1.0, tensor=True)
    b2 = validate.real("b2", b2, upper=1.0, tensor=True)
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    smooth_beta = validate.real("smooth_beta", smooth_beta, positive=True)
    c1, c2 = 1.0 - b1, 1.0 - b2
    mu_format = moment_format(
        "mu_dtype", mu_dtype, second=False, block_size=block_size, rounding=moment_rounding
    )

    def init(params: PyTree) -> ScaleByLionState:
        leaves = tree_flatten(params)[0]
        device = leaves[0].device if leaves else None
        return ScaleByLionState(
            count=torch.zeros((), dtype=torch.int32, device=device),
            mu=zeros_like_moments(mu_format, params),
        )

    def update(updates: PyTree, state: ScaleByLionState, params: PyTree | None = None):
        del params
        g_leaves, spec = tree_flatten(updates)
        stored = check_same_structure(updates, state.mu, name="mu", reference_name="updates")
        count = saturating_increment(state.count)
        if not g_leaves:
            return updates, ScaleByLionState(count, state.mu)
        mu = decode_all(mu_format, stored)
        g32 = [g.to(torch.float32) for g in g_leaves]
        # m * b + g * c: the sum is exact in either order, and the result takes the
        # momentum's layout whatever the updates' strides.
        out = [
            _direction(m * b1 + g * c1, mode, smooth_beta).to(g0.dtype)
            for g, m, g0 in zip(g32, mu, g_leaves)
        ]
        new_mu = encode_all(mu_format, [m * b2 + g * c2 for g, m in zip(g32, mu)], stored, count)
        new_state = ScaleByLionState(count, tree_unflatten(spec, new_mu))
        return tree_unflatten(spec, out), new_state

    spec = LionSpec(b1, b2, mode, smooth_beta, mu_format)
    return GradientTransformation(init, update, spec)


def lion(
    learning_rate: float | Schedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    *,
    mask=None,
    mu_dtype: torch.dtype | str | None = None,
    block_size: int = DEFAULT_BLOCK,
    moment_rounding: str = "stochastic",
) -> GradientTransformation:
    r"""The Lion optimiser: the sign of an interpolated momentum, with decoupled weight decay.

    .. math::
        \theta \leftarrow \theta - \eta\,\big(\operatorname{sign}((1 - \beta_1) g
        + \beta_1 m) + \lambda\, \theta\big), \qquad m \leftarrow (1 - \beta_2) g + \beta_2 m

    Its step has the same magnitude on every element, so a good learning rate
    is typically 3 to 10 times smaller than AdamW's, and the weight decay
    correspondingly larger.

    Args:
      learning_rate: :math:`\eta`, a float >= 0 or a schedule of the applied-step count.
      b1, b2: see :func:`scale_by_lion`.
      weight_decay: :math:`\lambda \ge 0` (optax's default, 1e-3), multiplied by the
        learning rate as in optax and PyTorch.
      mask: which leaves decay, as in :func:`~functional_fp16.adamw`.
      mu_dtype, block_size, moment_rounding: how the momentum is stored; see
        :func:`scale_by_lion`.

    Returns:
      ``chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask),
      scale_by_learning_rate(learning_rate))``.
    """
    decay = (
        add_decayed_weights(weight_decay)
        if mask is None
        else add_decayed_weights(weight_decay, mask=mask)
    )
    moments = scale_by_lion(
        b1, b2, mu_dtype=mu_dtype, block_size=block_size, moment_rounding=moment_rounding
    )
    return chain(moments, decay, scale_by_learning_rate(learning_rate))
