r"""Loss-scale telemetry for long runs: counters of skipped steps, growths and backoffs.

:class:`ScaleStats` is a leaf of every :class:`~functional_fp16.FP16State`
(``state.scale_stats``); each optimiser step advances it with
:func:`advance_stats`, on the device, without a host read:

.. math::
    \text{skips} \mathrel{+}= [\neg a], \quad
    \text{growths} \mathrel{+}= [s' > s], \quad
    \text{backoffs} \mathrel{+}= [s' < s], \quad
    \text{since\_skip} \leftarrow \begin{cases} 0 & \neg a \\ \text{since\_skip} + 1 & a \end{cases}

with :math:`a` whether the step was applied and :math:`s, s'` the loss scale
before and after it. The counters are int32: they would wrap after
:math:`2^{31} - 1` steps (68 years at one step a second). Every
implementation of ``fp16_update`` computes them from the same three values,
so they are bitwise the same everywhere, and checkpoints carry them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ScaleStats", "COUNTER_NAMES", "zero_stats", "advance_stats", "stepped_stats"]


class ScaleStats(NamedTuple):
    """Counters of the optimiser steps so far (each a 0-d int32 tensor)."""

    skips: torch.Tensor  # steps skipped because a gradient (or the loss) was not finite
    growths: torch.Tensor  # steps after which the loss scale grew
    backoffs: torch.Tensor  # steps after which the loss scale backed off
    since_skip: torch.Tensor  # applied steps since the last skipped one


COUNTER_NAMES: tuple[str, ...] = ScaleStats._fields
"""The counters' names, in field order."""


def zero_stats(device: torch.device | None = None) -> ScaleStats:
    """All four counters at zero, on ``device``."""
    return ScaleStats(*(torch.zeros((), dtype=torch.int32, device=device) for _ in range(4)))


def advance_stats(
    stats: ScaleStats, old_scale: torch.Tensor, new_scale: torch.Tensor, applied: torch.Tensor
) -> ScaleStats:
    """The counters after one optimiser step (see the module docstring); 0-d tensors only.

    Eight elementwise ops on 0-d tensors: the counters are int32 and a flag adds as 0 or 1.
    """
    return ScaleStats(
        skips=stats.skips + ~applied,
        growths=stats.growths + (new_scale > old_scale),
        backoffs=stats.backoffs + (new_scale < old_scale),
        since_skip=(stats.since_skip + 1) * applied,
    )


def stepped_stats(state, new_loss_scale, applied: torch.Tensor) -> ScaleStats:
    """``state.scale_stats`` advanced by one step from ``state.loss_scale`` to
    ``new_loss_scale`` (``applied``: whether the step was applied)."""
    return advance_stats(
        state.scale_stats, state.loss_scale.loss_scale, new_loss_scale.loss_scale, applied
    )
