"""Stuck-scale detection: a check that training has stopped learning.

When the gradients overflow even at the smallest loss scale, every update is
skipped, the scale cannot back off further, and training goes on silently
without learning (the failure reported for years against apex and DeepSpeed).
A non-finite loss is the same dead end. :func:`~functional_fp16.fp16_update`
never raises, because it must stay free of host synchronisation; the training
loop asks instead, where it already talks to the host.

The detector is a pure pair over an explicit state, like an optimiser::

    tracker = stuck_scale_init(state)                      # before the first update
    for step, batch in enumerate(data):
        grads, loss = grad_fn(state.loss_scale, state.params, batch)
        state = fp16_update(state, grads, loss=loss)
        tracker = stuck_scale_observe(tracker, state, loss)   # 0-d tensor ops, no sync
        if step % 100 == 0:
            tracker = stuck_scale_check(tracker, patience=20)  # one sync; may raise

``StuckScaleMonitor`` wraps the same three functions for loops that prefer an
object (``monitor.observe(state, loss)``, ``monitor.check()``).

A step counts as *stuck* when it was skipped while the loss scale it used was
already at its floor (``min_scale`` of a :class:`~functional_fp16.DynamicLossScale`;
any scale of a static or no-op loss scale), or when its loss was not finite.
:meth:`StuckScaleMonitor.check` raises once ``patience`` stuck steps have
occurred in a row since the previous check.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16.precision.loss_scale import DynamicLossScale
from functional_fp16.transforms.base import saturating_increment
from functional_fp16.update import FP16State

__all__ = [
    "StuckScaleError",
    "StuckScaleMonitor",
    "StuckScaleState",
    "stuck_scale_init",
    "stuck_scale_observe",
    "stuck_scale_check",
    "new_window",
]


class StuckScaleError(RuntimeError):
    """Training cannot go on: updates keep being skipped at the smallest loss scale.

    Attributes:
      step: the ``state.step`` at which the run of stuck steps was last seen.
      run_length: how many stuck steps in a row.
      nonfinite_losses: how many of them had a non-finite loss.
      last_applied_step: ``state.step`` after the last applied update (0: none yet).
      last_finite_loss: the loss of that update (NaN if no loss was observed).
      loss_scale: the loss scale's floor at which the steps were skipped.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int,
        run_length: int,
        nonfinite_losses: int,
        last_applied_step: int,
        last_finite_loss: float,
        loss_scale: float,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.run_length = run_length
        self.nonfinite_losses = nonfinite_losses
        self.last_applied_step = last_applied_step
        self.last_finite_loss = last_finite_loss
        self.loss_scale = loss_scale


class StuckScaleState(NamedTuple):
    """Device-side counters of :class:`StuckScaleMonitor` (a checkpointable pytree)."""

    run: torch.Tensor  # 0-d int32: stuck steps in a row, up to the last observed step
    run_nonfinite_loss: torch.Tensor  # 0-d int32: how many of those had a non-finite loss
    worst: torch.Tensor  # 0-d int32: longest run since the last check
    worst_nonfinite_loss: torch.Tensor  # 0-d int32: non-finite losses in that run
    worst_step: torch.Tensor  # 0-d int32: state.step where that run was last extended
    last_applied_step: torch.Tensor  # 0-d int32: state.step after the last applied update
    last_finite_loss: torch.Tensor  # 0-d float32: its loss (NaN when never observed)
    scale: torch.Tensor  # 0-d float32: the loss scale the next step will use


def _floor(state: FP16State) -> float:
    scale = state.loss_scale
    if isinstance(scale, DynamicLossScale):
        return scale.min_scale
    return math.inf  # a static scale cannot back off: every scale is its floor


def _check_patience(patience: int) -> int:
    return validate.integer("patience", patience, 1)


def _check_state(state: FP16State) -> None:
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")


