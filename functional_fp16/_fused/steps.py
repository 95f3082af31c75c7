"""``impl="fused"``: a fusable optimiser chain as one call of a ``torch.library`` op.

Every fusable optimiser registers a :class:`Fusable` here (:mod:`functional_fp16._fused.sgd`,
:mod:`functional_fp16._fused.adam`): how to read its plan from the declared
transforms, which per-parameter state tensors it keeps, and its step. For a
state whose optimiser is one of them, the step is at most two reads of the
gradients and one pass over the state:

1. with clipping, or when the decision needs more than the gradients (a
   cross-replica ``agree``), one ``functional_fp16::grad_stats`` call: the
   peak magnitude for the all-finite decision and the sum of squares for the
   global norm;
2. one ``functional_fp16::sgd_step`` / ``adam_step`` call (``sgd_step_`` /
   ``adam_step_`` when donating), which reads gradient, master and optimiser
   state once and writes them and the working copy once: 22 bytes per
   parameter for SGD with momentum and FP16 gradients and parameters, 30 for
   Adam. A pure CPU SGD step without step 1 finds the gradients' peak while
   it updates, and undoes a skipped step afterwards (20 bytes per parameter).

What the op computes per element is in the optimiser's module; decisions, loss scale, counters and
skipped steps are bitwise the reference's, the master within one ulp.

Because the step is an op, ``torch.compile`` calls the same kernel (the op is
opaque to Inductor), ``vmap`` batches inside it (``K`` members are ``K``
groups of one call) and a CUDA graph captures it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._fused.chains import lr_factor
from functional_fp16._fused.device_kernels import finite_from_peak
from functional_fp16._fused.op_library import grad_stats
from functional_fp16._kernels.signatures import DTYPE_CODES, dense
from functional_fp16._util.tree import tree_flatten, tree_unflatten
from functional_fp16.precision.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    unscale_factor,
)
from functional_fp16.transforms.base import replace_at, state_at
from functional_fp16.transforms.clipping import clip_factors, norm_of_sum_of_squares
from functional_fp16.transforms.sgd import ScaleByScheduleState

__all__ = ["Fusable", "register", "FusedPlan", "fused_plan", "why_not_fused", "fused_update"]


class Fusable(NamedTuple):
    """A fusable optimiser: what its module registers with :func:`register`.

    Its plan (a NamedTuple) has at least ``max_norm`` (``None``: no clipping),
    ``learning_rate`` (a number or a schedule), ``sign`` and ``lr_path``.
    """

    name: str
    plan: Callable[[Any], Any]  # plan(tx): the declared hyperparameters, or None
    buffers: Callable[..., list[list[torch.Tensor]] | None]  # (plan, opt_state, master spec)
    step: Callable[..., tuple]  # (state, plan, grads, masters, own params, common, donate)


_FUSABLE: list[Fusable] = []


def register(fusable: Fusable) -> None:
    """Makes ``fusable`` one of the optimisers :func:`fused_plan` recognises."""
    _FUSABLE.append(fusable)


class FusedPlan(NamedTuple):
    """What the fused op needs to know about a state: derived from its static metadata."""

    fusable: Fusable
    plan: Any  # the optimiser's declared hyperparameters
    separate: tuple[bool, ...]  # per leaf: the working copy is a tensor of its own (not FP32)


def _optimizer_plan(state) -> tuple[Fusable | None, Any, list[list[torch.Tensor]] | None]:
    """The fusable optimiser of ``state.tx``, its plan and its per-parameter FP32 state
    tensors (``None``: a state of another layout); ``(None, None, None)`` if none fuses."""
    spec = tree_flatten(state.master)[1]
    for fusable in _FUSABLE:
        plan = fusable.plan(state.tx)
        if plan is not None:
            return fusable, plan, fusable.buffers(plan, state.opt_state, spec)
    return None, None, None


def _examine(state) -> tuple[str | None, FusedPlan | None]:
    """``(why not, plan)``: the reason ``state`` cannot take the fused op, or its plan."""
    if not isinstance(state.loss_scale, (DynamicLossScale, StaticLossScale, NoOpLossScale)):
        return "a loss scale of another type", None
    fusable, plan, buffers = _optimizer_plan(state)
    if fusable is None:
        return "an optimiser that is not a fusable chain", None
    if buffers is None:
        return "an optimiser state of another layout", None
    masters = tree_flatten(state.master)[0]
    params = tree_flatten(state.params)[0]
    device = masters[0].device
    if any(t.device != device for t in [*masters, *params]):
        return "tensors on several devices", None
    state_tensors = [x for b in buffers for x in b]
    if any(t.dtype != torch.float32 for t in [*masters, *state_tensors]):
        return "a master or optimiser state that is not float32", None
    for p in params:
        if p.dtype not in DTYPE_CODES:
            return f"a working copy of dtype {p.dtype}", None
    layout = [(m.shape, m.stride()) for m in masters]
    same = all([(t.shape, t.stride()) for t in ts] == layout for ts in [params, *buffers])
    if not same or not all(dense(m) for m in masters):
        return "state tensors that are not dense with one layout", None
    return None, FusedPlan(fusable, plan, tuple(p.dtype != torch.float32 for p in params))


def why_not_fused(state) -> str | None:
    """Why ``state`` cannot take the fused op (``None``: it can). Reads metadata only."""
    return _examine(state)[0]


def fused_plan(state) -> FusedPlan | None:
    """The fused plan of ``state``, or ``None`` when it runs another path.

    A pure function of the state's static metadata (its ``tx`` and the
    leaves' dtypes, shapes and strides); plans of transforms are cached by
    the transforms' declared values.
    """
    return _examine(state)[1]


def _grad_like(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``g`` laid out like ``m`` (a copy only when its strides or dtype differ)."""
    if g.stride() == m.stride() and g.dtype in DTYPE_CODES:
        return g
    dtype = g.dtype if g.dtype in DTYPE_CODES else torch.float32
    return torch.empty_like(m, dtype=dtype).copy_(g)


