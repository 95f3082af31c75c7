r"""Hyperparameters as tensors in the state, changed from outside between steps.

``inject_hyperparams(adamw)(learning_rate=1e-3, weight_decay=0.1)`` is AdamW
whose float hyperparameters live in the state's ``hyperparams`` dict as 0-d
float32 tensors, as optax lays it out::

    InjectHyperparamsState(count, hyperparams={"learning_rate": tensor(1e-3), ...},
                           inner_state=<adamw's state>)

A training loop reads and sets them like any other state tensor (an LR finder,
a manual decay, a value read from a config file), and because they are tensor
*values*, a compiled step (``torch.compile(fullgraph=True)``) does not
recompile when one changes. A hyperparameter given as a schedule is evaluated
at the transform's count on every update and stored there too.

Inside :func:`~functional_fp16.fp16_update`, a chain whose only injected
hyperparameter is the learning rate runs on the fused kernel (the kernel takes
its learning rate as a device tensor); other injected hyperparameters run on
the multi-tensor path (``update_path`` says which).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._util.tree import PyTree, tree_flatten
from functional_fp16.transforms.base import GradientTransformation, saturating_increment

__all__ = ["InjectHyperparamsState", "InjectSpec", "inject_hyperparams"]


class InjectHyperparamsState(NamedTuple):
    """State of a transform made by :func:`inject_hyperparams`."""

    count: torch.Tensor  # 0-d int32: the number of updates produced (applied steps)
    hyperparams: dict[str, torch.Tensor]  # name -> 0-d float32: the values the next update uses
    inner_state: Any  # the inner transform's state


class InjectSpec(NamedTuple):
    """Declared form of an injected transform: how to rebuild it, and what is injected."""

    factory: Callable[..., GradientTransformation]
    fixed: tuple[tuple[str, Any], ...]  # arguments passed as they are (static)
    numeric: tuple[tuple[str, float], ...]  # injected numbers, with their initial values
    schedules: tuple[tuple[str, Callable], ...]  # injected schedules, evaluated each update

    def build(self, values: dict[str, Any]) -> GradientTransformation:
        """The inner transform with the injected arguments set to ``values``."""
        fixed = {n: v.value if isinstance(v, _Opaque) else v for n, v in self.fixed}
        return self.factory(**fixed, **values)

    def initial(self) -> dict[str, float]:
        """The injected numbers' initial values (schedules excluded)."""
        return dict(self.numeric)


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        return _Opaque(value)
    return value


class _Opaque:
    """An unhashable static argument, compared by identity (it is configuration)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def inject_hyperparams(
    inner_factory: Callable[..., GradientTransformation],
    static_args: str | tuple[str, ...] = (),
) -> Callable[..., GradientTransformation]:
    r"""Wraps a transform factory so that its float hyperparameters live in the state.

    ``inject_hyperparams(f)(*args, **kwargs)`` binds the arguments to ``f``'s
    signature (defaults included). Each float argument not named in
    ``static_args`` becomes a 0-d float32 tensor in the state's
    ``hyperparams``; each callable one (a schedule) is evaluated at the
    transform's count every update and stored there; every other argument
    (ints, bools, strings, masks, transforms) is passed as it is. Every update
    then computes

    .. math::
        h &\leftarrow h \text{ with } h_s = \text{schedule}_s(t) \text{ for each schedule } s \\
        (u', \sigma') &= f(\text{static}, h).\text{update}(u, \sigma, p), \qquad t \leftarrow t + 1

    so setting ``state.hyperparams["learning_rate"]`` between steps changes the
    next step's learning rate (``tensor.fill_(x)`` in place, or a new 0-d
    float32 tensor on the same device). The arithmetic with a tensor value is
    the float one's, except that the value is the float32 tensor's (``0.9`` is
    ``fl32(0.9)``) and parts that a float 0 would skip are computed.

    Args:
      inner_factory: a function returning a :class:`GradientTransformation`
        (``adamw``, ``sgd``, ``lion``, ``clip_by_global_norm``, or one of yours
        whose hyperparameters accept 0-d tensors).
      static_args: names of arguments to pass as they are: floats to keep as Python
        numbers, and callables that are not schedules, such as a weight-decay mask
        (``inject_hyperparams(adamw, static_args="mask")(1e-3, mask=fn)``), as optax
        has it.

    Returns:
      A function with ``inner_factory``'s arguments returning the wrapped
      transform, with state :class:`InjectHyperparamsState`.
    """
    if not callable(inner_factory):
        raise TypeError(f"inner_factory must be callable, got {type(inner_factory).__name__}")
    static = (static_args,) if isinstance(static_args, str) else tuple(static_args)
    if not all(isinstance(name, str) for name in static):
        raise TypeError("static_args must be a name or a tuple of names")
    signature = inspect.signature(inner_factory)
    unknown = [n for n in static if n not in signature.parameters]
    if unknown:
        raise ValueError(f"static_args: {unknown} are not arguments of {inner_factory.__name__}")

    def wrapped(*args: Any, **kwargs: Any) -> GradientTransformation:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        fixed, numeric, schedules = [], [], []
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise TypeError(
                    f"inject_hyperparams: {inner_factory.__name__} takes *args/**kwargs"
                )
            if name in static or isinstance(value, bool):
                fixed.append((name, _hashable(value)))
            elif isinstance(value, float):
                numeric.append((name, value))
            elif callable(value) and not isinstance(value, GradientTransformation):
                schedules.append((name, value))
            else:
                fixed.append((name, _hashable(value)))
        spec = InjectSpec(inner_factory, tuple(fixed), tuple(numeric), tuple(schedules))
        # Built once with the Python values: checks them now and gives the state's layout.
        probe = spec.build({**spec.initial(), **dict(spec.schedules)})
        return _injected(spec, probe)

    wrapped.__name__ = f"inject_hyperparams({getattr(inner_factory, '__name__', 'factory')})"
    wrapped.__doc__ = inner_factory.__doc__
    return wrapped


def _injected(spec: InjectSpec, probe: GradientTransformation) -> GradientTransformation:
    del probe  # its construction checked the values

    def values(state_hp: dict[str, torch.Tensor], count: torch.Tensor) -> dict[str, torch.Tensor]:
        hp = dict(state_hp)
        for name, schedule in spec.schedules:
            hp[name] = schedule(count).to(torch.float32)
        return hp

    def init(params: PyTree) -> InjectHyperparamsState:
        leaves = tree_flatten(params)[0]
        device = leaves[0].device if leaves else None
        count = torch.zeros((), dtype=torch.int32, device=device)
        hp = {
            name: torch.full((), value, dtype=torch.float32, device=device)
            for name, value in spec.numeric
        }
        hp = values(hp, count)
        return InjectHyperparamsState(count, hp, spec.build(hp).init(params))

    def update(updates: PyTree, state: InjectHyperparamsState, params: PyTree | None = None):
        if not isinstance(state, InjectHyperparamsState):
            raise TypeError(f"state must be an InjectHyperparamsState, got {type(state).__name__}")
        missing = {n for n, _ in (*spec.numeric, *spec.schedules)} - set(state.hyperparams)
        if missing:
            raise KeyError(f"state.hyperparams lacks {sorted(missing)}")
        hp = values(state.hyperparams, state.count)
        new, inner_state = spec.build(hp).update(updates, state.inner_state, params)
        return new, InjectHyperparamsState(saturating_increment(state.count), hp, inner_state)

    return GradientTransformation(init, update, spec)
