r"""States whose leaves are DTensors: the update runs on the local shards.

A state built from DTensor parameters (``fully_shard``'s FP16 parameters, or
``distribute_tensor``) holds DTensors wherever ``params`` does: the FP32
master and the optimiser's per-parameter state have the parameters' mesh and
placements (``p.float()`` and ``zeros_like`` keep them). :func:`dtensor_update`
steps such a state as the same computation on every rank's local shards:

* every elementwise part (unscale, optimiser, select, cast) runs on
  ``x.to_local()`` through the same implementation a plain state takes (the
  fused op, on the local tensors: no gather and no DTensor dispatch);
* the reductions that span leaves are completed over the ranks of the
  leaves' mesh, by one all-reduce each (over the default group when the mesh
  spans it or the mesh's own when it is 1-D; else one per mesh dimension in
  turn), however the leaves are laid out: each leaf's
  finite flag :math:`\ell_l = \bigwedge_r \ell_{l,r}` by one all-reduce (MIN)
  of the flags of all leaves, so every rank takes the same decision
  :math:`f = \bigwedge_l \ell_l` and holds the same ``leaf_finite``; and the
  sum of squares behind ``clip_by_global_norm`` by one all-reduce (SUM) of
  :math:`\sum_l w_{l,r} S_{l,r}`, where :math:`w_{l,r}` is 1 on exactly one
  holder of each distinct shard of leaf :math:`l` (coordinate 0 on the
  dimensions it is replicated over, and the first slice of a sub-mesh), so
  every shard is counted once however the leaves are laid out;
* the new local tensors are wrapped back with their leaf's mesh, placements,
  global shape and stride (``DTensor.from_local``, no communication).

The loss scale, ``step`` and ``grads_finite`` are plain tensors, equal on every
rank. Every leaf is a DTensor with ``Shard`` (FSDP2's strided shards included)
or ``Replicate`` placements, on one mesh or on sub-meshes sliced from it (a
2-D ``("dp", "tp")`` mesh of tensor parallelism under FSDP2, with leaves
sharded over both dimensions, over one, or replicated). A gradient placed
otherwise on its parameter's mesh (``Replicate``, ``Partial``) is moved to the
parameter's placements by DTensor's ``redistribute``; a plain leaf, a leaf on
another mesh, or a ``Partial`` parameter raises, naming the leaf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

try:  # FSDP2's shards of a tensor-parallel dimension (not a subclass of Shard)
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = Shard

from functional_fp16._util.cache import remember
from functional_fp16._util.tree import tree_flatten, tree_paths, tree_unflatten
from functional_fp16.transforms.clipping import LeafSums
from functional_fp16.update.decision import LeafAgreement
from functional_fp16.update.fingerprint import (
    agree,
    describe_leaf,
    describe_static,
    describe_tree,
)
from functional_fp16.update.mesh_reduce import (
    agreement_groups,
    all_reduce,
    root_mesh,
    whole_mesh_groups,
)
from functional_fp16.update.state_check import check_state, mark_checked

__all__ = [
    "dtensor_update",
    "local_state",
    "plan",
    "mesh_hooks",
    "checked_locally",
]


def _is_replicate(x) -> bool:
    return isinstance(x, Replicate)


def _replicated(p: DTensor) -> bool:
    return all(map(_is_replicate, p.placements))


def _ranks(mesh) -> tuple[int, ...]:
    return tuple(sorted(mesh.mesh.flatten().tolist()))


def _counts(p: DTensor, root) -> bool:
    r"""Whether this rank counts ``p``'s squares in the mesh's sum: :math:`w_{l,r} = 1` on
    exactly one holder of each distinct shard of ``p`` among the ranks of ``root``.

    On ``p``'s mesh the holders of one shard differ only in their coordinates
    on the ``Replicate`` dimensions, so the one at coordinate 0 there counts; a
    sub-mesh of ``root`` is one of the slices that together cover it, each
    holding the same values, and only the slice that holds ``root``'s first
    rank counts.
    """
    mesh = p.device_mesh
    coordinate = mesh.get_coordinate()
    if any(c and isinstance(x, Replicate) for c, x in zip(coordinate, p.placements)):
        return False
    return mesh is root or int(root.mesh.flatten()[0]) in mesh.mesh.flatten().tolist()


def _layout(paths, leaves, name: str) -> tuple[Any, tuple[bool, ...], bool, bool]:
    r"""``(root, counted, summed, mixed)`` of a tree's DTensor leaves (at ``paths``), checked:
    the mesh that every leaf's mesh is (or was sliced from), whether this rank counts each
    leaf's squares (:func:`_counts`), whether the sum of squares needs an all-reduce at all
    (some leaf is sharded, or lies on a sub-mesh), and whether the leaves are laid out
    unalike, so that some rank counts some and not others (the same answer on every rank)."""
    first, counted, summed, kinds = None, [], False, set()
    for path, p in zip(paths, leaves):
        if not isinstance(p, DTensor):
            raise TypeError(
                f"{name}{path}: a plain tensor among DTensor parameters; every leaf must be a "
                "DTensor (a module left out of a tensor-parallel plan keeps plain parameters: "
                "give it SequenceParallel, or distribute_tensor(p, mesh, [Replicate()]))"
            )
        if not all(isinstance(x, (Shard, _StridedShard, Replicate)) for x in p.placements):
            raise ValueError(
                f"{name}{path}: placements {p.placements}; only Shard and Replicate are supported"
            )
        mesh = p.device_mesh
        if mesh.get_coordinate() is None:
            raise ValueError(f"{name}{path}: on a device mesh that does not hold this rank")
        root = root_mesh(mesh)
        if first is None:
            first = root
        elif root is not first and _ranks(root) != _ranks(first):
            raise ValueError(
                f"{name}{path}: on a device mesh over ranks {list(_ranks(root))}, the first "
                f"leaf's over {list(_ranks(first))}; every leaf's mesh must span the same "
                "ranks (the whole mesh, or a sub-mesh sliced from it)"
            )
        summed |= mesh is not root or not _replicated(p)
        counted.append(_counts(p, root))
        # Two roots over the same ranks (meshes made apart, their dimensions in another
        # order) slice alike-named sub-meshes differently: the root is part of the kind.
        kinds.add((
            mesh is root, mesh.mesh_dim_names, tuple(map(_is_replicate, p.placements)),
            root.mesh_dim_names, tuple(root.mesh.flatten().tolist()), tuple(root.shape),
        ))  # fmt: skip
    if not summed:  # every leaf whole on every rank: each counts its own copy, no reduction
        counted, kinds = [True] * len(counted), set()
    # Whether some rank counts some leaves and not others: from the layout alone, so that
    # every rank takes the same path (and raises, if it must, with the others).
    return first, tuple(counted), summed, len(kinds) > 1


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


def _check_grads(plan: _Plan, grads) -> bool:
    """Refuses a gradient that is not a DTensor on its parameter's mesh, naming it (local:
    no communication); returns whether every gradient also has its parameter's placements
    (else some must be redistributed). Their structure, shapes and dtypes are the
    caller's checks."""
    g_leaves = tree_flatten(grads)[0]
    if all(type(g) is DTensor for g in g_leaves) and all(
        g.device_mesh == mesh and g.placements == want
        for g, mesh, want in zip(g_leaves, plan.meshes, plan.placements)
    ):
        return True
    for path, g, mesh, want in zip(tree_paths(grads), g_leaves, plan.meshes, plan.placements):
        if not isinstance(g, DTensor):
            raise TypeError(
                f"grads{path}: a plain tensor where params holds a DTensor; pass the DTensor "
                "gradients (FSDP2's p.grad)"
            )
        if g.device_mesh != mesh:
            raise ValueError(
                f"grads{path}: placements {g.placements} on {g.device_mesh}, expected the "
                f"parameter's {want} on {mesh}"
            )
    return False


