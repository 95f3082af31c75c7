"""The FP16 training state and its one pure update.

``FP16State`` holds everything that changes during training: the FP16 working
copy of the parameters, the FP32 master copy, the optimiser state, the loss
scale, the step counter and whether the last step was applied. The optimiser
itself (a :class:`~functional_fp16.GradientTransformation`) is static
configuration carried alongside, not a leaf.

``fp16_update(state, grads)`` is the whole mixed-precision step::

    g32       = fl32(grads) * fl32(1 / fl64(s))          # unscale in FP32
    finite    = all(isfinite(g32))
    u, opt'   = tx.update(g32, opt, master)               # on FP32 values only
    master'   = finite ? master + u : master              # bitwise no-op if skipped
    opt'      = finite ? opt'       : opt
    params'   = fl16(master')                             # round to nearest
    s'        = loss_scale.adjust(finite)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from functional_fp16._tree import (
    PyTree,
    check_like,
    describe_tensor,
    register_node,
    tree_leaves,
    tree_map,
    tree_paths,
    tree_select,
)
from functional_fp16.accumulation import (
    fp16_accumulate_update,
    fp16_accumulates,
    inner_fp16_state,
)
from functional_fp16.base import GradientTransformation, apply_updates
from functional_fp16.batching import is_batched, per_member
from functional_fp16.fast_update import foreach_update
from functional_fp16.fused_update import fused_plan, fused_update
from functional_fp16.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    loss_scale_for,
)
from functional_fp16.sgd_plan import sgd_plan

__all__ = ["FP16State", "fp16_init", "fp16_update", "update_path"]

_LOSS_SCALES = (DynamicLossScale, StaticLossScale, NoOpLossScale)
_FIELDS = ("params", "master", "opt_state", "loss_scale", "step", "grads_finite")


class FP16State:
    """Everything that changes during mixed-precision training (an immutable pytree).

    Fields (leaves, or subtrees of leaves):

    * ``params`` — the working copy in ``param_dtype`` (FP16 by default), same
      tree structure as the parameters given to :func:`fp16_init`; the round-
      to-nearest cast of ``master``.
    * ``master`` — FP32 copies; the source of truth, never rebuilt from ``params``.
    * ``opt_state`` — the optimiser's state, from ``tx.init(master)``.
    * ``loss_scale`` — a loss-scale pytree (:class:`DynamicLossScale`, ...).
    * ``step`` — 0-d int32, the number of :func:`fp16_update` calls, skipped ones included.
    * ``grads_finite`` — 0-d bool, whether the last update was applied (with
      :func:`~functional_fp16.MultiSteps`, the open window's flag so far; see
      :mod:`functional_fp16.accumulation`).

    Static configuration: ``tx``, the :class:`GradientTransformation`, and
    ``shard``: ``None``, or for a state made by
    :func:`functional_fp16.distributed.shard_state`, the
    :class:`~functional_fp16.distributed.ShardLayout` saying which slice of the
    flattened FP32 tensors this rank's ``master`` and ``opt_state`` hold (as
    1-D pieces, one per parameter leaf, in the parameters' tree structure).
    """

    # ``_kernel_plan``: the fused kernel's verdict on this object's layout,
    # cached by the update that produced it (never by replace or unflatten).
    __slots__ = _FIELDS + ("tx", "shard", "_kernel_plan")

    def __init__(
        self,
        params: PyTree,
        master: PyTree,
        opt_state: Any,
        loss_scale: LossScale,
        step: torch.Tensor,
        grads_finite: torch.Tensor,
        tx: GradientTransformation,
        shard: Any = None,
    ) -> None:
        self.params = params
        self.master = master
        self.opt_state = opt_state
        self.loss_scale = loss_scale
        self.step = step
        self.grads_finite = grads_finite
        self.tx = tx
        self.shard = shard
        self._kernel_plan = None

    def replace(self, **changes: Any) -> FP16State:
        """A copy with the given fields replaced."""
        fields = {name: getattr(self, name) for name in _FIELDS + ("tx", "shard")}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"FP16State has no field(s) {sorted(unknown)}")
        fields.update(changes)
        return FP16State(**fields)

    def __repr__(self) -> str:
        n = sum(p.numel() for p in tree_leaves(self.params))
        shard = (
            "" if self.shard is None else f", shard {self.shard.rank} of {self.shard.world_size}"
        )
        return (
            f"FP16State(step={self.step!r}, grads_finite={self.grads_finite!r}, "
            f"loss_scale={self.loss_scale!r}, {len(tree_leaves(self.params))} tensors / {n} params"
            f"{shard})"
        )


register_node(
    FP16State,
    lambda s: (tuple(getattr(s, n) for n in _FIELDS), (s.tx, s.shard)),
    lambda meta, children: FP16State(*children, tx=meta[0], shard=meta[1]),
    lambda s: _FIELDS,
)


def _check_params(params: PyTree) -> list[torch.Tensor]:
    leaves = tree_leaves(params)
    paths = tree_paths(params)
    if not leaves:
        raise ValueError("params is an empty tree: there is nothing to train")
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"params{path}: expected a floating-point tensor, got {describe_tensor(leaf)}"
            )
        if not leaf.is_floating_point():
            raise TypeError(
                f"params{path}: expected a floating-point tensor, got {describe_tensor(leaf)}"
            )
        if leaf.layout != torch.strided:
            raise TypeError(f"params{path}: expected a dense tensor, got layout {leaf.layout}")
    device = leaves[0].device
    for path, leaf in zip(paths, leaves):
        if leaf.device != device:
            raise ValueError(
                f"params{path}: on {leaf.device}, but params{paths[0]} is on {device}; "
                "all parameters must live on one device"
            )
    return leaves


def _check_param_values(params: PyTree, master: PyTree, working: PyTree) -> None:
    """Refuses non-finite parameters, warns about ones that overflow ``param_dtype`` (one sync)."""
    masters, works = tree_leaves(master), tree_leaves(working)
    if masters[0].is_meta:
        return
    ok = torch.stack(
        [torch.isfinite(m).all() & torch.isfinite(w).all() for m, w in zip(masters, works)]
    )
    if bool(ok.all()):
        return
    for path, m, w in zip(tree_paths(params), masters, works):
        if not bool(torch.isfinite(m).all()):
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
) -> FP16State:
    r"""Builds the initial :class:`FP16State` from a tree of parameters.

    .. math:: m_0 = \operatorname{fl}_{32}(p), \quad p_0 = \operatorname{fl}_{16}(m_0)

    Args:
      params: a pytree (dicts, lists, tuples, NamedTuples) of floating-point
        tensors of any dtype, all on one device. They are copied, never aliased.
      tx: the optimiser, e.g. ``sgd(1e-3, momentum=0.9)``.
      loss_scale: a loss scale; default :class:`DynamicLossScale` for FP16
        ``param_dtype`` and :class:`NoOpLossScale` otherwise. It is moved to
        the parameters' device.
      param_dtype: dtype of the working copy ``state.params`` (default FP16).

    Returns:
      The initial state: ``step == 0`` and ``grads_finite == True``.
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
    leaves = _check_params(params)
    device = leaves[0].device
    master = tree_map(lambda p: p.detach().to(torch.float32, copy=True), params)
    working = tree_map(lambda m: m.to(param_dtype), master)
    _check_param_values(params, master, working)
    return FP16State(
        params=working,
        master=master,
        opt_state=tx.init(master),
        loss_scale=loss_scale.to(device),
        step=torch.zeros((), dtype=torch.int32, device=device),
        grads_finite=torch.ones((), dtype=torch.bool, device=device),
        tx=tx,
    )


