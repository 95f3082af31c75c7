"""``impl="fused"``: the SGD chain as one reduction and one pass over memory.

For a state whose optimiser is a fusable SGD chain (:func:`~functional_fp16.sgd_plan.sgd_plan`:
``sgd``, ``chain(clip_by_global_norm, sgd)``, ``chain(add_decayed_weights, sgd)``,
with or without a schedule), the update is two loops over the parameters:

1. one read of the low-precision gradients for the all-finite decision
   (and, with clipping, the sum of squares for the global norm);
2. one pass that reads gradient, master and momentum once and writes master,
   momentum and the working copy once (22 bytes per parameter with FP16
   gradients and parameters, counting step 1).

A pure step without clipping on the CPU folds step 1 into step 2 (20 bytes
per parameter): it writes its fresh outputs speculatively while finding the
gradients' peak, and copies the old state over them if the step is skipped.

Per element, with :math:`\\hat g = \\operatorname{fl}_{32}(g) \\cdot s^{-1}`:

.. math::
    \\hat g &\\leftarrow (\\hat g / \\max(1, \\lVert \\hat g\\rVert / c)) \\text{ as clip\\_by\\_global\\_norm does} \\\\
    \\hat g &\\leftarrow \\operatorname{fma}(m, \\lambda, \\hat g) \\\\
    b' &= \\operatorname{fma}(\\hat g, 1 - d, \\operatorname{fl}(\\mu b)) \\quad (b'_1 = \\hat g) \\\\
    v &= \\operatorname{fma}(b', \\mu, \\hat g) \\text{ (Nesterov) or } b' \\\\
    m' &= \\operatorname{fma}(v, -\\eta, m), \\qquad p' = \\operatorname{fl}_{16}(m')

This is ``torch.optim.SGD``'s arithmetic, multiply-adds contracted as its
vectorised kernels contract them; it differs from the two-rounding reference
chain only in those contractions (the numerical contract: within one ulp of the
reference's master after one step). Decisions, loss scale, counters and
skipped steps are bitwise the reference's.

On the CPU the kernel is compiled C (:mod:`functional_fp16.cpu_kernel`); pure
updates write fresh buffers with streaming stores, taken from a
:class:`~functional_fp16.buffer_pool.BufferPool` so that a dropped state's memory
is reused instead of page-faulted anew. On CUDA it is a Triton kernel
(:mod:`functional_fp16.cuda_kernel`), one launch per leaf after the
all-finite reduction. Under ``torch.compile``, or for any other optimiser, the
update runs the multi-tensor ``foreach`` path.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch

from functional_fp16 import cpu_kernel, cuda_kernel
from functional_fp16._tree import tree_flatten, tree_unflatten
from functional_fp16.adam_plan import AdamPlan, adam_plan, adam_state_fits
from functional_fp16.buffer_pool import BufferPool
from functional_fp16.clipping import clip_factors, global_norm, norm_of_sum_of_squares
from functional_fp16.fast_update import _lr_factor, foreach_update, grads_finite
from functional_fp16.kernel_args import KernelScalars, KernelTensors
from functional_fp16.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    unscale_factor,
)
from functional_fp16.sgd import ScaleByScheduleState, TraceState
from functional_fp16.sgd_plan import SGDPlan, replace_at, sgd_plan, state_at, state_fits

__all__ = ["fused_update", "fused_plan", "FusedPlan"]

_POOL = BufferPool()
_warned: set[str] = set()


class FusedPlan(NamedTuple):
    """What the fused kernel needs to know about a state's layout."""

    plan: SGDPlan | AdamPlan  # the optimiser's declared hyperparameters
    kernel: Any  # the module that runs it: cpu_kernel or cuda_kernel


_KERNELS = {"cpu": cpu_kernel, "cuda": cuda_kernel}
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (
        t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    )


def _optimizer_plan(state) -> tuple[SGDPlan | AdamPlan | None, list[list[torch.Tensor]]]:
    """The declared plan of ``state.tx`` and its per-parameter FP32 state tensors (momentum, moments)."""
    masters, spec = tree_flatten(state.master)
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


