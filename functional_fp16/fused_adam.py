"""``impl="fused"`` for Adam and AdamW: one reduction and one pass over memory.

For a state whose optimiser is a fusable Adam chain
(:func:`~functional_fp16.adam_plan.adam_plan`: ``adam``, ``adamw``,
``chain(add_decayed_weights, adam)``, optionally after
``clip_by_global_norm``, with or without a schedule), the update is:

1. one read of the low-precision gradients for the all-finite decision (and,
   with clipping, the sum of squares for the global norm);
2. one pass that reads gradient, master and both moments once and writes
   master, moments and the working copy once: 30 bytes per parameter with
   FP16 gradients and parameters (32 counting step 1).

Per element it computes what the reference chain computes (see
``_sgd_kernel.c``): ``torch.lerp`` and ``addcmul`` for the moments, the bias
corrections as float32 factors made in float64 on the device, and the step
``m + f * s`` as one fused multiply-add where the reference rounds ``f * s``
first (the numerical contract's one allowed contraction). The count, the
moments and the master of a skipped step are bitwise the old ones.
"""

from __future__ import annotations

import torch

from functional_fp16._tree import tree_flatten, tree_unflatten
from functional_fp16.adam import ScaleByAdamState, bias_corrections
from functional_fp16.adam_plan import AdamPlan
from functional_fp16.base import saturating_increment
from functional_fp16.clipping import clip_factors
from functional_fp16.fast_update import _lr_factor
from functional_fp16.fused_update import (
    FusedPlan,
    _grad_like,
    _inv_scale,
    advance_schedule,
    decide_step,
    fresh_outputs,
    next_state,
)
from functional_fp16.kernel_args import AdamScalars, AdamTensors
from functional_fp16.sgd_plan import replace_at, state_at

__all__ = ["fused_adam_update"]


def fused_adam_update(state, grads, decide, donate: bool, fp: FusedPlan):
    """The fused Adam step for ``state`` (whose plan ``fp`` is an :class:`AdamPlan`)."""
    plan: AdamPlan = fp.plan
    masters, m_spec = tree_flatten(state.master)
    params, p_spec = tree_flatten(state.params)
    g = [_grad_like(x, m) for x, m in zip(tree_flatten(grads)[0], masters)]
    inv = _inv_scale(state.loss_scale)
    clipping = plan.max_norm is not None
    finite, norm = decide_step(fp.kernel, g, inv, decide, clipping)
    factor, new_lr_state = _lr_factor(plan, state.opt_state, masters[0])

    adam: ScaleByAdamState = state_at(state.opt_state, plan.adam_path)
    mu, moment_spec = tree_flatten(adam.mu)
    nu = tree_flatten(adam.nu)[0]
    count = saturating_increment(adam.count)
    inv_c1, sqrt_c2 = bias_corrections(count, plan.b1, plan.b2)
    if donate:
        m_out, mu_out, nu_out = masters, mu, nu
        p_out = [m if p.dtype == torch.float32 else p for m, p in zip(masters, params)]
    else:
        m_out, mu_out, nu_out, p_out = fresh_outputs(fp.kernel, [masters, mu, nu], params)
    fp.kernel.adam_update(
        AdamTensors(g, masters, mu, nu, params, m_out, mu_out, nu_out, p_out),
        AdamScalars(
            inv=inv,
            clip=clip_factors(norm, plan.max_norm) if clipping else None,
            lr=factor.reshape(()).contiguous(),
            apply=finite.contiguous(),
            inv_c1=inv_c1,
            sqrt_c2=sqrt_c2,
            l2_decay=plan.l2_decay,
            b1=plan.b1,
            b2=plan.b2,
            eps=plan.eps,
            decoupled_decay=plan.decoupled_decay,
        ),
    )
    new_adam = ScaleByAdamState(
        count=torch.where(finite, count, adam.count),
        mu=tree_unflatten(moment_spec, mu_out),
        nu=tree_unflatten(moment_spec, nu_out),
    )
    opt_state = replace_at(state.opt_state, plan.adam_path, new_adam)
    opt_state = advance_schedule(plan, opt_state, finite, new_lr_state)
    return next_state(state, fp, finite, (p_spec, p_out), (m_spec, m_out), opt_state)