def _local_grads(state, grads) -> Any:
    """The gradients' local tensors (checked by :func:`_check_grads`); one placed otherwise
    on its parameter's mesh is redistributed to the parameter's placements first."""
    g_leaves, g_spec = tree_flatten(grads)
    p_leaves = tree_flatten(state.params)[0]
    out = []
    for path, g, p in zip(tree_paths(grads), g_leaves, p_leaves):
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


class _Plan(NamedTuple):
    """What follows from a DTensor state's signature: computed once per signature."""

    groups: list  # whose all-reduces in turn span every rank of the leaves' meshes
    summed: bool  # whether the sum of squares is all-reduced (some leaf sharded)
    counted: tuple[bool, ...]  # per leaf, whether this rank counts its squares
    mixed: bool  # whether some rank counts some leaves and not others (alike on all)
    paths: dict  # each leaf's path -> its position (to place the leaves a clip sees)
    placements: tuple  # each parameter's placements (its gradient's must match)
    meshes: tuple  # each parameter's mesh
    picks: dict  # (a clip's tree structure, device) -> the positions this rank counts there

    @property
    def mesh(self) -> Any:
        """The first leaf's mesh: the plan is looked up only for the same object."""
        return self.meshes[0]


_PLANS: dict = {}
_PLANS_KEPT = 64
_LOCAL_SIGNATURES: dict = {}  # (state signature, local strides) -> the local state's signature


