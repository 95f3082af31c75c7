"""How a step's apply/skip decision is made from its gradients, its loss and its replicas,
and how its global sums reach the other shards of the tree."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from functional_fp16._util.tree import describe_tensor

__all__ = ["Decision", "FiniteHook", "SumHook", "LeafAgreement", "Carry"]

FiniteHook = Callable[[torch.Tensor], torch.Tensor]
SumHook = Callable[[torch.Tensor], torch.Tensor]


class LeafAgreement(NamedTuple):
    r"""An ``agree`` hook that agrees on every leaf's flag, not only on the decision.

    ``reduce`` maps a bool tensor of any shape to its elementwise AND over the
    processes (e.g. one all-reduce MIN); ``then``, if given, is a caller's own
    hook, applied to the decision afterwards. A :class:`Decision` whose
    ``agree`` is one reduces the leaves' flags :math:`\ell` (with the
    ``require`` condition in the same reduction) and decides from the result,
    so every process holds the same per-leaf flags: a state that holds one shard
    of each leaf reports which leaves overflowed anywhere. Called on a 0-d flag
    it is an ordinary ``agree`` hook.
    """

    reduce: Callable[[torch.Tensor], torch.Tensor]
    then: FiniteHook | None = None

    def __call__(self, finite: torch.Tensor) -> torch.Tensor:
        out = self.reduce(finite)
        return out if self.then is None else self.then(out)


class Carry(NamedTuple):
    """Flags of this process that ride in a :class:`LeafAgreement`'s reduction of a step's
    leaves, so that one collective agrees both: ``local`` (a 1-d bool tensor) goes in, and
    the agreed flags are appended to ``agreed`` (an empty list the caller reads after the
    step). A :func:`~functional_fp16.MultiSteps` micro-batch's flags ride with its inner
    step's."""

    local: torch.Tensor
    agreed: list


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

    ``carry``: ``None``, or a :class:`Carry` of flags that an ``agree`` hook
    which is a :class:`LeafAgreement` reduces in the same collective as the
    step's own.
    """

    require: torch.Tensor | None = None
    agree: FiniteHook | None = None
    global_sum: SumHook | None = None
    carry: Carry | None = None

    def __call__(self, finite: torch.Tensor) -> torch.Tensor:
        if self.require is not None:
            finite = finite & self.require.to(finite.device)
        if self.agree is None:
            return finite
        return _agreed(self.agree, finite)

    def leaves(self, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(leaf_finite, finite)`` from the per-leaf flags :math:`\ell` of this process.

        .. math:: d = \operatorname{agree}\big(r \wedge \textstyle\bigwedge_l \ell_l\big)

        With a :class:`LeafAgreement` the flags (and :math:`r`) are agreed
        first, elementwise, and :math:`d` is decided from them: every process
        returns the same ``leaf_finite``. With any other hook (or none) the
        flags returned are this process's own.
        """
        agree = self.agree
        if not isinstance(agree, LeafAgreement):
            return flags, self(flags.all())
        n = flags.shape[0]
        parts = [flags]
        if self.require is not None:
            parts.append(self.require.to(flags.device).reshape(1))
        if self.carry is not None:
            parts.append(self.carry.local.to(flags.device))
        reduced = agree.reduce(torch.cat(parts) if len(parts) > 1 else flags)
        flags = reduced[:n]
        finite = flags.all() if self.require is None else flags.all() & reduced[n]
        if self.carry is not None:
            self.carry.agreed.append(reduced[n + (self.require is not None) :])
        return flags, (finite if agree.then is None else _agreed(agree.then, finite))

    def with_require(self, require: torch.Tensor | None) -> Decision:
        """This rule with ``require`` in place of its own condition."""
        return self._replace(require=require)

    def extra_args(self) -> dict[str, SumHook]:
        """The keyword arguments the step's ``tx.update`` gets besides ``(updates, state, params)``."""
        return {} if self.global_sum is None else {"global_sum": self.global_sum}


def _agreed(hook: FiniteHook, local: torch.Tensor) -> torch.Tensor:
    """``hook(local)``, refused unless it is a 0-d bool tensor on ``local``'s device."""
    finite = hook(local)
    if (
        not isinstance(finite, torch.Tensor)
        or finite.ndim != 0
        or finite.dtype != torch.bool
        or finite.device != local.device
    ):
        got = describe_tensor(finite)
        raise TypeError(f"agree must return a 0-d bool tensor on {local.device}, got {got}")
    return finite
