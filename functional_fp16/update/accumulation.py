"""``fp16_update`` for a :func:`~functional_fp16.MultiSteps` optimiser: one micro-batch at a time.

The rules (one loss scale per window, an overflow skips the whole window) are
described in :mod:`functional_fp16.transforms.accumulation`, which holds the transform.
"""

from __future__ import annotations

from typing import Any

import torch

from functional_fp16._util.finite import leaves_finite
from functional_fp16._util.multi_tensor import multi_tensor, unscaled
from functional_fp16._util.tree import PyTree, tree_flatten, tree_select, tree_unflatten
from functional_fp16.precision.loss_scale import NoOpLossScale, unscale_inverse
from functional_fp16.precision.scale_stats import stepped_stats
from functional_fp16.transforms.accumulation import (
    MultiStepsSpec,
    MultiStepsState,
    check_multi_steps_state,
    empty_unless,
    hand_over,
    next_counters,
    window_closes,
    window_size,
)
from functional_fp16.transforms.base import ChainSpec, GradientTransformation
from functional_fp16.update.decision import Carry, LeafAgreement
from functional_fp16.update.state_check import check_disjoint

__all__ = ["fp16_accumulates", "inner_fp16_state", "fp16_accumulate_update"]


def _contains_multi_steps(spec: Any) -> bool:
    if isinstance(spec, MultiStepsSpec):
        return True
    if isinstance(spec, ChainSpec):
        return any(_contains_multi_steps(part) for part in spec.parts)
    return False


def fp16_accumulates(tx: GradientTransformation) -> bool:
    """Whether ``fp16_update`` accumulates for ``tx``: ``tx`` is a :func:`MultiSteps`.

    Raises ``ValueError`` for a ``MultiSteps`` anywhere but outermost (inside
    a chain, or inside another ``MultiSteps``): its loss-scale and skipping
    rules need to see every micro-batch before the rest of the optimiser does.
    """
    spec = tx.spec
    if isinstance(spec, MultiStepsSpec):
        if _contains_multi_steps(spec.inner.spec):
            raise ValueError(
                "MultiSteps inside MultiSteps: fp16_update accumulates one level only; "
                "use one MultiSteps with the product of the window sizes"
            )
        return True
    if _contains_multi_steps(spec):
        raise ValueError(
            "MultiSteps must be the outermost transform given to fp16_init "
            "(write MultiSteps(chain(...), k), not chain(..., MultiSteps(...)))"
        )
    return False


def _unscaled(leaves: list[torch.Tensor], inv: torch.Tensor | None) -> list[torch.Tensor]:
    r"""``loss_scale.unscale`` of the leaves: :math:`\operatorname{fl}_{32}(g)\cdot s^{-1}`
    (multi-tensor ops outside ``vmap``), or the float32 leaves themselves for a unit scale."""
    if inv is None:
        return [g if g.dtype == torch.float32 else g.float() for g in leaves]
    return unscaled(leaves, inv)


def _unit_scale(device: torch.device) -> NoOpLossScale:
    # A fill on the device, not a host-to-device copy (CUDA-graph capturable).
    return NoOpLossScale().replace(loss_scale=torch.ones((), dtype=torch.float32, device=device))


def inner_fp16_state(state: Any):
    """The state the inner optimiser is stepped on: its own ``tx`` and state, a unit loss scale.

    Its gradients are the accumulated, already unscaled FP32 mean. Used by
    :func:`fp16_accumulate_update` and by :func:`~functional_fp16.update_path`.
    """
    ms = state.opt_state
    check_multi_steps_state(ms)
    return state.replace(
        tx=state.tx.spec.inner,
        opt_state=ms.inner_opt_state,
        loss_scale=_unit_scale(state.step.device),
    )


