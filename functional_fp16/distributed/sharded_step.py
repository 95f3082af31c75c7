"""``sharded_update``: reduce-scatter the gradients, step this rank's slice, all-gather the params."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from functional_fp16._util.cache import remember
from functional_fp16._util.tree import PyTree, check_like, tree_flatten, tree_paths, tree_unflatten
from functional_fp16.distributed.all_reduce import (
    DEFAULT_BUCKET_BYTES,
    check_bucket_bytes,
    check_comm_dtype,
    check_predivide,
    default_predivide,
)
from functional_fp16.distributed.process_group import ProcessGroup, require_group
from functional_fp16.distributed.row_shards import gather_rows, plan_buckets, reduce_rows, rows
from functional_fp16.distributed.sharding import _format, mesh_of, refuse_replicated_steps
from functional_fp16.update import FP16State, fp16_update
from functional_fp16.update.batching import is_batched
from functional_fp16.update.dispatch import IMPLEMENTATIONS
from functional_fp16.update.dtensor import checked_locally, local_state, mesh_hooks, plan
from functional_fp16.update.fingerprint import (
    agree_once,
    describe_arguments,
    describe_leaf,
    describe_tree,
)

__all__ = ["sharded_update"]


def sharded_update(
    state: FP16State,
    grads: PyTree,
    *,
    comm_dtype: torch.dtype | None = None,
    loss: torch.Tensor | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    predivide_factor: float | None = None,
    impl: str = "auto",
) -> FP16State:
    r"""One data-parallel mixed-precision step on a sharded state (ZeRO-1).

    Every rank passes its own gradients of the scaled loss (shaped like the
    full ``state.params``). With :math:`N` ranks, pre-divide factor :math:`f`,
    communication dtype :math:`c` and :math:`R` this rank's ``Shard(0)`` rows of
    a leaf (:mod:`~functional_fp16.distributed.row_shards`):

    .. math::
        \bar g_R &= \operatorname{fl}_c\Big(\sum_r \operatorname{fl}_c(g_{r,R} / f)\Big) / (N / f)
            \quad\text{(reduce-scatter)} \\
        f_\text{all} &= \min_r f_r \quad\text{(the finite flag, all-reduced with MIN)} \\
        \text{state}_R' &= \text{fp16\_update}(\text{state}_R, \bar g_R) \\
        p' &= \text{all-gather}_r(p'_{R_r})

    The average is the one :func:`tree_all_reduce_mean` forms (same cast,
    pre-divide and post-divide; the sum's order is the collective's), the
    step is :func:`~functional_fp16.fp16_update` on this rank's rows of the
    parameters and its local shards of the master and optimiser state (any
    implementation; the fused kernel where it applies), and the decision is
    agreed across ranks, so a non-finite gradient on any rank skips the step
    on every rank. The optimiser must be elementwise, except for global
    norms: ``clip_by_global_norm`` adds up the shards' float64 sums of squares
    across the ranks (one more all-reduce), so it clips by the whole tree's
    norm. Each rank writes only its shards of the FP32 state; the new FP16
    working copy is whole and bitwise the same on every rank. The first call
    with a configuration (the state's structure, ``tx.spec``, leaf dtypes and
    shapes; the gradients' dtypes; the arguments; the world size) checks with
    one small all-gather that every rank has the same one, and raises on
    every rank, naming the rank and the difference, if not; later calls with
    it communicate nothing more. Collectives are bucketed (about
    ``bucket_bytes`` per call, all launched before any is waited on, as
    FSDP2 packs them: each rank's rows padded to :math:`\lceil d/N \rceil`),
    nothing is read back to the host, and no input is modified.

    Args:
      state: this rank's shard, from :func:`shard_state` (its mesh is the group
        the gradients are averaged over).
      grads: this rank's gradients of the scaled loss, shaped like ``state.params``.
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
        _group_of(state),
        comm_dtype=comm_dtype,
        bucket_bytes=bucket_bytes,
        predivide_factor=predivide_factor,
        impl=impl,
        loss=loss,
    )
    mesh = mesh_of(state, "sharded_update")
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
    found = _plan(state, mesh, comm_dtype, bucket_bytes)
    world, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    p_leaves, p_spec = tree_flatten(state.params)
    # This rank's rows of the parameters, beside its shards of the FP32 state: a plain
    # state that fp16_update steps like any other, checked once per configuration.
    local, wrap = local_state(
        state.replace(params=tree_unflatten(p_spec, _rows_of(p_leaves, world, rank)))
    )
    local = checked_locally(local, found.key)
    wire = comm_dtype

    def pre(dtype: torch.dtype) -> float:
        return predivide_factor or default_predivide(dtype, world)

    with torch.no_grad():
        mean = reduce_rows(
            [g.detach().contiguous() for g in g_leaves],
            found.buckets,
            group,
            world,
            rank,
            wire,
            pre,
        )
    g_rows = tree_unflatten(p_spec, mean)
    agree, global_sum = mesh_hooks(found.mesh_plan, agree=None, global_sum=None)
    stepped = fp16_update(local, g_rows, impl=impl, loss=loss, agree=agree, global_sum=global_sum)
    new_rows = tree_flatten(stepped.params)[0]
    full = gather_rows(new_rows, found.gather_buckets, group, world, rank)
    params = [_format(f, p) for f, p in zip(full, p_leaves)]
    return wrap(stepped).replace(params=tree_unflatten(p_spec, params))