def plan(state, signature, field: str = "params") -> _Plan:
    """What follows from the layout of ``state.<field>`` (the leaves that carry the
    placements: ``params``, or a sharded state's ``master``), looked up by ``signature``."""
    tree = getattr(state, field)
    leaves = tree_flatten(tree)[0]
    found = None if signature is None else _PLANS.get(signature)
    # The same mesh object, not only an equal one: its process groups are the plan's.
    if found is not None and found.mesh is leaves[0].device_mesh:
        return found
    paths = tree_paths(tree)
    root, counted, summed, mixed = _layout(paths, leaves, f"state.{field}")
    found = _Plan(
        whole_mesh_groups(root),
        summed,
        counted,
        mixed,
        {path: i for i, path in enumerate(paths)},
        tuple(p.placements for p in leaves),
        tuple(p.device_mesh for p in leaves),
        {},
    )
    if signature is not None:
        remember(_PLANS, signature, found, _PLANS_KEPT)
    return found


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


class MeshSum(LeafSums):
    r"""The ``global_sum`` of a DTensor state: :math:`S = \sum_r \sum_l w_{l,r} S_{l,r}` by
    one all-reduce (SUM) over the ranks of the leaves' mesh, each distinct shard of
    each leaf counted once (see :func:`_counts`), then ``then`` (a caller's hook).

    Where every leaf is laid out alike, every rank counts all its leaves or none,
    and the plain sum serves (``per_leaf`` false); otherwise, on every rank alike,
    the clip (on the fused path, ``grad_stats`` per leaf) gives each leaf's sum,
    placed among the state's leaves by its path.
    """

    def __init__(self, plan: _Plan, then):
        self.plan = plan
        self.then = then
        self.per_leaf = plan.mixed

    def _total(self, share: torch.Tensor) -> torch.Tensor:
        total = share.clone()
        if self.plan.summed:
            all_reduce(total, dist.ReduceOp.SUM, self.plan.groups)
        return total if self.then is None else self.then(total)

    def __call__(self, partial: torch.Tensor) -> torch.Tensor:
        if self.per_leaf:
            raise NotImplementedError(
                "a global sum over DTensor leaves sharded over different mesh dimensions "
                "needs each leaf's own sum (LeafSums.of_leaves); this transform passes one"
            )
        return self._total(partial if self.plan.counted[0] else torch.zeros_like(partial))

    def of_leaves(self, sums: torch.Tensor, tree) -> torch.Tensor:
        key = (None if tree is None else tree_flatten(tree)[1], sums.device)
        picks = self.plan.picks.get(key)
        if picks is None:
            if tree is None:
                where = range(len(self.plan.counted))
            else:
                where = [self._position(path) for path in tree_paths(tree)]
            picks = torch.tensor(
                [i for i, j in enumerate(where) if self.plan.counted[j]],
                dtype=torch.long, device=sums.device,
            )  # fmt: skip
            self.plan.picks[key] = picks
        return self._total(sums.index_select(0, picks).sum())

    def _position(self, path: str) -> int:
        found = self.plan.paths.get(path)
        if found is None:
            raise ValueError(
                f"clip_by_global_norm saw a leaf at {path}, which the parameters do not hold; "
                "over DTensor leaves it must see the parameters' tree (or a masked part of it)"
            )
        return found