def fp16_accumulate_update(state, grads: PyTree, decide, donate: bool, impl):
    """``fp16_update`` for a :func:`MultiSteps` optimiser: one micro-batch.

    ``grads`` are already checked against ``state.params``; ``decide`` is
    ``fp16_update``'s :class:`Decision` (``loss=``, ``agree=``), applied to this
    micro-batch's finite flag; ``impl`` is the implementation of the plain
    update (``impl(state, grads, decide, donate)``) that steps the inner
    optimiser. See the module docstring for the rules.
    """
    spec: MultiStepsSpec = state.tx.spec
    inner = inner_fp16_state(state)
    ms: MultiStepsState = state.opt_state
    g32 = _unscaled(tree_flatten(grads)[0], unscale_inverse(state.loss_scale))
    acc_leaves, acc_spec = tree_flatten(ms.acc_grads)
    m_spec = tree_flatten(state.master)[1]
    if acc_spec != m_spec:
        raise ValueError(
            f"opt_state.acc_grads has a different tree structure than master: "
            f"expected {m_spec}, got {acc_spec}"
        )
    local = leaves_finite(g32, None)
    if donate and multi_tensor([*acc_leaves, *g32]):  # the donated accumulator, in place
        if not torch.compiler.is_compiling():  # (no data pointers in a trace)
            check_disjoint(state, tree_flatten(grads)[0])  # summed in place: no sharing
        torch._foreach_add_(acc_leaves, g32)
        acc = acc_leaves
    else:
        acc = torch._foreach_add(acc_leaves, g32)
    del g32  # freed before the inner step (4 B a parameter)
    owned = acc is acc_leaves or spec.use_grad_mean
    k = window_size(spec.every_k_schedule, ms.gradient_step)
    emit = window_closes(ms, k)
    handed = tree_unflatten(m_spec, hand_over(acc, k, spec.use_grad_mean))
    # The inner update skips unless this is a window's last micro-batch and
    # all of it was finite; it also checks the mean itself, agreed too, so that
    # ranks that each hold a slice of it (a sharded state) decide alike. It may
    # reuse the memory of what it is handed only where that is not the accumulator.
    reuse = donate and spec.use_grad_mean
    agree = decide.agree
    if isinstance(agree, LeafAgreement) and agree.then is None:
        # One reduction agrees both this micro-batch's flags and loss check (carried) and
        # the mean's: AND over the processes of (emit & acc_finite & all local flags & r)
        # is the agreed apply, since emit and acc_finite are alike on every process.
        r = decide.require
        carried = local if r is None else torch.cat([local, r.to(local.device).reshape(1)])
        carry = Carry(carried, [])
        inner_decide = decide._replace(require=emit & ms.acc_finite & carried.all(), carry=carry)
        stepped = impl(inner, handed, inner_decide, reuse)
        if len(carry.agreed) != 1:  # pragma: no cover - every implementation decides so
            raise RuntimeError(
                "MultiSteps on a mesh: the inner update did not agree its leaves' flags "
                "through Decision.leaves once"
            )
        agreed = carry.agreed[0]
        flags = agreed[: local.shape[0]]
        finite = flags.all() if r is None else flags.all() & agreed[-1]
        window_ok = ms.acc_finite & finite
    else:
        flags, finite = decide.leaves(local)
        window_ok = ms.acc_finite & finite
        stepped = impl(inner, handed, decide.with_require(emit & window_ok), reuse)
    del handed  # freed before the accumulator is emptied
    # Per leaf, finite in every micro-batch of the window so far (a window opens afresh).
    window_leaves = torch.where(ms.mini_step == 0, flags, state.leaf_finite & flags)
    applied = stepped.grads_finite
    mini_step, gradient_step = next_counters(ms, emit, applied)
    opt_state = MultiStepsState(
        mini_step=mini_step,
        gradient_step=gradient_step,
        inner_opt_state=stepped.opt_state,
        # emptied in place where ``acc`` is the donated accumulator, or this call's own sum
        # and the inner update was handed the mean (else it was given ``acc`` itself)
        acc_grads=tree_unflatten(acc_spec, empty_unless(emit, acc, owned)),
        acc_finite=emit | window_ok,
    )
    adjusted = state.loss_scale.adjust(applied)
    # One optimiser step per window: the counters move when it closes.
    stats = stepped_stats(state, adjusted, applied)
    return stepped.replace(
        tx=state.tx,
        opt_state=opt_state,
        loss_scale=tree_select(emit, adjusted, state.loss_scale),
        grads_finite=torch.where(emit, applied, window_ok),
        scale_stats=tree_select(emit, stats, state.scale_stats),
        # On a window's last micro-batch, also the mean's own flags (it may overflow).
        leaf_finite=torch.where(emit, window_leaves & stepped.leaf_finite, window_leaves),
    )
