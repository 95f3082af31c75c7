"""A ``torch.amp.GradScaler`` as a loss scale, and a loss scale written back into one."""

from __future__ import annotations

import math
from typing import Any

import torch

from functional_fp16.precision.loss_scale import DynamicLossScale, LossScale, NoOpLossScale

_TINY32 = torch.finfo(torch.float32).tiny


def _check_between_iterations(scaler: Any, name: str) -> None:
    # GradScaler's own test before pickling: per-optimizer records exist from
    # unscale_()/step() until update() clears them.
    if getattr(scaler, "_per_optimizer_states", None):
        raise ValueError(
            f"{name} is in the middle of an iteration (unscale_ or step without update); "
            "migrate between iterations, after scaler.update()"
        )


def _check_scaler_type(scaler: Any) -> None:
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}"
        )


def _loss_scale_from(scaler: Any, loss_scale: LossScale | None) -> LossScale:
    if scaler is None:
        return NoOpLossScale() if loss_scale is None else loss_scale
    if loss_scale is not None:
        raise ValueError(
            "pass scaler or loss_scale, not both: with a GradScaler the loss scale is its state"
        )
    _check_scaler_type(scaler)
    if not scaler.is_enabled():
        return NoOpLossScale()
    _check_between_iterations(scaler, "scaler")
    sd = scaler.state_dict()
    tracker = int(sd["_growth_tracker"])
    if not 0 <= tracker < sd["growth_interval"]:
        raise ValueError(
            f"scaler's growth tracker ({tracker}) is not in [0, growth_interval = "
            f"{sd['growth_interval']})"
        )
    try:
        scale = DynamicLossScale(
            init_scale=sd["scale"],
            growth_factor=sd["growth_factor"],
            backoff_factor=sd["backoff_factor"],
            growth_interval=sd["growth_interval"],
            min_scale=_TINY32,
            max_scale=math.inf,
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"scaler: {err}") from None
    return scale.replace(growth_count=tracker)


def _scaler_state(loss_scale: LossScale, scaler: Any) -> dict[str, Any] | None:
    """What ``scaler.load_state_dict`` gets (``None``: nothing to write), checked against it."""
    kind = type(loss_scale).__name__
    if scaler is not None:
        _check_scaler_type(scaler)
    if scaler is None or not scaler.is_enabled():
        if isinstance(loss_scale, NoOpLossScale):
            return None
        which = "scaler is None" if scaler is None else "scaler is disabled"
        raise ValueError(
            f"state.loss_scale is a {kind} but {which}: pass an enabled torch.amp.GradScaler "
            "to carry the scale over, or state.replace(loss_scale=ff.NoOpLossScale()) to drop it"
        )
    if not isinstance(loss_scale, DynamicLossScale):
        raise ValueError(
            f"state.loss_scale is a {kind}, which an enabled GradScaler cannot hold (it is "
            "always dynamic): pass a disabled GradScaler or scaler=None"
        )
    if loss_scale.hysteresis != 1:
        raise ValueError(
            f"state.loss_scale.hysteresis is {loss_scale.hysteresis}: GradScaler backs off on "
            "every overflow (hysteresis 1)"
        )
    _check_between_iterations(scaler, "scaler")
    settings = {
        "growth_factor": scaler.get_growth_factor(),
        "backoff_factor": scaler.get_backoff_factor(),
        "growth_interval": scaler.get_growth_interval(),
    }
    for key, value in settings.items():
        if getattr(loss_scale, key) != value:
            raise ValueError(
                f"state.loss_scale.{key} is {getattr(loss_scale, key)!r} but the scaler's "
                f"{key} is {value!r}"
            )
    return {
        "scale": float(loss_scale.loss_scale),
        **settings,
        "_growth_tracker": int(loss_scale.growth_count),
    }
