r"""Sharded FP32 state (ZeRO-1) on DTensor: the master and optimiser state ``Shard(0)`` over a mesh.

In FP16 training the FP32 master and the optimiser's FP32 buffers are most of
the state (8 of every 10 bytes per parameter with SGD-momentum, 12 of 14 with
Adam), and data parallelism replicates them on every rank. A sharded state
keeps the FP16 working copy (``params``) whole on every rank, as plain
tensors for the forward and backward passes, and holds every FP32 tensor
that belongs to a parameter as a DTensor ``Shard(0)`` over a 1-D device mesh
of the ranks (a 0-d one ``Replicate()``): rank :math:`r` of :math:`N` holds
rows :math:`[\min(rc, d), \min((r+1)c, d))`, :math:`c = \lceil d/N \rceil`, of a
leaf of :math:`d` rows, as DTensor splits them
(:mod:`~functional_fp16.distributed.row_shards`). The placements are the
state's own metadata, so DCP saves and reshards it (:func:`save_dcp_state`,
:func:`load_dcp_state`) and :func:`sharded_update` steps it.

``shard_state`` needs no communication beyond a check that every rank holds
the same structure (every rank already holds the full, identical state);
``unshard_state`` gathers. The optimiser-state leaves that belong to a
parameter are found from ``tx.init`` itself, run once on shape-only
(``meta``) tensors: a leaf that ``init`` derives from parameter ``i`` is
sharded like it, every other leaf (counters, flags) is kept as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from functional_fp16._util.tree import (
    NAMESPACE,
    PyTree,
    describe_tensor,
    format_path,
    tree_flatten,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.distributed.all_reduce import AllReduceSpec
from functional_fp16.distributed.process_group import require_group
from functional_fp16.distributed.replicas import check_same_tree
from functional_fp16.distributed.row_shards import gather_rows, plan_buckets, rows
from functional_fp16.precision.moment_storage import BlockCodes, ScaledHalf
from functional_fp16.transforms.accumulation import MultiStepsSpec
from functional_fp16.transforms.base import ChainSpec
from functional_fp16.update import FP16State
from functional_fp16.update.master import master_form

__all__ = ["shard_state", "unshard_state", "is_sharded", "default_mesh"]

# Probe leaf i has i + _TAG elements. A tx.init that ignores the device and
# materialises it allocates a few MB, not terabytes; no optimiser creates
# state of that length from nothing.
_TAG = 1_000_003
_GATHER_BUCKET_BYTES = 64 * 1024 * 1024
_MESHES: dict = {}


def is_sharded(state: Any) -> bool:
    """Whether ``state`` is a sharded (ZeRO-1) :class:`~functional_fp16.FP16State`: plain
    ``params``, DTensor ``master``."""
    if not isinstance(state, FP16State):
        return False
    masters = tree_flatten(state.master)[0]
    params = tree_flatten(state.params)[0]
    return any(isinstance(m, DTensor) for m in masters) and not any(
        isinstance(p, DTensor) for p in params
    )


def default_mesh(device: torch.device | str) -> DeviceMesh:
    """The 1-D mesh of every rank of the default process group, for ``device``'s type
    (one object per device type, so that states sharded apart share it)."""
    kind = torch.device(device).type
    key = (kind, dist.get_world_size())
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(kind, (dist.get_world_size(),))
    return _MESHES[key]


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

    On shards, whose rows differ between ranks, it would average rows of
    different parameters; ``sharded_update`` averages the gradients already.
    """
    if any(isinstance(spec, AllReduceSpec) for spec in _declared(getattr(tx, "spec", None))):
        raise ValueError(
            "state.tx contains all_reduce_mean(), which would average shards of different "
            "parameters across the ranks; sharded_update averages the gradients itself "
            "(reduce-scatter), so build the optimiser without it"
        )


_STORED = {
    ScaledHalf: (
        "float16 moments with a per-tensor scale (nu_dtype=torch.float16 with nu_scale)",
        "the scale belongs to the whole tensor, and each rank would pick its own from its "
        "rows (a checkpoint would then hold one rank's scale for all); store them as "
        "torch.bfloat16 or float32, which shard_state shards",
    ),
    BlockCodes: (
        "'e4m3' moments (8-bit block codes)",
        "their block scales are not shaped like their parameter; use FSDP2 (fully_shard), "
        "which shards the codes and scales by rows, or torch.bfloat16 moments with shard_state",
    ),
}


