"""The FP16 training state and its one pure update.

``FP16State`` holds everything that changes during training: the FP16 working
copy of the parameters, the FP32 master copy, the optimiser state, the loss
scale, the step counter and whether the last step was applied. The optimiser
itself (a :class:`~functional_fp16.GradientTransformation`) is static
configuration carried alongside, not a leaf.

``fp16_update(state, grads)`` is the whole mixed-precision step::

    g32       = fl32(grads) * fl32(1 / fl64(s))          # unscale in FP32
    leaf_ok   = [all(isfinite(g)) for g in g32]            # per leaf (state.leaf_finite)
    finite    = all(leaf_ok)
    u, opt'   = tx.update(g32, opt, master)               # on FP32 values only
    master'   = finite ? master + u : master              # bitwise no-op if skipped
    opt'      = finite ? opt'       : opt
    params'   = fl16(master')                             # round to nearest
    s'        = loss_scale.adjust(finite)
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from functional_fp16._util.dtensors import is_dtensor
from functional_fp16._util.tree import (
    PyTree,
    describe_tensor,
    dotted_paths,
    register_node,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.precision.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_for,
)
from functional_fp16.precision.master_split import check_master_form, split_leaf
from functional_fp16.precision.scale_stats import COUNTER_NAMES, ScaleStats, zero_stats
from functional_fp16.transforms.base import GradientTransformation
from functional_fp16.update.mesh_reduce import finite_everywhere

__all__ = ["FP16State", "fp16_init", "loss_scale_stats", "nonfinite_leaves", "leaf_paths"]
__all__ += ["ADDED_FIELDS", "added_field_value", "old_checkpoint_note"]

_LOSS_SCALES = (DynamicLossScale, StaticLossScale, NoOpLossScale)
_FIELDS = (  # the pytree children, in flattening order
    "params",
    "master",
    "opt_state",
    "loss_scale",
    "step",
    "grads_finite",
    "scale_stats",
    "leaf_finite",
)


class FP16State:
    """Everything that changes during mixed-precision training (an immutable pytree).

    Fields (leaves, or subtrees of leaves):

    * ``params`` — the working copy in ``param_dtype`` (FP16 by default), same
      tree structure as the parameters given to :func:`fp16_init`; the round-
      to-nearest cast of ``master``.
    * ``master`` — FP32 copies; the source of truth, never rebuilt from ``params``.
      For a state made with ``master="split"``: ``int16`` residuals, one per
      parameter, that with ``params`` hold the FP32 master exactly
      (:mod:`functional_fp16.precision.master_split`; read the master with
      :func:`~functional_fp16.master_weights`).
    * ``opt_state`` — the optimiser's state, from ``tx.init(master)``.
    * ``loss_scale`` — a loss-scale pytree (:class:`DynamicLossScale`, ...).
    * ``step`` — 0-d int32, the number of :func:`fp16_update` calls, skipped ones included.
    * ``grads_finite`` — 0-d bool, whether the last update was applied (with
      :func:`~functional_fp16.MultiSteps`, the open window's flag so far; see
      :mod:`functional_fp16.transforms.accumulation`).
    * ``scale_stats`` — :class:`~functional_fp16.precision.scale_stats.ScaleStats`:
      0-d int32 counters of the optimiser steps skipped, of the loss scale's
      growths and backoffs, and of the applied steps since the last skip
      (:func:`~functional_fp16.loss_scale_stats` reads them).
    * ``leaf_finite`` — 1-d bool, one flag per leaf of ``params`` (in flattening
      order): whether that leaf's unscaled gradient was finite at the last
      update (with :func:`~functional_fp16.MultiSteps`, in every micro-batch
      of the open window so far); :func:`~functional_fp16.nonfinite_leaves`
      names the leaves that were not.

    Static configuration: ``tx``, the :class:`GradientTransformation`. Any
    tensor may be a DTensor: FSDP2's parameters give DTensor ``params``,
    ``master`` and per-parameter optimiser state with the same placements,
    and :func:`functional_fp16.distributed.shard_state` makes ``master`` and
    the per-parameter optimiser state ``Shard(0)`` DTensors beside plain
    ``params`` (ZeRO-1).
    """

    __slots__ = _FIELDS + ("tx", "_checked")
    FIELDS = _FIELDS  # the pytree children, in flattening order

    def __init__(
        self,
        params: PyTree,
        master: PyTree,
        opt_state: Any,
        loss_scale: LossScale,
        step: torch.Tensor,
        grads_finite: torch.Tensor,
        scale_stats: ScaleStats | None = None,
        leaf_finite: torch.Tensor | None = None,
        *,
        tx: GradientTransformation,
    ) -> None:
        init = object.__setattr__
        init(self, "params", params)
        init(self, "master", master)
        init(self, "opt_state", opt_state)
        init(self, "loss_scale", loss_scale)
        init(self, "step", step)
        init(self, "grads_finite", grads_finite)
        if scale_stats is None:  # a state built by hand: the counters start at zero
            scale_stats = zero_stats(getattr(step, "device", None))
        init(self, "scale_stats", scale_stats)
        if leaf_finite is None:  # a state built by hand: no leaf has overflowed yet
            leaf_finite = initial_leaf_finite(params, getattr(step, "device", None))
        init(self, "leaf_finite", leaf_finite)
        init(self, "tx", tx)
        # The signature under which fp16_update checked this state's parts when it
        # made the state (functional_fp16.update.state_check); None for a state
        # made any other way. Never copied: replace() and tree_unflatten() build
        # states without it, which are then checked again.
        init(self, "_checked", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"FP16State is immutable: use state.replace({name}=...) for a changed copy"
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError("FP16State is immutable")

    def __reduce__(self) -> tuple:
        return _rebuild, tuple(getattr(self, n) for n in _FIELDS + ("tx",))

    def replace(self, **changes: Any) -> FP16State:
        """A copy with the given fields replaced."""
        fields = {name: getattr(self, name) for name in _FIELDS + ("tx",)}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"FP16State has no field(s) {sorted(unknown)}")
        fields.update(changes)
        return FP16State(**fields)

    def __repr__(self) -> str:
        n = sum(p.numel() for p in tree_leaves(self.params))
        return (
            f"FP16State(step={self.step!r}, grads_finite={self.grads_finite!r}, "
            f"loss_scale={self.loss_scale!r}, {len(tree_leaves(self.params))} tensors / {n} params)"
        )


def initial_leaf_finite(params: PyTree, device: torch.device | None) -> torch.Tensor:
    """``leaf_finite`` before any update: one ``True`` per leaf of ``params``."""
    return torch.ones(len(tree_leaves(params)), dtype=torch.bool, device=device)


ADDED_FIELDS: dict[str, str] = {
    "scale_stats": "the loss-scale counters (loss_scale_stats) start at zero",
    "leaf_finite": "the leaves' finite flags (nonfinite_leaves) start as all finite",
}
"""The fields added after the first checkpoints were written (the last ones, in order), and
what a checkpoint without them loads them as."""


def added_field_value(field: str, like: torch.Tensor) -> torch.Tensor:
    """The value a checkpoint without ``field`` gives one of its tensors (laid out like
    ``like``): zero counters, all-finite flags."""
    if field == "leaf_finite":
        return torch.ones_like(like)
    return torch.zeros_like(like)


def old_checkpoint_note(where: str, missing: list[str]) -> str:
    """The one-line note a load of a checkpoint without the fields ``missing`` warns with."""
    fields = " and ".join(f"FP16State.{f}" for f in missing)
    return f"{where}: a checkpoint from before {fields}; " + "; ".join(
        ADDED_FIELDS[f] for f in missing
    )


def _rebuild(*fields: Any) -> FP16State:
    """An :class:`FP16State` from its fields in ``_FIELDS`` order and ``tx`` (unpickling)."""
    return FP16State(*fields[:-1], tx=fields[-1])


register_node(
    FP16State,
    lambda s: (tuple(getattr(s, n) for n in _FIELDS), s.tx),
    lambda tx, children: FP16State(*children, tx=tx),
    lambda s: _FIELDS,
)


def check_params(params: PyTree, *, name: str = "params") -> list[torch.Tensor]:
    """The leaves of ``params``: dense floating-point tensors on one device (else a
    ``TypeError``/``ValueError`` naming ``name`` and the leaf path)."""
    leaves = tree_leaves(params)
    if not leaves:
        raise ValueError(f"{name} is an empty tree: there is nothing to train")
    if all(
        isinstance(x, torch.Tensor) and x.is_floating_point() and x.layout == torch.strided
        for x in leaves
    ) and all(x.device == leaves[0].device for x in leaves):
        return leaves
    paths = tree_paths(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor) or not leaf.is_floating_point():
            raise TypeError(
                f"{name}{path}: expected a floating-point tensor, got {describe_tensor(leaf)}"
            )
        if leaf.layout != torch.strided:
            raise TypeError(f"{name}{path}: expected a dense tensor, got layout {leaf.layout}")
    device = leaves[0].device
    for path, leaf in zip(paths, leaves):
        if leaf.device != device:
            raise ValueError(
                f"{name}{path}: on {leaf.device}, but {name}{paths[0]} is on {device}; "
                "all parameters must live on one device"
            )
    return leaves


def _shard(x):
    return x.to_local() if is_dtensor(x) else x


def _check_param_values(params: PyTree, master: PyTree, working: PyTree) -> None:
    """Refuses non-finite parameters, warns about ones that overflow ``param_dtype`` (one sync).

    DTensors are checked on this rank's shards, and the master's flags agreed over
    the ranks (:func:`~functional_fp16.update.mesh_reduce.finite_everywhere`), so every
    rank refuses a parameter that one rank's shard holds inf or NaN in."""
    masters, works = (
        [_shard(x) for x in tree_leaves(master)],
        [_shard(x) for x in tree_leaves(working)],
    )
    if masters[0].is_meta:
        return
    finite = finite_everywhere(master, torch.stack([torch.isfinite(m).all() for m in masters]))
    ok = finite & torch.stack([torch.isfinite(w).all() for w in works])
    if bool(ok.all()):
        return
    for path, m, w, fine in zip(tree_paths(params), masters, works, finite.tolist()):
        if not fine:
            raise ValueError(
                f"params{path}: contains inf or NaN (in float32); initial parameters must be finite"
            )
        if not bool(torch.isfinite(w).all()):
            big = float(m.abs().max())
            warnings.warn(
                f"params{path}: values up to {big:g} overflow {w.dtype} "
                f"(largest finite {torch.finfo(w.dtype).max:g}), so the working copy holds inf; "
                "rescale them or use a wider param_dtype such as torch.bfloat16",
                stacklevel=3,
            )


