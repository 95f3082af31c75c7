"""Different transforms for different parameters: ``multi_transform`` and ``set_to_zero``.

``multi_transform(transforms, param_labels)`` gives every leaf (or subtree)
of the parameters a label and runs ``transforms[label]`` on the leaves that
carry it, as optax's ``multi_transform`` (``partition``) does::

    u_i <- transforms[label_i](u restricted to {j : label_j == label_i})_i

It is ``torch.optim``'s parameter groups written as transforms: a head with
its own learning rate, a group without weight decay, a frozen layer
(``set_to_zero()``). Each label's state is a
:class:`~functional_fp16.transforms.masking.MaskedState` over that label's leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import torch

from functional_fp16._util.tree import PyTree, tree_flatten, tree_map, tree_paths
from functional_fp16.transforms.base import (
    EmptyState,
    GradientTransformation,
    update_with_extra_args,
)
from functional_fp16.transforms.masking import MaskedState, is_mask_function, masked_transform

__all__ = ["MultiTransformState", "LabelsSpec", "multi_transform", "set_to_zero"]

Labels = PyTree | Callable[[PyTree], PyTree]
"""A tree of labels shaped like the parameters (or a prefix of them), or a function returning one."""


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`."""

    inner_states: dict[Hashable, MaskedState]  # per label: its transform's state, on its leaves


class LabelsSpec(NamedTuple):
    """Declared form of :func:`multi_transform`: the labels, their transforms' specs
    and the labels of the parameters (a tree, or a function returning one)."""

    labels: tuple[Hashable, ...]  # the labels, in the order of ``transforms``
    inner: tuple[Any, ...]  # each label's transform spec
    param_labels: PyTree | None  # fixed labels: a tree of labels
    label_fn: Callable[[PyTree], PyTree] | None  # labels from a function of the tree

    def resolve(self, tree: PyTree) -> PyTree:
        """The tree of labels for ``tree`` (a label function is called with it)."""
        return self.param_labels if self.label_fn is None else self.label_fn(tree)


def set_to_zero() -> GradientTransformation:
    r"""Replaces every update by zeros: the leaves it sees do not move.

    .. math:: u \leftarrow -0.0

    The zeros are negative zeros, the exact additive identity: :math:`p +
    (-0) = p` bitwise for every :math:`p`, :math:`-0.0` included (optax's
    ``set_to_zero`` gives :math:`+0.0`, which turns a :math:`-0.0` parameter
    into :math:`+0.0`). Used as the last transform of a label in
    :func:`multi_transform` to freeze parameters.

    Returns:
      A stateless :class:`~functional_fp16.GradientTransformation`; the zeros
      have the shapes and dtypes of the updates.
    """

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(updates: PyTree, state: EmptyState, params: PyTree | None = None):
        del params
        return tree_map(lambda u: torch.full_like(u, -0.0), updates), state

    return GradientTransformation(init, update)


def _check_labels(labels: PyTree, known: Mapping[Hashable, Any], *, name: str) -> None:
    """Every leaf of ``labels`` must be a key of ``known``; the error names the first that is not."""
    leaves = tree_flatten(labels)[0]
    try:
        if all(label in known for label in leaves):
            return
    except TypeError:  # an unhashable leaf; found below
        pass
    for path, label in zip(tree_paths(labels), leaves):
        shown = name if path == "<root>" else f"{name}{path}"
        try:
            ok = label in known
        except TypeError:
            raise TypeError(
                f"{shown}: a label must be hashable, got {type(label).__name__}"
            ) from None
        if not ok:
            raise ValueError(
                f"{shown}: label {label!r} has no transform; transforms has labels {list(known)}"
            )


def _per_label(
    transforms: dict[Hashable, GradientTransformation], labels: PyTree, *, name: str
) -> dict[Hashable, GradientTransformation]:
    """``masked(transforms[k], labels == k)`` for every label ``k``."""
    _check_labels(labels, transforms, name=name)
    return {
        k: masked_transform(tx, tree_map(lambda label, k=k: bool(label == k), labels), name=name)
        for k, tx in transforms.items()
    }


