r"""States whose leaves are DTensors: the update runs on the local shards.

A state built from DTensor parameters (``fully_shard``'s FP16 parameters, or
``distribute_tensor``) holds DTensors wherever ``params`` does: the FP32
master and the optimiser's per-parameter state have the parameters' mesh and
placements (``p.float()`` and ``zeros_like`` keep them). :func:`dtensor_update`
steps such a state as the same computation on every rank's local shards:

* every elementwise part (unscale, optimiser, select, cast) runs on
  ``x.to_local()`` through the same implementation a plain state takes (the
  fused op, on the local tensors: no gather and no DTensor dispatch);
* the reductions that span leaves are completed over the mesh: each leaf's
  finite flag :math:`\ell_l = \bigwedge_r \ell_{l,r}` by one all-reduce (MIN) of
  the flags of all leaves, so every rank takes the same decision
  :math:`f = \bigwedge_l \ell_l` and holds the same ``leaf_finite``, and the sum of squares behind ``clip_by_global_norm``,
  :math:`S = \sum_r S_r`, by an all-reduce (SUM) over the mesh dimensions on
  which the leaves are sharded (a replicated dimension holds the same values
  on every rank and is not summed);
* the new local tensors are wrapped back with their leaf's mesh, placements,
  global shape and stride (``DTensor.from_local``, no communication).

The loss scale, ``step`` and ``grads_finite`` are plain tensors, equal on every
rank. Leaves must be on one mesh with ``Shard`` or ``Replicate`` placements;
the sharded parameters must be sharded over the same mesh dimensions (as FSDP2
and HSDP lay them out), and fully replicated ones may sit beside them (their
squares are counted once: the sum over the sharded dimensions counts them once
per rank, and the surplus is subtracted; that is exact on the fused path, where
the clip comes first and sees the unscaled gradients, and anywhere else such a
mix raises ``NotImplementedError`` when the optimiser clips). A ``Partial``
placement or another mix raises, naming the leaf.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from functional_fp16._util.cache import remember
from functional_fp16._util.tree import tree_flatten, tree_paths, tree_unflatten
from functional_fp16.precision.loss_scale import unscale_inverse
from functional_fp16.update.accumulation import fp16_accumulates
from functional_fp16.update.decision import LeafAgreement
from functional_fp16.update.dispatch import route
from functional_fp16.update.state_check import check_state, mark_checked

__all__ = [
    "holds_dtensors",
    "dtensor_update",
    "local_state",
    "plan",
    "mesh_hooks",
    "checked_locally",
]


def holds_dtensors(state) -> bool:
    """Whether ``state.params`` holds DTensor leaves."""
    return any(isinstance(x, DTensor) for x in tree_flatten(state.params)[0])


def _layout(tree, name: str) -> tuple[Any, tuple[int, ...]]:
    """The mesh of ``tree``'s DTensors and the mesh dimensions they are sharded over (checked)."""
    paths = tree_paths(tree)
    leaves = tree_flatten(tree)[0]
    mesh, sharded = None, None
    for path, p in zip(paths, leaves):
        if not isinstance(p, DTensor):
            raise TypeError(
                f"{name}{path}: a plain tensor among DTensor parameters; every leaf "
                "must be a DTensor on one mesh"
            )
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh != mesh:
            raise ValueError(f"{name}{path}: on another device mesh than the first leaf")
        if not all(isinstance(x, (Shard, Replicate)) for x in p.placements):
            raise ValueError(
                f"{name}{path}: placements {p.placements}; only Shard and Replicate are supported"
            )
        dims = tuple(i for i, x in enumerate(p.placements) if isinstance(x, Shard))
        if dims and dims != sharded:
            if sharded is not None:
                raise ValueError(
                    f"{name}{path}: sharded over mesh dimensions {dims}, the other "
                    f"sharded parameters over {sharded}; the global norm needs one layout"
                )
            sharded = dims
    return mesh, sharded or ()


def _replicated(p: DTensor) -> bool:
    return all(isinstance(x, Replicate) for x in p.placements)


