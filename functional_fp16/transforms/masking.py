"""Applying a transform to part of the parameters: ``masked``, as optax's ``masked``.

``masked(inner, mask)`` runs ``inner`` on the leaves (or subtrees) where the
mask is ``True`` and passes the other updates through unchanged::

    u_i <- inner(u)_i   if mask_i
    u_i <- u_i          otherwise

The inner transform sees the masked-out parts replaced by :class:`MaskedNode`,
a container with no leaves, so its state holds tensors for the masked-in
leaves only and stays a pytree of tensors: ``fp16_update`` can select between
an old and a new state leaf by leaf, and checkpoints store and rebuild it like
any other state.

The mask is static configuration: Python bools, read on the host, never a
tensor. It is a tree with the structure of the parameters or a prefix of it
(a ``bool`` standing for a whole subtree), or a function of the parameters
returning one (called with ``params`` by ``init`` and with ``updates`` by
``update``, as optax calls it).

A masked transform declares :class:`MaskedSpec` (its inner transform's spec
and the mask), so a chain of declared transforms stays declared with a mask
inside: ``fp16_update`` resolves the mask once per tree structure into static
groups of leaves and runs the fused op (``update_path`` says ``"fused"``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree

from functional_fp16._util.tree import (
    NAMESPACE,
    PyTree,
    describe_tensor,
    first_difference,
    tree_flatten,
    tree_leaves,
    tree_paths,
    tree_unflatten,
)
from functional_fp16.transforms.base import GradientTransformation, update_with_extra_args

__all__ = ["MaskedNode", "MaskedState", "MaskedSpec", "Mask", "masked"]

Mask = PyTree | Callable[[PyTree], PyTree]
"""A tree of bools shaped like the parameters (or a prefix of them), or a function returning one."""


class MaskedNode(NamedTuple):
    """Stands in for a masked-out subtree: a container without leaves (optax's ``MaskedNode``)."""


class MaskedState(NamedTuple):
    """State of :func:`masked`."""

    inner_state: Any  # the inner transform's state; MaskedNode() where the mask is False


class MaskedSpec(NamedTuple):
    """Declared form of :func:`masked`: the inner transform's spec and the mask.

    A fixed mask is held as given (a tree of bools, ``mask``); a mask function
    as ``mask_fn`` (then ``mask`` is ``None``).
    """

    inner: Any  # the inner transform's spec (None: undeclared)
    mask: PyTree | None  # a fixed mask: a tree of bools (a prefix of the parameters' tree)
    mask_fn: Callable[[PyTree], PyTree] | None  # a mask function, called with the tree

    def resolve(self, tree: PyTree) -> PyTree:
        """The mask, a tree of bools, for ``tree`` (a mask function is called with it)."""
        return self.mask if self.mask_fn is None else self.mask_fn(tree)


def is_mask_function(mask: Any) -> bool:
    """Whether ``mask`` is a function to call rather than a tree (a callable *leaf*).

    A callable container registered as a pytree node (a module-like object)
    is a tree, as optax treats it.
    """
    return callable(mask) and optree.tree_is_leaf(mask, namespace=NAMESPACE)


def check_mask(mask: PyTree, *, name: str) -> tuple[list[bool], optree.PyTreeSpec]:
    """The mask's leaves and structure, after checking that every leaf is a Python bool.

    Raises ``TypeError`` naming the path of the first leaf that is not one.
    """
    flags, spec = tree_flatten(mask)
    if all(type(f) is bool for f in flags):
        return flags, spec
    for path, flag in zip(tree_paths(mask), flags):
        if type(flag) is not bool:
            suffix = "" if path == "<root>" else path
            raise TypeError(
                f"{name}{suffix}: expected a Python bool (True: transform this leaf or "
                f"subtree), got {describe_tensor(flag)}"
            )
    raise AssertionError("unreachable")


def split_by(
    spec: optree.PyTreeSpec, mask: PyTree, tree: PyTree, *, name: str, tree_name: str
) -> list[Any]:
    """``tree``'s subtrees at the leaves of ``spec`` (the mask's structure), in order.

    Raises ``ValueError`` naming the first path where ``tree`` does not have
    the mask's structure (the mask may stop above ``tree``'s leaves, not below).
    """
    try:
        return spec.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        # Explained from the structures alone: optree's own message prints tensors.
        where = first_difference(mask, tree)
        if where is None:
            detail = str(err)[:300]
        else:
            path = "" if where[0] == "<root>" else where[0]
            detail = f"{tree_name}{path} against {name}{path}: {where[1]}"
        raise ValueError(
            f"{name} does not fit {tree_name} (it must have the tree structure of "
            f"{tree_name}, or a prefix of it): {detail}"
        ) from None


@functools.lru_cache(maxsize=256)
def leaf_positions(
    spec: optree.PyTreeSpec, tree_spec: optree.PyTreeSpec
) -> tuple[tuple[int, ...], ...]:
    """For each leaf of the mask structure ``spec``, the indices of the leaves below it
    in the flattening order of a tree of structure ``tree_spec`` (cached per pair)."""
    index = tree_unflatten(tree_spec, list(range(tree_spec.num_leaves)))
    return tuple(tuple(tree_leaves(part)) for part in spec.flatten_up_to(index))


def hidden_in_trace(mask: PyTree, tree: PyTree) -> PyTree:
    """``tree`` with the subtrees under false leaves of ``mask`` replaced by :class:`MaskedNode`,
    in a form ``torch.compile`` traces (``torch.utils._pytree``; Dynamo's ``optree``
    polyfill cannot flatten a ``dict`` of Python constants in torch 2.14)."""
    if not all(type(f) is bool for f in torch_pytree.tree_leaves(mask)):
        raise TypeError("mask: expected a tree of Python bools")
    return torch_pytree.tree_map(lambda keep, part: part if keep else MaskedNode(), mask, tree)


def masked_transform(
    inner: GradientTransformation, mask: Mask, *, name: str
) -> GradientTransformation:
    """:func:`masked`, with ``name`` for ``mask`` in error messages (``param_labels`` in
    :func:`~functional_fp16.multi_transform`)."""
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"inner must be a GradientTransformation, got {type(inner).__name__}")
    if mask is None:  # an empty tree: it would fit no parameters but None
        raise TypeError(f"{name} must be a tree of bools or a function returning one, got None")
    if is_mask_function(mask):
        mask_fn = mask
        fixed = None
    else:
        mask_fn = None
        fixed = check_mask(mask, name=name)

    def resolve(tree: PyTree, tree_name: str) -> tuple[list[bool], optree.PyTreeSpec, PyTree, str]:
        if mask_fn is None:
            return (*fixed, mask, name)
        shown = f"{name}({tree_name})"
        tree_mask = mask_fn(tree)
        return (*check_mask(tree_mask, name=shown), tree_mask, shown)

    def hide(flags: list[bool], parts: list[Any]) -> list[Any]:
        return [part if keep else MaskedNode() for keep, part in zip(flags, parts)]

    def init(params: PyTree) -> MaskedState:
        if torch.compiler.is_compiling():  # traced by the whole-state check's template
            tree_mask = mask if mask_fn is None else mask_fn(params)
            return MaskedState(inner_state=inner.init(hidden_in_trace(tree_mask, params)))
        flags, spec, tree_mask, shown = resolve(params, "params")
        parts = split_by(spec, tree_mask, params, name=shown, tree_name="params")
        return MaskedState(inner_state=inner.init(tree_unflatten(spec, hide(flags, parts))))

    def update(updates: PyTree, state: MaskedState, params: PyTree | None = None, **extra_args):
        if not isinstance(state, MaskedState):
            raise TypeError(f"masked: state must be a MaskedState, got {type(state).__name__}")
        if torch.compiler.is_compiling():  # the mask as hidden_in_trace can trace it
            tree_mask = mask if mask_fn is None else mask_fn(updates)
            hidden = None if params is None else hidden_in_trace(tree_mask, params)
            new, inner_state = update_with_extra_args(
                inner, hidden_in_trace(tree_mask, updates), state.inner_state, hidden,
                **extra_args,
            )  # fmt: skip
            merged = torch_pytree.tree_map(
                lambda keep, n, u: n if keep else u, tree_mask, new, updates
            )
            return merged, MaskedState(inner_state=inner_state)
        flags, spec, tree_mask, shown = resolve(updates, "updates")
        u_parts = split_by(spec, tree_mask, updates, name=shown, tree_name="updates")
        hidden_params = None
        if params is not None:
            p_parts = split_by(spec, tree_mask, params, name=shown, tree_name="params")
            hidden_params = tree_unflatten(spec, hide(flags, p_parts))
        new, inner_state = update_with_extra_args(
            inner,
            tree_unflatten(spec, hide(flags, u_parts)),
            state.inner_state,
            hidden_params,
            **extra_args,
        )
        n_parts = split_by(spec, tree_mask, new, name=shown, tree_name="the inner updates")
        # Written back into the updates' own structure (not the mask's: a dict
        # mask fits an OrderedDict, whose leaves come in another order).
        u_leaves, u_spec = tree_flatten(updates)
        out = list(u_leaves)
        for keep, where, part in zip(flags, leaf_positions(spec, u_spec), n_parts):
            if keep:
                leaves = tree_leaves(part)
                if len(leaves) != len(where):
                    raise ValueError(
                        f"masked: the inner transform returned {len(leaves)} leaves for a part "
                        f"of the updates with {len(where)}"
                    )
                for i, leaf in zip(where, leaves):
                    out[i] = leaf
        return tree_unflatten(u_spec, out), MaskedState(inner_state=inner_state)

    return GradientTransformation(init, update, MaskedSpec(inner.spec, mask, mask_fn))