def fp16_init(
    params: PyTree,
    tx: GradientTransformation,
    loss_scale: LossScale | None = None,
    *,
    param_dtype: torch.dtype = torch.float16,
    copy_master: bool = True,
    master: str = "float32",
) -> FP16State:
    r"""Builds the initial :class:`FP16State` from a tree of parameters.

    .. math:: m_0 = \operatorname{fl}_{32}(p), \quad p_0 = \operatorname{fl}_{16}(m_0)

    With ``master="split"``, :math:`(p_0, q_0) = \operatorname{split}(m_0)`: the FP16
    params and an ``int16`` residual per parameter that together hold the FP32 master
    exactly (:mod:`functional_fp16.precision.master_split`).

    Args:
      params: a pytree (dicts, lists, tuples, NamedTuples) of floating-point
        tensors of any dtype, all on one device. They are copied, never aliased
        (unless ``copy_master=False``).
      tx: the optimiser, e.g. ``sgd(1e-3, momentum=0.9)``.
      loss_scale: a loss scale; default :class:`DynamicLossScale` for FP16
        ``param_dtype`` and :class:`NoOpLossScale` otherwise. It is moved to
        the parameters' device.
      param_dtype: dtype of the working copy ``state.params`` (default FP16).
      copy_master: ``False`` makes FP32 ``params`` the master without a copy
        (the state's master shares their memory, so a donated update writes
        into them). For FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.float16)``,
        where the module's FP32 shards are the master: with
        ``param_dtype=torch.float32`` they are the working copy too, and no
        other copy of the weights exists. Every leaf must then be float32.
      master: how the FP32 master is held: ``"float32"`` (the default; 4 bytes per
        parameter beside the params) or ``"split"`` (``state.master`` holds ``int16``
        residuals, 2 bytes per parameter; FP16 ``param_dtype`` only).
        :func:`~functional_fp16.master_weights` reads the FP32 master of either form;
        :func:`~functional_fp16.convert_master` converts a state between them.

    Returns:
      The initial state, with ``step == 0`` and ``grads_finite == True``.
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"tx must be a GradientTransformation, got {type(tx).__name__}")
    if not isinstance(param_dtype, torch.dtype) or not param_dtype.is_floating_point:
        raise TypeError(f"param_dtype must be a floating torch.dtype, got {param_dtype!r}")
    if loss_scale is None:
        loss_scale = loss_scale_for(param_dtype)
    if not isinstance(loss_scale, _LOSS_SCALES):
        raise TypeError(
            "loss_scale must be a DynamicLossScale, StaticLossScale or NoOpLossScale, "
            f"got {type(loss_scale).__name__}"
        )
    if not isinstance(copy_master, bool):
        raise TypeError(f"copy_master must be a bool, got {type(copy_master).__name__}")
    check_master_form(master, param_dtype)
    if master == "split" and not copy_master:
        raise ValueError(
            "copy_master=False shares float32 params as the master; "
            "master='split' keeps no float32 master to share"
        )
    leaves = check_params(params)
    device = leaves[0].device
    if not copy_master:
        for path, p in zip(tree_paths(params), leaves):
            if p.dtype != torch.float32:
                raise TypeError(
                    f"params{path}: dtype {p.dtype}; copy_master=False takes float32 "
                    "parameters as the master"
                )
    wide = tree_map(lambda p: p.detach().to(torch.float32, copy=copy_master), params)
    if master == "split":  # the params and residuals split from the master, leaf by leaf
        leaves, spec = tree_flatten(wide)
        pairs = [split_leaf(m) for m in leaves]
        working = tree_unflatten(spec, [p for p, _ in pairs])
        kept = tree_unflatten(spec, [q for _, q in pairs])
    else:
        working, kept = tree_map(lambda m: m.to(param_dtype), wide), wide
    _check_param_values(params, wide, working)
    return FP16State(
        params=working,
        master=kept,
        opt_state=tx.init(wide),
        loss_scale=loss_scale.to(device),
        step=torch.zeros((), dtype=torch.int32, device=device),
        grads_finite=torch.ones((), dtype=torch.bool, device=device),
        scale_stats=zero_stats(device),
        leaf_finite=initial_leaf_finite(working, device),
        tx=tx,
    )


def loss_scale_stats(state: FP16State) -> dict[str, int]:
    r"""The loss-scale counters of a run so far, read from the device in one copy.

    ``{"skips": ..., "growths": ..., "backoffs": ..., "since_skip": ...}``: the
    optimiser steps skipped (a non-finite gradient or loss), the steps after
    which the loss scale grew, and backed off, and the applied steps since the
    last skip (see :mod:`functional_fp16.precision.scale_stats` for the rules).
    They are kept in ``state.scale_stats`` and advanced by every
    :func:`~functional_fp16.fp16_update` without a host read, bitwise alike in
    every implementation, under ``vmap`` (per member: the values come back as
    lists) and ``torch.compile``; checkpoints carry them, and a checkpoint
    written before they existed loads with them at zero.

    Args:
      state: an :class:`FP16State`.

    Returns:
      The four counters as Python ints (lists of ints for a stacked state).
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    stats = state.scale_stats
    if not isinstance(stats, ScaleStats):
        raise TypeError(f"state.scale_stats must be a ScaleStats, got {type(stats).__name__}")
    values = torch.stack([t.to(torch.int64) for t in stats]).cpu().tolist()
    return dict(zip(COUNTER_NAMES, values))