def local_state(state):
    """``state`` with every DTensor leaf replaced by its local tensor, and what wraps them back:
    ``(local, wrap)`` where ``wrap(new_local_state)`` restores the DTensor leaves."""
    leaves, spec = tree_flatten(state)
    olds = [x if isinstance(x, DTensor) else None for x in leaves]
    with torch.no_grad():
        local_leaves = [x.to_local() if d is not None else x for x, d in zip(leaves, olds)]
    local = tree_unflatten(spec, local_leaves)

    def wrap(new):
        new_leaves, new_spec = tree_flatten(new)
        out = [
            x if old is None else (old if x is before else _like(old, before, x))
            for x, old, before in zip(new_leaves, olds, local_leaves)
        ]
        return tree_unflatten(new_spec, out)

    return local, wrap


def _like(old: DTensor, before: torch.Tensor, local: torch.Tensor) -> DTensor:
    """A DTensor of ``old``'s mesh, placements, global shape and stride around ``local``
    (a new local tensor of ``old``'s local shape, stride and dtype, as an update makes);
    ``before`` is ``old.to_local()``.

    An update keeps every leaf's metadata, so ``old``'s spec describes the new
    leaf too: it is wrapped as DTensor's own operators wrap their results
    (``DTensor(local, old._spec, requires_grad=False)``), without the public
    ``DTensor.from_local``'s autograd function and re-validation. Measured
    (``fp16_update`` of the recipe per call, world size 1 on gloo, one thread,
    AMD EPYC, torch 2.14.1, median of 300 calls interleaved with this form's):
    with ``from_local(..., run_check=False, shape=, stride=)`` a call took 1.35x
    as long on a 5-leaf tree (788 -> 1067 us) and 1.72x on a 73-leaf one (5469
    -> 9408 us; SGD with momentum 1.40x and 1.79x), far over 2 %, so the private
    ``_spec`` stays. A donated update's leaf is the old local tensor itself, and
    keeps its old DTensor.
    """
    if (local.shape, local.stride(), local.dtype) == (before.shape, before.stride(), before.dtype):
        return DTensor(local, old._spec, requires_grad=False)
    return DTensor.from_local(
        local, old.device_mesh, old.placements, run_check=False, shape=old.shape,
        stride=old.stride(),
    )  # fmt: skip


def _local_grads(state, grads) -> Any:
    """The gradients' local tensors, after checking they are DTensors on the params' mesh;
    one placed otherwise there is redistributed to its parameter's placements first."""
    g_leaves, g_spec = tree_flatten(grads)
    p_leaves = tree_flatten(state.params)[0]
    out = []
    for path, g, p in zip(tree_paths(grads), g_leaves, p_leaves):
        if not isinstance(g, DTensor):
            raise TypeError(
                f"grads{path}: a plain tensor where params holds a DTensor; pass the DTensor "
                "gradients (FSDP2's p.grad)"
            )
        if g.device_mesh != p.device_mesh:
            raise ValueError(
                f"grads{path}: placements {g.placements} on {g.device_mesh}, expected the "
                f"parameter's {p.placements} on {p.device_mesh}"
            )
        if g.placements != p.placements:
            # Placed otherwise on the parameter's mesh (a Replicate gradient of a sharded
            # embedding, a Partial sum): DTensor moves it to the parameter's placements.
            try:
                g = g.redistribute(p.device_mesh, p.placements)
            except (RuntimeError, NotImplementedError, ValueError) as err:
                raise ValueError(
                    f"grads{path}: placements {g.placements} cannot be redistributed to the "
                    f"parameter's {p.placements}: {err}"
                ) from None
        out.append(g.to_local())
    return tree_unflatten(g_spec, out)


def _sum_of_squares(grads: list[torch.Tensor], loss_scale) -> torch.Tensor:
    r""":math:`\sum (\operatorname{fl}_{32}(g)\cdot\mathrm{inv})^2` in float64, as the update sums."""
    inv = unscale_inverse(loss_scale)
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        u = g.float() if inv is None else g.float() * inv
        total = total + u.double().square().sum()
    return total


def _groups(mesh, dims) -> list:
    return [mesh.get_group(d) for d in dims]


