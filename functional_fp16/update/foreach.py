"""The multi-tensor implementation of :func:`~functional_fp16.fp16_update` (``impl="foreach"``).

It runs wherever the fused kernel (:mod:`functional_fp16._fused.steps`) does
not: for optimisers that are not a fusable SGD chain, under ``torch.compile``,
on devices without a kernel, and where no C compiler is available. It produces
bitwise the results of the reference implementation in
:mod:`functional_fp16.update` on the CPU: every value goes through the same
roundings. What changes is how the work is organised:

* The tree is flattened once; the hot path works on flat lists of tensors with
  PyTorch's multi-tensor ``torch._foreach_*`` operations, in place on buffers
  the update itself allocated (never on an input, unless ``donate=True``).
* The all-finite test reads the low-precision gradients once, with a min/max
  reduction instead of ``isfinite(x).all()`` (about 20x faster on the CPU);
  see :func:`grads_finite`.
* For a chain that declares itself an SGD step without clipping
  (:func:`~functional_fp16._fused.sgd.sgd_plan`), the chain
  runs as a specialised multi-tensor sequence on exactly negated operands, and
  a skipped step is made a no-op by zeroing the negated terms bitwise instead
  of selecting with ``torch.where`` (two to three times the cost of an add).
  Any other ``tx`` runs unchanged on the unscaled tree, followed by a select.
* With ``donate=True`` the new master weights, momentum and FP16 parameters are
  written into the old state's tensors, like JAX's ``donate_argnums``.

Eager PyTorch offers no fused multiply-then-add that rounds twice (its fused
kernels, ``addcmul``, ``add(alpha=)`` and the fused SGD, use FMA), so the exact
eager path makes several passes over memory. Under ``torch.compile`` the
generic path is traced (functionally: no ``out=``, no scratch reuse) and
Inductor fuses it into one reduction over the FP16 gradients plus one pass
over the parameters, the 22 bytes per parameter an SGD-momentum step needs;
donation then becomes a final ``copy_`` into the old buffers, which Inductor
folds into that pass.

Large pure updates allocate fresh multi-megabyte tensors every step. With
glibc's default ``malloc`` those are ``mmap``-ed and page-faulted anew each
time, which can cost more than the update itself;
:func:`~functional_fp16.allocator.tune_malloc` is an explicit, opt-in remedy.
"""

from __future__ import annotations

from typing import Any

import torch

from functional_fp16._fused.chains import lr_factor
from functional_fp16._fused.sgd import SGDPlan, sgd_plan, state_fits
from functional_fp16._util.finite import grads_finite, leaves_finite
from functional_fp16._util.tree import PyTree, tree_flatten, tree_unflatten
from functional_fp16.precision.loss_scale import (
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
    unscale_inverse,
)
from functional_fp16.precision.scale_stats import stepped_stats
from functional_fp16.transforms.base import replace_at, state_at, update_with_extra_args
from functional_fp16.transforms.sgd import ScaleByScheduleState, TraceState

__all__ = ["foreach_update", "grads_finite", "sgd_sequence"]


# ---------------------------------------------------------------------------
# The update.
# ---------------------------------------------------------------------------


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    # A fill, not a host-to-device copy (no sync, capturable in CUDA graphs);
    # the same value as functional_fp16.transforms.sgd builds.
    return torch.full((), value, dtype=torch.float32, device=like.device)


def _inv_scale(loss_scale: Any) -> tuple[bool, torch.Tensor | None]:
    """(known, inv): known loss-scale types unscale as ``fl32(g) * inv`` (``inv=None``: no product)."""
    if isinstance(loss_scale, (NoOpLossScale, DynamicLossScale, StaticLossScale)):
        return True, unscale_inverse(loss_scale)
    return False, None


def _unscale(
    grads: list[torch.Tensor],
    inv: torch.Tensor | None,
    like: list[torch.Tensor],
    *,
    negate: bool = False,
) -> list[torch.Tensor]:
    """New float32 buffers holding ``g.float() * inv`` (bitwise the loss scale's ``unscale``),
    laid out like ``like`` (the masters), so that every new state tensor keeps its layout.

    With ``negate``, the buffers hold the exact negation ``g.float() * (-inv)``.
    """
    if torch.compiler.is_compiling():
        out = [g.float() for g in grads]
        return out if inv is None else [g * inv for g in out]
    out = [torch.empty_like(m, dtype=torch.float32) for m in like]
    torch._foreach_copy_(out, grads)
    if inv is not None:
        torch._foreach_mul_(out, -inv if negate else inv)
    elif negate:
        torch._foreach_neg_(out)
    return out


def _select_into(flag: torch.Tensor, new: list[torch.Tensor], old: list[torch.Tensor], dest):
    """``where(flag, new, old)`` per leaf, written into ``dest`` (a list, or None: fresh tensors)."""
    if dest is None:
        return [torch.where(flag, n, o) for n, o in zip(new, old)]
    for n, o, d in zip(new, old, dest):
        torch.where(flag, n, o, out=d)
    return dest


