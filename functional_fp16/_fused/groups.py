r"""Masks and labels resolved into static groups of leaves: what each leaf's optimiser is.

A chain of declared transforms may hold :func:`~functional_fp16.masked` parts
(``adamw(mask=...)`` is one) and :func:`~functional_fp16.multi_transform`
labels. Both are static configuration, so the optimiser that acts on a leaf
follows from the tree's structure alone. :func:`leaf_parts` walks the
declared specs once, beside an *index tree* (the parameters with leaf
:math:`i` replaced by the int :math:`i`) and the optimiser state with its
leaves replaced by their positions in ``tree_leaves(opt_state)``, and returns
for every leaf the parts that act on it, in order:

.. math:: \text{parts}(i) = [(s_1, k_1, r_1), (s_2, k_2, r_2), \dots]

with :math:`s_j` a part's spec, :math:`k_j` its key (its position in the
spec tree, the same for every leaf the part acts on) and :math:`r_j` the
positions of its state tensors for leaf :math:`i` (``{"mu": 17, "nu": 165,
"count": 3}`` for Adam). A masked part acts on the leaves where its mask is
true; a labelled part on the leaves of its label. The fused plans then read
each leaf's parts as a chain; leaves whose plans are equal form one group,
one op call.

Nothing here reads a tensor's value. ``None`` means a part is undeclared or
the state has another layout; the update then runs the multi-tensor path.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as tp

from functional_fp16._util.tree import tree_flatten, tree_rebuild
from functional_fp16.precision.moment_storage import BlockCodes, ScaledHalf
from functional_fp16.transforms.base import ChainSpec, EmptyState
from functional_fp16.transforms.clipping import ClipSpec
from functional_fp16.transforms.combining import LabelsSpec, MultiTransformState
from functional_fp16.transforms.masking import MaskedSpec, MaskedState, hidden_in_trace
from functional_fp16.transforms.sgd import DecaySpec, LearningRateSpec, ScaleByScheduleState

__all__ = ["INDEX", "Part", "leaf_parts"]

INDEX = "#index"
"""The key, among a stateful part's positions, of the leaf's index among that part's leaves."""

Part = tuple[Any, tuple, dict[str, int]]
"""``(spec, key, state positions)`` of one part acting on one leaf."""


class _Unfusable(Exception):
    """A part is undeclared or its state has another layout."""


def leaf_parts(spec: Any, params: Any, opt_state: Any) -> list[list[Part]] | None:
    """Per leaf of ``params``, the declared parts that act on it (see the module docstring).

    ``params`` is the tree the optimiser sees (the master: a mask function is
    called with it); ``opt_state`` its state. Positions count in the library's
    flattening order; the walk pairs a part's leaves with its state's leaves
    through ``torch.utils._pytree``, which ``torch.compile`` traces. ``None`` if
    a part is undeclared or the state does not have the layout its spec
    implies.
    """
    leaves, p_spec = tree_flatten(params)
    o_leaves, o_spec = tree_flatten(opt_state)
    state_index = tree_rebuild(o_spec, opt_state, list(range(len(o_leaves))))
    index = tree_rebuild(p_spec, params, list(range(len(leaves))))
    out: list[list[Part]] = [[] for _ in leaves]
    try:
        _walk(spec, index, params, state_index, (), out)
    except (_Unfusable, TypeError, ValueError, KeyError, IndexError, AttributeError):
        return None
    return out


def _positions(tree: Any) -> list[int]:
    """The positions held by an index tree's leaves, in order."""
    found = [x for x in tp.tree_leaves(tree) if x is not None]
    if not all(type(x) is int for x in found):
        raise _Unfusable
    return found