def _why_not(state) -> str | None:
    """Why ``state`` cannot take the fused kernel (``None``: it can)."""
    if not isinstance(state.loss_scale, (DynamicLossScale, StaticLossScale, NoOpLossScale)):
        return "a loss scale of another type"
    if sgd_plan(state.tx) is None and adam_plan(state.tx) is None:
        return "an optimiser that is not a fusable SGD or Adam chain"
    plan, buffers = _optimizer_plan(state)
    if plan is None:
        return "an optimiser state of another layout"
    masters = tree_flatten(state.master)[0]
    if not masters or masters[0].device.type not in _KERNELS:
        return "tensors on a device without a fused kernel"
    if any(m.device != masters[0].device for m in masters):
        return "tensors on several devices"
    params = tree_flatten(state.params)[0]
    for i, (m, p) in enumerate(zip(masters, params)):
        own = [b[i] for b in buffers]
        if m.dtype != torch.float32 or any(b.dtype != torch.float32 for b in own):
            return "a master or optimiser state that is not float32"
        if p.dtype not in _DTYPES:
            return f"a working copy of dtype {p.dtype}"
        if not _dense(m) or any(t.stride() != m.stride() for t in [p, *own]):
            return "state tensors that are not dense with one layout"
    return None


def fused_plan(state) -> FusedPlan | None:
    """The plan for ``state``, or ``None`` when it runs another path.

    States produced by the fused kernel carry their plan; others are checked
    leaf by leaf once.
    """
    cached = state._kernel_plan
    if cached is not None:
        return cached
    if _why_not(state) is not None:
        return None
    kernel = _KERNELS[tree_flatten(state.master)[0][0].device.type]
    if not kernel.available():
        reason = kernel.unavailable_reason()
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(
                f"functional_fp16: {reason}; fp16_update runs the multi-tensor path instead "
                "(correct, but slower)",
                RuntimeWarning,
                stacklevel=4,
            )
        return None
    return FusedPlan(_optimizer_plan(state)[0], kernel)