class _Plan(NamedTuple):
    """What follows from a DTensor state's signature: computed once per signature."""

    mesh: Any
    every_dim: list  # the process groups of every mesh dimension (the finite flag)
    sum_dims: list  # those of the dimensions the parameters are sharded over (the norm)
    copies: int  # how many ranks hold each replicated leaf within ``sum_dims``
    replicated: tuple[int, ...]  # the positions of the fully replicated parameters
    placements: tuple  # each parameter's placements (its gradient's must match)


_PLANS: dict = {}
_PLANS_KEPT = 64
_LOCAL_SIGNATURES: dict = {}  # (state signature, local strides) -> the local state's signature


def plan(state, signature, field: str = "params") -> _Plan:
    """What follows from the layout of ``state.<field>`` (the leaves that carry the
    placements: ``params``, or a sharded state's ``master``), looked up by ``signature``."""
    tree = getattr(state, field)
    found = None if signature is None else _PLANS.get(signature)
    # The same mesh object, not only an equal one: its process groups are the plan's.
    if found is not None and found.mesh is tree_flatten(tree)[0][0].device_mesh:
        return found
    mesh, sharded = _layout(tree, f"state.{field}")
    sum_dims = _groups(mesh, sharded)
    copies = 1
    for group in sum_dims:
        copies *= dist.get_world_size(group)
    params = tree_flatten(tree)[0]
    found = _Plan(
        mesh,
        _groups(mesh, range(mesh.ndim)),
        sum_dims,
        copies,
        tuple(i for i, p in enumerate(params) if _replicated(p)),
        tuple(p.placements for p in params),
    )
    if signature is not None:
        remember(_PLANS, signature, found, _PLANS_KEPT)
    return found


def _grad_locals(plan: _Plan, state, grads) -> Any:
    """The gradients' local tensors; the checks that name a leaf run when a fast one fails."""
    leaves, spec = tree_flatten(grads)
    if all(type(g) is DTensor for g in leaves) and all(
        g.device_mesh == plan.mesh and g.placements == want
        for g, want in zip(leaves, plan.placements)
    ):
        with torch.no_grad():
            return tree_unflatten(spec, [g.to_local() for g in leaves])
    return _local_grads(state, grads)


def checked_locally(local, signature):
    """``local`` marked with the signature its metadata gives (looked up after the first call)."""
    if signature is None:
        return local
    leaves = tree_flatten(local)[0]
    key = (signature, tuple([x.stride() for x in leaves if isinstance(x, torch.Tensor)]))
    found = _LOCAL_SIGNATURES.get(key)
    if found is None:
        found = remember(_LOCAL_SIGNATURES, key, check_state(local), _PLANS_KEPT)
    return mark_checked(local, found)


def mesh_hooks(plan: _Plan, state, local, local_grads, *, agree, global_sum, impl="auto"):
    r"""The ``agree`` and ``global_sum`` hooks that complete a local update's reductions over
    the mesh: the leaves' finite flags (and the decision from them) by MIN over every mesh
    dimension (a :class:`~functional_fp16.update.decision.LeafAgreement`), the float64 sum
    of squares by SUM over the sharded ones, less the surplus copies of the replicated
    leaves. ``agree`` and ``global_sum``, when given, apply after the mesh's own
    reductions."""

    def mesh_and(finite: torch.Tensor) -> torch.Tensor:
        flag = finite.to(torch.int32)
        for group in plan.every_dim:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return flag.to(torch.bool).reshape(finite.shape)

    # Per leaf: the flags of a leaf's shards on every rank, in the same all-reduce.
    mesh_agree = LeafAgreement(mesh_and, agree)

    mixed = bool(plan.replicated) and plan.copies > 1
    # The surplus copies of the replicated leaves are known exactly where the norm is
    # that of the unscaled gradients themselves: the fused path, clip first, no MultiSteps.
    exact = not mixed or (not fp16_accumulates(state.tx) and route(local, impl).name == "fused")

    def mesh_sum(partial: torch.Tensor) -> torch.Tensor:
        if not exact:
            raise NotImplementedError(
                "clip_by_global_norm over a mix of replicated and sharded DTensor parameters "
                "runs on the fused path only (the clip first in the chain, no MultiSteps); "
                "shard every parameter, or clip first"
            )
        total = partial.clone()
        for group in plan.sum_dims:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        if mixed:  # each rank summed the replicated leaves: keep one copy
            g = tree_flatten(local_grads)[0]
            extra = _sum_of_squares([g[i] for i in plan.replicated], state.loss_scale)
            total = total - (plan.copies - 1) * extra
        return total if global_sum is None else global_sum(total)

    return mesh_agree, mesh_sum