def refuse_stored_moments(opt_state: PyTree) -> None:
    """Refuses moments stored with scales (:mod:`~functional_fp16.precision.moment_storage`),
    naming the first one's path.

    ``shard_state`` splits by rows the leaves shaped like their parameter and keeps every
    other leaf whole; a per-tensor float16 scale or a tensor of block scales is neither.
    Moments without a scale (float32, bfloat16, unscaled float16) are plain tensors
    shaped like their parameters and shard like them.
    """

    def stored(x: Any) -> bool:
        return isinstance(x, (ScaledHalf, BlockCodes))

    nodes = optree.tree_leaves(opt_state, is_leaf=stored, namespace=NAMESPACE)
    if not any(stored(x) for x in nodes):
        return
    accessors = optree.tree_accessors(opt_state, is_leaf=stored, namespace=NAMESPACE)
    for accessor, node in zip(accessors, nodes, strict=True):
        if stored(node):
            what, why = _STORED[type(node)]
            raise ValueError(
                f"state.opt_state{format_path(accessor)}: {what} cannot be sharded by "
                f"shard_state: {why}"
            )


def owners(state: FP16State) -> list[int | None]:
    """For every leaf of ``state.opt_state``: the parameter leaf it belongs to, or ``None``.

    ``state.tx.init`` runs on ``meta`` tensors of distinct sizes, one per
    parameter, each with its parameter's number of dimensions (at least one,
    so a mask function decides alike); a leaf of the result with parameter
    ``i``'s size belongs to it. The real state's structure must match the probe's.
    """
    p_leaves, p_spec = tree_flatten(state.params)
    tags = [
        torch.empty((_TAG + i,) + (1,) * (p.ndim - 1), dtype=torch.float32, device="meta")
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


def placements_of(ndim: int) -> tuple:
    """The placement of a parameter's FP32 tensors: ``Shard(0)``, or ``Replicate()`` for 0-d."""
    return (Shard(0),) if ndim else (Replicate(),)


def _shard(x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """This rank's rows of ``x`` (a copy owning its storage), as a DTensor of ``x``'s shape."""
    placements = placements_of(x.ndim)
    if x.ndim:
        lo, hi = rows(x.shape[0], mesh.size(), mesh.get_local_rank())
        local = x[lo:hi].contiguous().clone()
    else:
        local = x.clone()
    stride = torch.empty(x.shape, device="meta").stride()  # the global tensor's, contiguous
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=x.shape, stride=stride
    )


def shard_state(state: FP16State, *, mesh: DeviceMesh | None = None) -> FP16State:
    r"""This rank's shard of a full (replicated) state: ``params`` whole, FP32 state ``Shard(0)``.

    With :math:`N` ranks on ``mesh`` and :math:`c_i = \lceil d_i/N \rceil` for a
    parameter of :math:`d_i` rows, rank :math:`r` keeps

    .. math::
        \text{master}'_i = \text{master}_i[\min(rc_i, d_i) : \min((r+1)c_i, d_i)]

    as a DTensor ``Shard(0)`` of the full shape (a 0-d leaf whole, ``Replicate()``),
    and the same for every optimiser-state leaf that belongs to parameter
    :math:`i`; ``params``, the loss scale and the counters stay plain and
    whole. Each shard owns its storage, so once the full state is dropped
    only :math:`1/N` of its FP32 bytes remain. No communication beyond a
    check that every rank holds the same structure (the values must already
    be the same on every rank, e.g. after :func:`broadcast_state`), made
    first so that a state that differs on one rank (structure, shapes,
    dtypes, ``tx.spec``) raises on every rank, naming the rank and the difference.

    Args:
      state: a full :class:`~functional_fp16.FP16State` of plain tensors.
      mesh: a 1-D device mesh of the ranks (default: :func:`default_mesh` of
        the parameters' device, every rank of the default group).

    Returns:
      A sharded state; update it with :func:`sharded_update`, save it with
      :func:`save_dcp_state`, gather it with :func:`unshard_state`.

    Raises:
      ValueError: for a state that is already sharded or holds DTensor
        parameters, a mesh that is not 1-D, an optimiser state whose
        per-parameter tensors are not shaped like their parameters, or
        moments stored with scales (float16 with ``nu_scale``, ``"e4m3"``;
        float32, bfloat16 and unscaled float16 moments shard), naming the leaf.
    """
    require_group("shard_state")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"mesh must be 1-D (the ranks the FP32 state is split over), got {mesh}")
    # First, so that every refusal below happens on every rank alike (no rank waits alone).
    check_same_tree(state, None if mesh is None else mesh.get_group(), name="state")
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    leaves = tree_flatten(state)[0]
    if any(isinstance(x, DTensor) for x in leaves):
        raise ValueError(
            "state already holds DTensors (sharded, or built from FSDP2 parameters): "
            "shard_state takes a full state of plain tensors"
        )
    if master_form(state) == "split":
        raise ValueError(
            "state has a split master (int16 residuals beside its FP16 params): shard_state "
            "shards a float32 master beside whole params; convert_master(state, 'float32') first"
        )
    refuse_replicated_steps(state.tx)
    refuse_stored_moments(state.opt_state)
    owner = owners(state)
    _check_full(state, owner)
    p_leaves, p_spec = tree_flatten(state.params)
    devices = {p.device for p in p_leaves}
    if len(devices) > 1:
        raise ValueError(
            f"params live on several devices ({sorted(map(str, devices))}); "
            "a sharded state keeps all of them on one"
        )
    if mesh is None:
        mesh = default_mesh(p_leaves[0].device)
    master = [_shard(m, mesh) for m in tree_flatten(state.master)[0]]
    o_leaves, o_spec = tree_flatten(state.opt_state)
    opt = [leaf if i is None else _shard(leaf, mesh) for leaf, i in zip(o_leaves, owner)]
    return state.replace(
        master=tree_unflatten(p_spec, master), opt_state=tree_unflatten(o_spec, opt)
    )