_SHARDED_MESSAGE = (
    "state holds shard {} of {} of the FP32 master and optimiser state "
    "(from functional_fp16.distributed.shard_state): update it with "
    "functional_fp16.distributed.sharded_update on every rank, or gather it "
    "with unshard_state first"
)

FiniteHook = Callable[[torch.Tensor], torch.Tensor]
UpdateImpl = Callable[[FP16State, PyTree, FiniteHook | None, bool], FP16State]
"""``impl(state, grads, decide, donate)``: ``decide`` (or ``None``) maps the local
all-finite flag of the unscaled grads to the final apply/skip decision."""


def _reference_update(
    state: FP16State, grads: PyTree, decide: FiniteHook | None, donate: bool
) -> FP16State:
    """The plain tree-map implementation; the specification the fast paths are tested against.

    It never writes in place, so ``donate`` is accepted and ignored.
    """
    del donate
    grads32 = state.loss_scale.unscale(grads)
    finite = torch.stack([torch.isfinite(g).all() for g in tree_leaves(grads32)]).all()
    if decide is not None:
        finite = decide(finite)
    updates, opt_state = state.tx.update(grads32, state.opt_state, state.master)
    master = tree_select(finite, apply_updates(state.master, updates), state.master)
    opt_state = tree_select(finite, opt_state, state.opt_state)
    params = tree_map(lambda m, p: m.to(p.dtype), master, state.params)
    return state.replace(
        params=params,
        master=master,
        opt_state=opt_state,
        loss_scale=state.loss_scale.adjust(finite),
        step=state.step + 1,
        grads_finite=finite,
    )


