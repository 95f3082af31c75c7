"""Whether a state's parts belong together: the state compared, as a whole, with what it must be.

An :class:`~functional_fp16.FP16State` can be assembled by hand
(``state.replace``, ``tree_unflatten``, a migration written for another
layout), so every update first compares the state with its *template*, the
state its ``tx`` and parameters imply:

* ``master`` has the tree structure of ``params`` and float32 leaves of their
  shapes (for a sharded state, the rank's pieces: ``master_shapes``);
* ``opt_state`` has exactly the structure, leaf dtypes and leaf shapes of
  ``tx.init(master)``;
* the loss scale's tensors are 0-d, of their declared dtypes (a float32
  scale, int32 counters);
* ``step`` is a 0-d int32 tensor and ``grads_finite`` a 0-d bool tensor;
* every tensor lives on the parameters' device.

The template is built from ``meta`` tensors (``tx.init`` allocates nothing),
once per configuration. A state that matches is remembered by its
*signature*, the tree structure (with ``tx`` and the loss scale's settings in
its static metadata) and every leaf's shape, dtype and device; the check of a
state seen before costs one flatten and one set lookup, whatever the number
of leaves. A refusal is a ``TypeError`` (wrong dtype or kind) or
``ValueError`` (wrong structure, shape or device) naming the part and the
leaf path; nothing is computed and the inputs are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from functional_fp16._tree import (
    describe_tensor,
    first_difference,
    tree_flatten,
    tree_paths,
)
from functional_fp16.base import GradientTransformation
from functional_fp16.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from functional_fp16.update.state import FP16State, check_params

__all__ = ["check_state"]

_FIELDS = ("params", "master", "opt_state", "loss_scale", "step", "grads_finite")
_KNOWN_SCALES = (DynamicLossScale, StaticLossScale, NoOpLossScale)
_META = torch.device("meta")
_CACHE_SIZE = 256

_good: dict[Any, None] = {}  # signatures of states that matched their template (insertion order)


def _signature(state: FP16State, master_shapes) -> Any:
    """A hashable key of the state's structure and leaf metadata (shapes, strides,
    dtypes, devices); ``None`` if it has none."""
    leaves, spec = tree_flatten(state)
    try:
        key = (
            spec,
            master_shapes,
            tuple([(x.shape, x.stride(), x.dtype, x.device) for x in leaves]),
        )
        hash(key)
    except (AttributeError, TypeError):  # a non-tensor leaf, or unhashable static metadata
        return None
    return key


def check_state(
    state: FP16State, *, master_shapes: Sequence[tuple[int, ...]] | None = None
) -> None:
    r"""Refuses a state whose parts do not belong together (see the module docstring).

    .. math:: \text{opt\_state} \simeq \text{tx.init}(\text{master}), \quad
        \text{master} \simeq \operatorname{fl}_{32}(\text{params}),

    where :math:`\simeq` means the same tree structure and, leaf by leaf, the
    same dtype, shape and device. Reads metadata only, never a value.

    Args:
      state: the state to check.
      master_shapes: the shapes of the master leaves, in flattening order,
        when they are not the parameters' (a sharded state's pieces).

    Returns:
      The state's signature: a hashable value of its static metadata alone
      (what :func:`~functional_fp16.update.dispatch.route` caches its answer
      by), or ``None`` where there is none (while ``torch.compile`` traces, or
      for unhashable static configuration).

    Raises:
      TypeError: a leaf of the wrong kind or dtype.
      ValueError: a part of another structure, a leaf of the wrong shape or
        on another device. Both name the part and the leaf path.
    """
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _signature(state, master_shapes)
    if key is not None and key in _good:
        return key
    _compare(state, _template(state, master_shapes))
    if key is not None:
        if len(_good) >= _CACHE_SIZE:
            del _good[next(iter(_good))]
        _good[key] = None
    return key


def _empty(shape, dtype, device=_META) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _template(state: FP16State, master_shapes) -> FP16State:
    """The state ``state.tx`` and ``state.params`` imply, with ``meta`` tensors for the rest."""
    if not isinstance(state.tx, GradientTransformation):
        raise TypeError(f"state.tx must be a GradientTransformation, got {type(state.tx).__name__}")
    if not isinstance(state.loss_scale, _KNOWN_SCALES):
        raise TypeError(
            "state.loss_scale must be a DynamicLossScale, StaticLossScale or NoOpLossScale, "
            f"got {type(state.loss_scale).__name__}"
        )
    params = check_params(state.params, name="state.params")
    device = params[0].device
    leaves, spec = tree_flatten(state.params)
    shapes = [tuple(p.shape) for p in params] if master_shapes is None else list(master_shapes)
    if len(shapes) != len(leaves):
        raise ValueError(
            f"master_shapes has {len(shapes)} shapes for {len(leaves)} parameter leaves"
        )
    # While torch.compile traces, tensors of the parameters' device (the traced
    # allocations have no use and are dropped from the graph); else ``meta``.
    where = device if torch.compiler.is_compiling() else _META
    master = spec.unflatten([_empty(s, torch.float32, where) for s in shapes])
    try:
        opt_state = state.tx.init(master)
    except Exception:  # a transform that needs real tensors: build them once per configuration
        opt_state = state.tx.init(
            spec.unflatten([_empty(s, torch.float32, device) for s in shapes])
        )
    scale = state.loss_scale
    tensors = [_empty((), dtype, where) for dtype in type(scale).TENSOR_DTYPES]
    scale = type(scale)._from_parts(scale.config(), tensors)
    return FP16State(
        params=state.params,
        master=master,
        opt_state=opt_state,
        loss_scale=scale,
        step=_empty((), torch.int32, where),
        grads_finite=_empty((), torch.bool, where),
        tx=state.tx,
        shard=state.shard,
    )


_WHAT = {
    "master": "float32 copies of params",
    "opt_state": "what tx.init(master) gives",
    "loss_scale": "the loss scale's declared tensors",
    "step": "a 0-d int32 tensor",
    "grads_finite": "a 0-d bool tensor",
}


def _compare(state: FP16State, template: FP16State) -> None:
    """Raises at the first part or leaf where ``state`` departs from ``template``."""
    device = tree_flatten(state.params)[0][0].device
    for field in _FIELDS[1:]:
        want, got = getattr(template, field), getattr(state, field)
        want_leaves, want_spec = tree_flatten(want)
        got_leaves, got_spec = tree_flatten(got)
        name = f"state.{field}"
        if got_spec != want_spec:
            where = first_difference(want, got)
            if where is None:  # a leaf of the template is a subtree here
                where = ("", f"expected structure {want_spec}, got {got_spec}")
            path = "" if where[0] == "<root>" else where[0]
            raise ValueError(f"{name}{path}: {where[1]}; {name} must be {_WHAT[field]}")
        for path, w, g in zip(tree_paths(want), want_leaves, got_leaves):
            if path == "<root>":
                path = ""
            if not isinstance(w, torch.Tensor):
                continue  # a non-tensor leaf of tx.init's: only its place is checked
            expected_device = device if w.device == _META else w.device
            expected = f"{w.dtype} tensor of shape {tuple(w.shape)} on {expected_device}"
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"{name}{path}: expected a {expected}, got {describe_tensor(g)}")
            if g.dtype != w.dtype:
                raise TypeError(
                    f"{name}{path}: dtype {g.dtype}, expected {w.dtype} ({_WHAT[field]})"
                )
            if g.shape != w.shape:
                raise ValueError(
                    f"{name}{path}: shape {tuple(g.shape)}, expected {tuple(w.shape)} "
                    f"({_WHAT[field]})"
                )
            if g.device != expected_device:
                raise ValueError(
                    f"{name}{path}: on {g.device}, expected {expected_device} "
                    "(every tensor of a state lives on the parameters' device)"
                )
            if g.layout != torch.strided:
                raise TypeError(f"{name}{path}: layout {g.layout}, expected a dense tensor")
