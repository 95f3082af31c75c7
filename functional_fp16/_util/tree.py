"""Pytree plumbing shared by every module: one namespace, readable leaf paths.

The library's own containers (:class:`~functional_fp16.FP16State` and the loss
scales) are registered with ``optree`` under :data:`NAMESPACE`, so that their
static configuration stays out of the leaves. Every tree operation inside the
library goes through the helpers here so that the namespace is never forgotten.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_LAYOUT = operator.attrgetter("layout")

NAMESPACE = "functional_fp16"
"""The ``optree`` namespace under which the library's containers are registered."""

PyTree = Any


def register_node(
    cls: type,
    flatten: Callable[[Any], tuple[tuple[Any, ...], Any]],
    unflatten: Callable[[Any, Sequence[Any]], Any],
    fields: Callable[[Any], tuple[str, ...]],
) -> None:
    """Registers one of the library's containers with ``optree`` and ``torch.utils._pytree``.

    ``flatten(obj) -> (children, metadata)`` splits it into its tensor
    children and its static configuration; ``unflatten(metadata, children)``
    rebuilds it; ``fields(obj)`` names the children (attribute names, used in
    leaf paths). With both registrations, the library's own tree functions
    (namespace :data:`NAMESPACE`) and torch's (``torch.func.vmap``,
    ``torch.compile``, ``torch.utils._pytree``) see the same children.
    """
    _REGISTERED.add(cls)
    optree.register_pytree_node(
        cls,
        lambda obj: (*flatten(obj), fields(obj)),
        unflatten,
        path_entry_type=optree.GetAttrEntry,
        namespace=NAMESPACE,
    )

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], Any]:
        children, metadata = flatten(obj)
        keys = [torch_pytree.GetAttrKey(name) for name in fields(obj)]
        return list(zip(keys, children, strict=True)), metadata

    torch_pytree.register_pytree_node(
        cls,
        lambda obj: (list(flatten(obj)[0]), flatten(obj)[1]),
        lambda children, metadata: unflatten(metadata, list(children)),
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )


