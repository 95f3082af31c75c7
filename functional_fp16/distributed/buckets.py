"""Packing tensors into flat buckets, so that one collective moves many leaves."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []

# The flat collectives under their names since torch 2.13 (the old names warn);
# older releases have only the old ones.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _buckets(
    leaves: list[torch.Tensor], dtypes: list[torch.dtype], bucket_bytes: int
) -> list[list[int]]:
    """Groups leaf indices by (device, communication dtype), then cuts each group
    into consecutive runs of at most ``bucket_bytes`` (a larger leaf goes alone)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (leaf, dtype) in enumerate(zip(leaves, dtypes, strict=True)):
        groups.setdefault((leaf.device, dtype), []).append(i)
    buckets: list[list[int]] = []
    for (_, dtype), indices in groups.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = leaves[i].numel() * itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


def _pack(
    leaves: list[torch.Tensor], indices: list[int], dtype: torch.dtype, pre: float
) -> torch.Tensor:
    """One new flat ``dtype`` buffer of ``fl(x / pre)`` (see :func:`fill`); the inputs are only read."""
    flat = torch.empty(
        sum(leaves[i].numel() for i in indices), dtype=dtype, device=leaves[indices[0]].device
    )
    fill(flat, 0, [leaves[i].reshape(-1) for i in indices], pre)
    return flat


def fill(buf: torch.Tensor, at: int, parts: list[torch.Tensor], pre: float) -> int:
    """Writes ``fl_buf(x / pre)`` of each flat ``x`` in ``parts`` into ``buf`` from ``at`` on.

    Divided in ``x``'s own dtype, then cast (no division for ``pre == 1``):
    dividing before the cast keeps FP32 values that exceed the FP16 range but
    whose share ``x / pre`` fits from overflowing on the wire. Same-dtype
    parts are written straight into ``buf``, with no temporary. Returns the
    position after the last part.
    """
    with torch.no_grad():  # values only: gradients that carry a graph are taken as values
        for x in parts:
            dst = buf[at : at + x.numel()]
            if pre == 1.0:
                dst.copy_(x)
            elif x.dtype == buf.dtype:
                torch.div(x, pre, out=dst)
            else:
                dst.copy_(x / pre)
            at += x.numel()
    return at


def _unpack(
    flat: torch.Tensor, like: list[torch.Tensor], indices: list[int], out: list[Any]
) -> None:
    """The leaves ``indices`` of ``like`` back out of ``flat``, with their dtypes and memory
    formats (views of ``flat`` where the leaf is contiguous, copies where it is channels-last)."""
    offset = 0
    for i in indices:
        x = like[i]
        n = x.numel()
        leaf = flat[offset : offset + n].view(x.shape)
        if x.is_contiguous():
            out[i] = leaf.to(x.dtype)
        else:
            out[i] = torch.empty_like(x).copy_(leaf)
        offset += n