class _Zero1Plan(NamedTuple):
    """What follows from a sharded state's configuration: computed once per configuration."""

    key: tuple  # the configuration (the local state's signature is cached under it)
    tx: Any  # the optimiser the key names by id (kept, so the id is not reused)
    mesh_plan: Any  # the mesh reductions (functional_fp16.update.dtensor.plan of the master)
    buckets: list  # the gradients' reduce-scatter buckets
    gather_buckets: list  # the parameters' all-gather buckets


_PLANS: dict = {}
_PLANS_KEPT = 64


def _plan(state: FP16State, mesh, comm_dtype, bucket_bytes: int) -> _Zero1Plan:
    p_leaves, p_spec = tree_flatten(state.params)
    m_leaves = tree_flatten(state.master)[0]
    key = (
        id(mesh),
        mesh.size(),
        id(state.tx),
        p_spec,
        tree_flatten(state.opt_state)[1],
        tree_flatten(state.loss_scale)[1],
        tuple((tuple(p.shape), p.dtype, p.device) for p in p_leaves),
        tuple(m.dtype for m in m_leaves),
        comm_dtype,
        bucket_bytes,
    )
    found = _PLANS.get(key)
    if found is not None and found.mesh_plan.mesh is mesh and found.tx is state.tx:
        return found
    shapes = [tuple(p.shape) for p in p_leaves]
    for path, p, m in zip(tree_paths(state.params), p_leaves, m_leaves):
        if tuple(m.shape) != tuple(p.shape):
            raise ValueError(
                f"state.params{path}: shape {tuple(p.shape)}, but the sharded master is of "
                f"shape {tuple(m.shape)}; replace params only with what sharded_update returns"
            )
    world = mesh.size()
    found = _Zero1Plan(
        key,
        state.tx,
        plan(state, None, "master"),
        plan_buckets(shapes, [comm_dtype or p.dtype for p in p_leaves], world, bucket_bytes),
        plan_buckets(shapes, [p.dtype for p in p_leaves], world, bucket_bytes),
    )
    return remember(_PLANS, key, found, _PLANS_KEPT)


def _rows_of(params: list[torch.Tensor], world: int, rank: int) -> list[torch.Tensor]:
    """This rank's ``Shard(0)`` rows of each parameter (views where the parameter is
    contiguous; a 0-d parameter whole)."""
    out = []
    for p in params:
        if p.ndim:
            lo, hi = rows(p.shape[0], world, rank)
            p = p[lo:hi]
        out.append(p if p.is_contiguous() else p.contiguous())
    return out


def _group_of(state: Any) -> ProcessGroup:
    """The process group of a sharded state's mesh (the default group for anything else:
    the configuration is compared there, and refused after)."""
    if isinstance(state, FP16State):
        for m in tree_flatten(state.master)[0]:
            if isinstance(m, DTensor):
                return m.device_mesh.get_group() if m.device_mesh.ndim == 1 else None
    return None


def _agree_on_configuration(
    state: Any, grads: PyTree, group: ProcessGroup, *, loss: Any, **arguments: Any
) -> None:
    """:func:`~functional_fp16.update.fingerprint.agree_once` on one step's configuration.

    The key (a few tuples per call) stands for the configuration: the state's
    ``tx``, layout (the parameters' sizes and dtype groups), loss-scale
    settings and parameter structure; the gradients' structure and dtypes;
    the arguments; the kind of ``loss``. Its description (on the first call of
    a configuration only) is the state's and the gradients'
    :func:`~functional_fp16.update.fingerprint.describe_tree`, the
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
