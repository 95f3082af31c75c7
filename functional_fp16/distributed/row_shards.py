r"""``Shard(0)`` as DTensor lays it out, and the bucketed collectives that move such rows.

DTensor splits dimension 0 of a tensor of :math:`d` rows over :math:`N`
ranks as ``torch.chunk`` does: every rank but the last few holds
:math:`c = \lceil d / N \rceil` rows, rank :math:`r` the rows
:math:`[\min(rc, d), \min((r+1)c, d))` (possibly none). A 0-d tensor cannot
be split and is replicated.

The collectives move many leaves at once, as FSDP2 does: every rank's rows of
every leaf of a bucket, each padded with zeros to :math:`c` rows, in one flat
buffer of :math:`N` equal blocks, so that one ``reduce_scatter`` (or, on
gloo, whose reduce-scatter is an all-reduce plus a copy, one in-place
``all_reduce``) leaves each rank the sums of its own rows, and one
``all_gather`` gives every rank every row. A replicated leaf sits whole in
every block, so the same reduce-scatter leaves its full sum on every rank.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from functional_fp16.distributed.buckets import all_gather_flat, reduce_scatter_flat

__all__ = [
    "rows", "local_shape", "Leaf", "Bucket", "plan_buckets", "reduces_in_place", "reduce_rows",
    "gather_rows",
]  # fmt: skip


def rows(d: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` of a dimension of ``d`` that ``rank`` of ``world`` holds (``Shard(0)``)."""
    c = -(-d // world)
    return min(rank * c, d), min((rank + 1) * c, d)


def local_shape(shape: tuple[int, ...], world: int, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s shard of a tensor of ``shape`` (``Shard(0)``; 0-d: replicated)."""
    if not shape:
        return ()
    lo, hi = rows(shape[0], world, rank)
    return (hi - lo, *shape[1:])


class Leaf(NamedTuple):
    """Where one leaf sits in its bucket's blocks."""

    index: int  # the leaf's position in the flat list of leaves
    shape: tuple[int, ...]  # its global shape
    at: int  # its offset in a block
    width: int  # its elements in a block: c rows (padded), or all of a replicated leaf
    counts: tuple[int, ...]  # the elements each rank holds (a replicated leaf: all, on every rank)

    @property
    def replicated(self) -> bool:
        return not self.shape


class Bucket(NamedTuple):
    leaves: tuple[Leaf, ...]
    block: int  # the elements of one rank's block


def plan_buckets(
    shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], world: int, bucket_bytes: int
) -> list[Bucket]:
    """Leaves grouped by dtype and cut into runs whose buffer (:math:`N` blocks of
    ``dtypes``' items) stays within ``bucket_bytes`` (a larger leaf goes alone)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(i)
    out: list[Bucket] = []
    for dtype, indices in groups.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        current: list[Leaf] = []
        at = 0
        for i in indices:
            shape = tuple(shapes[i])
            rest = math.prod(shape[1:])
            if shape:
                width = -(-shape[0] // world) * rest
                counts = tuple(
                    (hi - lo) * rest for lo, hi in (rows(shape[0], world, r) for r in range(world))
                )
            else:
                width, counts = 1, (1,) * world
            if current and (at + width) * world * itemsize > bucket_bytes:
                out.append(Bucket(tuple(current), at))
                current, at = [], 0
            current.append(Leaf(i, shape, at, width, counts))
            at += width
        if current:
            out.append(Bucket(tuple(current), at))
    return out


def reduces_in_place(device: torch.device) -> bool:
    """Whether gradients on ``device`` are all-reduced in place rather than reduce-scattered:
    CPU tensors go through gloo, whose reduce-scatter is an all-reduce plus copies."""
    return device.type == "cpu"


def _zeros(n: int, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(n, dtype=like.dtype, device=like.device)


def reduce_rows(
    grads: list[torch.Tensor],
    buckets: list[Bucket],
    group: Any,
    world: int,
    rank: int,
    comm_dtype: torch.dtype | None,
    pre: Any,
) -> list[torch.Tensor]:
    r"""This rank's rows of :math:`\sum_r \operatorname{fl}_c(g_r / f) / (N / f)` for every leaf.

    ``grads`` are this rank's full gradients (contiguous); ``pre(c)`` gives
    the pre-divide factor :math:`f` of a communication dtype :math:`c`
    (``comm_dtype``, else the gradient's). Returns, per leaf, this rank's
    ``Shard(0)`` rows (the whole mean of a replicated leaf), in the gradient's
    dtype, as views into one buffer per bucket.
    """
    pending = []
    for bucket in buckets:
        first = grads[bucket.leaves[0].index]
        wire = comm_dtype or first.dtype
        f = pre(wire)
        pad = _zeros(max(leaf.width for leaf in bucket.leaves), first)
        parts = []
        for r in range(world):
            for leaf in bucket.leaves:
                flat = grads[leaf.index].reshape(-1)
                if leaf.replicated:
                    parts.append(flat)
                    continue
                start = sum(leaf.counts[:r])
                parts.append(flat[start : start + leaf.counts[r]])
                parts.append(pad[: leaf.width - leaf.counts[r]])
        with torch.no_grad():
            send = torch.cat(parts)
            if f != 1.0:  # divided in the gradient's dtype, then cast, as tree_all_reduce_mean
                send.div_(f)
            send = send.to(wire)
        if world == 1:
            pending.append((None, send, f))
        elif reduces_in_place(send.device):  # gloo: all-reduce in place, keep this rank's block
            work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=group, async_op=True)
            pending.append((work, send.view(world, bucket.block)[rank], f))
        else:
            out = torch.empty(bucket.block, dtype=wire, device=send.device)
            work = reduce_scatter_flat(out, send, op=dist.ReduceOp.SUM, group=group, async_op=True)
            pending.append((work, out, f))
    result: list[Any] = [None] * len(grads)
    for bucket, (work, block, f) in zip(buckets, pending):
        if work is not None:
            work.wait()
        post = world / f
        if post != 1.0:
            block.div_(post)
        block = block.to(grads[bucket.leaves[0].index].dtype)
        for leaf in bucket.leaves:
            shape = local_shape(leaf.shape, world, rank)
            result[leaf.index] = block[leaf.at : leaf.at + leaf.counts[rank]].view(shape)
    return result


def gather_rows(
    shards: list[torch.Tensor | None], buckets: list[Bucket], group: Any, world: int, rank: int
) -> list[torch.Tensor | None]:
    """The full tensors whose ``Shard(0)`` rows ``shards`` holds on this rank (one all-gather
    per bucket; a bucket's replicated leaves are taken from this rank as they are)."""
    pending = []
    for bucket in buckets:
        sharded = [leaf for leaf in bucket.leaves if not leaf.replicated]
        if not sharded or world == 1:
            pending.append(None)
            continue
        first = shards[sharded[0].index]
        pad = _zeros(max(leaf.width for leaf in sharded), first)
        parts = []
        at, where = 0, {}
        for leaf in sharded:
            parts.append(shards[leaf.index].reshape(-1))
            parts.append(pad[: leaf.width - leaf.counts[rank]])
            where[leaf.index] = at
            at += leaf.width
        with torch.no_grad():
            send = torch.cat(parts)
        out = torch.empty(world * at, dtype=send.dtype, device=send.device)
        pending.append((all_gather_flat(out, send, group=group, async_op=True), out, at, where))
    result: list[Any] = list(shards)
    for bucket, item in zip(buckets, pending):
        if item is None:
            if world == 1:
                for leaf in bucket.leaves:
                    result[leaf.index] = shards[leaf.index].view(leaf.shape)
            continue
        work, out, block, where = item
        work.wait()
        for leaf in bucket.leaves:
            if leaf.replicated:
                continue
            at = where[leaf.index]
            pieces = [out[r * block + at : r * block + at + leaf.counts[r]] for r in range(world)]
            result[leaf.index] = torch.cat(pieces).view(leaf.shape)
    return result
