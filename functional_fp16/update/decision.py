"""How a step's apply/skip decision is made from its gradients, its loss and its replicas,
and how its global sums reach the other shards of the tree."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from functional_fp16._util.tree import describe_tensor

__all__ = ["Decision", "FiniteHook", "SumHook"]

FiniteHook = Callable[[torch.Tensor], torch.Tensor]
SumHook = Callable[[torch.Tensor], torch.Tensor]


class Decision(NamedTuple):
    r"""The decision rule of one step, applied to the local all-finite flag :math:`f`:

    .. math:: d = \operatorname{agree}(f \wedge r)

    ``require`` (:math:`r`): ``None`` or a 0-d bool that must also hold (the
    loss is finite; a window of micro-batches closes). ``agree``: ``None`` or
    a hook from the local flag to the one every replica agrees on (e.g. an
    all-reduce). Calling the rule applies it.

    ``global_sum``: ``None``, or, for a state that holds one shard of the
    parameter tree, the hook from this process's partial sum to the sum over
    the whole tree; the step's transforms get it as their ``global_sum``
    argument (:func:`~functional_fp16.transforms.clip_by_global_norm` sums
    its squares with it). It travels with the decision because both are how
    one step hears from the other processes.
    """

    require: torch.Tensor | None = None
    agree: FiniteHook | None = None
    global_sum: SumHook | None = None

    def __call__(self, finite: torch.Tensor) -> torch.Tensor:
        if self.require is not None:
            finite = finite & self.require.to(finite.device)
        if self.agree is None:
            return finite
        local = finite
        finite = self.agree(local)
        if (
            not isinstance(finite, torch.Tensor)
            or finite.ndim != 0
            or finite.dtype != torch.bool
            or finite.device != local.device
        ):
            got = describe_tensor(finite)
            raise TypeError(f"agree must return a 0-d bool tensor on {local.device}, got {got}")
        return finite

    def with_require(self, require: torch.Tensor | None) -> Decision:
        """This rule with ``require`` in place of its own condition."""
        return self._replace(require=require)

    def extra_args(self) -> dict[str, SumHook]:
        """The keyword arguments the step's ``tx.update`` gets besides ``(updates, state, params)``."""
        return {} if self.global_sum is None else {"global_sum": self.global_sum}