def tree_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flattens ``tree`` (``None`` is an empty subtree, as in optax).

    The answer is ``optree``'s. For the trees an update sees on every call
    (dicts of tensors keyed by strings, inside tuples and named tuples) the
    structure is read in bulk and looked up (see :func:`_known_flatten`).
    """
    if not torch.compiler.is_compiling():
        found = _known_flatten(tree)
        if found is not None:
            return found
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    if not torch.compiler.is_compiling():
        found = _known_flatten(tree)
        if found is not None:
            return found[0]
    return optree.tree_leaves(tree, namespace=NAMESPACE)


class _Unknown(Exception):
    """A node :func:`_known_flatten` leaves to ``optree``."""


_PLAIN_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter})
_STR = frozenset({str})
_STRUCTURES: dict[Any, tuple[optree.PyTreeSpec, tuple[int, ...]] | None] = {}
_STRUCTURES_KEPT = 1024
_REGISTERED: set[type] = set()  # the library's own nodes (flattened by their registration)


def _known_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec] | None:
    """``optree.tree_flatten(tree)`` for a tree of known node kinds, or ``None``.

    ``optree`` spends about 0.2 us per leaf (its registry lookups), which at
    hundreds of leaves is a large part of an update. Here a tree whose nodes
    are ``dict`` (string keys, plain tensor values), ``tuple``, ``list``,
    named tuples and ``None`` is described by a key (each node's type, each
    dict's keys in insertion order), its leaves gathered in insertion order,
    and the key looked up: the first time, ``optree`` flattens the tree and
    the key keeps its spec and the permutation to ``optree``'s order (sorted
    keys), checked leaf by leaf; a tree ``optree`` orders another way is
    never looked up again. Two trees with one key have the same node types
    and keys, so ``optree`` gives them the same spec.
    """
    leaves: list[Any] = []
    try:
        key = _describe(tree, leaves)
    except _Unknown:
        return None
    hit = _STRUCTURES.get(key, False)
    if hit is False:
        hit = _learn(tree, key, leaves)
    if hit is None:
        return None
    spec, order = hit
    return (leaves if not order else list(map(leaves.__getitem__, order))), spec


def _describe(tree: PyTree, leaves: list[Any]) -> Any:
    kind = type(tree)
    if kind in _PLAIN_LEAVES:
        leaves.append(tree)
        return 0
    if kind is dict:
        values = list(tree.values())
        # Keys of exactly ``str``: a str subclass or str enum member is equal to its
        # string (the same lookup key) but optree keeps it in the spec.
        if not set(map(type, values)) <= _PLAIN_LEAVES or not set(map(type, tree)) <= _STR:
            raise _Unknown
        leaves += values
        return (dict, tuple(tree))
    if tree is None:
        return None
    if (
        kind is tuple
        or kind is list
        or (issubclass(kind, tuple) and hasattr(kind, "_fields") and kind not in _REGISTERED)
    ):
        return (kind, *[_describe(child, leaves) for child in tree])
    raise _Unknown


def _learn(tree: PyTree, key: Any, leaves: list[Any]):
    """``optree``'s spec of ``tree`` and the permutation from ``leaves`` (insertion
    order) to its leaves (each dict's keys sorted), checked against ``optree``."""
    found, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    order: list[int] = []
    try:
        _sorted_order(key, order)
    except TypeError:  # keys that do not sort: optree keeps insertion order
        order = None
    if order is not None and (
        len(order) != len(found) or any(leaves[i] is not x for i, x in zip(order, found))
    ):
        order = None
    hit = None if order is None else (spec, () if order == sorted(order) else tuple(order))
    if len(_STRUCTURES) >= _STRUCTURES_KEPT:
        del _STRUCTURES[next(iter(_STRUCTURES))]
    _STRUCTURES[key] = hit
    return hit


def _sorted_order(key: Any, order: list[int]) -> None:
    """Appends to ``order`` the insertion-order positions of the described leaves in
    ``optree``'s order (raises ``TypeError`` for a dict whose keys are not all strings)."""
    if key is None:
        return
    if key == 0:
        order.append(len(order))
        return
    if key[0] is not dict:
        for child in key[1:]:
            _sorted_order(child, order)
        return
    keys = key[1]
    if not all(type(k) is str for k in keys):
        raise TypeError("not string keys")
    start = len(order)
    order += [start + i for i in sorted(range(len(keys)), key=keys.__getitem__)]


def tree_unflatten(spec: optree.PyTreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of :func:`tree_flatten`."""
    return optree.tree_unflatten(spec, leaves)


def tree_rebuild(spec: optree.PyTreeSpec, like: PyTree, leaves: Sequence[Any]) -> PyTree:
    """``tree_unflatten(spec, leaves)`` where ``spec`` is ``like``'s structure, in a form
    ``torch.compile`` traces.

    Eager, this is ``optree``'s unflatten. While Dynamo traces, its ``optree``
    polyfill cannot rebuild a ``dict`` (torch 2.14), so the tree is rebuilt
    with ``torch.utils._pytree``, which Dynamo traces: ``like``'s leaves are
    matched to the library's order by flattening, with ``optree``, a tree of
    their ``torch.utils._pytree`` positions (where torch counts ``None`` as a
    leaf and the library does not, the ``None`` stays).
    """
    if not torch.compiler.is_compiling():
        return optree.tree_unflatten(spec, leaves)
    t_leaves, t_spec = torch_pytree.tree_flatten(like)
    index = torch_pytree.tree_unflatten(
        [None if x is None else i for i, x in enumerate(t_leaves)], t_spec
    )
    out: list[Any] = [None] * len(t_leaves)
    for i, position in enumerate(optree.tree_leaves(index, namespace=NAMESPACE)):
        out[position] = leaves[i]
    return torch_pytree.tree_unflatten(out, t_spec)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``optree.tree_map`` in the library's namespace."""
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_select(flag: torch.Tensor, new: PyTree, old: PyTree) -> PyTree:
    """``where(flag, new, old)`` leaf by leaf (a 0-d bool ``flag``; bitwise either side)."""
    return tree_map(lambda n, o: torch.where(flag, n, o), new, old)


def tree_paths(tree: PyTree) -> list[str]:
    """Human-readable paths (``['conv1']['weight']``, ``[0].bias``) of every leaf."""
    accessors = optree.tree_accessors(tree, namespace=NAMESPACE)
    return [format_path(a) for a in accessors]


def dotted_paths(tree: PyTree) -> list[str]:
    """Every leaf's path as its keys, indices and field names joined by dots
    (``h.3.mlp.c_fc.weight``; a flat dict's key as it is); ``""`` for the root."""
    return [
        ".".join(str(_step_name(e)) for e in accessor)
        for accessor in optree.tree_accessors(tree, namespace=NAMESPACE)
    ]


def _step_name(entry: Any) -> Any:
    """One path step's name: a NamedTuple's or a dataclass's field, an attribute, else the
    key or index."""
    for attr in ("field", "name"):
        value = getattr(entry, attr, None)
        if isinstance(value, str):
            return value
    return entry.entry


def format_path(accessor: optree.PyTreeAccessor) -> str:
    """Formats an ``optree`` accessor as Python indexing syntax, ``<root>`` for the root."""
    return accessor.codify("") or "<root>"


def child_steps(node: PyTree) -> list[str]:
    """The path step from ``node`` to each of its children (``.field``, ``[0]``, ``['key']``).

    Written as :func:`tree_paths` writes them, from the node's own ``optree``
    accessors, so a path built step by step reads like one built at once.
    """
    steps = optree.tree_structure(node, namespace=NAMESPACE).one_level().accessors()
    return [step.codify("") for step in steps]


def describe_tensor(x: Any) -> str:
    """A short description used in error messages: dtype, shape and device."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return (
        f"{type(x).__name__} {x!r}" if not isinstance(x, (list, tuple, dict)) else type(x).__name__
    )


def check_same_structure(
    reference: PyTree, other: PyTree, *, name: str, reference_name: str
) -> list[Any]:
    """Checks that ``other`` has ``reference``'s tree structure; returns its leaves.

    Leaves are returned in ``reference``'s flattening order. Raises ``ValueError``
    naming both structures when they differ.
    """
    ref_spec = optree.tree_structure(reference, namespace=NAMESPACE)
    try:
        return ref_spec.flatten_up_to(other)
    except (ValueError, TypeError) as err:
        other_spec = optree.tree_structure(other, namespace=NAMESPACE)
        where = first_difference(reference, other)
        at = ""
        if where is not None:
            at = f" at {name}{where[0]} ({where[1]})" if where[0] != "<root>" else f" ({where[1]})"
        raise ValueError(
            f"{name} has a different tree structure than {reference_name}{at}: "
            f"expected {ref_spec}, got {other_spec} ({err})"
        ) from None


def first_difference(reference: PyTree, other: PyTree, path: str = "") -> tuple[str, str] | None:
    """The path of the first node where ``other``'s structure departs from ``reference``'s.

    Returns ``(path, what differs)``, or ``None`` when ``reference``'s
    structure is a prefix of ``other``'s (a leaf of ``reference`` matches any
    subtree). Used only to explain errors, never in the hot path.
    """
    if optree.tree_is_leaf(reference, namespace=NAMESPACE):
        return None
    shown = path or "<root>"
    if optree.tree_is_leaf(other, namespace=NAMESPACE) and other is not None:
        return shown, f"expected a {type(reference).__name__}, got {describe_tensor(other)}"
    if type(reference) is not type(other):
        return shown, f"expected a {type(reference).__name__}, got a {type(other).__name__}"
    ref = optree.tree_flatten_one_level(reference, namespace=NAMESPACE)
    oth = optree.tree_flatten_one_level(other, namespace=NAMESPACE)
    if isinstance(reference, dict):
        missing = [k for k in reference if k not in other]
        extra = [k for k in other if k not in reference]
        if missing or extra:
            return shown, f"missing keys {missing}, unexpected keys {extra}"
    if len(ref.children) != len(oth.children):
        return shown, f"expected length {len(ref.children)}, got {len(oth.children)}"
    for step, a, b in zip(child_steps(reference), ref.children, oth.children, strict=True):
        found = first_difference(a, b, path + step)
        if found is not None:
            return found
    if ref.metadata != oth.metadata:
        return shown, f"static metadata differs: expected {ref.metadata!r}, got {oth.metadata!r}"
    return None


def check_like(
    reference: PyTree,
    other: PyTree,
    *,
    name: str,
    reference_name: str,
    check_dtype: bool = True,
    check_device: bool = True,
) -> list[torch.Tensor]:
    """Checks that ``other`` matches ``reference`` leaf by leaf.

    Structure, tensor-ness, shape, layout, dtype (unless ``check_dtype`` is
    false) and device (unless ``check_device`` is false) must agree. The error
    names the path of the first offending leaf. Returns the leaves of ``other``
    in flattening order. Only metadata is read, never tensor values, so the
    check never synchronises with the device.

    The common case, nothing wrong, costs one flatten of each tree and one
    comparison per leaf; leaf paths are built only to report an error.
    """
    ref_leaves, ref_spec = tree_flatten(reference)
    leaves, spec = tree_flatten(other)
    if torch.compiler.is_compiling():  # Dynamo traces no attrgetter: leaf by leaf
        fast = spec == ref_spec and all(
            type(x) is torch.Tensor  # noqa: E721 - subclasses take the slow, thorough path
            and x.shape == r.shape
            and (x.dtype == r.dtype or not check_dtype)
            and (x.device == r.device or not check_device)
            and x.layout == r.layout
            for x, r in zip(leaves, ref_leaves)
        )
        if fast:
            return leaves
    elif (
        spec == ref_spec
        and all(type(x) is torch.Tensor for x in leaves)  # noqa: E721 - subclasses: thorough path
        and list(map(torch.Tensor.size, leaves)) == list(map(torch.Tensor.size, ref_leaves))
        and (not check_dtype or list(map(_DTYPE, leaves)) == list(map(_DTYPE, ref_leaves)))
        and (not check_device or list(map(_DEVICE, leaves)) == list(map(_DEVICE, ref_leaves)))
        and set(map(_LAYOUT, leaves)) <= {torch.strided}
        and set(map(_LAYOUT, ref_leaves)) <= {torch.strided}
    ):
        return leaves
    leaves = check_same_structure(reference, other, name=name, reference_name=reference_name)
    ref_leaves = tree_leaves(reference)
    paths = tree_paths(reference)
    for path, ref, leaf in zip(paths, ref_leaves, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{name}{path}: expected a tensor, got {describe_tensor(leaf)}")
        if leaf.shape != ref.shape:
            raise ValueError(
                f"{name}{path}: shape {tuple(leaf.shape)} does not match "
                f"{reference_name}{path} shape {tuple(ref.shape)}"
            )
        if check_dtype and leaf.dtype != ref.dtype:
            raise TypeError(
                f"{name}{path}: dtype {leaf.dtype} does not match "
                f"{reference_name}{path} dtype {ref.dtype}"
            )
        if check_device and leaf.device != ref.device:
            raise ValueError(
                f"{name}{path}: device {leaf.device} does not match "
                f"{reference_name}{path} device {ref.device}"
            )
        if leaf.layout != ref.layout:
            raise TypeError(
                f"{name}{path}: layout {leaf.layout} does not match "
                f"{reference_name}{path} layout {ref.layout} (sparse tensors are not supported)"
            )
    return leaves
