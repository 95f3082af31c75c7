"""Whether a state's parts belong together: the state compared, as a whole, with what it must be.

An :class:`~functional_fp16.FP16State` can be assembled by hand
(``state.replace``, ``tree_unflatten``, a migration written for another
layout), so every update first compares the state with its *template*, the
state its ``tx`` and parameters imply:

* ``master`` has the tree structure of ``params`` and float32 leaves of their
  shapes (for a sharded state, checked as this rank's pieces), or, for a split
  master, ``int16`` residuals of their shapes beside float16 ``params``;
* ``opt_state`` has exactly the structure, leaf dtypes and leaf shapes of
  ``tx.init(master)``;
* the loss scale's tensors are 0-d, of their declared dtypes (a float32
  scale, int32 counters);
* ``step`` is a 0-d int32 tensor and ``grads_finite`` a 0-d bool tensor;
* ``leaf_finite`` is a 1-d bool tensor with one flag per leaf of ``params``;
* every tensor lives on the parameters' device;
* every tensor is dense, without gaps or overlapping elements.

The template is built from ``meta`` tensors (``tx.init`` allocates nothing),
once per configuration. A state that matches is remembered by its
*signature*: the tree structure (with ``tx`` and the loss scale's settings in
its static metadata) and every leaf's shape, strides, dtype and device. A
state seen before costs one flatten and one lookup (a few microseconds per
leaf, no template). A state that :func:`~functional_fp16.fp16_update`
returned carries the signature it was checked under, since an update keeps
every leaf's metadata, so checking it costs one attribute read whatever the
number of leaves. A refusal is a ``TypeError`` (wrong dtype or kind) or
``ValueError`` (wrong structure, shape or device) naming the part and the
leaf path; nothing is computed and the inputs are untouched.
"""

from __future__ import annotations

from typing import Any

import torch

from functional_fp16._fused.op_checks import first_overlap
from functional_fp16._util.cache import remember
from functional_fp16._util.layout import dense_without_overlap
from functional_fp16._util.tree import (
    describe_tensor,
    first_difference,
    tree_flatten,
    tree_paths,
    tree_rebuild,
)
from functional_fp16.precision.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from functional_fp16.precision.master_split import PARAM_DTYPE, RESIDUAL_DTYPE
from functional_fp16.precision.scale_stats import COUNTER_NAMES, ScaleStats
from functional_fp16.transforms.base import GradientTransformation
from functional_fp16.update.state import FP16State, check_params

__all__ = ["check_state"]

_FIELDS = FP16State.FIELDS
_KNOWN_SCALES = (DynamicLossScale, StaticLossScale, NoOpLossScale)
_META = torch.device("meta")
_CACHE_SIZE = 256

_good: dict[Any, Any] = {}  # signatures of states that matched their template, to themselves


class Signature:
    """A state's structure and leaf metadata as a dictionary key whose hash is computed once.

    ``value`` is ``(tree spec, ((shape, strides, dtype, device), ...))``; a
    tuple of that size would be hashed anew at every lookup.
    """

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Signature) and self._hash == other._hash and self.value == other.value
        )


def _signature(state: FP16State) -> Signature | None:
    """A hashable key of the state's structure and leaf metadata (shapes, strides,
    dtypes, devices); ``None`` if it has none."""
    leaves, spec = tree_flatten(state)
    try:
        return Signature((spec, tuple([_leaf_key(x) for x in leaves])))
    except (AttributeError, TypeError):  # a non-tensor leaf, or unhashable static metadata
        return None


def _leaf_key(x: torch.Tensor) -> tuple:
    """A leaf's metadata in a signature; a DTensor's mesh and placements too."""
    key = (type(x), x.shape, x.stride(), x.dtype, x.device)
    if type(x) is torch.Tensor:
        return key
    placements = getattr(x, "placements", None)
    return key if placements is None else (*key, x.device_mesh, placements)


