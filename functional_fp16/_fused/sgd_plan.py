"""Reading a chain of declared transforms as one fusable SGD step.

Every transform of the library declares what it computes in its ``spec``
(:class:`~functional_fp16.base.ChainSpec`, :class:`~functional_fp16.clipping.ClipSpec`,
:class:`~functional_fp16.sgd.DecaySpec`, :class:`~functional_fp16.sgd.TraceSpec`,
:class:`~functional_fp16.sgd.LearningRateSpec`). :func:`sgd_plan` reads those
specs, never code, and returns the hyperparameters of the single-pass kernel
when the chain, flattened, has the form::

    [clip_by_global_norm(c)]  [add_decayed_weights(wd)]  [trace(mu, ...)]  scale_by_learning_rate(lr)

(brackets: optional; parts with a coefficient of 0 pass their input through
and are dropped; ``identity()`` is an empty chain). Anything else, including
any transform without a spec, returns ``None`` and runs as written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._tree import tree_flatten
from functional_fp16.base import ChainSpec, GradientTransformation
from functional_fp16.clipping import ClipSpec
from functional_fp16.sgd import (
    DecaySpec,
    LearningRateSpec,
    ScaleByScheduleState,
    TraceSpec,
    TraceState,
)

__all__ = ["SGDPlan", "sgd_plan", "chain_parts", "cached_plan", "state_at", "replace_at"]

Path = tuple[int, ...]


class SGDPlan(NamedTuple):
    """The hyperparameters of a fusable chain, and where its state lives.

    ``trace_path`` and ``lr_path`` index into the (nested tuple) optimiser
    state; ``trace_path`` is ``None`` without momentum.
    """

    max_norm: float | None  # None: no clipping
    weight_decay: float  # 0.0: no decay
    momentum: float  # 0.0: no momentum
    nesterov: bool
    dampening: float
    learning_rate: float | Callable[[torch.Tensor], torch.Tensor]
    sign: float  # -1.0 to descend
    trace_path: Path | None
    lr_path: Path


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


def _read(parts: list[tuple[Any, Path]]) -> SGDPlan | None:
    # Pass-through parts change nothing; drop them.
    parts = [
        (s, p)
        for s, p in parts
        if not (isinstance(s, DecaySpec) and s.weight_decay == 0.0)
        and not (isinstance(s, TraceSpec) and s.decay == 0.0)
    ]
    order = (ClipSpec, DecaySpec, TraceSpec, LearningRateSpec)
    found: dict[type, tuple[Any, Path]] = {}
    rank = -1
    for spec, path in parts:
        if type(spec) not in order:  # a declared transform the SGD kernel does not run
            return None
        r = order.index(type(spec))
        if r <= rank:  # out of order, or twice
            return None
        rank = r
        found[type(spec)] = (spec, path)
    if LearningRateSpec not in found or parts[-1][0] is not found[LearningRateSpec][0]:
        return None
    clip = found.get(ClipSpec, (None, None))[0]
    decay = found.get(DecaySpec, (None, None))[0]
    trace, trace_path = found.get(TraceSpec, (None, None))
    lr, lr_path = found[LearningRateSpec]
    return SGDPlan(
        max_norm=clip.max_norm if clip is not None else None,
        weight_decay=decay.weight_decay if decay is not None else 0.0,
        momentum=trace.decay if trace is not None else 0.0,
        nesterov=trace.nesterov if trace is not None else False,
        dampening=trace.dampening if trace is not None else 0.0,
        learning_rate=lr.learning_rate,
        sign=lr.sign,
        trace_path=trace_path,
        lr_path=lr_path,
    )


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


_sgd_plan = cached_plan(_read)


def sgd_plan(tx: GradientTransformation) -> SGDPlan | None:
    """The :class:`SGDPlan` of ``tx``, or ``None`` if it is not a fusable SGD chain.

    Read from the transforms' declared ``spec`` only, cached by its value.
    """
    return _sgd_plan(tx)


def state_at(state: Any, path: Path) -> Any:
    """The inner state at ``path`` of a nested chain state."""
    for i in path:
        state = state[i]
    return state


def replace_at(state: Any, path: Path, value: Any) -> Any:
    """A copy of the nested chain state with the inner state at ``path`` replaced."""
    if not path:
        return value
    parts = list(state)
    parts[path[0]] = replace_at(state[path[0]], path[1:], value)
    return tuple(parts)


def state_fits(plan: SGDPlan, opt_state: Any, master_spec: Any) -> bool:
    """Whether ``opt_state`` has the plan's layout, its momentum shaped like the master."""
    try:
        if plan.trace_path is not None:
            trace = state_at(opt_state, plan.trace_path)
            if not isinstance(trace, TraceState) or tree_flatten(trace.trace)[1] != master_spec:
                return False
        if callable(plan.learning_rate):
            if not isinstance(state_at(opt_state, plan.lr_path), ScaleByScheduleState):
                return False
    except (TypeError, IndexError, KeyError):
        return False
    return True