_IMPLEMENTATIONS: dict[str, UpdateImpl] = {
    "reference": _reference_update,
    "foreach": foreach_update,  # flat multi-tensor path (functional_fp16.fast_update)
    "fused": fused_update,  # one-pass kernel for SGD chains (functional_fp16.fused_update)
}
"""Every implementation of the update, by name. All of them run the same tests."""


def update_path(state: FP16State, impl: str = "auto") -> str:
    """Which code :func:`fp16_update` runs for ``state`` in eager mode.

    Returns one of:

    * ``"fused"`` — the single-pass kernel (:mod:`functional_fp16.fused_update`):
      the optimiser is a fusable SGD chain (:func:`~functional_fp16.sgd`, alone
      or after ``clip_by_global_norm`` or ``add_decayed_weights``) or Adam chain
      (:func:`~functional_fp16.adam`, :func:`~functional_fp16.adamw`, the same
      prefixes; see :mod:`functional_fp16.adam_plan`) and a kernel exists for
      the state's device (the CPU with a C compiler, or CUDA with Triton);
    * ``"foreach-sgd"`` — the multi-tensor SGD sequence (a fusable chain
      without clipping, where no kernel is available);
    * ``"foreach"`` — any other optimiser, run on flat lists of tensors;
    * ``"reference"`` — the plain tree-map specification (``impl="reference"``).

    ``impl`` is the argument you pass to :func:`fp16_update`. Under
    ``torch.compile`` every implementation traces the ``foreach`` code, which
    Inductor fuses by itself.
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    if state.shard is not None:
        raise ValueError(_SHARDED_MESSAGE.format(state.shard.rank, state.shard.world_size))
    if impl not in ("auto", *_IMPLEMENTATIONS):
        raise ValueError(f"impl must be 'auto' or one of {sorted(_IMPLEMENTATIONS)}, got {impl!r}")
    if fp16_accumulates(state.tx):  # MultiSteps: the path of the inner optimiser's step
        state = inner_fp16_state(state)
    if impl == "reference":
        return "reference"
    if impl in ("auto", "fused") and fused_plan(state) is not None:
        return "fused"
    plan = sgd_plan(state.tx)
    if plan is not None and plan.max_norm is None:
        return "foreach-sgd"
    return "foreach"


def fp16_update(
    state: FP16State,
    grads: PyTree,
    *,
    impl: str = "auto",
    loss: torch.Tensor | None = None,
    donate: bool = False,
    agree: FiniteHook | None = None,
) -> FP16State:
    r"""One mixed-precision optimiser step, as a pure function.

    ``grads`` are the gradients of the *scaled* loss with respect to
    ``state.params`` (same structure, shapes, dtypes and device). With
    :math:`s` the loss scale and :math:`m` the FP32 master:

    .. math::
        \hat g &= \operatorname{fl}_{32}(g)\cdot \operatorname{fl}_{32}(1/\operatorname{fl}_{64}(s)) \\
        f &= \textstyle\bigwedge_i \operatorname{isfinite}(\hat g_i) \\
        (u, o') &= \text{tx.update}(\hat g, o, m) \\
        m' &= m + u \text{ if } f \text{ else } m, \qquad o' = o' \text{ if } f \text{ else } o \\
        p' &= \operatorname{fl}_{16}(m'), \qquad s' = \text{adjust}(s, f)

    A skipped step (:math:`f` false) leaves ``master``, ``params`` and every
    optimiser-state tensor bitwise unchanged; only the loss scale, ``step`` and
    ``grads_finite`` move. No input tensor is modified and nothing is read back
    to the host, so the function runs on CUDA without synchronisation and
    compiles with ``torch.compile(fullgraph=True)``.

    Args:
      state: the current :class:`FP16State`.
      grads: gradients of the scaled loss, shaped like ``state.params``.
      loss: optionally, the loss of this step (scaled or not); a non-finite
        loss skips the step like non-finite gradients do.
      impl: which implementation to run: ``"auto"`` (the fused kernel where
        it applies, else the multi-tensor path; :func:`update_path` tells
        which), ``"fused"`` (the same), ``"foreach"`` or ``"reference"``.
        Decisions, loss scale and counters are bitwise the same in all;
        the fused kernel contracts multiply-adds (within one ulp of the
        reference's master per step).
      donate: the caller promises never to use ``state`` (or ``grads``) again,
        so the implementation may reuse their memory (like JAX's
        ``donate_argnums``). Off by default: the update is pure.
      agree: maps the local finite flag to the one every replica agrees on
        (e.g. an all-reduce across processes); ``None`` on one process.

    Returns:
      The next :class:`FP16State`; ``grads_finite`` says whether it was applied.
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    if state.shard is not None:
        raise ValueError(_SHARDED_MESSAGE.format(state.shard.rank, state.shard.world_size))
    if impl == "auto":
        impl = "fused"  # which falls back to "foreach" where it does not apply
    if impl not in _IMPLEMENTATIONS:
        raise ValueError(f"impl must be 'auto' or one of {sorted(_IMPLEMENTATIONS)}, got {impl!r}")
    g_leaves = check_like(state.params, grads, name="grads", reference_name="params")
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor or None, got {type(loss).__name__}")
    if agree is not None and not callable(agree):
        raise TypeError(f"agree must be a callable or None, got {type(agree).__name__}")
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be a bool, got {type(donate).__name__}")
    # Gradients from an autograd graph (``loss.backward()``, ``torch.autograd.grad``
    # with ``create_graph``) are taken as values: no graph reaches the new state.
    if any(g.requires_grad for g in g_leaves):
        grads = tree_map(torch.Tensor.detach, grads)
    # Under torch.func.vmap (a batched state, gradients or loss): each member on its own.
    if is_batched([state.step, loss, *g_leaves]):
        return per_member(
            lambda s, g, lo: _step(s, g, lo, impl, agree, donate=False), state, grads, loss
        )
    return _step(state, grads, loss, impl, agree, donate)


def _step(state, grads, loss, impl: str, agree, donate: bool) -> FP16State:
    decide = _decision(loss, agree)
    if fp16_accumulates(state.tx):  # MultiSteps: one micro-batch (functional_fp16.accumulation)
        return fp16_accumulate_update(state, grads, decide, donate, _IMPLEMENTATIONS[impl])
    return _IMPLEMENTATIONS[impl](state, grads, decide, donate)


def _decision(loss: torch.Tensor | None, agree: FiniteHook | None) -> FiniteHook | None:
    """Combines the optional loss check and cross-replica agreement into one hook."""
    if loss is None and agree is None:
        return None

    def decide(finite: torch.Tensor) -> torch.Tensor:
        if loss is not None:
            finite = finite & torch.isfinite(loss.detach()).all().to(finite.device)
        if agree is not None:
            local = finite
            finite = agree(local)
            if (
                not isinstance(finite, torch.Tensor)
                or finite.ndim != 0
                or finite.dtype != torch.bool
                or finite.device != local.device
            ):
                got = describe_tensor(finite)
                raise TypeError(f"agree must return a 0-d bool tensor on {local.device}, got {got}")
        return finite

    return decide