def mesh_hooks(plan: _Plan, *, agree, global_sum):
    r"""The ``agree`` and ``global_sum`` hooks that complete a local update's reductions over
    the mesh: the leaves' finite flags (and the decision from them) by one all-reduce (MIN)
    over every rank of the leaves' mesh (a
    :class:`~functional_fp16.update.decision.LeafAgreement`), and the float64 sum of
    squares by one all-reduce (SUM), each distinct shard counted once (:class:`MeshSum`).
    ``agree`` and ``global_sum``, when given, apply after the mesh's own reductions."""

    def mesh_and(finite: torch.Tensor) -> torch.Tensor:
        flag = all_reduce(finite.to(torch.int32), dist.ReduceOp.MIN, plan.groups)
        return flag.to(torch.bool).reshape(finite.shape)

    # Per leaf: the flags of a leaf's shards on every rank, in the same all-reduce.
    return LeafAgreement(mesh_and, agree), MeshSum(plan, global_sum)


_AGREED_KEPT = 64
_AGREED_KEYS: dict = {}  # the call keys agreed on


def _first_root(state):
    """The mesh the first DTensor parameter's mesh is (or was sliced from)."""
    first = next(x for x in tree_flatten(state.params)[0] if isinstance(x, DTensor))
    return root_mesh(first.device_mesh)


def _describe_call(state, grads, arguments: dict, error: BaseException | None) -> list:
    """What every rank must hold alike before the update's first collective: every node
    and leaf of the state (``tx``'s declared configuration and the loss scale's settings
    included) and of ``grads``, the call's arguments, and whether this rank's own checks
    passed (a refusal that only some ranks reach is a disagreement)."""
    entries = [(f"state{p}", d) for p, d in describe_tree(state)]
    entries += [(f"grads{p}", d) for p, d in describe_tree(grads)]
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            entries.append((f"argument {name}", describe_leaf(value)))
        else:
            entries += describe_static(value, f"argument {name}")
    # The kind of refusal only: its message may name rank-dependent things (a sub-mesh's
    # own ranks), and ranks that make the same mistake should each raise their own error.
    outcome = "passed" if error is None else f"refused ({type(error).__name__})"
    entries.append(("the checks of this call", outcome))
    return entries


_STEPPED: dict = {}  # the states' structures and root meshes the ranks have agreed calls on


def _stepped_key(state) -> tuple:
    """What even a state that its checks refuse still shows: its tree structure (``tx`` and
    the loss scale's settings in its static metadata) and the mesh its first DTensor
    parameter is (or was sliced from)."""
    return (tree_flatten(state)[1], _first_root(state))