def mesh_of(state: FP16State, what: str) -> DeviceMesh:
    """The mesh of a sharded state's DTensor leaves, after checking it is one 1-D mesh."""
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    if not is_sharded(state):
        raise ValueError(f"{what} needs a sharded state: call shard_state(state) first")
    m_spec, p_spec = tree_flatten(state.master)[1], tree_flatten(state.params)[1]
    if m_spec != p_spec:
        raise ValueError(
            f"state.master has the structure {m_spec}, but state.params {p_spec}; "
            "a sharded state's master mirrors its params"
        )
    mesh = None
    for path, m in zip(tree_paths(state.master), tree_flatten(state.master)[0]):
        if not isinstance(m, DTensor):
            raise TypeError(f"state.master{path}: a plain tensor in a sharded state's master")
        if mesh is None:
            mesh = m.device_mesh
        if m.device_mesh != mesh or tuple(m.placements) != placements_of(m.ndim):
            raise ValueError(
                f"state.master{path}: a DTensor of shape {tuple(m.shape)}, placements "
                f"{m.placements} on {m.device_mesh}; a sharded "
                f"state holds Shard(0) (0-d: Replicate()) on one 1-D mesh, here {mesh}"
            )
    if mesh.ndim != 1:
        raise ValueError(f"{what}: the state's mesh {mesh} is not 1-D")
    return mesh


def unshard_state(state: FP16State) -> FP16State:
    r"""The full state of plain tensors, on every rank, gathered from the shards.

    The inverse of :func:`shard_state`: the rows of every DTensor leaf are
    all-gathered in rank order (in buckets of one dtype, one collective each)
    into a plain tensor of the parameter's memory format. The result is
    bitwise the same on every rank, and can be saved, inspected, updated with
    :func:`~functional_fp16.fp16_update`, or sharded again for another mesh.
    """
    require_group("unshard_state")
    mesh = mesh_of(state, "unshard_state")
    owner = owners(state)
    o_leaves, o_spec = tree_flatten(state.opt_state)
    m_leaves, m_spec = tree_flatten(state.master)
    sharded = [j for j, x in enumerate(o_leaves) if isinstance(x, DTensor)]
    tensors = m_leaves + [o_leaves[j] for j in sharded]
    shapes = [tuple(x.shape) for x in tensors]
    buckets = plan_buckets(shapes, [x.dtype for x in tensors], mesh.size(), _GATHER_BUCKET_BYTES)
    with torch.no_grad():
        locals_ = [x.to_local().contiguous() for x in tensors]
    full = gather_rows(locals_, buckets, mesh.get_group(), mesh.size(), mesh.get_local_rank())
    params = tree_flatten(state.params)[0]
    master = [_format(f, p) for f, p in zip(full, params)]
    rest = iter(full[len(m_leaves) :])
    opt = list(o_leaves)
    for j in sharded:
        i = owner[j]
        opt[j] = next(rest) if i is None else _format(next(rest), params[i])
    return state.replace(
        master=tree_unflatten(m_spec, master), opt_state=tree_unflatten(o_spec, opt)
    )


def _format(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` in ``like``'s memory format (channels-last stays channels-last)."""
    if like.is_contiguous() or full.shape != like.shape:
        return full
    return torch.empty_like(like, dtype=full.dtype).copy_(full)


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
    return state.replace(master=master, opt_state=state.tx.init(master))


def shard_like(tree: PyTree, like: PyTree) -> PyTree:
    """``tree`` with :func:`shard_state` applied to the states that are sharded in ``like``
    (on the mesh of ``like``'s state)."""

    def states(t: PyTree) -> tuple[list[Any], Any]:
        return optree.tree_flatten(
            t, is_leaf=lambda x: isinstance(x, FP16State), namespace=NAMESPACE
        )

    nodes, spec = states(tree)
    wanted = states(like)[0]
    out = [
        shard_state(n, mesh=mesh_of(w, "shard_like")) if is_sharded(w) else n
        for n, w in zip(nodes, wanted, strict=True)
    ]
    return optree.tree_unflatten(spec, out)
