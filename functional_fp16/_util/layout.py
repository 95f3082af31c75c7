"""A tensor's layout in memory, as the state checks and the split master read it."""

from __future__ import annotations

import torch

__all__ = ["dense_without_overlap"]


def dense_without_overlap(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill ``numel`` consecutive slots of memory, each once
    (any order of dimensions: channels-last and transposed tensors qualify)."""
    if x.numel() == 0:
        return True
    pairs: list = []
    for s, n in zip(x.stride(), x.shape):  # by stride, ties by size: an insertion sort, whose
        if n != 1:  # comparisons Dynamo guards (it cannot sort symbolic strides)
            at = len(pairs)
            while at and (s, n) < pairs[at - 1]:
                at -= 1
            pairs.insert(at, (s, n))
    expected = 1
    for stride, size in pairs:
        if stride != expected:
            return False
        expected *= size
    return True