def _grad_like(g: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``g`` laid out like ``m`` (a copy only when its strides differ)."""
    if g.stride() == m.stride() and g.dtype in _DTYPES:
        return g
    dtype = g.dtype if g.dtype in _DTYPES else torch.float32
    return torch.empty_like(m, dtype=dtype).copy_(g)


def _decision(peak: torch.Tensor, inv: torch.Tensor | None, decide) -> torch.Tensor:
    """The all-finite flag from the gradients' peak magnitude (as ``grads_finite``), then ``decide``."""
    finite = torch.isfinite(peak if inv is None else peak * inv)
    return decide(finite) if decide is not None else finite


def _inv_scale(loss_scale) -> torch.Tensor | None:
    """fl32(1 / fl64(s)), or None for a unit scale (no product at all)."""
    if isinstance(loss_scale, NoOpLossScale):
        return None
    return unscale_factor(loss_scale.loss_scale)


def decide_step(kernel, g, inv, decide, clipping: bool):
    """(the step's all-finite decision, the clipping norm or None): one read of the gradients."""
    if kernel is cpu_kernel:
        peak, sum_sq = cpu_kernel.grad_stats(g, inv, sum_squares=clipping)
        # The norm as global_norm computes it: float64 sum and root, rounded once.
        return _decision(peak, inv, decide), norm_of_sum_of_squares(sum_sq) if clipping else None
    finite = grads_finite(g, inv)
    finite = decide(finite) if decide is not None else finite
    if not clipping:
        return finite, None
    return finite, global_norm([x.float() if inv is None else x.float() * inv for x in g])


def fresh_outputs(kernel, fp32: list[list[torch.Tensor]], params: list[torch.Tensor]):
    """New buffers shaped like each list in ``fp32`` (float32), then the new working copy.

    The working copy of an FP32 parameter is its new master (the first list's
    buffer). On the CPU, buffers come from the pool of dropped states; CUDA's
    caching allocator already reuses freed blocks.
    """
    same = [p.dtype == torch.float32 for p in params]
    likes = [t for group in fp32 for t in group] + [p for p, s in zip(params, same) if not s]
    dtypes = [torch.float32] * (len(likes) - sum(not s for s in same))
    dtypes += [p.dtype for p, s in zip(params, same) if not s]
    if kernel is cpu_kernel:
        fresh = iter(_POOL.empty_like(likes, dtypes))
    else:
        fresh = iter([torch.empty_like(t, dtype=d) for t, d in zip(likes, dtypes)])
    groups = [[next(fresh) for _ in group] for group in fp32]
    return [*groups, [m if s else next(fresh) for m, s in zip(groups[0], same)]]


def advance_schedule(plan, opt_state, finite: torch.Tensor, new_lr_state):
    """The learning-rate schedule's count advanced on applied steps only."""
    if not callable(plan.learning_rate):
        return opt_state
    count = state_at(opt_state, plan.lr_path).count
    new_count = ScaleByScheduleState(count=torch.where(finite, new_lr_state.count, count))
    return replace_at(opt_state, plan.lr_path, new_count)


def next_state(state, fp: FusedPlan, finite, params, master, opt_state):
    """The state after a fused step: ``params`` and ``master`` as ``(spec, leaves)``.

    The new state carries the plan, since its layout is the input's.
    """
    new = state.replace(
        params=tree_unflatten(*params),
        master=tree_unflatten(*master),
        opt_state=opt_state,
        loss_scale=state.loss_scale.adjust(finite),
        step=state.step + 1,
        grads_finite=finite,
    )
    new._kernel_plan = fp
    return new


def fused_update(state, grads, decide, donate: bool):
    """``impl="fused"``; see the module docstring. Same signature as every implementation."""
    if torch.compiler.is_compiling():
        # Inductor fuses the traced generic path by itself.
        return foreach_update(state, grads, decide, donate)
    fp = fused_plan(state)
    if fp is None:
        return foreach_update(state, grads, decide, donate)
    if isinstance(fp.plan, AdamPlan):
        from functional_fp16.fused_adam import fused_adam_update  # it builds on this module

        return fused_adam_update(state, grads, decide, donate, fp)
    plan = fp.plan
    masters, m_spec = tree_flatten(state.master)
    params, p_spec = tree_flatten(state.params)
    g = [_grad_like(x, m) for x, m in zip(tree_flatten(grads)[0], masters)]
    inv = _inv_scale(state.loss_scale)

    clipping = plan.max_norm is not None
    # A pure CPU step without clipping runs speculatively: the update pass also
    # finds the gradients' peak, and a skipped step is undone afterwards (a
    # copy, on overflow steps only). That saves the separate read of the
    # gradients; a donated step cannot be undone, a clipped one needs the norm first.
    speculate = fp.kernel is cpu_kernel and not donate and not clipping
    finite, norm = (None, None) if speculate else decide_step(fp.kernel, g, inv, decide, clipping)
    clip = clip_factors(norm, plan.max_norm) if clipping else None
    factor, new_lr_state = _lr_factor(plan, state.opt_state, masters[0])
    factor = factor.reshape(()).contiguous()

    old_trace: TraceState | None = None
    trace = trace_out = None
    if plan.trace_path is not None:
        old_trace = state_at(state.opt_state, plan.trace_path)
        trace, trace_spec = tree_flatten(old_trace.trace)
    same = [p.dtype == torch.float32 for p in params]  # the working copy is the master
    if donate:
        m_out, trace_out = masters, trace
        p_out = [m if s else p for m, p, s in zip(masters, params, same)]
    else:
        fresh = iter(fresh_outputs(fp.kernel, [masters, *([trace] if trace else [])], params))
        m_out = next(fresh)
        trace_out = next(fresh) if trace is not None else None
        p_out = next(fresh)

    started = old_trace.initialized.contiguous() if old_trace is not None else None
    peak = torch.empty((), dtype=torch.float32) if speculate else None
    tensors = KernelTensors(g, masters, trace, params, m_out, trace_out, p_out)
    scalars = KernelScalars(
        inv=inv,
        clip=clip,
        lr=factor,
        apply=None if speculate else finite.contiguous(),
        started=started,
        weight_decay=plan.weight_decay,
        momentum=plan.momentum,
        dampening=plan.dampening,
        nesterov=plan.nesterov,
    )
    fp.kernel.sgd_update(tensors, scalars, peak_out=peak)
    if speculate:
        finite = _decision(peak, inv, decide)
        cpu_kernel.keep_unless(finite.contiguous(), tensors)

    opt_state = state.opt_state
    if old_trace is not None:
        initialized = torch.where(finite, torch.ones_like(old_trace.initialized), started)
        new_trace = TraceState(
            trace=tree_unflatten(trace_spec, trace_out),
            initialized=initialized,
        )
        opt_state = replace_at(opt_state, plan.trace_path, new_trace)
    opt_state = advance_schedule(plan, opt_state, finite, new_lr_state)
    return next_state(state, fp, finite, (p_spec, p_out), (m_spec, m_out), opt_state)
