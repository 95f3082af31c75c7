"""Reading a chain of declared transforms as one fusable Adam/AdamW step.

The counterpart of :mod:`functional_fp16._fused.sgd_plan` for Adam. :func:`adam_plan`
reads the transforms' declared ``spec`` only, never code, and returns the
hyperparameters of the single-pass kernel when the chain, flattened, has the
form::

    [clip_by_global_norm(c)]  [add_decayed_weights(wd)]  scale_by_adam(b1, b2, eps)
        [add_decayed_weights(wd)]  scale_by_learning_rate(lr)

(brackets: optional; a weight decay of 0 is dropped). The decay before
``scale_by_adam`` is ``torch.optim.Adam``'s L2 term, added to the gradient;
the one after it is AdamW's decoupled decay. ``eps_root`` must be 0 (the
kernel computes torch's denominator). Anything else returns ``None`` and runs
as written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._tree import tree_flatten
from functional_fp16.adam import AdamSpec, ScaleByAdamState
from functional_fp16.base import GradientTransformation
from functional_fp16.clipping import ClipSpec
from functional_fp16.sgd import DecaySpec, LearningRateSpec, ScaleByScheduleState
from functional_fp16._fused.sgd_plan import Path, cached_plan, state_at

__all__ = ["AdamPlan", "adam_plan", "adam_state_fits"]


class AdamPlan(NamedTuple):
    """The hyperparameters of a fusable Adam chain, and where its state lives."""

    max_norm: float | None  # None: no clipping
    l2_decay: float  # torch.optim.Adam's weight_decay, added to the gradient
    b1: float
    b2: float
    eps: float
    decoupled_decay: float  # AdamW's weight decay, added to the Adam direction
    learning_rate: float | Callable[[torch.Tensor], torch.Tensor]
    sign: float  # -1.0 to descend
    adam_path: Path
    lr_path: Path


_ORDER = (ClipSpec, DecaySpec, AdamSpec, DecaySpec, LearningRateSpec)


def _read(parts: list[tuple[Any, Path]]) -> AdamPlan | None:
    parts = [(s, p) for s, p in parts if not (isinstance(s, DecaySpec) and s.weight_decay == 0.0)]
    slots: list[tuple[Any, Path] | None] = [None] * len(_ORDER)
    position = 0
    for spec, path in parts:
        while position < len(_ORDER) and type(spec) is not _ORDER[position]:
            position += 1
        if position == len(_ORDER):  # out of order, twice, or unknown
            return None
        slots[position] = (spec, path)
        position += 1
    clip, l2, adam, decoupled, lr = slots
    if adam is None or lr is None or adam[0].eps_root != 0.0:
        return None
    spec: AdamSpec = adam[0]
    return AdamPlan(
        max_norm=clip[0].max_norm if clip else None,
        l2_decay=l2[0].weight_decay if l2 else 0.0,
        b1=spec.b1,
        b2=spec.b2,
        eps=spec.eps,
        decoupled_decay=decoupled[0].weight_decay if decoupled else 0.0,
        learning_rate=lr[0].learning_rate,
        sign=lr[0].sign,
        adam_path=adam[1],
        lr_path=lr[1],
    )


_adam_plan = cached_plan(_read)


def adam_plan(tx: GradientTransformation) -> AdamPlan | None:
    """The :class:`AdamPlan` of ``tx``, or ``None`` if it is not a fusable Adam chain.

    Read from the transforms' declared ``spec`` only, cached by its value.
    """
    return _adam_plan(tx)


def adam_state_fits(plan: AdamPlan, opt_state: Any, master_spec: Any) -> bool:
    """Whether ``opt_state`` has the plan's layout, its moments shaped like the master."""
    try:
        adam = state_at(opt_state, plan.adam_path)
        if not isinstance(adam, ScaleByAdamState):
            return False
        if tree_flatten(adam.mu)[1] != master_spec or tree_flatten(adam.nu)[1] != master_spec:
            return False
        if callable(plan.learning_rate):
            if not isinstance(state_at(opt_state, plan.lr_path), ScaleByScheduleState):
                return False
    except (TypeError, IndexError, KeyError, AttributeError):
        return False
    return True
