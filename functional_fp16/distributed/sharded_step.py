"""``sharded_update``: reduce-scatter the gradients, step this rank's slice, all-gather the params."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from functional_fp16._util.tree import PyTree, check_like, tree_flatten, tree_unflatten
from functional_fp16.distributed.all_reduce import (
    DEFAULT_BUCKET_BYTES,
    agree_finite,
    check_bucket_bytes,
    check_comm_dtype,
    check_predivide,
    default_predivide,
)
from functional_fp16.distributed.buckets import all_gather_flat, fill, reduce_scatter_flat
from functional_fp16.distributed.fingerprint import (
    agree_once,
    describe_arguments,
    describe_leaf,
    describe_tree,
)
from functional_fp16.distributed.process_group import ProcessGroup, require_group
from functional_fp16.distributed.shard_layout import ShardLayout, piece_shape
from functional_fp16.distributed.sharding import check_layout, refuse_replicated_steps
from functional_fp16.update import FP16State, fp16_update
from functional_fp16.update.batching import is_batched
from functional_fp16.update.dispatch import IMPLEMENTATIONS
from functional_fp16.update.state_check import check_state

__all__ = ["sharded_update"]


def sharded_update(
    state: FP16State,
    grads: PyTree,
    *,
    group: ProcessGroup = None,
    comm_dtype: torch.dtype | None = None,
    loss: torch.Tensor | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    predivide_factor: float | None = None,
    impl: str = "auto",
) -> FP16State:
    r"""One data-parallel mixed-precision step on a sharded state (ZeRO-1).

    Every rank passes its own gradients of the scaled loss (shaped like the
    full ``state.params``). With :math:`N` ranks, pre-divide factor :math:`f`
    and this rank's slice :math:`[a, b)` of each dtype group's flattened
    parameters:

    .. math::
        \bar g_{[a,b)} &= \operatorname{fl}_c\Big(\sum_r \operatorname{fl}_c(g_{r,[a,b)} / f)\Big) / (N / f)
            \quad\text{(reduce-scatter)} \\
        f_\text{all} &= \neg \max_r \neg f_r \quad\text{(the finite flag, all-reduced with MAX)} \\
        \text{state}_{[a,b)}' &= \text{fp16\_update}(\text{state}_{[a,b)}, \bar g_{[a,b)}) \\
        p' &= \text{all-gather}_r(p'_{[a_r, b_r)})

    The average is the one :func:`tree_all_reduce_mean` forms (same cast,
    pre-divide and post-divide), the step is
    :func:`~functional_fp16.fp16_update` on the pieces (any implementation;
    the fused kernel where it applies), and the decision is agreed across
    ranks, so a non-finite gradient on any rank skips the step on every rank.
    The optimiser must be elementwise, except for global norms: within this
    call, ``clip_by_global_norm`` adds up the shards' float64 sums of squares
    across the ranks (one more all-reduce), so it clips by the whole tree's norm.
    Each rank writes only its slice of the FP32 state; the new FP16 working
    copy is whole and bitwise the same on every rank. The first call with a
    configuration (the state's structure, ``tx.spec``, layout, leaf dtypes
    and shapes; the gradients' dtypes; the arguments; the world size) checks
    with one small all-gather that every rank has the same one, and raises
    on every rank, naming the rank and the difference, if not; later calls
    with it communicate nothing more. Collectives are
    bucketed (at most ``bucket_bytes`` per call, all launched before any is
    waited on), nothing is read back to the host, and no input is modified.

    Args:
      state: this rank's shard, from :func:`shard_state` over ``group``.
      grads: this rank's gradients of the scaled loss, shaped like ``state.params``.
      group: the process group (default: the default group).
      comm_dtype: the dtype sent in the reduce-scatter; default each group's
        gradient dtype (FP16 for FP16 parameters).
      loss: optionally this rank's loss; a non-finite one skips the step (on
        every rank).
      bucket_bytes: the most bytes one collective moves.
      predivide_factor: :math:`f`; default as :func:`tree_all_reduce_mean`
        (:math:`N` for FP16/BF16 communication, else 1).
      impl: the implementation of the step on the pieces (see
        :func:`~functional_fp16.fp16_update`).

    Returns:
      The next sharded state.
    """
    require_group("sharded_update")
    # The ranks first agree on the configuration (one small collective, the first
    # time each configuration is seen), so that whatever is refused below on a
    # first call is refused on every rank alike, before the step's first
    # collective: no rank waits alone. A rank whose inputs change later while
    # the others keep an agreed configuration is not compared again (that would
    # take a collective every step), and the others then wait until the
    # process group's timeout.
    _agree_on_configuration(
        state,
        grads,
        group,
        comm_dtype=comm_dtype,
        bucket_bytes=bucket_bytes,
        predivide_factor=predivide_factor,
        impl=impl,
        loss=loss,
    )
    layout = check_layout(state, group, "sharded_update")
    refuse_replicated_steps(state.tx)
    bucket_bytes = check_bucket_bytes(bucket_bytes)
    comm_dtype = check_comm_dtype(comm_dtype)
    predivide_factor = check_predivide(predivide_factor)
    if impl not in ("auto", *IMPLEMENTATIONS):
        raise ValueError(f"impl must be 'auto' or one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor or None, got {type(loss).__name__}")
    g_leaves = check_like(state.params, grads, name="grads", reference_name="params")
    if is_batched([state.step, loss, *g_leaves]):
        raise TypeError("sharded_update cannot run under torch.func.vmap")
    p_leaves, p_spec = tree_flatten(state.params)
    pieces = [layout.piece(i) for i in range(len(p_leaves))]
    shapes = [piece_shape(p.ndim, hi - lo) for p, (lo, hi) in zip(p_leaves, pieces)]
    # This rank's pieces as a plain state, which fp16_update steps like any other;
    # checked as a whole before the first collective of the step.
    p_pieces = [
        p.reshape(-1)[lo:hi].view(shape) for p, (lo, hi), shape in zip(p_leaves, pieces, shapes)
    ]
    inner = state.replace(params=tree_unflatten(p_spec, p_pieces), shard=None)
    check_state(inner)
    mean = _reduce_scatter(
        [g.detach().reshape(-1) for g in g_leaves],
        pieces,
        layout,
        group,
        comm_dtype,
        bucket_bytes,
        predivide_factor,
    )
    g_pieces = [g.view(shape) for g, shape in zip(mean, shapes)]
    # Global norms (clip_by_global_norm) add up the shards' sums of squares.
    stepped = fp16_update(
        inner,
        tree_unflatten(p_spec, g_pieces),
        impl=impl,
        loss=loss,
        agree=functools.partial(agree_finite, group=group),
        global_sum=functools.partial(_sum_over_ranks, group=group),
    )
    new_pieces = [x.reshape(-1) for x in tree_flatten(stepped.params)[0]]
    params = _all_gather(new_pieces, layout, group, p_leaves, bucket_bytes)
    return stepped.replace(params=tree_unflatten(p_spec, params), shard=layout)


def _agree_on_configuration(
    state: Any, grads: PyTree, group: ProcessGroup, *, loss: Any, **arguments: Any
) -> None:
    """:func:`~functional_fp16.distributed.fingerprint.agree_once` on one step's configuration.

    The key (a few tuples per call) stands for the configuration: the state's
    ``tx``, layout (the parameters' sizes and dtype groups), loss-scale
    settings and parameter structure; the gradients' structure and dtypes;
    the arguments; the kind of ``loss``. Its description (on the first call of
    a configuration only) is the state's and the gradients'
    :func:`~functional_fp16.distributed.fingerprint.describe_tree`, the
    arguments and the world size. Nothing here refuses anything: malformed
    inputs are described as they are and refused after the agreement.
    """
    g_leaves, g_spec = tree_flatten(grads)
    loss_kind = describe_leaf(loss) if loss is not None else "None"
    if isinstance(state, FP16State):
        # The layout stands for the parameters' sizes and dtype groups; their
        # shapes and the gradients' shapes are compared on the first call.
        head: tuple[Any, ...] = (
            state.tx,
            state.shard,
            tree_flatten(state.loss_scale)[1],
            tree_flatten(state.params)[1],
        )
    else:
        head = (type(state),)
    key = (
        "sharded_update",
        head,
        g_spec,
        tuple(g.dtype if isinstance(g, torch.Tensor) else type(g) for g in g_leaves),
        loss_kind,
        tuple(arguments.items()),
    )
    world = dist.get_world_size(group)

    def describe() -> list[tuple[str, str]]:
        return (
            [(f"state{p}", d) for p, d in describe_tree(state)]
            + [(f"grads{p}", d) for p, d in describe_tree(grads)]
            + describe_arguments(world, loss=loss_kind, **arguments)
        )

    agree_once(key, describe, group, name="", what="sharded_update: the ranks disagree")


def _sum_over_ranks(x: torch.Tensor, *, group: ProcessGroup) -> torch.Tensor:
    """The sum of ``x`` over the ranks (a new tensor; ``x`` is not written to)."""
    total = x.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


def _rounds(length: int, itemsize: int, world: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``(start, stop)`` within a slice, so that a round's collective moves at most ``bucket_bytes``."""
    chunk = max(1, bucket_bytes // (itemsize * world))
    return [(s, min(s + chunk, length)) for s in range(0, length, chunk)]


def _reduce_scatter(
    g_flat: list[torch.Tensor],
    pieces: list[tuple[int, int]],
    layout: ShardLayout,
    group: ProcessGroup,
    comm_dtype: torch.dtype | None,
    bucket_bytes: int,
    predivide_factor: float | None,
) -> list[torch.Tensor]:
    """This rank's piece of the mean gradient of every leaf (views into one slice per dtype group);
    ``pieces`` are the leaves' ``layout.piece``.

    Each round packs its part of every rank's slice into one buffer (divided by
    the pre-divide factor on the way) and reduce-scatters it. gloo's
    reduce-scatter is an all-reduce of the whole buffer followed by a copy of
    one chunk, so on gloo the buffer is all-reduced in place and the chunk
    read from it: the same sums, two copies fewer. With one rank there is
    nothing to exchange.
    """
    world, rank = layout.world_size, layout.rank
    if world == 1:
        return [_alone(x, comm_dtype, predivide_factor) for x in g_flat]
    in_place = reduces_in_place(g_flat[0].device)
    pending: list[Any] = []
    outs = []
    for g, members in enumerate(layout.groups):
        dtype = g_flat[members[0]].dtype
        wire = comm_dtype or dtype
        pre = predivide_factor or default_predivide(wire, world)
        size, total = layout.slice_numel(g), layout.group_numel(g)
        device = g_flat[members[0]].device
        rounds = _rounds(size, torch.empty((), dtype=wire).element_size(), world, bucket_bytes)
        out = torch.empty(size, dtype=wire, device=device)
        for start, stop in rounds:
            send = torch.empty(world * (stop - start), dtype=wire, device=device)
            at = 0
            for r in range(world):
                a, b = r * size + start, r * size + stop
                parts = [g_flat[i][lo:hi] for i, lo, hi in layout.segments(g, a, b)]
                at = fill(send, at, parts, pre)
                pad = b - max(min(b, total), a)
                send[at : at + pad].zero_()
                at += pad
            if in_place:
                work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=group, async_op=True)
                chunk = send.view(world, stop - start)[rank]
                if len(rounds) == 1:
                    out = chunk
                pending.append((work, None if len(rounds) == 1 else (out[start:stop], chunk)))
            else:
                work = reduce_scatter_flat(
                    out[start:stop], send, op=dist.ReduceOp.SUM, group=group, async_op=True
                )
                pending.append((work, None))
        outs.append((out, world / pre, dtype))
    for work, copy in pending:
        work.wait()
        if copy is not None:
            copy[0].copy_(copy[1])
    mean: list[Any] = [None] * len(g_flat)
    for g, (out, post, dtype) in enumerate(outs):
        if post != 1.0:
            out.div_(post)
        out = out.to(dtype)
        start = layout.bounds(g)[0]
        for i in layout.groups[g]:
            lo, hi = pieces[i]
            at = layout.offsets[i] + lo - start
            mean[i] = out[at : at + hi - lo]
    return mean


def reduces_in_place(device: torch.device) -> bool:
    """Whether the gradients of ``device`` are all-reduced in place rather than reduce-scattered.

    CPU tensors go through gloo (or MPI), whose reduce-scatter is an all-reduce
    of the whole buffer plus copies; CUDA tensors through NCCL's reduce-scatter.
    """
    return device.type == "cpu"


def _alone(x: torch.Tensor, comm_dtype: torch.dtype | None, pre: float | None) -> torch.Tensor:
    """The "mean" over one rank: ``x`` put through the casts and divisions a group would apply."""
    wire = comm_dtype or x.dtype
    pre = pre or default_predivide(wire, 1)
    if wire == x.dtype and pre == 1.0:
        return x
    buf = torch.empty(x.numel(), dtype=wire, device=x.device)
    fill(buf, 0, [x], pre)
    if pre != 1.0:
        buf.div_(1.0 / pre)
    return buf.to(x.dtype)


def _all_gather(
    pieces: list[torch.Tensor],
    layout: ShardLayout,
    group: ProcessGroup,
    like: list[torch.Tensor],
    bucket_bytes: int,
) -> list[torch.Tensor]:
    """The whole leaves, every rank contributing its ``pieces`` (one per leaf)."""
    world = layout.world_size
    pending: list[Any] = []
    fulls = []
    for g, members in enumerate(layout.groups):
        size = layout.slice_numel(g)
        dtype, device = pieces[members[0]].dtype, pieces[members[0]].device
        if world == 1:  # the pieces are the leaves
            fulls.append(None)
            continue
        send = torch.empty(size, dtype=dtype, device=device)
        at = fill(send, 0, [pieces[i] for i in members], 1.0)
        send[at:].zero_()
        full = torch.empty(world * size, dtype=dtype, device=device)
        rounds = _rounds(size, send.element_size(), world, bucket_bytes)
        if len(rounds) == 1:  # straight into the result
            pending.append(all_gather_flat(full, send, group=group, async_op=True))
            rounds = []
        for a, b in rounds:
            outs = [full[r * size + a : r * size + b] for r in range(world)]
            pending.append(dist.all_gather(outs, send[a:b], group=group, async_op=True))
        fulls.append(full)
    for work in pending:
        work.wait()
    out = []
    for i, x in enumerate(like):
        full, o = fulls[layout.group_index[i]], layout.offsets[i]
        leaf = pieces[i] if full is None else full[o : o + layout.sizes[i]]
        leaf = leaf.view(x.shape)
        if not x.is_contiguous():  # keep the parameter's memory format (channels-last)
            leaf = torch.empty_like(x).copy_(leaf)
        out.append(leaf)
    return out
