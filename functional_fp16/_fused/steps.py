"""``impl="fused"``: a fusable SGD or Adam chain as one call of a ``torch.library`` op.

For a state whose optimiser is a fusable chain (:mod:`functional_fp16._fused.sgd_plan`,
:mod:`functional_fp16._fused.adam_plan`), the step is at most two reads of the
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

What the op computes per element is in its docstring
(:mod:`functional_fp16._fused.ops`); decisions, loss scale, counters and
skipped steps are bitwise the reference's, the master within one ulp.

Because the step is an op, ``torch.compile`` calls the same kernel (the op is
opaque to Inductor), ``vmap`` batches inside it (``K`` members are ``K``
groups of one call) and a CUDA graph captures it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from functional_fp16._fused import ops
from functional_fp16._fused.adam_plan import AdamPlan, adam_plan, adam_state_fits
from functional_fp16._fused.sgd_plan import SGDPlan, replace_at, sgd_plan, state_at, state_fits
from functional_fp16._kernels.signatures import DTYPE_CODES, dense
from functional_fp16._tree import tree_flatten, tree_unflatten
from functional_fp16.adam import ScaleByAdamState, bias_corrections
from functional_fp16.base import saturating_increment
from functional_fp16.clipping import clip_factors, norm_of_sum_of_squares
from functional_fp16.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    unscale_factor,
)
from functional_fp16.sgd import ScaleByScheduleState, TraceState

__all__ = ["FusedPlan", "fused_plan", "why_not_fused", "fused_update", "lr_factor"]


class FusedPlan(NamedTuple):
    """What the fused op needs to know about a state: derived from its static metadata."""

    plan: SGDPlan | AdamPlan  # the optimiser's declared hyperparameters
    separate: tuple[bool, ...]  # per leaf: the working copy is a tensor of its own (not FP32)


def _optimizer_plan(state) -> tuple[SGDPlan | AdamPlan | None, list[list[torch.Tensor]]]:
    """The declared plan of ``state.tx`` and its per-parameter FP32 state tensors."""
    spec = tree_flatten(state.master)[1]
    plan = sgd_plan(state.tx)
    if plan is not None:
        if not state_fits(plan, state.opt_state, spec):
            return None, []
        if plan.trace_path is None:
            return plan, []
        return plan, [tree_flatten(state_at(state.opt_state, plan.trace_path).trace)[0]]
    plan = adam_plan(state.tx)
    if plan is not None:
        if not adam_state_fits(plan, state.opt_state, spec):
            return None, []
        adam = state_at(state.opt_state, plan.adam_path)
        return plan, [tree_flatten(adam.mu)[0], tree_flatten(adam.nu)[0]]
    return None, []


def why_not_fused(state) -> str | None:
    """Why ``state`` cannot take the fused op (``None``: it can). Reads metadata only."""
    if not isinstance(state.loss_scale, (DynamicLossScale, StaticLossScale, NoOpLossScale)):
        return "a loss scale of another type"
    if sgd_plan(state.tx) is None and adam_plan(state.tx) is None:
        return "an optimiser that is not a fusable SGD or Adam chain"
    plan, buffers = _optimizer_plan(state)
    if plan is None:
        return "an optimiser state of another layout"
    masters = tree_flatten(state.master)[0]
    if any(m.device != masters[0].device for m in masters):
        return "tensors on several devices"
    params = tree_flatten(state.params)[0]
    for i, (m, p) in enumerate(zip(masters, params)):
        own = [b[i] for b in buffers]
        if m.dtype != torch.float32 or any(b.dtype != torch.float32 for b in own):
            return "a master or optimiser state that is not float32"
        if p.dtype not in DTYPE_CODES:
            return f"a working copy of dtype {p.dtype}"
        if not dense(m) or any(t.stride() != m.stride() or t.shape != m.shape for t in [p, *own]):
            return "state tensors that are not dense with one layout"
    return None


def fused_plan(state) -> FusedPlan | None:
    """The fused plan of ``state``, or ``None`` when it runs another path.

    A pure function of the state's static metadata (its ``tx`` and the
    leaves' dtypes, shapes and strides); plans of transforms are cached by
    the transforms' declared values.
    """
    if why_not_fused(state) is not None:
        return None
    params = tree_flatten(state.params)[0]
    return FusedPlan(
        _optimizer_plan(state)[0], tuple(p.dtype != torch.float32 for p in params)
    )


def lr_factor(plan, opt_state, like: torch.Tensor):
    """(signed step factor as a 0-d float32 tensor, the learning-rate transform's next state)."""
    if not callable(plan.learning_rate):
        # a fill on the device, not a host-to-device copy (capturable in CUDA graphs)
        factor = torch.full((), plan.sign * plan.learning_rate, dtype=torch.float32, device=like.device)
        return factor, state_at(opt_state, plan.lr_path)
    count = state_at(opt_state, plan.lr_path).count
    lr = plan.learning_rate(count).to(torch.float32) * plan.sign
    return lr, ScaleByScheduleState(count=saturating_increment(count))


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


def _decision_inputs(g, inv, decide, clipping: bool, loss_ok):
    """``(apply, require, clip)``: what the op is told before it runs.

    Without clipping or a cross-replica hook the op decides itself (``apply=None``),
    with the loss's finiteness as ``require``; otherwise one ``grad_stats`` call
    gives the decision (through ``decide``) and the clipping norm.
    """
    if not clipping and decide is None:
        return None, _one(loss_ok), None
    peak, sum_sq = ops.grad_stats(g, _one(inv), 1, 1, clipping)
    finite = torch.isfinite(peak if inv is None else peak * inv).reshape(())
    if loss_ok is not None:
        finite = finite & loss_ok
    if decide is not None:
        finite = decide(finite)
    clip = None
    if clipping:
        clip = norm_of_sum_of_squares(sum_sq.reshape(()))
    return _one(finite), None, clip


def fused_update(state, grads, fp: FusedPlan, *, loss_ok, decide, donate: bool):
    """One fused step of ``state`` (see the module docstring); returns the new state.

    ``loss_ok``: ``None`` or a 0-d bool that must hold for the step to apply;
    ``decide``: ``None`` or a hook from the local decision to the agreed one.
    """
    plan = fp.plan
    masters, m_spec = tree_flatten(state.master)
    params, p_spec = tree_flatten(state.params)
    g = [_grad_like(x, m) for x, m in zip(tree_flatten(grads)[0], masters)]
    inv = None if isinstance(state.loss_scale, NoOpLossScale) else unscale_factor(
        state.loss_scale.loss_scale
    )
    clipping = plan.max_norm is not None
    apply, require, norm = _decision_inputs(g, inv, decide, clipping, loss_ok)
    clip_div = clip_mul = None
    if clipping:
        clip_div, clip_mul = (_one(x) for x in clip_factors(norm, plan.max_norm))
    factor, new_lr_state = lr_factor(plan, state.opt_state, masters[0])
    separate = list(fp.separate)
    own = [p for p, s in zip(params, separate) if s]
    common = dict(inv=_one(inv), clip_div=clip_div, clip_mul=clip_mul, lr=_one(factor))
    common.update(apply=apply, require=require, separate=separate, members=1)
    if isinstance(plan, AdamPlan):
        opt_state, m_out, p_new, finite = _adam(state, plan, g, masters, own, common, donate)
    else:
        opt_state, m_out, p_new, finite = _sgd(state, plan, g, masters, own, common, donate)
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


def _sgd(state, plan: SGDPlan, g, masters, own, common: dict[str, Any], donate: bool):
    old = state_at(state.opt_state, plan.trace_path) if plan.trace_path is not None else None
    trace, trace_spec = tree_flatten(old.trace) if old is not None else ([], None)
    hyper = dict(weight_decay=plan.weight_decay, momentum=plan.momentum)
    hyper.update(dampening=plan.dampening, nesterov=plan.nesterov)
    started = _one(old.initialized) if old is not None else None
    if donate:
        finite = ops.sgd_step_(g, masters, trace, own, started=started, **common, **hyper)
        m_out, t_out, p_new = masters, trace, own
    else:
        m_out, t_out, p_new, finite = ops.sgd_step(
            g, masters, trace, own, started=started, **common, **hyper
        )
    opt_state = state.opt_state
    if old is not None:
        flag = finite.reshape(())
        new_trace = TraceState(
            trace=tree_unflatten(trace_spec, list(t_out)),
            initialized=torch.where(flag, torch.ones_like(old.initialized), old.initialized),
        )
        opt_state = replace_at(opt_state, plan.trace_path, new_trace)
    return opt_state, list(m_out), list(p_new), finite


def _adam(state, plan: AdamPlan, g, masters, own, common: dict[str, Any], donate: bool):
    adam: ScaleByAdamState = state_at(state.opt_state, plan.adam_path)
    mu, moment_spec = tree_flatten(adam.mu)
    nu = tree_flatten(adam.nu)[0]
    count = saturating_increment(adam.count)
    inv_c1, sqrt_c2 = bias_corrections(count, plan.b1, plan.b2)
    hyper = dict(l2=plan.l2_decay, b1=plan.b1, b2=plan.b2, eps=plan.eps)
    hyper.update(decoupled=plan.decoupled_decay, inv_c1=_one(inv_c1), sqrt_c2=_one(sqrt_c2))
    if donate:
        finite = ops.adam_step_(g, masters, mu, nu, own, **common, **hyper)
        m_out, mu_out, nu_out, p_new = masters, mu, nu, own
    else:
        m_out, mu_out, nu_out, p_new, finite = ops.adam_step(g, masters, mu, nu, own, **common, **hyper)
    flag = finite.reshape(())
    new_adam = ScaleByAdamState(
        count=torch.where(flag, count, adam.count),
        mu=tree_unflatten(moment_spec, list(mu_out)),
        nu=tree_unflatten(moment_spec, list(nu_out)),
    )
    return replace_at(state.opt_state, plan.adam_path, new_adam), list(m_out), list(p_new), finite