def stuck_scale_init(state: FP16State) -> StuckScaleState:
    """The tracker before any update is observed: zero counters, ``state``'s scale in force.

    Args:
      state: the :class:`~functional_fp16.FP16State` whose next update is the
        first one to observe (its loss scale is the one that update uses).
    """
    _check_state(state)
    device = state.step.device
    zero = torch.zeros((), dtype=torch.int32, device=device)
    return StuckScaleState(
        run=zero,
        run_nonfinite_loss=zero,
        worst=zero,
        worst_nonfinite_loss=zero,
        worst_step=zero,
        last_applied_step=zero,
        last_finite_loss=torch.full((), math.nan, dtype=torch.float32, device=device),
        scale=state.loss_scale.loss_scale.detach().to(torch.float32),
    )


def stuck_scale_observe(
    tracker: StuckScaleState, state: FP16State, loss: torch.Tensor | None = None
) -> StuckScaleState:
    r"""Records one update's outcome; a pure function of tensors, no host synchronisation.

    A step is *stuck* when it was skipped with the scale it used, ``tracker.scale``,
    at its floor (``min_scale`` of a dynamic scale; any scale of a static one), or
    when its loss is not finite:

    .. math:: \text{stuck} = (\neg f \wedge s_{used} \le s_{min}) \vee \neg\operatorname{isfinite}(\ell)

    ``run`` counts stuck steps in a row, ``worst`` the longest run since the
    last :func:`stuck_scale_check`.

    Args:
      tracker: the previous tracker (:func:`stuck_scale_init` to start).
      state: the state the update returned.
      loss: this step's loss (unscaled), or ``None``.

    Returns:
      The new tracker.
    """
    if not isinstance(tracker, StuckScaleState):
        raise TypeError(f"tracker must be a StuckScaleState, got {type(tracker).__name__}")
    _check_state(state)
    if loss is not None and not isinstance(loss, torch.Tensor):
        raise TypeError(f"loss must be a tensor or None, got {type(loss).__name__}")
    device = state.step.device
    prev = tracker
    applied = state.grads_finite
    at_floor = prev.scale <= _floor(state)
    if loss is None:
        loss_bad = torch.zeros((), dtype=torch.bool, device=device)
        loss_value = prev.last_finite_loss
    else:
        loss = loss.detach().to(device)
        loss_bad = ~torch.isfinite(loss).all()
        loss_value = loss.float().mean()
    stuck = (~applied & at_floor) | loss_bad
    one = torch.ones_like(prev.run)
    run = torch.where(stuck, saturating_increment(prev.run), torch.zeros_like(one))
    run_bad = torch.where(stuck, prev.run_nonfinite_loss + loss_bad.to(torch.int32), 0 * one)
    new_worst = stuck & (run >= prev.worst)
    return StuckScaleState(
        run=run,
        run_nonfinite_loss=run_bad,
        worst=torch.where(new_worst, run, prev.worst),
        worst_nonfinite_loss=torch.where(new_worst, run_bad, prev.worst_nonfinite_loss),
        worst_step=torch.where(new_worst, state.step, prev.worst_step),
        last_applied_step=torch.where(applied, state.step, prev.last_applied_step),
        last_finite_loss=torch.where(applied & ~loss_bad, loss_value, prev.last_finite_loss).to(
            torch.float32
        ),
        scale=state.loss_scale.loss_scale.detach().to(torch.float32),
    )


def new_window(tracker: StuckScaleState) -> StuckScaleState:
    """The tracker with its longest run reset to the current one (a new check window)."""
    return tracker._replace(worst=tracker.run, worst_nonfinite_loss=tracker.run_nonfinite_loss)