def multi_transform(
    transforms: Mapping[Hashable, GradientTransformation], param_labels: Labels
) -> GradientTransformation:
    r"""Runs a different transform on each labelled group of parameters.

    .. math::
        u'_i = \text{transforms}[\ell_i]\big(u|_{\{j:\, \ell_j = \ell_i\}}\big)_i

    where :math:`\ell_i` is the label of leaf :math:`i`. Each transform sees
    only the leaves of its label (the others are
    :class:`~functional_fp16.transforms.masking.MaskedNode`), as
    ``masked(transforms[k], labels == k)``; the groups are disjoint, so the
    order in which they run does not matter. As optax's ``multi_transform``.
    For example, ``torch.optim.SGD`` parameter groups with a faster head and a
    frozen embedding::

        labels = {"embed": "frozen", "body": "body", "head": "head"}
        tx = multi_transform(
            {"body": sgd(0.1, momentum=0.9), "head": sgd(1.0, momentum=0.9),
             "frozen": set_to_zero()},
            labels)

    Args:
      transforms: a mapping from labels to transformations. A label no
        parameter carries keeps no parameter-shaped tensors.
      param_labels: a tree of labels (hashable leaves, typically strings) with
        the tree structure of the parameters or a prefix of it (a label then
        covers the whole subtree below it); or a function of the parameters
        returning one, called with ``params`` by ``init`` and with ``updates``
        by ``update``.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`MultiTransformState`, one
      :class:`~functional_fp16.transforms.masking.MaskedState` per label. It
      declares :class:`LabelsSpec`: labels over fusable optimisers run as
      fused op calls, one per group of leaves with the same hyperparameters.

    Raises:
      TypeError: ``transforms`` is not a mapping of transformations, or a
        label is not hashable.
      ValueError: a label has no transform, or (from ``init``/``update``) the
        labels do not have the structure of the parameters; the error names
        the leaf's path.
    """
    if not isinstance(transforms, Mapping):
        raise TypeError(
            f"transforms must be a mapping from labels to GradientTransformations, "
            f"got {type(transforms).__name__}"
        )
    transforms = dict(transforms)
    for k, tx in transforms.items():
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"transforms[{k!r}] must be a GradientTransformation, got {type(tx).__name__}"
            )
    if param_labels is None:  # an empty tree: it would label no parameters
        raise TypeError(
            "param_labels must be a tree of labels or a function returning one, got None"
        )
    if is_mask_function(param_labels):
        label_fn = param_labels
        fixed = None
    else:
        label_fn = None
        fixed = _per_label(transforms, param_labels, name="param_labels")

    def groups(tree: PyTree, tree_name: str) -> dict[Hashable, GradientTransformation]:
        if label_fn is None:
            return fixed
        return _per_label(transforms, label_fn(tree), name=f"param_labels({tree_name})")

    def init(params: PyTree) -> MultiTransformState:
        return MultiTransformState(
            {k: tx.init(params) for k, tx in groups(params, "params").items()}
        )

    def update(
        updates: PyTree, state: MultiTransformState, params: PyTree | None = None, **extra_args
    ):
        if not isinstance(state, MultiTransformState) or set(state.inner_states) != set(transforms):
            got = (
                sorted(map(repr, state.inner_states))
                if isinstance(state, MultiTransformState)
                else type(state).__name__
            )
            raise ValueError(
                f"multi_transform: state must be a MultiTransformState with labels "
                f"{sorted(map(repr, transforms))}, got {got}"
            )
        new_states = {}
        for k, tx in groups(updates, "updates").items():
            updates, new_states[k] = update_with_extra_args(
                tx, updates, state.inner_states[k], params, **extra_args
            )
        return updates, MultiTransformState(new_states)

    spec = LabelsSpec(
        tuple(transforms),
        tuple(tx.spec for tx in transforms.values()),
        None if label_fn is not None else param_labels,
        label_fn,
    )
    return GradientTransformation(init, update, spec)