def _walk(spec: Any, index: Any, real: Any, state: Any, key: tuple, out: list) -> None:
    if spec is None:
        raise _Unfusable
    if isinstance(spec, ChainSpec):
        if not isinstance(state, tuple) or len(state) != len(spec.parts):
            raise _Unfusable
        for i, part in enumerate(spec.parts):
            _walk(part, index, real, state[i], key + (i,), out)
        return
    if isinstance(spec, MaskedSpec):
        _masked(spec.inner, spec.resolve(real), index, real, state, key + ("mask",), out)
        return
    if isinstance(spec, LabelsSpec):
        if not isinstance(state, MultiTransformState) or set(state.inner_states) != set(
            spec.labels
        ):
            raise _Unfusable
        labels = spec.resolve(real)
        for label, inner in zip(spec.labels, spec.inner):
            mask = tp.tree_map(lambda x, label=label: x == label, labels)
            _masked(inner, mask, index, real, state.inner_states[label], key + (label,), out)
        return
    leaves = _positions(index)
    # A leaf's index among the part's leaves in the library's flattening order (the
    # positions' order; torch's pytree, which pairs them with the state, may differ).
    rank = {leaf: r for r, leaf in enumerate(sorted(leaves))}
    for leaf, positions in zip(leaves, _states_of(spec, state, len(leaves))):
        if INDEX in positions:
            positions[INDEX] = rank[leaf]
        out[leaf].append((spec, key, positions))


def _hide(mask: Any, tree: Any) -> Any:
    """``tree`` with every subtree under a false leaf of ``mask`` replaced by ``MaskedNode()``."""
    if not all(type(f) is bool for f in tp.tree_leaves(mask)):
        raise _Unfusable
    return hidden_in_trace(mask, tree)


def _masked(inner: Any, mask: Any, index: Any, real: Any, state: Any, key: tuple, out) -> None:
    if not isinstance(state, MaskedState):
        raise _Unfusable
    _walk(inner, _hide(mask, index), _hide(mask, real), state.inner_state, key, out)


def _states_of(spec: Any, state: Any, n: int) -> list[dict[str, int]]:
    """Per leaf of part ``spec`` (``n`` of them), the positions of its state tensors.

    A part's state is a NamedTuple: each field that holds one tensor per leaf
    gives the ``j``-th leaf its ``j``-th position, each 0-d tensor (a counter, a
    flag) every leaf its own (``{"mu": 17, "nu": 165, "count": 3}`` for Adam); a
    moment stored as block codes gives its codes' position and its scales'
    (``"mu_scales"``), and :data:`INDEX` is set by the caller. The learning rate
    keeps a count only with a schedule; clipping and weight decay keep nothing.
    Each field is flattened once for all the leaves (once per leaf would be
    quadratic in the leaves, and ``torch.compile`` traces it).
    """
    if n == 0:  # a part that acts on no leaf: nothing of its state is read
        return []
    if isinstance(spec, LearningRateSpec):
        if isinstance(state, ScaleByScheduleState) and type(state.count) is int:
            return [{"count": state.count} for _ in range(n)]
        if isinstance(state, EmptyState) and not callable(spec.learning_rate):
            return [{} for _ in range(n)]
        raise _Unfusable
    if isinstance(spec, (ClipSpec, DecaySpec)):
        if not isinstance(state, EmptyState):
            raise _Unfusable
        return [{} for _ in range(n)]
    if not isinstance(state, tuple) or not hasattr(state, "_fields"):
        raise _Unfusable
    out: list[dict[str, int]] = [{INDEX: j} for j in range(n)]
    for name in state._fields:
        value = getattr(state, name)
        if type(value) is int:
            for positions in out:
                positions[name] = value
            continue
        entries = [x for x in tp.tree_leaves(value, is_leaf=_stored) if x is not None]
        if len(entries) != n:
            raise _Unfusable
        for positions, entry in zip(out, entries):
            if isinstance(entry, BlockCodes):  # a coded moment: its codes, its block scales
                positions[name], positions[f"{name}_scales"] = _positions(entry)
            elif type(entry) is int:
                positions[name] = entry
            else:  # a moment with a per-tensor scale, or something else
                raise _Unfusable
    return out


def _stored(x: Any) -> bool:
    """A moment stored as more than one tensor counts as one entry per leaf."""
    return isinstance(x, (BlockCodes, ScaledHalf))