def leaf_paths(tree: PyTree) -> list[str]:
    """Every leaf's path in ``tree`` as :func:`nonfinite_leaves` names it, in flattening order.

    The keys, indices and field names from the root to the leaf, joined by dots
    (``h.3.mlp.c_fc.weight``; a flat dict's keys as they are). Position ``l``
    names the leaf whose flag is ``state.leaf_finite[l]`` when ``tree`` is
    ``state.params``, so a loop that keeps each step's flags (on the device,
    read back with its other metrics) names them without the state.
    """
    return dotted_paths(tree)


def nonfinite_leaves(state: FP16State) -> list[str] | list[list[str]]:
    r"""The paths of the leaves whose gradients held an inf or NaN at the last update.

    Every :func:`~functional_fp16.fp16_update` records, per leaf :math:`l` of
    the gradients, :math:`\ell_l = \bigwedge \operatorname{isfinite}(\hat g_l)`
    of the unscaled gradient (``state.leaf_finite``, on the device, without a
    host read; the step applies iff every :math:`\ell_l` holds and the loss,
    if given, is finite). This reads those flags in one copy and names the
    leaves where :math:`\ell_l` is false, as dotted paths of ``state.params``
    (``"h.3.mlp.c_fc.weight"``; a flat dict's keys as they are), in
    flattening order.

    * After an applied step: ``[]``. After a step skipped for a non-finite
      ``loss`` alone, or because another process's gradients overflowed
      (``agree=``), also ``[]``: no leaf of this process overflowed.
    * Sharded and DTensor states (FSDP2, ``shard_state``): the flags are
      agreed across ranks in the update's own all-reduce, so every rank names
      the leaves that overflowed on any rank.
    * With :func:`~functional_fp16.MultiSteps`: the leaves that overflowed in
      some micro-batch of the open window so far (on its last micro-batch, of
      the window, including the mean handed to the optimiser).
    * A stacked state (``vmap`` over members): one list per member (lists of
      lists for members of members).
    * A state loaded from a checkpoint written before these flags existed:
      ``[]`` until its next update (the load warns that the flags start as
      all finite).

    Args:
      state: an :class:`FP16State`.

    Returns:
      The paths, a list of strings (nested lists for a stacked state).
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    flags = state.leaf_finite
    paths = leaf_paths(state.params)
    n = len(paths)
    if (
        not isinstance(flags, torch.Tensor)
        or flags.dtype != torch.bool
        or flags.ndim < 1
        or flags.shape[-1] != n
    ):
        raise TypeError(
            f"state.leaf_finite must be a bool tensor of shape ({n},) (one flag per leaf of "
            f"state.params), got {describe_tensor(flags)}"
        )

    def named(values: list) -> list:
        if values and isinstance(values[0], list):  # one list per member
            return [named(v) for v in values]
        return [p for p, ok in zip(paths, values) if not ok]

    return named(flags.cpu().tolist())
