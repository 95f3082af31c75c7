"""Sharded FP32 state (ZeRO-1): each rank keeps only its slice of the master and optimiser state.

In FP16 training the FP32 master and the optimiser's FP32 buffers are most of
the state (8 of every 10 bytes per parameter with SGD-momentum, 12 of 14 with
Adam), and data parallelism replicates them on every rank. Sharding keeps
the full FP16 working copy (``params``) on every rank, for the forward and
backward passes, and divides the rest: rank :math:`r` of :math:`N` holds,
for every parameter leaf, the 1-D *piece* of it that falls in its contiguous
slice of the flattened parameters (:mod:`.shard_layout`). Since the update is
elementwise, each rank can step its pieces alone
(:func:`~functional_fp16.distributed.sharded_update`).

``shard_state`` needs no communication (every rank already holds the full,
identical state); ``unshard_state`` gathers. The optimiser-state leaves that
belong to a parameter are found from ``tx.init`` itself, run once on
shape-only (``meta``) tensors: a leaf that ``init`` derives from parameter
``i`` is sharded like it, every other leaf (counters, flags) is kept whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist

from functional_fp16._util.tree import (
    NAMESPACE,
    PyTree,
    describe_tensor,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.distributed.all_reduce import AllReduceSpec
from functional_fp16.distributed.buckets import all_gather_flat, fill
from functional_fp16.distributed.process_group import ProcessGroup, require_group
from functional_fp16.distributed.replicas import check_same_tree
from functional_fp16.distributed.shard_layout import ShardLayout, layout_for, owners, piece_shape
from functional_fp16.transforms.accumulation import MultiStepsSpec
from functional_fp16.transforms.base import ChainSpec
from functional_fp16.update import FP16State

__all__ = ["shard_state", "unshard_state", "is_sharded"]


def is_sharded(state: Any) -> bool:
    """Whether ``state`` is an :class:`~functional_fp16.FP16State` holding one rank's shard."""
    return isinstance(state, FP16State) and state.shard is not None


def _declared(spec: Any) -> Iterator[Any]:
    """Every spec declared in a transform's ``spec``, looking inside chains and ``MultiSteps``."""
    yield spec
    if isinstance(spec, ChainSpec):
        for part in spec.parts:
            yield from _declared(part)
    elif isinstance(spec, MultiStepsSpec):
        yield from _declared(getattr(spec.inner, "spec", None))


def refuse_replicated_steps(tx: Any) -> None:
    """Refuses an optimiser that averages across ranks itself (``all_reduce_mean``).

    On pieces, whose sizes differ between ranks, it would average elements of
    different parameters; ``sharded_update`` averages the gradients already.
    """
    if any(isinstance(spec, AllReduceSpec) for spec in _declared(getattr(tx, "spec", None))):
        raise ValueError(
            "state.tx contains all_reduce_mean(), which would average pieces of different "
            "parameters across the ranks; sharded_update averages the gradients itself "
            "(reduce-scatter), so build the optimiser without it"
        )


def _check_full(state: FP16State, owner: list[int | None]) -> None:
    """Every per-parameter tensor of an unsharded state has its parameter's shape."""
    p_leaves = tree_flatten(state.params)[0]
    m_leaves = tree_flatten(state.master)[0]
    for path, p, m in zip(tree_paths(state.params), p_leaves, m_leaves, strict=True):
        if not isinstance(m, torch.Tensor) or m.shape != p.shape:
            raise ValueError(
                f"state.master{path}: expected the shape {tuple(p.shape)} of params{path}, "
                f"got {describe_tensor(m)}"
            )
    o_leaves = tree_flatten(state.opt_state)[0]
    for path, leaf, i in zip(tree_paths(state.opt_state), o_leaves, owner, strict=True):
        if i is not None and (
            not isinstance(leaf, torch.Tensor) or leaf.shape != p_leaves[i].shape
        ):
            raise ValueError(
                f"state.opt_state{path}: expected the shape {tuple(p_leaves[i].shape)} of its "
                f"parameter, got {describe_tensor(leaf)}"
            )


