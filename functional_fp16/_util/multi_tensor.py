"""When PyTorch's multi-tensor ops may run on a list, and two list operations built on them.

``torch._foreach_*`` ops have no ``vmap`` batching rule, so every list
operation here takes the multi-tensor form only where no tensor is a
``vmap`` batched tensor, and otherwise does the same arithmetic tensor by
tensor. The multi-tensor form is a fixed number of launches whatever the
number of tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["is_batched", "multi_tensor", "by_bit_width", "peaks", "unscaled", "zero_where"]

_NARROW = (torch.float16, torch.bfloat16, torch.float32)
_SAME_WIDTH_INT = {4: torch.int32, 2: torch.int16, 1: torch.uint8, 8: torch.int64}


def is_batched(tensors: list[Any]) -> bool:
    """Whether any of ``tensors`` (``None`` allowed) is a ``vmap`` batched tensor."""
    return any(x is not None and torch._C._functorch.is_batchedtensor(x) for x in tensors)


def multi_tensor(tensors: list[torch.Tensor]) -> bool:
    """Whether the multi-tensor form may run on ``tensors``: a non-empty list, none batched."""
    return bool(tensors) and not is_batched(tensors)


def by_bit_width(xs: list[torch.Tensor]) -> list[tuple[torch.dtype, list[int]]]:
    """The positions of ``xs`` grouped by element size, each with the integer dtype of that
    width: how the bit patterns of a list are handled as integers, one multi-tensor op a
    group."""
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        groups.setdefault(x.element_size(), []).append(i)
    return [(_SAME_WIDTH_INT[w], idx) for w, idx in groups.items()]


def peaks(grads: list[torch.Tensor]) -> torch.Tensor:
    r"""Per tensor the largest magnitude :math:`M_l = \max |g_l|` as float32 (NaN where the
    tensor holds one, 0 for an empty one), in one multi-tensor reduction where it may run
    (float16, bfloat16 and float32 tensors), else tensor by tensor."""
    if multi_tensor(grads) and all(g.dtype in _NARROW for g in grads):
        shown = grads
        if not all(g.numel() for g in grads):  # the infinity norm of nothing: a peak of 0
            shown = [g if g.numel() else g.new_zeros(1) for g in grads]
        return torch.stack(torch._foreach_norm(shown, math.inf, dtype=torch.float32))
    out = []
    for g in grads:
        if g.numel() == 0:
            g = g.new_zeros(1)
        lo, hi = torch.aminmax(g)
        out.append(torch.maximum(hi, -lo).float())  # NaN where the tensor holds one
    return torch.stack(out)


def unscaled(grads: list[torch.Tensor], inv: torch.Tensor) -> list[torch.Tensor]:
    r"""New float32 tensors :math:`\operatorname{fl}_{32}(g)\cdot\mathrm{inv}`, in two
    multi-tensor ops where they may run (``inv`` a 0-d tensor)."""
    if multi_tensor(grads) and not is_batched([inv]):
        out = [torch.empty_like(g, dtype=torch.float32) for g in grads]
        torch._foreach_copy_(out, grads)
        torch._foreach_mul_(out, inv)
        return out
    return [g.float() * inv for g in grads]


def zero_where(flag: torch.Tensor, xs: list[torch.Tensor], in_place: bool = False) -> list:
    """``+0`` (all bits zero) where the 0-d bool ``flag`` holds, else ``xs`` bit for bit
    (inf, NaN and -0.0 kept); a multiply of the bit patterns as integers by 0 or 1 where
    the multi-tensor form may run: into new tensors, or with ``in_place`` into ``xs``
    themselves (returned; elsewhere new tensors all the same)."""
    if multi_tensor(xs) and not is_batched([flag]) and all(x.is_contiguous() for x in xs):
        keep = torch.logical_not(flag)
        out: list[torch.Tensor] = [None] * len(xs)  # type: ignore[list-item]
        for kind, idx in by_bit_width(xs):
            bits = [xs[i].view(kind) for i in idx]
            if in_place:
                torch._foreach_mul_(bits, keep.to(kind))
                kept = bits
            else:
                kept = torch._foreach_mul(bits, keep.to(kind))
            for i, k in zip(idx, kept):
                out[i] = k.view(xs[i].dtype)
        return out
    return [torch.where(flag, torch.zeros_like(x), x) for x in xs]