def agree_on_layout(state, grads, signature, arguments: dict, error: BaseException | None) -> None:
    r"""Raises on every rank if any rank's call differs (agreed once per call key).

    Before the update's first collective, each rank describes its call
    (:func:`_describe_call`: the state's and the gradients' trees, their leaves'
    dtypes, global shapes, placements and meshes, ``tx``, the arguments, and
    the outcome of its own checks) and the ranks of the leaves' mesh compare
    digests of it (:func:`~functional_fp16.update.fingerprint.agree`, over the
    default group when the mesh spans it, else over each of its dimensions in
    turn); only if they differ are the descriptions gathered, to name the first
    rank and path that differ from the lowest rank. So a rank with another
    mesh, placement, dtype, tree, optimiser or argument, or one whose checks
    refuse the call, makes every rank raise instead of leaving the others in a
    collective. The call's key (``signature``, the state's, with the gradients'
    metadata and the arguments) is remembered once agreed, so a later call with
    the same one communicates nothing; a call whose checks failed (``error``) is
    never remembered. It agrees unless the ranks have already agreed a call on a
    state of this structure, ``tx`` and mesh (:func:`_stepped_key`): then the
    others, their call agreed before, go straight to the step's collectives, and
    this rank raises its own error at once instead of waiting for them in an
    agreement they do not enter (they wait in theirs until the collective's
    timeout, or until torchrun's agent ends the job when this rank exits).
    Telling the others too would take a value read back to the host at every step.
    """
    # The key lives only here: held through the step, its tuples (one per leaf) would
    # make Python's garbage collector run four times as often (measured, 73 leaves).
    key = None if error is not None or signature is None else _call_key(signature, grads, arguments)
    if key is not None and key in _AGREED_KEYS:  # agreed before: nothing to communicate
        return
    if not dist.is_initialized():
        return
    if error is not None and _stepped_key(state) in _STEPPED:
        return
    entries = _describe_call(state, grads, arguments, error)
    groups = agreement_groups(_first_root(state))
    agree(entries, groups, name="", what="fp16_update: the ranks disagree")
    if key is not None:  # _AGREED_KEYS is the one record of agreed calls
        remember(_AGREED_KEYS, key, True, _AGREED_KEPT)
        remember(_STEPPED, _stepped_key(state), True, _AGREED_KEPT)


def _call_key(signature, grads, arguments: dict):
    """A local, hashable stand-in for a call that passed its checks: the state's signature,
    the gradients' tree and leaf metadata (placements included; their meshes are the
    parameters', which the signature holds), the arguments' kinds."""
    g_leaves, g_spec = tree_flatten(grads)
    described = []
    for g in g_leaves:
        if isinstance(g, DTensor):
            described.append((g.dtype, g.shape, g.placements))
        elif isinstance(g, torch.Tensor):
            described.append((type(g), g.dtype, g.shape, g.device))
        else:
            described.append(type(g))
    args = tuple(
        (k, (type(v), v.dtype, v.shape, v.device) if isinstance(v, torch.Tensor) else v)
        for k, v in arguments.items()
    )
    return (signature, g_spec, tuple(described), args)


def dtensor_update(
    state, grads, update, *, loss, agree, global_sum, signature=None, error=None, check=None,
    impl="auto", donate=False,
):  # fmt: skip
    r"""``update`` (``fp16_update``) of a DTensor state, run on the local shards.

    See the module docstring. Every check that can differ between the ranks
    runs first, and its outcome is agreed (:func:`agree_on_layout`) before
    anything communicates: ``error`` is a refusal the caller's own checks
    already reached (the state's), ``check()`` runs the rest (the arguments,
    the gradients against the parameters, the layout). ``agree`` and
    ``global_sum``, when given, apply after the mesh's own reductions.
    ``signature`` (the state's, from ``check_state``) lets what follows from
    the layout be looked up. Returns the state with its DTensor leaves.
    """
    arguments = {
        "impl": impl, "loss": loss, "donate": donate,
        "agree": None if agree is None else "given",
        "global_sum": None if global_sum is None else "given",
    }  # fmt: skip
    found = placed = local = wrap = None
    if error is None:
        try:
            if check is not None:
                check()
            found = plan(state, signature)
            placed = _check_grads(found, grads)
            local, wrap = local_state(state)
            local = checked_locally(local, signature)  # each rank's shards: dense, no overlap
        except (TypeError, ValueError, NotImplementedError) as err:
            error = err
    agree_on_layout(state, grads, signature, arguments, error)
    if error is not None:
        raise error
    if placed:
        g_leaves, g_spec = tree_flatten(grads)
        with torch.no_grad():
            local_grads = tree_unflatten(g_spec, [g.to_local() for g in g_leaves])
    else:  # some placed otherwise on their parameter's mesh: redistributed (a collective)
        local_grads = _local_grads(state, grads)
    mesh_agree, mesh_sum = mesh_hooks(found, agree=agree, global_sum=global_sum)
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    new = update(
        local, local_grads, loss=loss, agree=mesh_agree, global_sum=mesh_sum, impl=impl,
        donate=donate,
    )  # fmt: skip
    return wrap(new)
