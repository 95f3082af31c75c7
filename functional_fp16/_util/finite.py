"""The all-finite reduction over low-precision gradients, shared by the update and ``MultiSteps``."""

from __future__ import annotations

import torch

__all__ = ["grads_finite"]


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
    peaks = []
    for g in grads:
        if g.numel() == 0:
            continue
        lo, hi = torch.aminmax(g)
        peaks.append(torch.maximum(hi, -lo))
    if not peaks:
        device = grads[0].device if grads else None
        return torch.ones((), dtype=torch.bool, device=device)
    dtypes = {p.dtype for p in peaks}
    if len(dtypes) > 1:
        peaks = [p.float() for p in peaks]
    peak = torch.stack(peaks).amax().float()
    if inv_scale is not None:
        peak = peak * inv_scale
    return torch.isfinite(peak)