_AGREED: dict = {}  # the configurations every rank was seen to hold, by key


def _describe(x) -> str:
    if isinstance(x, DTensor):
        mesh = x.device_mesh
        return (
            f"a {x.dtype} DTensor of shape {tuple(x.shape)}, {tuple(x.placements)} on a mesh "
            f"of shape {tuple(mesh.shape)}"
        )
    if isinstance(x, torch.Tensor):
        return f"a plain {x.dtype} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def agree_on_layout(state, grads, signature) -> None:
    r"""Raises on every rank if any rank's DTensor layout differs (checked once per layout).

    Before the first collective of a layout, each rank describes every leaf of
    ``state.params`` and ``grads`` (dtype, global shape, placements, mesh shape)
    and the ranks of the default process group all-gather a digest of it; only
    if the digests differ are the descriptions gathered, to name the first rank
    and path that differ from rank 0. So a rank with another mesh or another
    gradient placement makes every rank raise instead of leaving the others in
    an all-reduce. Runs when the mesh spans the whole default group.
    """
    if not dist.is_initialized():
        return
    g_leaves, g_spec = tree_flatten(grads)
    p0 = tree_flatten(state.params)[0][0]
    if not isinstance(p0, DTensor) or p0.device_mesh.size() != dist.get_world_size():
        return
    key = (
        signature,
        g_spec,
        tuple(
            (type(g), g.dtype, g.shape, tuple(g.placements) if isinstance(g, DTensor) else None)
            if isinstance(g, torch.Tensor)
            else type(g)
            for g in g_leaves
        ),
    )
    if signature is not None and key in _AGREED:
        return
    entries = [
        (f"state.params{p}", _describe(x))
        for p, x in zip(tree_paths(state.params), tree_flatten(state.params)[0])
    ]
    entries += [(f"grads{p}", _describe(g)) for p, g in zip(tree_paths(grads), g_leaves)]
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    world = dist.get_world_size()
    digests: list = [None] * world
    dist.all_gather_object(digests, digest)
    if len(set(digests)) > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, entries)
        r = next(i for i, d in enumerate(digests) if d != digests[0])
        ref, other = dict(everyone[0]), dict(everyone[r])
        for path in list(ref) + [p for p in other if p not in ref]:
            if ref.get(path) != other.get(path):
                raise ValueError(
                    f"fp16_update: the ranks disagree: {path} is {ref.get(path, 'absent')} on "
                    f"rank 0 but {other.get(path, 'absent')} on rank {r}"
                )
    if signature is not None:
        remember(_AGREED, key, True, _PLANS_KEPT)


def dtensor_update(state, grads, update, *, loss, agree, global_sum, signature=None, **kwargs):
    r"""``update`` (``fp16_update``) of a DTensor state, run on the local shards.

    See the module docstring. ``agree`` and ``global_sum``, when given, apply
    after the mesh's own reductions. ``signature`` (the state's, from
    ``check_state``) lets what follows from the layout be looked up. Returns
    the state with its DTensor leaves.
    """
    agree_on_layout(state, grads, signature)  # before anything that may raise on one rank
    found = plan(state, signature)
    local, wrap = local_state(state)
    local = checked_locally(local, signature)
    local_grads = _grad_locals(found, state, grads)
    mesh_agree, mesh_sum = mesh_hooks(
        found, state, local, local_grads, agree=agree, global_sum=global_sum,
        impl=kwargs.get("impl", "auto"),
    )  # fmt: skip
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    new = update(local, local_grads, loss=loss, agree=mesh_agree, global_sum=mesh_sum, **kwargs)
    return wrap(new)
