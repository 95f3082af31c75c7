"""Checks of configuration numbers, each error naming the argument (one place for all modules)."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["real", "integer", "flag", "is_zero"]


def real(
    name: str,
    value: Any,
    *,
    positive: bool = False,
    upper: float | None = None,
    tensor: bool = False,
) -> float:
    """``value`` as a finite float, ``>= 0`` (or ``> 0`` with ``positive``) and ``<= upper``.

    Raises ``TypeError`` for a non-number (``bool`` included), ``ValueError``
    for a value outside the range; both messages start with ``name``.

    With ``tensor``, a 0-d floating-point tensor (a hyperparameter that
    :func:`~functional_fp16.inject_hyperparams` keeps in the state) is returned
    as it is: its value lives on the device and is not read here.
    """
    if tensor and isinstance(value, torch.Tensor):
        if value.ndim != 0 or not value.is_floating_point():
            raise TypeError(
                f"{name} must be a real number or a 0-d floating-point tensor, got a tensor "
                f"of shape {tuple(value.shape)} and dtype {value.dtype}"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if positive:
        if not math.isfinite(value) or value <= 0.0:
            raise ValueError(f"{name} must be finite and > 0, got {value}")
    elif not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be <= {upper}, got {value}")
    return value


def is_zero(value: Any) -> bool:
    """Whether a checked hyperparameter is the number 0 (a tensor never is: its value is
    not read on the host, so a transform keeps its general form for it)."""
    return not isinstance(value, torch.Tensor) and value == 0.0


def flag(name: str, value: Any) -> bool:
    """``value``, which must be a Python ``bool`` (``TypeError`` naming ``name`` otherwise)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def integer(name: str, value: Any, minimum: int, *, int32: bool = False) -> int:
    """``value`` as an int ``>= minimum`` (and within int32 with ``int32``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if int32 and value > 2**31 - 1:
        raise ValueError(f"{name} must fit in int32, got {value}")
    return value