def masked(inner: GradientTransformation, mask: Mask) -> GradientTransformation:
    r"""Applies ``inner`` where ``mask`` is ``True``; passes the other updates through.

    .. math::
        u'_i = \begin{cases} \text{inner}(u|_M)_i & i \in M \\ u_i & i \notin M \end{cases}

    where :math:`M` is the set of masked-in leaves and :math:`u|_M` the updates
    with every other leaf (or subtree) replaced by :class:`MaskedNode`. The
    inner transform sees only :math:`u|_M` and :math:`p|_M`; its state holds
    tensors for the masked-in leaves only (``MaskedNode()`` elsewhere). The
    masked-out updates come back as the very tensors that went in. As
    optax's ``masked``; for example, weight decay on everything but the biases::

        mask = lambda p: tree_map(lambda x: x.ndim > 1, p)
        tx = chain(masked(add_decayed_weights(1e-4), mask), sgd(0.1, momentum=0.9))

    (which is ``add_decayed_weights(1e-4, mask=mask)``). To leave leaves
    untouched altogether, give them zero updates: :func:`~functional_fp16.multi_transform`
    with :func:`~functional_fp16.set_to_zero`; a masked-out leaf here still
    receives the updates that other transforms in the chain produce.

    Args:
      inner: the transformation to apply to the masked-in leaves.
      mask: a tree of Python bools with the tree structure of the parameters,
        or a prefix of it (a bool then stands for the whole subtree below it);
        or a function of the parameters returning such a tree, called with
        ``params`` by ``init`` and with ``updates`` by ``update``. Static
        configuration: never a tensor.

    Returns:
      A :class:`~functional_fp16.GradientTransformation` with state
      :class:`MaskedState`. It declares :class:`MaskedSpec`: a chain of
      fusable transforms holding it runs the fused op, the mask resolved
      once per tree structure into groups of leaves (``update_path`` says
      ``"fused"``).

    Raises:
      TypeError: a leaf of the mask is not a bool (the error names its path).
      ValueError: (from ``init`` or ``update``) the mask does not have the
        structure of the parameters; the error names the first path where
        they differ.
    """
    return masked_transform(inner, mask, name="mask")