def _one(x: torch.Tensor | None) -> torch.Tensor | None:
    """A 0-d per-step scalar as the op's one-group form (shape ``(1,)``)."""
    return None if x is None else x.reshape(1)


def _advance_schedule(plan, opt_state, finite: torch.Tensor, new_lr_state):
    """The learning-rate schedule's count advanced on applied steps only."""
    if not callable(plan.learning_rate):
        return opt_state
    count = state_at(opt_state, plan.lr_path).count
    new_count = ScaleByScheduleState(count=torch.where(finite, new_lr_state.count, count))
    return replace_at(opt_state, plan.lr_path, new_count)


def _decision_inputs(g, inv, decision, clipping: bool):
    """``(apply, require, clip)``: what the op is told before it runs.

    Without clipping or a cross-replica hook the op decides itself (``apply=None``),
    with the rule's ``require`` (the loss is finite); otherwise one
    ``grad_stats`` call gives the local flag, the rule (``decision``) the
    decision, and the sum of squares the clipping norm.
    """
    if not clipping and decision.agree is None:
        require = decision.require
        return None, None if require is None else _one(require.to(g[0].device)), None
    peak, sum_sq = grad_stats(g, _one(inv), 1, 1, clipping)
    finite = decision(finite_from_peak(peak, _one(inv)).reshape(()))
    clip = None
    if clipping:
        clip = norm_of_sum_of_squares(sum_sq.reshape(()), decision.global_sum)
    return _one(finite), None, clip


def fused_update(state, grads, fp: FusedPlan, decision, donate: bool):
    """One fused step of ``state`` (see the module docstring); returns the new state.

    ``decision`` is the step's :class:`~functional_fp16.update.decision.Decision`
    (what must also hold, and the cross-replica agreement).
    """
    plan = fp.plan
    masters, m_spec = tree_flatten(state.master)
    params, p_spec = tree_flatten(state.params)
    g = [_grad_like(x, m) for x, m in zip(tree_flatten(grads)[0], masters)]
    inv = (
        None
        if isinstance(state.loss_scale, NoOpLossScale)
        else unscale_factor(state.loss_scale.loss_scale)
    )
    clipping = plan.max_norm is not None
    apply, require, norm = _decision_inputs(g, inv, decision, clipping)
    clip_div = clip_mul = None
    if clipping:
        clip_div, clip_mul = (_one(x) for x in clip_factors(norm, plan.max_norm))
    factor, new_lr_state = lr_factor(plan, state.opt_state, masters[0])
    separate = list(fp.separate)
    own = [p for p, s in zip(params, separate) if s]
    common = dict(inv=_one(inv), clip_div=clip_div, clip_mul=clip_mul, lr=_one(factor))
    common.update(apply=apply, require=require, separate=separate, members=1)
    opt_state, m_out, p_new, finite = fp.fusable.step(state, plan, g, masters, own, common, donate)
    finite = finite.reshape(())
    opt_state = _advance_schedule(plan, opt_state, finite, new_lr_state)
    it = iter(p_new)
    p_out = [next(it) if s else m for m, s in zip(m_out, separate)]
    return state.replace(
        params=tree_unflatten(p_spec, p_out),
        master=tree_unflatten(m_spec, m_out),
        opt_state=opt_state,
        loss_scale=state.loss_scale.adjust(finite),
        step=state.step + 1,
        grads_finite=finite,
    )
