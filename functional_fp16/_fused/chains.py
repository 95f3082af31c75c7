"""Reading chains of declared transforms: the machinery every fused plan shares.

Every transform of the library declares what it computes in its ``spec``
(:class:`~functional_fp16.transforms.base.ChainSpec` and the parts' own specs). A fused
plan flattens a chain into ``(spec, state path)`` pairs with :func:`chain_parts`
and accepts or refuses the parts' types; :func:`cached_plan` caches its answer
by the specs' values. A part's state is addressed with
:func:`~functional_fp16.transforms.base.state_at` and
:func:`~functional_fp16.transforms.base.replace_at`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from functional_fp16.transforms.base import (
    ChainSpec,
    GradientTransformation,
    StatePath,
    saturating_increment,
    state_at,
)
from functional_fp16.transforms.sgd import ScaleByScheduleState

__all__ = [
    "Path",
    "chain_parts",
    "in_order",
    "cached_plan",
    "lr_state_fits",
    "lr_factor",
]

Path = StatePath


def chain_parts(spec: Any, path: Path = ()) -> list[tuple[Any, Path]] | None:
    """A declared chain flattened into ``(spec, state path)`` pairs; ``None`` if a part is undeclared.

    Shared by every fused plan: a plan then accepts or refuses the parts' types.
    """
    if spec is None:
        return None
    if not isinstance(spec, ChainSpec):
        return [(spec, path)]
    out: list[tuple[Any, Path]] = []
    for i, part in enumerate(spec.parts):
        inner = chain_parts(part, path + (i,))
        if inner is None:
            return None
        out.extend(inner)
    return out


def in_order(parts: list[tuple[Any, Path]], order: tuple[type, ...]) -> dict | None:
    """``{spec type: (spec, path)}`` of ``parts`` where each part's spec is one of
    ``order``'s types, each at most once and in that order; ``None`` otherwise (a part
    the plan does not run, one out of order, or twice)."""
    found: dict[type, tuple[Any, Path]] = {}
    rank = -1
    for spec, path in parts:
        if type(spec) not in order:
            return None
        r = order.index(type(spec))
        if r <= rank:
            return None
        rank = r
        found[type(spec)] = (spec, path)
    return found


def _typed(spec: Any) -> Any:
    """``spec`` as a hashable key that tells specs of equal values but other types apart."""
    if isinstance(spec, tuple):
        return (type(spec), tuple(_typed(x) for x in spec))
    return (type(spec), spec)


def cached_plan(read: Callable[[list[tuple[Any, Path]]], Any]) -> Callable[..., Any]:
    """Turns ``read(parts)`` into ``plan(tx)``: the plan of ``tx``'s declared ``spec``.

    Cached by the spec's value (specs are tuples of hyperparameters), never by
    object identity; a spec that cannot be hashed is read every time.
    ``plan(tx)`` returns ``None`` for a transform with an undeclared part.
    """

    @functools.lru_cache(maxsize=256)
    def of_key(key: Any, spec: Any) -> Any:
        del key  # the cache's key; ``spec`` rides along (equal keys, equal specs)
        parts = chain_parts(spec)
        return read(parts) if parts else None

    def plan(tx: GradientTransformation) -> Any:
        spec = getattr(tx, "spec", None)
        if torch.compiler.is_compiling():  # traced once per graph: no cache needed
            parts = chain_parts(spec)
            return read(parts) if parts else None
        try:
            key = _typed(spec)
            hash(key)
        except TypeError:  # an unhashable hyperparameter: read it every time
            parts = chain_parts(spec)
            return read(parts) if parts else None
        return of_key(key, spec)

    return plan


def lr_state_fits(plan: Any, opt_state: Any) -> bool:
    """Whether a plan with a learning-rate schedule finds its count at ``plan.lr_path``.

    ``plan`` has ``learning_rate`` (a number or a schedule) and ``lr_path``;
    a constant learning rate keeps no state. Raises what indexing raises for
    a state of another structure.
    """
    if not callable(plan.learning_rate):
        return True
    return isinstance(state_at(opt_state, plan.lr_path), ScaleByScheduleState)


def lr_factor(plan: Any, opt_state: Any, like: torch.Tensor):
    r"""``(f, s')``: the signed step factor :math:`f = \sigma\,\eta_t` as a 0-d float32
    tensor on ``like``'s device, and the learning-rate transform's next state.

    A constant :math:`\eta` is a fill on the device (not a host-to-device copy:
    capturable in CUDA graphs); a schedule is evaluated at its count, which
    advances by one (saturating).
    """
    if not callable(plan.learning_rate):
        factor = torch.full(
            (), plan.sign * plan.learning_rate, dtype=torch.float32, device=like.device
        )
        return factor, state_at(opt_state, plan.lr_path)
    count = state_at(opt_state, plan.lr_path).count
    lr = plan.learning_rate(count).to(torch.float32) * plan.sign
    return lr, ScaleByScheduleState(count=saturating_increment(count))