def check_state(state: FP16State) -> Any:
    r"""Refuses a state whose parts do not belong together (see the module docstring).

    .. math:: \text{opt\_state} \simeq \text{tx.init}(\text{master}), \quad
        \text{master} \simeq \operatorname{fl}_{32}(\text{params}),

    where :math:`\simeq` means the same tree structure and, leaf by leaf, the
    same dtype, shape and device; every tensor is dense without overlapping
    elements. Reads metadata only, never a value. A state that
    :func:`~functional_fp16.fp16_update` returned carries the signature it
    was checked under (:func:`mark_checked`) and is not checked again.

    Args:
      state: the state to check (for a sharded state, this rank's pieces as
        a plain state: their ``params`` are the pieces).

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
    if not compiling and state._checked is not None:
        return state._checked
    key = None if compiling else _signature(state)
    # The first equal signature is returned, so that the caches keyed by it
    # find their entries by identity instead of comparing every leaf's metadata.
    known = None if key is None else _good.get(key)
    if known is not None:
        return known
    _compare(state, _template(state))
    if key is not None:
        remember(_good, key, key, _CACHE_SIZE)
    return key


def _empty(shape, dtype, device=_META) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def mark_checked(state: FP16State, signature: Any) -> FP16State:
    """Records on ``state`` (just made by the update) the signature it shares with its input.

    An update keeps every leaf's structure, shape, strides, dtype and device,
    so the state it returns has its input's signature
    (``tests/test_state_check.py`` holds every implementation to that). The
    state is returned for chaining; nothing is recorded while
    ``torch.compile`` traces or without a signature.
    """
    if signature is not None and not torch.compiler.is_compiling():
        object.__setattr__(state, "_checked", signature)
    return state


def _template(state: FP16State) -> FP16State:
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
    spec = tree_flatten(state.params)[1]
    shapes = [tuple(p.shape) for p in params]
    # While torch.compile traces, tensors of the parameters' device (the traced
    # allocations have no use and are dropped from the graph); else ``meta``.
    where = device if torch.compiler.is_compiling() else _META
    master = tree_rebuild(spec, state.params, [_empty(s, torch.float32, where) for s in shapes])
    kept = master
    if any(getattr(m, "dtype", None) == RESIDUAL_DTYPE for m in tree_flatten(state.master)[0]):
        for path, p in zip(tree_paths(state.params), params):
            if p.dtype != PARAM_DTYPE:
                raise TypeError(
                    f"state.params{path}: dtype {p.dtype}; a split master (int16 residuals in "
                    "state.master) needs float16 params"
                )
        kept = tree_rebuild(spec, state.params, [_empty(s, RESIDUAL_DTYPE, where) for s in shapes])
    try:
        opt_state = state.tx.init(master)
    except Exception:  # a transform that needs real tensors: build them once per configuration
        opt_state = state.tx.init(
            tree_rebuild(spec, state.params, [_empty(s, torch.float32, device) for s in shapes])
        )
    scale = state.loss_scale
    tensors = [_empty((), dtype, where) for dtype in type(scale).TENSOR_DTYPES]
    scale = type(scale)._from_parts(scale.config(), tensors)
    return FP16State(
        params=state.params,
        master=kept,
        opt_state=opt_state,
        loss_scale=scale,
        step=_empty((), torch.int32, where),
        grads_finite=_empty((), torch.bool, where),
        scale_stats=ScaleStats(*(_empty((), torch.int32, where) for _ in COUNTER_NAMES)),
        leaf_finite=_empty((len(params),), torch.bool, where),
        tx=state.tx,
    )


_WHAT = {
    "master": "float32 copies of params (or, split, int16 residuals of float16 params)",
    "opt_state": "what tx.init(master) gives",
    "loss_scale": "the loss scale's declared tensors",
    "step": "a 0-d int32 tensor",
    "grads_finite": "a 0-d bool tensor",
    "scale_stats": "a ScaleStats of 0-d int32 tensors",
    "leaf_finite": "a 1-d bool tensor, one flag per leaf of params",
}


def _compare(state: FP16State, template: FP16State) -> None:
    """Raises at the first part or leaf where ``state`` departs from ``template``.

    Each tree is flattened once; a leaf's path is found only for the message of a
    refusal (paths cost more than the comparison, and ``torch.compile`` traces both).
    """
    params = tree_flatten(state.params)[0]
    device = params[0].device
    for i, p in enumerate(params):
        if not dense_without_overlap(p):
            raise ValueError(
                f"state.params{_path(state.params, i)}: strides {p.stride()} for shape "
                f"{tuple(p.shape)} leave gaps or overlap elements; a state tensor must be "
                "dense (e.g. .contiguous())"
            )
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
        for i, (w, g) in enumerate(zip(want_leaves, got_leaves)):
            if not isinstance(w, torch.Tensor):
                continue  # a non-tensor leaf of tx.init's: only its place is checked
            expected_device = device if w.device == _META else w.device
            if (
                isinstance(g, torch.Tensor)
                and g.dtype == w.dtype
                and g.shape == w.shape
                and g.device == expected_device
                and g.layout == torch.strided
                and dense_without_overlap(g)
            ):
                continue
            _refuse(name, field, _path(want, i), w, g, expected_device)


def _path(tree: Any, i: int) -> str:
    """The path of leaf ``i`` of ``tree`` as a message shows it (the root: empty)."""
    path = tree_paths(tree)[i]
    return "" if path == "<root>" else path


def _refuse(name: str, field: str, path: str, w, g, expected_device) -> None:
    """Raises for the state leaf ``g`` at ``name + path``, which is not like ``w``."""
    expected = f"{w.dtype} tensor of shape {tuple(w.shape)} on {expected_device}"
    if not isinstance(g, torch.Tensor):
        raise TypeError(f"{name}{path}: expected a {expected}, got {describe_tensor(g)}")
    if g.dtype != w.dtype:
        raise TypeError(f"{name}{path}: dtype {g.dtype}, expected {w.dtype} ({_WHAT[field]})")
    if g.shape != w.shape:
        raise ValueError(
            f"{name}{path}: shape {tuple(g.shape)}, expected {tuple(w.shape)} ({_WHAT[field]})"
        )
    if g.device != expected_device:
        raise ValueError(
            f"{name}{path}: on {g.device}, expected {expected_device} "
            "(every tensor of a state lives on the parameters' device)"
        )
    if g.layout != torch.strided:
        raise TypeError(f"{name}{path}: layout {g.layout}, expected a dense tensor")
    raise ValueError(
        f"{name}{path}: strides {g.stride()} for shape {tuple(g.shape)} leave gaps "
        "or overlap elements; a state tensor must be dense (e.g. .contiguous())"
    )


def check_disjoint(state: FP16State, grads: list[torch.Tensor]) -> None:
    """Refuses to donate a state whose tensors share memory with each other or the gradients.

    A donated update writes the new values into the state's tensors, so two
    leaves over the same bytes would be written twice. A working copy that
    *is* its master (a float32 working copy) is one tensor, not two. The
    tensors are dense (:func:`check_state`), so each covers
    ``[data_ptr, data_ptr + nbytes)``.
    """
    masters = tree_flatten(state.master)[0]
    leaves, paths = [], []
    for path, x in zip(tree_paths(state), tree_flatten(state)[0]):
        if isinstance(x, torch.Tensor) and not (
            path.startswith(".params") and any(x is m for m in masters)
        ):
            leaves.append(x)
            paths.append(f"state{path}")
    leaves += grads
    paths += [f"grads[{i}]" for i in range(len(grads))]
    found = first_overlap(leaves)
    if found is not None:
        raise ValueError(
            f"{paths[found[0]]} and {paths[found[1]]} share memory; a donated update writes "
            "the state in place (pass separate tensors, or donate=False)"
        )
