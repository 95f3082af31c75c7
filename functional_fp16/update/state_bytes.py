r"""How many bytes a training state holds: :func:`state_nbytes`.

.. math::
    B_{part} = \sum_{x \in \text{leaves}(part)} \text{numel}(x_{local}) \cdot \text{itemsize}(x)

counted from sizes alone (no value is read, so nothing waits for the device).
A DTensor counts its local shard: the bytes this rank holds.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from functional_fp16._util.tree import tree_leaves
from functional_fp16.update.state import FP16State

__all__ = ["StateBytes", "state_nbytes"]


class StateBytes(NamedTuple):
    """Bytes of each part of an :class:`~functional_fp16.FP16State` on this rank."""

    params: int  # the working copy (e.g. FP16)
    master: int  # the FP32 master
    opt_state: int  # the optimiser state (moments, counters)
    other: int  # the loss scale, step, flags and counters of the state itself
    total: int  # the sum of the four

    def per_param(self, n_params: int) -> dict[str, float]:
        """Each part in bytes per parameter, for ``n_params`` parameters."""
        return {k: v / n_params for k, v in self._asdict().items()}


def _bytes(tree) -> int:
    total = 0
    for x in tree_leaves(tree):
        if isinstance(x, torch.Tensor):
            local = getattr(x, "_local_tensor", x)  # a DTensor's shard on this rank
            total += local.numel() * local.element_size()
    return total


def state_nbytes(state: FP16State) -> StateBytes:
    """The bytes of ``state``'s params, master, optimiser state, the rest, and their total.

    Tensors are counted by ``numel * element_size`` (a view counts its own
    elements), DTensors by their local shard; no tensor value is read.

    Raises:
      TypeError: ``state`` is not an :class:`~functional_fp16.FP16State`.
    """
    if not isinstance(state, FP16State):
        raise TypeError(f"state must be an FP16State, got {type(state).__name__}")
    params, master, opt = (_bytes(state.params), _bytes(state.master), _bytes(state.opt_state))
    everything = _bytes(state)
    other = everything - params - master - opt
    return StateBytes(params, master, opt, other, everything)
