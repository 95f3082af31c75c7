"""The optax-style transform interface: ``GradientTransformation``, ``chain``, ``apply_updates``.

A gradient transformation is a pair of pure functions::

    state = tx.init(params)
    updates, new_state = tx.update(updates, state, params)

Everything that changes from step to step lives in ``state`` (a NamedTuple of
tensors); everything fixed is closed over by the factory that built ``tx``.
No function here modifies its arguments.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._util.tree import PyTree, check_same_structure, tree_flatten, tree_unflatten

__all__ = [
    "GradientTransformation",
    "EmptyState",
    "ChainSpec",
    "identity",
    "chain",
    "apply_updates",
    "saturating_increment",
    "update_with_extra_args",
    "StatePath",
    "state_at",
    "replace_at",
]

InitFn = Callable[[PyTree], Any]
UpdateFn = Callable[..., tuple[PyTree, Any]]


class GradientTransformation(NamedTuple):
    """A pure ``(init, update)`` pair, and optionally what it computes, as data.

    ``init(params) -> state``; ``update(updates, state, params=None) -> (updates, state)``.

    ``spec`` declares the transform's rule and hyperparameters (for example
    :class:`~functional_fp16.transforms.sgd.TraceSpec`), so that
    :func:`~functional_fp16.fp16_update` can run a chain of declared transforms
    as one fused kernel (see :func:`~functional_fp16.update_path`). ``None``
    (the default, and what user-written transforms have) means "run
    ``update`` as it is".
    """

    init: InitFn
    update: UpdateFn
    spec: Any = None


# The position of a part's state in a nested chain state: one index per level.
StatePath = tuple[int, ...]


class ChainSpec(NamedTuple):
    """The declared form of :func:`chain`: the specs of its parts, in order."""

    parts: tuple[Any, ...]


class EmptyState(NamedTuple):
    """The state of a transformation that keeps none."""


def identity() -> GradientTransformation:
    """The transformation that returns its updates unchanged."""

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        del params
        return updates, state

    return GradientTransformation(init, update, ChainSpec(()))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    r"""Composes transformations left to right.

    .. math:: u \mapsto t_n(\dots t_2(t_1(u)))

    The state is the tuple of the inner states, in order.

    Args:
      *transforms: the transformations to apply, first one first.

    Returns:
      A :class:`GradientTransformation`.
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain argument {i} must be a GradientTransformation, got {type(t).__name__}"
            )

    def init(params: PyTree) -> tuple[Any, ...]:
        return tuple(t.init(params) for t in transforms)

    def update(updates: PyTree, state: tuple[Any, ...], params: PyTree | None = None, **extra_args):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(
                f"chain state must be a tuple of {len(transforms)} inner states, "
                f"got {type(state).__name__}"
            )
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = update_with_extra_args(t, updates, s, params, **extra_args)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init, update, ChainSpec(tuple(t.spec for t in transforms)))


def update_with_extra_args(
    tx: GradientTransformation,
    updates: PyTree,
    state: Any,
    params: PyTree | None = None,
    **extra_args: Any,
) -> tuple[PyTree, Any]:
    """``tx.update(updates, state, params, **extra)``, where ``extra`` holds the
    ``extra_args`` that ``tx.update`` declares.

    Extra keyword arguments carry what a transform cannot see in its updates,
    such as ``global_sum`` (how a sum over one shard of the parameter tree
    becomes the sum over the whole tree; see
    :func:`~functional_fp16.transforms.clip_by_global_norm`). A transform gets
    an extra argument only if its ``update`` names it or takes ``**kwargs``,
    so a plain ``update(updates, state, params)`` keeps working inside any
    chain. The combinators (``chain``, ``masked``, ``multi_transform``,
    ``apply_if_finite``, ``MultiSteps``) pass them on to their inner
    transforms. With no extra arguments this is ``tx.update(updates, state,
    params)``.
    """
    if not extra_args:
        return tx.update(updates, state, params)
    accepted = _keywords(tx.update)
    if accepted is not None:
        extra_args = {k: v for k, v in extra_args.items() if k in accepted}
    return tx.update(updates, state, params, **extra_args)


# update function -> the keywords it takes; weak, so a cached transform can still be freed.
_KEYWORDS: weakref.WeakKeyDictionary[Callable[..., Any], frozenset[str] | None] = (
    weakref.WeakKeyDictionary()
)


def _keywords(update: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword names ``update`` takes, or ``None`` when it takes ``**kwargs``."""
    try:
        return _KEYWORDS[update]
    except (KeyError, TypeError):  # not seen yet, or not weakly referable / hashable
        pass
    names: set[str] | None = set()
    for p in inspect.signature(update).parameters.values():
        if p.kind is p.VAR_KEYWORD:
            names = None
            break
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.add(p.name)
    found = None if names is None else frozenset(names)
    try:
        _KEYWORDS[update] = found
    except TypeError:
        pass
    return found


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    r"""Returns :math:`\operatorname{fl}_p(p + u)` for every leaf: the sum in the
    promoted dtype, rounded once to the dtype of :math:`p` (as optax does).

    Args:
      params: the tree of parameters.
      updates: a tree of the same structure.

    Returns:
      A new tree; ``params`` and ``updates`` are left untouched.
    """
    p_leaves, spec = tree_flatten(params)
    u_leaves = check_same_structure(params, updates, name="updates", reference_name="params")
    out = [torch.add(p, u).to(p.dtype) for p, u in zip(p_leaves, u_leaves)]
    return tree_unflatten(spec, out)


def saturating_increment(count: torch.Tensor) -> torch.Tensor:
    """``count + 1`` for a 0-d int32 counter, staying at the int32 maximum instead of wrapping.

    (``clamp(count + 1, max=...)`` would not do: the sum wraps to -2**31 first.)
    """
    top = torch.iinfo(torch.int32).max
    return torch.where(count < top, count + 1, count).to(torch.int32)


def state_at(state: Any, path: StatePath) -> Any:
    """The inner state at ``path`` of a nested chain state."""
    for i in path:
        state = state[i]
    return state


def replace_at(state: Any, path: StatePath, value: Any) -> Any:
    """A copy of the nested chain state with the inner state at ``path`` replaced."""
    if not path:
        return value
    parts = list(state)
    parts[path[0]] = replace_at(state[path[0]], path[1:], value)
    return tuple(parts)