def _piece(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A copy of the flat elements ``lo .. hi - 1`` of ``x``, owning its own (small) storage,
    shaped by :func:`~functional_fp16.distributed.shard_layout.piece_shape`."""
    return x.reshape(-1)[lo:hi].clone().view(piece_shape(x.ndim, hi - lo))


def shard_state(state: FP16State, *, group: ProcessGroup = None) -> FP16State:
    r"""This rank's shard of a full (replicated) state: ``params`` whole, FP32 state sliced.

    With :math:`N` ranks and this rank's slice :math:`[a, b)` of the flattened
    parameters of a dtype group (:mod:`~functional_fp16.distributed.shard_layout`):

    .. math::
        \text{master}'_i = \operatorname{vec}(\text{master}_i)[a - o_i : b - o_i]
        \quad\text{(clamped to the leaf; possibly empty)}

    and the same for every optimiser-state leaf that belongs to parameter
    :math:`i`; ``params``, the loss scale and the counters stay whole. Each
    piece is a fresh 1-D tensor, so once the full state is dropped only
    :math:`1/N` of its FP32 bytes remain. No communication beyond a check
    that every rank holds the same structure (the values must already be
    the same on every rank, e.g. after :func:`broadcast_state`), made first so
    that a state that differs on one rank (structure, shapes, dtypes,
    ``tx.spec``) raises on every rank, naming the rank and the difference.

    Args:
      state: a full :class:`~functional_fp16.FP16State` (not already sharded).
      group: the process group to shard over (default: the default group).

    Returns:
      A sharded state (``state.shard`` is its
      :class:`~functional_fp16.distributed.ShardLayout`); update it with
      :func:`sharded_update`, gather it with :func:`unshard_state`.

    Raises:
      ValueError: for a state that is already sharded, or an optimiser state
        whose per-parameter tensors are not shaped like their parameters.
    """
    require_group("shard_state")
    # First, so that every refusal below happens on every rank alike (no rank waits alone).
    check_same_tree(state, group, name="state")
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    if state.shard is not None:
        raise ValueError(
            f"state is already sharded (shard {state.shard.rank} of {state.shard.world_size})"
        )
    refuse_replicated_steps(state.tx)
    owner = owners(state)
    _check_full(state, owner)
    p_leaves, p_spec = tree_flatten(state.params)
    devices = {p.device for p in p_leaves}
    if len(devices) > 1:
        raise ValueError(
            f"params live on several devices ({sorted(map(str, devices))}); "
            "a sharded state keeps all of them on one"
        )
    layout = layout_for(p_leaves, dist.get_world_size(group), dist.get_rank(group))
    pieces = [layout.piece(i) for i in range(len(p_leaves))]
    master = [_piece(m, *pieces[i]) for i, m in enumerate(tree_flatten(state.master)[0])]
    o_leaves, o_spec = tree_flatten(state.opt_state)
    opt = [leaf if i is None else _piece(leaf, *pieces[i]) for leaf, i in zip(o_leaves, owner)]
    return state.replace(
        master=tree_unflatten(p_spec, master),
        opt_state=tree_unflatten(o_spec, opt),
        shard=layout,
    )


def check_layout(state: FP16State, group: ProcessGroup, what: str) -> ShardLayout:
    """The state's layout, after checking that it was sharded over a group like ``group``."""
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    layout = state.shard
    if layout is None:
        raise ValueError(f"{what} needs a sharded state: call shard_state(state) first")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (layout.world_size, layout.rank) != (world, rank):
        raise ValueError(
            f"state holds shard {layout.rank} of {layout.world_size}, but this process is rank "
            f"{rank} of {world} in the group: shard it for this group (unshard_state on the old "
            "group, or load the full checkpoint, then shard_state)"
        )
    sizes = tuple(p.numel() for p in tree_flatten(state.params)[0])
    if sizes != layout.sizes:
        raise ValueError(
            f"state.shard was laid out for parameters of {layout.sizes} elements, but "
            f"state.params has {sizes}: shard a state only with shard_state"
        )
    return layout


def raise_together(error: str | None, group: ProcessGroup) -> None:
    """Raises on every rank if ``error`` (this rank's problem, or ``None``) is set on any.

    One small all-gather, so that a rank with a malformed state does not leave
    the others waiting in the collective that follows.
    """
    errors: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    for r, message in enumerate(errors):
        if message is not None:
            raise ValueError(message if r == dist.get_rank(group) else f"on rank {r}: {message}")


def unshard_state(state: FP16State, *, group: ProcessGroup = None) -> FP16State:
    r"""The full state, on every rank, gathered from the shards of ``group``.

    The inverse of :func:`shard_state`: every piece is all-gathered and the
    pieces of each leaf are concatenated in rank order and reshaped (in the
    parameter's memory format). One ``all_gather`` per dtype; the result is
    bitwise the same on every rank, and can be saved, inspected, updated with
    :func:`~functional_fp16.fp16_update`, or sharded again for another world
    size.

    Args:
      state: a sharded state, sharded over ``group``.
      group: the process group (default: the default group).

    Returns:
      An unsharded :class:`~functional_fp16.FP16State` (``shard`` is ``None``).
    """
    require_group("unshard_state")
    layout = check_layout(state, group, "unshard_state")
    owner = owners(state)
    p_leaves, p_spec = tree_flatten(state.params)
    m_leaves = tree_flatten(state.master)[0]
    o_leaves, o_spec = tree_flatten(state.opt_state)
    # Every sharded tensor: (its pieces here, the parameter it belongs to).
    sharded = list(enumerate(m_leaves)) + [
        (i, o_leaves[j]) for j, i in enumerate(owner) if i is not None
    ]
    error = None
    for i, t in sharded:
        lo, hi = layout.piece(i)
        want = piece_shape(p_leaves[i].ndim, hi - lo)
        if not isinstance(t, torch.Tensor) or t.shape != want:
            error = (
                f"a piece of params{tree_paths(state.params)[i]} is a {describe_tensor(t)}, but "
                f"shard {layout.rank} of {layout.world_size} holds it as shape {want}"
            )
            break
    raise_together(error, group)
    full = _gather_pieces(sharded, layout, p_leaves, group)
    master = full[: len(m_leaves)]
    rest = iter(full[len(m_leaves) :])
    opt = [leaf if i is None else next(rest) for leaf, i in zip(o_leaves, owner)]
    return state.replace(
        master=tree_unflatten(p_spec, master),
        opt_state=tree_unflatten(o_spec, opt),
        shard=None,
    )


def _gather_pieces(
    sharded: list[tuple[int, torch.Tensor]],
    layout: ShardLayout,
    params: list[torch.Tensor],
    group: ProcessGroup,
    bucket_bytes: int = 64 * 1024 * 1024,
) -> list[torch.Tensor]:
    """The full tensors of ``sharded`` (``(parameter index, piece)``), all-gathered in buckets.

    Tensors of one dtype go together until a bucket's gathered bytes would
    pass ``bucket_bytes``, so the memory in flight beyond the result is one
    bucket, not a second copy of the whole state.
    """
    world = layout.world_size
    lengths = [
        [hi - lo for lo, hi in (layout.piece(i, r) for i, _ in sharded)] for r in range(world)
    ]
    out: list[Any] = [None] * len(sharded)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for j, (_, t) in enumerate(sharded):
        by_dtype.setdefault(t.dtype, []).append(j)
    for dtype, js in by_dtype.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        bucket: list[int] = []
        for j in js + [None]:
            if j is not None:
                grown = bucket + [j]
                width = max(sum(lengths[r][k] for k in grown) for r in range(world))
                if not bucket or world * width * itemsize <= bucket_bytes:
                    bucket = grown
                    continue
            _gather_bucket(bucket, sharded, lengths, layout, params, group, dtype, out)
            bucket = [j] if j is not None else []
    return out


def _gather_bucket(js, sharded, lengths, layout, params, group, dtype, out) -> None:
    """All-gathers the pieces of ``sharded[j]`` for ``j`` in ``js`` and writes the full tensors to ``out``."""
    world = layout.world_size
    totals = [sum(lengths[r][j] for j in js) for r in range(world)]
    width = max(totals)
    device = sharded[js[0]][1].device
    mine = torch.empty(width, dtype=dtype, device=device)
    at = fill(mine, 0, [sharded[j][1].reshape(-1) for j in js], 1.0)
    mine[at:].zero_()
    gathered = torch.empty(world * width, dtype=dtype, device=device)
    all_gather_flat(gathered, mine, group=group)
    rows = gathered.view(world, width)
    starts = [0] * world
    for j in js:
        like = params[sharded[j][0]]
        full = torch.empty_like(like, dtype=dtype)  # the parameter's shape and memory format
        dense = full.is_contiguous()
        flat = full.view(-1) if dense else torch.empty(like.numel(), dtype=dtype, device=device)
        at = 0
        for r in range(world):
            n = lengths[r][j]
            flat[at : at + n].copy_(rows[r, starts[r] : starts[r] + n])
            starts[r] += n
            at += n
        if not dense:  # channels-last: reorder into the parameter's layout
            full.copy_(flat.view(like.shape))
        out[j] = full


def map_sharded(fn, tree: PyTree) -> PyTree:
    """``tree`` with every sharded :class:`~functional_fp16.FP16State` in it replaced by ``fn(state)``.

    Nodes are visited in flattening order, the same on every rank, so ``fn``
    may run collectives.
    """
    return optree.tree_map(
        lambda x: fn(x) if is_sharded(x) else x,
        tree,
        is_leaf=lambda x: isinstance(x, FP16State),
        namespace=NAMESPACE,
    )


def full_like(state: FP16State) -> FP16State:
    """An unsharded state shaped like the full form of the sharded ``state`` (values unspecified).

    The template to load a full checkpoint into: ``params`` as they are,
    ``master`` and the optimiser state freshly allocated at full size.
    """
    master = optree.tree_map(
        lambda p: torch.empty_like(p, dtype=torch.float32), state.params, namespace=NAMESPACE
    )
    return state.replace(master=master, opt_state=state.tx.init(master), shard=None)


def shard_like(tree: PyTree, like: PyTree, group: ProcessGroup) -> PyTree:
    """``tree`` with :func:`shard_state` applied to the states that are sharded in ``like``."""

    def states(t: PyTree) -> tuple[list[Any], Any]:
        return optree.tree_flatten(
            t, is_leaf=lambda x: isinstance(x, FP16State), namespace=NAMESPACE
        )

    nodes, spec = states(tree)
    wanted = states(like)[0]
    out = [
        shard_state(n, group=group) if is_sharded(w) else n
        for n, w in zip(nodes, wanted, strict=True)
    ]
    return optree.tree_unflatten(spec, out)
