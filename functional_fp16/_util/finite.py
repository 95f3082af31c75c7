"""The all-finite reductions over low-precision gradients (all leaves, or per leaf), shared by
the update and ``MultiSteps``."""

from __future__ import annotations

import torch

__all__ = ["grads_finite", "leaves_finite"]


def grads_finite(grads: list[torch.Tensor], inv_scale: torch.Tensor | None) -> torch.Tensor:
    r"""Whether :math:`\operatorname{fl}_{32}(g) \cdot s^{-1}` is finite for every element.

    Equal to ``all(isfinite(g.float() * inv_scale))`` over all leaves, computed
    from one reduction over the original (e.g. FP16) gradients:

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
    peaks = _peaks([g for g in grads if g.numel()])
    if peaks is None:
        device = grads[0].device if grads else None
        return torch.ones((), dtype=torch.bool, device=device)
    peak = peaks.amax().float()
    if inv_scale is not None:
        peak = peak * inv_scale
    return torch.isfinite(peak)


def leaves_finite(grads: list[torch.Tensor], inv_scale: torch.Tensor | None) -> torch.Tensor:
    r"""Per leaf, whether :math:`\operatorname{fl}_{32}(g_l) \cdot s^{-1}` is finite for
    every element: a 1-d bool tensor of ``len(grads)`` flags (``True`` for an empty leaf).

    .. math:: \ell_l = \operatorname{isfinite}\big(\operatorname{fl}_{32}(M_l)\cdot s^{-1}\big),
              \qquad M_l = \max(|\min g_l|, |\max g_l|)

    The reduction of :func:`grads_finite`, kept per leaf: its AND over the
    leaves is :func:`grads_finite` (rounding is monotonic). One min/max per
    leaf, no host read.
    """
    if not grads:
        return torch.ones(0, dtype=torch.bool)
    shown = [g if g.numel() else g.new_zeros(1) for g in grads]
    peak = _peaks(shown).float()
    if inv_scale is not None:
        peak = peak * inv_scale
    return torch.isfinite(peak)


def _peaks(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The leaves' largest magnitudes, stacked (NaN where a leaf holds one); ``None`` if none."""
    if not grads:
        return None
    peaks = []
    for g in grads:
        lo, hi = torch.aminmax(g)
        peaks.append(torch.maximum(hi, -lo))
    if len({p.dtype for p in peaks}) > 1:
        peaks = [p.float() for p in peaks]
    return torch.stack(peaks)
