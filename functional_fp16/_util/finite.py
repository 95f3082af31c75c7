"""The all-finite reductions over low-precision gradients (all leaves, or per leaf), shared by
the update and ``MultiSteps``."""

from __future__ import annotations

import torch

from functional_fp16._util.multi_tensor import peaks

__all__ = ["grads_finite", "leaves_finite"]


def grads_finite(grads: list[torch.Tensor], inv_scale: torch.Tensor | None) -> torch.Tensor:
    r"""Whether :math:`\operatorname{fl}_{32}(g) \cdot s^{-1}` is finite for every element.

    Equal to ``all(isfinite(g.float() * inv_scale))`` over all leaves: the AND of
    :func:`leaves_finite`, one min/max reduction per leaf over the original (e.g.
    FP16) gradients. It is the test of the largest magnitude,

    .. math:: f = \operatorname{isfinite}\big(\operatorname{fl}_{32}(M)\cdot s^{-1}\big),
              \qquad M = \max_i \max(|\min g_i|, |\max g_i|)

    ``min``/``max`` propagate NaN and rounding is monotonic, so the product of
    the largest magnitude overflows exactly when some element's product does,
    and any inf or NaN input makes :math:`M` inf or NaN. Unlike a sum, this
    cannot overflow for FP32 or BF16 gradients. ``inv_scale=None`` means no
    multiplication (a unit loss scale). Empty tensors are ignored; with none
    left the result is ``True``. Returns a 0-d bool tensor, without reading
    any value on the host.
    """
    if not grads:
        return torch.ones((), dtype=torch.bool)
    return leaves_finite(grads, inv_scale).all()


def leaves_finite(grads: list[torch.Tensor], inv_scale: torch.Tensor | None) -> torch.Tensor:
    r"""Per leaf, whether :math:`\operatorname{fl}_{32}(g_l) \cdot s^{-1}` is finite for
    every element: a 1-d bool tensor of ``len(grads)`` flags (``True`` for an empty leaf).

    .. math:: \ell_l = \operatorname{isfinite}\big(\operatorname{fl}_{32}(M_l)\cdot s^{-1}\big),
              \qquad M_l = \max(|\min g_l|, |\max g_l|)

    The reduction of :func:`grads_finite`, kept per leaf: its AND over the
    leaves is :func:`grads_finite` (rounding is monotonic). One multi-tensor
    reduction (PyTorch's infinity norm, NaN-propagating) outside ``vmap``, one
    min/max per leaf inside it; no host read.
    """
    if not grads:
        return torch.ones(0, dtype=torch.bool)
    peak = peaks(grads)  # one multi-tensor reduction where it may run
    if inv_scale is not None:
        peak = peak * inv_scale
    return torch.isfinite(peak)
