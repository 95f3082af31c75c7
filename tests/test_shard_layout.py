"""Tests for ``functional_fp16.distributed.shard_layout``: who owns which elements.

Hypothesis draws trees of leaves (sizes 0 to 40, two dtypes, any order) and
world sizes 1 to 8, and checks the bookkeeping against its definition: each
dtype group's flattened leaves, cut into ``N`` contiguous slices of
``ceil(P / N)`` elements.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_fp16.distributed.shard_layout import layout_for

DTYPES = (torch.float16, torch.float32)

leaves_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.sampled_from(DTYPES)), min_size=1, max_size=8
)
world_strategy = st.integers(1, 8)


def make_leaves(spec: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=dtype, device="meta") for n, dtype in spec]


def group_vectors(leaves: list[torch.Tensor]) -> dict[torch.dtype, list[tuple[int, int]]]:
    """The definition: per dtype (first appearance first), (leaf, element) in concatenation order."""
    out: dict[torch.dtype, list[tuple[int, int]]] = {}
    for i, leaf in enumerate(leaves):
        out.setdefault(leaf.dtype, []).extend((i, e) for e in range(leaf.numel()))
    return out


@settings(max_examples=200, deadline=None)
@given(spec=leaves_strategy, world=world_strategy)
def test_every_element_has_exactly_one_owner_as_defined(spec, world):
    leaves = make_leaves(spec)
    vectors = group_vectors(leaves)
    owned: dict[tuple[int, int], int] = {}
    for rank in range(world):
        layout = layout_for(leaves, world, rank)
        for i in range(len(leaves)):
            lo, hi = layout.piece(i)
            assert 0 <= lo <= hi <= leaves[i].numel()
            for e in range(lo, hi):
                assert (i, e) not in owned, "an element owned twice"
                owned[(i, e)] = rank
    for vector in vectors.values():
        size = -(-len(vector) // world)
        for position, element in enumerate(vector):
            assert owned[element] == position // size  # the contiguous slice it falls in
    assert len(owned) == sum(len(v) for v in vectors.values())


@settings(max_examples=200, deadline=None)
@given(spec=leaves_strategy, world=world_strategy)
def test_slices_are_padded_to_the_ceiling_and_cover_the_group(spec, world):
    leaves = make_leaves(spec)
    vectors = list(group_vectors(leaves).values())
    layout = layout_for(leaves, world, 0)
    assert len(layout.groups) == len(vectors)
    for g, vector in enumerate(vectors):
        total = len(vector)
        assert layout.group_numel(g) == total
        size = layout.slice_numel(g)
        assert size * world >= total and (size - 1) * world < max(total, 1)
        bounds = [layout.bounds(g, r) for r in range(world)]
        # Consecutive, each at most one slice long, together the whole group.
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        for (_, b0), (a1, _) in zip(bounds, bounds[1:]):
            assert b0 == a1
        assert all(0 <= b - a <= size for a, b in bounds)
        # A rank's pieces of the group's leaves fill its slice, in order.
        for r, (a, b) in enumerate(bounds):
            pieces = [layout.piece(i, r) for i in layout.groups[g]]
            assert sum(hi - lo for lo, hi in pieces) == b - a


@settings(max_examples=200, deadline=None)
@given(spec=leaves_strategy, world=world_strategy, data=st.data())
def test_segments_list_the_leaf_parts_of_any_range(spec, world, data):
    leaves = make_leaves(spec)
    vectors = list(group_vectors(leaves).values())
    layout = layout_for(leaves, world, 0)
    g = data.draw(st.integers(0, len(vectors) - 1))
    padded = layout.slice_numel(g) * world
    start = data.draw(st.integers(0, padded))
    stop = data.draw(st.integers(start, padded))
    segments = layout.segments(g, start, stop)
    # Expanding the segments gives the group's elements in [start, stop), padding left out.
    expanded = [(i, e) for i, lo, hi in segments for e in range(lo, hi)]
    assert expanded == vectors[g][start:stop]
    assert all(lo < hi for _, lo, hi in segments)


@settings(max_examples=100, deadline=None)
@given(spec=leaves_strategy, world=world_strategy)
def test_pieces_in_rank_order_rebuild_every_leaf(spec, world):
    # What unshard_state does with the gathered pieces, on values.
    leaves = [torch.arange(n, dtype=torch.float64) + 1000 * i for i, (n, _) in enumerate(spec)]
    typed = make_leaves(spec)
    layouts = [layout_for(typed, world, r) for r in range(world)]
    for i, leaf in enumerate(leaves):
        pieces = [leaf[slice(*layout.piece(i))] for layout in layouts]
        assert torch.equal(torch.cat(pieces), leaf)


def test_a_rank_outside_the_world_is_refused():
    leaves = make_leaves([(3, torch.float16)])
    with pytest.raises(ValueError, match="rank 2 must lie in"):
        layout_for(leaves, 2, 2)