def stuck_scale_check(tracker: StuckScaleState, patience: int) -> StuckScaleState:
    """Raises :class:`StuckScaleError` if ``patience`` stuck steps ran in a row.

    Reads the counters on the host (one synchronisation); call it where the
    loop already logs. Returns ``new_window(tracker)``: the next check looks at
    the steps observed after this one (plus a run still going on).
    """
    _check_patience(patience)
    s = tracker
    values = torch.stack(
        [
            s.worst.double(),
            s.worst_nonfinite_loss.double(),
            s.worst_step.double(),
            s.last_applied_step.double(),
            s.last_finite_loss.double(),
            s.scale.double(),
        ]
    ).tolist()
    worst, bad_losses, step, last_applied, last_loss, scale = values
    if worst < patience:
        return new_window(s)
    worst, bad_losses, step, last_applied = map(int, (worst, bad_losses, step, last_applied))
    raise StuckScaleError(
        _message(worst, bad_losses, step, last_applied, last_loss, scale),
        step=step,
        run_length=worst,
        nonfinite_losses=bad_losses,
        last_applied_step=last_applied,
        last_finite_loss=last_loss,
        loss_scale=scale,
    )


class StuckScaleMonitor:
    """The stuck-scale functions as an object for a host loop: ``observe`` and ``check``.

    The first :meth:`observe` starts the tracker from the state it is given (pass
    the initial state before training, or the state after the first update, whose
    own outcome is then not counted); later ones call :func:`stuck_scale_observe`.

    Args:
      patience: how many stuck steps in a row to tolerate, ``>= 1``.
      state: a tracker to resume from (``monitor.state`` of an earlier run, for
        example restored with :func:`~functional_fp16.load_checkpoint`).
    """

    def __init__(self, patience: int = 20, *, state: StuckScaleState | None = None) -> None:
        self.patience = _check_patience(patience)
        if state is not None and not isinstance(state, StuckScaleState):
            raise TypeError(f"state must be a StuckScaleState or None, got {type(state).__name__}")
        self.state = state

    def observe(self, state: FP16State, loss: torch.Tensor | None = None) -> None:
        """Records one step's outcome (no host synchronisation)."""
        if self.state is None:
            _check_state(state)
            if loss is not None and not isinstance(loss, torch.Tensor):
                raise TypeError(f"loss must be a tensor or None, got {type(loss).__name__}")
            self.state = stuck_scale_init(state)
            return
        self.state = stuck_scale_observe(self.state, state, loss)

    def check(self) -> None:
        """Raises :class:`StuckScaleError` if ``patience`` stuck steps ran in a row (one sync).

        Either way the next check starts a new window.
        """
        if self.state is not None:
            tracker, self.state = self.state, new_window(self.state)
            stuck_scale_check(tracker, self.patience)


def _message(
    run: int, bad_losses: int, step: int, last_applied: int, last_loss: float, scale: float
) -> str:
    first = step - run + 1
    if bad_losses == run:
        what = f"the loss was inf or NaN in {run} consecutive steps ({first} to {step})"
    elif bad_losses:
        what = (
            f"{run} consecutive updates ({first} to {step}) were skipped with the loss scale at "
            f"its minimum ({scale:g}); {bad_losses} of them had an inf or NaN loss"
        )
    else:
        what = (
            f"{run} consecutive updates ({first} to {step}) were skipped because the "
            f"gradients overflowed with the loss scale already at its minimum ({scale:g})"
        )
    if last_applied > 0:
        loss_text = "" if math.isnan(last_loss) else f", loss {last_loss:g}"
        last = f"The last applied update was step {last_applied}{loss_text}."
    else:
        last = "No update has been applied since this monitor started."
    return (
        f"Training is stuck: {what}. Lowering the scale cannot help any more, so the model "
        f"has stopped learning. {last} What to try: check the data and the forward pass for "
        "inf/NaN around these steps; lower the learning rate or add clip_by_global_norm; "
        "train in bfloat16 (fp16_init(..., param_dtype=torch.bfloat16) with NoOpLossScale), "
        "whose range is FP32's; resume from a checkpoint saved at or before step "
        f"{max(last_applied, 0)}."
    )
