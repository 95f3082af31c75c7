"""A Triton kernel that fails on its first launch falls back instead of reaching the training loop.

A Triton kernel can fail to compile or launch on a Triton, driver and GPU
combination it never ran on. :func:`with_triton` runs a launch the first
time for a *configuration* (the kernel, the device, the dtypes and the
arguments present: what Triton specialises on); if that first launch raises,
it warns once per device, remembers the configuration and runs the fallback
(the op's plain PyTorch kernel: the same decisions) for this call and every
later call of the configuration. After one successful launch, errors
propagate unchanged. An out-of-memory error is never taken for a broken
kernel. :func:`~functional_fp16.update.dispatch.route` reads
:func:`triton_failure` to send eager updates on a device where a kernel
failed to the multi-tensor path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["with_triton", "triton_failure", "triton_failures"]

_proven: set[Hashable] = set()  # configurations that launched once
_failed: dict[Hashable, tuple[torch.device, str]] = {}  # configuration -> (device, why)


def triton_failures() -> int:
    """How many configurations have failed their first Triton launch so far."""
    return len(_failed)


def triton_failure(device: torch.device) -> str | None:
    """Why a Triton kernel failed on its first launch on ``device`` (``None``: none failed)."""
    for config, (where, reason) in _failed.items():
        if where == device:
            return f"{config[0]}: {reason}"
    return None


def with_triton(
    config: tuple,
    device: torch.device,
    launch: Callable[[], Any],
    fallback: Callable[[], Any],
    launches: Callable[[], int],
    *,
    writes_inputs: bool,
) -> Any:
    """``launch()``, or ``fallback()`` if ``config`` failed on its first launch.

    Args:
      config: what the launch specialises on, its kernel's name first.
      device: the CUDA device it runs on.
      launch: runs the Triton kernels of one call.
      fallback: computes the same call with the plain kernel.
      launches: the number of kernel launches so far (to tell whether a
        failing call had already written something).
      writes_inputs: the call writes into its inputs (a donated step). If
        such a call fails after an earlier launch of the same call, it
        cannot be redone, and a ``RuntimeError`` says so.
    """
    key = (*config, device)
    if key in _failed:
        return fallback()
    if key in _proven:
        return launch()
    before = launches()
    try:
        result = launch()
    except torch.OutOfMemoryError:
        raise
    except Exception as err:
        reason = f"{type(err).__name__}: {err}"
        if writes_inputs and launches() - before > 1:
            raise RuntimeError(
                f"functional_fp16: the Triton kernel {config[0]} failed on {device} after part "
                f"of a donated step was written ({reason}); the donated state is partially "
                "updated: resume from the last checkpoint with donate=False"
            ) from err
        first_on_device = triton_failure(device) is None
        _failed[key] = (device, reason)
        if first_on_device:
            warnings.warn(
                f"functional_fp16: the Triton kernel {config[0]} failed on its first launch on "
                f"{device} ({reason}). Kernels that fail here run the op's plain PyTorch kernel "
                "instead, and eager updates on this device take the multi-tensor path: "
                "correct, but slower. Please report it to the functional_fp16 maintainers "
                f"with this message, torch {torch.__version__}, the triton version and the GPU.",
                RuntimeWarning,
                stacklevel=3,
            )
        return fallback()
    _proven.add(key)
    return result