def _cast_params(
    master: list[torch.Tensor], params: list[torch.Tensor], donate: bool
) -> list[torch.Tensor]:
    """``m.to(p.dtype)`` per leaf (an alias of ``m`` when the dtypes agree, as in the reference).

    With ``donate`` the rounded values are written into the old parameters.
    """
    out = []
    for m, p in zip(master, params):
        if p.dtype == m.dtype or not donate:
            out.append(m.to(p.dtype))
        else:
            p.copy_(m)
            out.append(p)
    return out


def sgd_sequence(state) -> SGDPlan | None:
    """The SGD plan that :func:`foreach_update` runs as its specialised sequence, or ``None``.

    A fusable SGD chain without clipping, a loss scale of a known type, a
    state of the plan's layout, in eager mode (under ``torch.compile`` the
    generic code is traced and Inductor fuses it).
    """
    if _compiling() or not _inv_scale(state.loss_scale)[0]:
        return None
    cfg = sgd_plan(state.tx)
    if cfg is None or cfg.max_norm is not None:
        return None
    return cfg if state_fits(cfg, state.opt_state, tree_flatten(state.master)[1]) else None


def foreach_update(state, grads: PyTree, decide, donate: bool):
    """``impl="foreach"``: flat multi-tensor update, bitwise equal to the reference on the CPU.

    See the module docstring. ``decide`` is the step's
    :class:`~functional_fp16.update.decision.Decision`.
    """
    known, inv = _inv_scale(state.loss_scale)
    g_leaves, _ = tree_flatten(grads)
    m_leaves, m_spec = tree_flatten(state.master)
    p_leaves = tree_flatten(state.params)[0]
    cfg = sgd_sequence(state)
    if known:
        flags = leaves_finite(g_leaves, inv)
        # The SGD kernel works on negated gradients; with weight decay it
        # negates after adding the decay, so that exact cancellations keep
        # the reference's signed zero.
        negate = cfg is not None and cfg.weight_decay == 0.0
        g32 = _unscale(g_leaves, inv, m_leaves, negate=negate)
    else:  # a loss scale this module does not know: use its own unscale
        g32 = tree_flatten(state.loss_scale.unscale(grads))[0]
        flags = torch.stack([torch.isfinite(g).all() for g in g32])
    flags, finite = (flags, flags.all()) if decide is None else decide.leaves(flags)

    if cfg is not None:
        master, opt_state = _sgd_eager(cfg, state.opt_state, g32, m_leaves, finite, donate)
    else:
        extra = {} if decide is None else decide.extra_args()
        master, opt_state = _generic(state, g32, m_leaves, m_spec, finite, donate, extra)

    params = _cast_params(master, p_leaves, donate)
    loss_scale = state.loss_scale.adjust(finite)
    return state.replace(
        params=tree_unflatten(tree_flatten(state.params)[1], params),
        master=tree_unflatten(m_spec, master),
        opt_state=opt_state,
        loss_scale=loss_scale,
        step=state.step + 1,
        grads_finite=finite,
        scale_stats=stepped_stats(state, loss_scale, finite),
        leaf_finite=flags,
    )


def _generic(state, g32, m_leaves, m_spec, finite, donate, extra):
    """Any ``tx``: run it on the unscaled tree, then apply and select on flat lists."""
    updates, new_opt = update_with_extra_args(
        state.tx, tree_unflatten(m_spec, g32), state.opt_state, state.master, **extra
    )
    u_leaves = tree_flatten(updates)[0]
    u_leaves = [u if u.dtype == m.dtype else u.to(m.dtype) for u, m in zip(u_leaves, m_leaves)]
    stepped = torch._foreach_add(m_leaves, u_leaves)  # m + u, fresh tensors
    # The optimiser state is selected into fresh tensors *before* a donated
    # master is overwritten: a transform may keep `params` (the old master)
    # in its state.
    new_leaves, o_spec = tree_flatten(new_opt)
    old_leaves = tree_flatten(state.opt_state)[0]
    opt = tree_unflatten(
        o_spec, [torch.where(finite, n, o) for n, o in zip(new_leaves, old_leaves)]
    )
    if _compiling():
        master = [torch.where(finite, s, m) for s, m in zip(stepped, m_leaves)]
    else:
        master = _select_into(finite, stepped, m_leaves, m_leaves if donate else stepped)
    if donate and _compiling():
        master, opt = _donate_into(state, master, opt)
    return master, opt


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _replace_parts(cfg: SGDPlan, opt_state, trace_state, lr_state):
    if cfg.trace_path is not None:
        opt_state = replace_at(opt_state, cfg.trace_path, trace_state)
    return replace_at(opt_state, cfg.lr_path, lr_state)


