"""Which elements of every parameter a rank owns when the FP32 state is sharded (ZeRO-1).

The parameters' leaves are grouped by dtype, in order of first appearance.
The leaves of a group, each flattened (row-major) and concatenated in tree
order, form one vector of :math:`P_g` elements. With :math:`N` ranks it is
cut into :math:`N` contiguous slices of

.. math:: S_g = \\lceil P_g / N \\rceil

elements; rank :math:`r` owns the elements :math:`[r S_g, \\min((r+1) S_g, P_g))`
of it. When :math:`N` does not divide :math:`P_g` the last slices are short
(or empty); the collectives pad them to :math:`S_g` with zeros, the state
itself holds only what the rank owns. A leaf's *piece* on a rank is the part
of the leaf inside that rank's slice, possibly empty, held with the leaf's
number of dimensions (:func:`piece_shape`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from functional_fp16._util.tree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from functional_fp16.update import FP16State

__all__ = ["ShardLayout", "layout_for", "piece_shape", "owners"]

# Probe leaf i has i + _TAG elements. A tx.init that ignores the device and
# materialises it allocates a few MB, not terabytes; no optimiser creates
# state of that length from nothing.
_TAG = 1_000_003


class ShardLayout(NamedTuple):
    """One rank's share of a parameter tree (static, host-side; see the module docstring)."""

    world_size: int  # N, the number of ranks sharing the state
    rank: int  # which slice this state holds, 0 .. N - 1
    sizes: tuple[int, ...]  # numel of every leaf, in flattening order
    groups: tuple[tuple[int, ...], ...]  # the leaf indices of each dtype group, in order
    offsets: tuple[int, ...]  # where every leaf starts in its group's vector
    group_index: tuple[int, ...]  # the dtype group of every leaf

    def group_numel(self, g: int) -> int:
        """:math:`P_g`, the number of elements of group ``g``."""
        last = self.groups[g][-1]
        return self.offsets[last] + self.sizes[last]

    def slice_numel(self, g: int) -> int:
        """:math:`S_g = \\lceil P_g / N \\rceil`, the padded length of every rank's slice of group ``g``."""
        return -(-self.group_numel(g) // self.world_size)

    def bounds(self, g: int, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)`` of the elements of group ``g`` that ``rank`` (default: this one) owns."""
        r = self.rank if rank is None else rank
        s, p = self.slice_numel(g), self.group_numel(g)
        return min(r * s, p), min((r + 1) * s, p)

    def piece(self, i: int, rank: int | None = None) -> tuple[int, int]:
        """``(lo, hi)``: the flat elements ``lo .. hi - 1`` of leaf ``i`` that ``rank`` owns (``lo == hi``: none)."""
        start, stop = self.bounds(self.group_index[i], rank)
        o, n = self.offsets[i], self.sizes[i]
        lo = min(max(start - o, 0), n)
        return lo, max(lo, min(stop - o, n))

    def segments(self, g: int, start: int, stop: int) -> list[tuple[int, int, int]]:
        """``(leaf, lo, hi)`` for the leaf parts that cover elements ``start .. stop - 1`` of group ``g``.

        Elements at or beyond :math:`P_g` (padding) belong to no leaf and are left out.
        """
        out = []
        for i in self.groups[g]:
            o, n = self.offsets[i], self.sizes[i]
            lo, hi = max(start - o, 0), min(stop - o, n)
            if lo < hi:
                out.append((i, lo, hi))
        return out


def layout_for(leaves: list[torch.Tensor], world_size: int, rank: int) -> ShardLayout:
    """The :class:`ShardLayout` of ``leaves`` (the parameters, flattened) for ``rank`` of ``world_size``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must lie in [0, world_size={world_size})")
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(i)
    sizes = tuple(leaf.numel() for leaf in leaves)
    offsets, group_index = [0] * len(leaves), [0] * len(leaves)
    for g, members in enumerate(by_dtype.values()):
        total = 0
        for i in members:
            offsets[i], group_index[i] = total, g
            total += sizes[i]
    return ShardLayout(
        world_size=world_size,
        rank=rank,
        sizes=sizes,
        groups=tuple(tuple(m) for m in by_dtype.values()),
        offsets=tuple(offsets),
        group_index=tuple(group_index),
    )


def piece_shape(ndim: int, n: int) -> tuple[int, ...]:
    """The shape of an ``n``-element piece of a leaf with ``ndim`` dimensions: ``(1, ..., 1, n)``.

    A piece keeps its leaf's number of dimensions, so that a mask function
    that tells weights from biases by ``ndim`` (``lambda p: tree_map(lambda x:
    x.ndim > 1, p)``) selects the same leaves on the pieces as on the whole
    parameters. A 0-d leaf's piece is 0-d where the rank owns its element and
    ``(0,)`` where it does not.
    """
    if ndim == 0:
        return () if n == 1 else (0,)
    return (1,) * (ndim - 1) + (n,)


def owners(state: FP16State) -> list[int | None]:
    """For every leaf of ``state.opt_state``: the parameter leaf it belongs to, or ``None``.

    ``state.tx.init`` runs on ``meta`` tensors of distinct sizes, one per
    parameter, each with its parameter's number of dimensions (as pieces have,
    so a mask function decides alike); a leaf of the result with parameter
    ``i``'s size belongs to it. The real state's structure must match the probe's.
    """
    p_leaves, p_spec = tree_flatten(state.params)
    tags = [
        torch.empty(piece_shape(max(p.ndim, 1), _TAG + i), dtype=torch.float32, device="meta")
        for i, p in enumerate(p_leaves)
    ]
    try:
        probe = state.tx.init(tree_unflatten(p_spec, tags))
    except Exception as err:
        raise TypeError(
            f"state.tx.init does not run on shape-only (meta) tensors ({type(err).__name__}: "
            f"{err}), so the optimiser state cannot be split by parameter"
        ) from None
    want, got = tree_flatten(probe)[1], tree_flatten(state.opt_state)[1]
    if want != got:
        raise ValueError(
            "state.opt_state does not have the structure state.tx.init gives: "
            f"expected {want}, got {got}"
        )
    out: list[int | None] = []
    for leaf in tree_flatten(probe)[0]:
        i = leaf.numel() - _TAG if isinstance(leaf, torch.Tensor) and leaf.ndim else -1
        out.append(i if 0 <= i < len(p_leaves) else None)
    return out