def _zero_unless(finite: torch.Tensor, xs: list[torch.Tensor]) -> None:
    """In place: leaves ``xs`` alone if ``finite``, else sets every element to +0.0.

    A bitwise AND of the float32 bit patterns with all-ones or all-zeros: exact
    for every value, inf and NaN included, and as cheap as a multiply.
    """
    ones = torch.full((), -1, dtype=torch.int32, device=finite.device)
    mask = torch.where(finite, ones, torch.zeros_like(ones))
    for x in xs:
        x.view(torch.int32).bitwise_and_(mask)


def _sgd_eager(cfg: SGDPlan, opt_state, nu, m_leaves, finite, donate):
    r"""The SGD chain on flat lists, without a per-element select.

    ``nu`` holds the *negated* unscaled gradients :math:`-\hat g` in buffers
    owned here (with weight decay, the plain ones, negated after the decay). The chain's operations are performed on negated operands,
    which is exact (rounding to nearest is symmetric, and :math:`a - (-b)`
    is :math:`a + b` by definition in IEEE 754), so every result is bitwise
    the reference's. A skipped step is made an exact no-op without
    ``torch.where``: the negated terms are zeroed bitwise to +0.0 and the
    momentum factor becomes 1, so that :math:`b \cdot 1 - (+0) = b` and
    :math:`m - (+0) = m` for every value, -0.0 included.

    With ``donate`` the momentum and master are updated in place.
    """
    if not nu:
        return m_leaves, opt_state
    like = nu[0]
    if cfg.weight_decay != 0.0:
        # ``nu`` arrives un-negated here: torch.add(u, m, alpha=wd) exactly as
        # the chain computes it, then the negation. Adding the negated terms
        # instead would turn an exact cancellation's +0 into the wrong zero.
        torch._foreach_add_(nu, m_leaves, alpha=cfg.weight_decay)
        torch._foreach_neg_(nu)
    factor, new_lr_state = lr_factor(cfg, opt_state, like)
    trace_state = None
    if cfg.trace_path is not None:
        ts: TraceState = state_at(opt_state, cfg.trace_path)
        b_leaves, b_spec = tree_flatten(ts.trace)
        started = ts.initialized
        keep = torch.where(started, _scalar(cfg.momentum, like), _scalar(0.0, like))
        keep = torch.where(finite, keep, _scalar(1.0, like))  # b * 1 == b when skipping
        _zero_unless(finite, nu)
        if cfg.dampening != 0.0:
            take = torch.where(started, _scalar(1.0 - cfg.dampening, like), _scalar(1.0, like))
            torch._foreach_mul_(nu, take)  # -(u * take)
        if donate:
            torch._foreach_mul_(b_leaves, keep)
            nb = b_leaves
        else:
            nb = torch._foreach_mul(b_leaves, keep)  # b * keep
        torch._foreach_sub_(nb, nu)  # b * keep + u (* take)
        if cfg.nesterov:
            # u + mu * nb computed on the plain operands, exactly as the chain
            # does (a negated sum would give the wrong zero on an exact
            # cancellation); products negate exactly, so the negation is
            # folded into the learning-rate factor.
            torch._foreach_neg_(nu)
            torch._foreach_add_(nu, nb, alpha=cfg.momentum)  # out = u + mu * nb
            torch._foreach_mul_(nu, -factor)  # -(out * lr)
        else:
            neg_factor = -factor
            for n, x in zip(nb, nu):
                torch.mul(n, neg_factor, out=x)  # -(nb * lr)
        initialized = torch.where(finite, torch.ones_like(started), started)
        trace_state = TraceState(trace=tree_unflatten(b_spec, nb), initialized=initialized)
    else:
        torch._foreach_mul_(nu, factor)  # -(u * lr)
    _zero_unless(finite, nu)
    if donate:
        torch._foreach_sub_(m_leaves, nu)  # m + update
        master = m_leaves
    else:
        # The scratch buffers become the new master: one allocation fewer.
        for m, x in zip(m_leaves, nu):
            torch.sub(m, x, out=x)  # m + update
        master = nu
    if callable(cfg.learning_rate):
        old = state_at(opt_state, cfg.lr_path).count
        new_lr_state = ScaleByScheduleState(count=torch.where(finite, new_lr_state.count, old))
    return master, _replace_parts(cfg, opt_state, trace_state, new_lr_state)


def _donate_into(state, master, opt_state):
    """Under ``torch.compile``: copy the new master and optimiser state into the old tensors.

    Inductor turns these copies into direct writes of the fused kernel into the
    donated buffers. Only leaves whose shape and dtype match are reused.
    """
    old_m = tree_flatten(state.master)[0]
    torch._foreach_copy_(old_m, master)
    new_leaves, spec = tree_flatten(opt_state)
    old_leaves = tree_flatten(state.opt_state)[0]
    out = []
    for n, o in zip(new_leaves, old_leaves):
        if n.numel() > 1 and n.shape == o.shape and n.dtype == o.dtype:
            o.copy_(n)
            out.append(o)
        else:
            out.append(n)
    return old_m, tree_unflatten(spec, out)
