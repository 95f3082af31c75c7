"""Pytree plumbing shared by every module: one namespace, readable leaf paths.

The library's own containers (:class:`~functional_fp16.FP16State` and the loss
scales) are registered with ``optree`` under :data:`NAMESPACE`, so that their
static configuration stays out of the leaves. Every tree operation inside the
library goes through the helpers here so that the namespace is never forgotten.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree

from functional_fp16._util.cache import remember

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
    _TRACED_NODES[cls] = (flatten, unflatten)
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
    return _traced_flatten(tree)


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    if not torch.compiler.is_compiling():
        found = _known_flatten(tree)
        if found is not None:
            return found[0]
        return optree.tree_leaves(tree, namespace=NAMESPACE)
    return _traced_flatten(tree)[0]


class _Unknown(Exception):
    """A node :func:`_known_flatten` leaves to ``optree``."""


class _Known(NamedTuple):
    """What the structure cache knows of one key."""

    spec: optree.PyTreeSpec  # optree's spec of every tree with this key
    order: tuple[int, ...]  # insertion-order positions of optree's leaves (() if the same)
    defaults: tuple[tuple[type, Any], ...]  # (class, its registry entry when learnt)


_PLAIN_LEAVES = frozenset({torch.Tensor, torch.nn.Parameter})
_STR = frozenset({str})
_STRUCTURES: dict[Any, _Known] = {}
_STRUCTURES_KEPT = 1024
_REGISTERED: set[type] = set()  # the library's own nodes (flattened by their registration)
_registry_entry = optree.register_pytree_node.get
# optree's registry entries for the kinds the cache flattens itself, as optree has them by
# default: tensors are leaves (no entry), a named tuple's children are its fields, a dict's
# children its values by sorted key. Registering a class (in this namespace or the global
# one) gives it another entry, and dict_insertion_ordered gives dict another.
_NAMED_TUPLE_DEFAULT = _registry_entry(collections.namedtuple)
_SORTED_DICT_DEFAULT = _registry_entry(dict)


def _proven(defaults: tuple[tuple[type, Any], ...]) -> bool:
    """Whether optree's registry still holds, for every class of ``defaults``, the entry
    it held when the key was learnt (about 0.3 us a class)."""
    for cls, entry in defaults:
        if _registry_entry(cls, namespace=NAMESPACE) is not entry:
            return False
    return True


def _known_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec] | None:
    """``optree.tree_flatten(tree)`` for a tree of node kinds it can prove, or ``None``.

    ``optree`` spends about 0.2 us per leaf (its registry lookups), which at
    hundreds of leaves is a large part of an update. Here a tree whose nodes
    are exactly ``dict`` (string keys, plain tensor values), ``tuple``,
    ``list``, named tuples and ``None`` is described by a key (each node's
    type, each leaf's type, each dict's keys in insertion order), its leaves
    gathered in insertion order, and the key looked up. The first time,
    ``optree`` flattens the tree and the key keeps its spec and the
    permutation to ``optree``'s order, read from ``optree``'s leaf paths.

    Those paths name the leaves the key describes only under ``optree``'s
    defaults: tensors are leaves, a named tuple's children are its fields in
    order, a dict's its values by key (sorted). So the key also keeps the
    registry entry of each class it relies on (the tensor types, ``dict``,
    its named tuples), and every hit asks ``optree.register_pytree_node.get``
    whether they still hold. A class registered in :data:`NAMESPACE` or the
    global one, before or after its first use, and ``dict`` under
    ``optree.dict_insertion_ordered`` fail that check: such a tree is
    flattened by ``optree``, and is never learnt. The library's own
    registered nodes go to ``optree`` always.
    """
    leaves: list[Any] = []
    try:
        key = _describe(tree, leaves)
    except _Unknown:
        return None
    known = _STRUCTURES.get(key)
    if known is None:
        known = _learn(tree, key, leaves)
        if known is None:
            return None
    elif not _proven(known.defaults):
        return None
    return (leaves if not known.order else list(map(leaves.__getitem__, known.order))), known.spec


def _describe(tree: PyTree, leaves: list[Any]) -> Any:
    """The key of ``tree``: a leaf's type, ``None``, or a tuple: ``(dict, keys, value
    types)`` or ``(node type, *children's keys)``; appends its leaves to ``leaves``."""
    kind = type(tree)
    if kind in _PLAIN_LEAVES:
        leaves.append(tree)
        return kind
    if kind is dict:
        values = list(tree.values())
        kinds = frozenset(map(type, values))
        # Keys of exactly ``str``: a str subclass or str enum member is equal to its
        # string (the same lookup key) but optree keeps it in the spec.
        if not kinds <= _PLAIN_LEAVES or not set(map(type, tree)) <= _STR:
            raise _Unknown
        leaves += values
        return (dict, tuple(tree), kinds)
    if tree is None:
        return None
    if kind is tuple or kind is list:
        return (kind, *[_describe(child, leaves) for child in tree])
    if issubclass(kind, tuple) and hasattr(kind, "_fields") and kind not in _REGISTERED:
        # optree reads a named tuple's slots, whatever its class's __iter__ does
        return (kind, *[_describe(child, leaves) for child in tuple.__iter__(tree)])
    raise _Unknown


def _learn(tree: PyTree, key: Any, leaves: list[Any]) -> _Known | None:
    """``optree``'s spec of ``tree`` and the permutation from ``leaves`` (insertion
    order) to its leaves, kept under ``key`` where optree's registry has its defaults for
    the key's classes; else ``None``, nothing kept.

    The permutation is read from optree's own leaf paths (each leaf's dict keys and
    indices), matched to the paths of ``leaves``, so it holds with one tensor at several
    places too; the leaves are then checked against optree's one by one.
    """
    classes: dict[type, Any] = {}
    _classes_of(key, classes)
    defaults = tuple(classes.items())
    if not _proven(defaults):
        return None
    found, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    paths: list[tuple[Any, ...]] = []
    _paths_of(key, (), paths)
    position = {path: i for i, path in enumerate(paths)}
    order = [position.get(path, -1) for path in spec.paths()]
    if (
        len(order) != len(leaves)
        or sorted(order) != list(range(len(leaves)))
        or any(leaves[i] is not x for i, x in zip(order, found))
    ):
        return None
    known = _Known(spec, () if order == sorted(order) else tuple(order), defaults)
    return remember(_STRUCTURES, key, known, _STRUCTURES_KEPT)


def _classes_of(key: Any, classes: dict[type, Any]) -> None:
    """Collects the classes of a key (tensor types, dicts, named tuples), each with the
    registry entry of optree's default for it."""
    if key is None:
        return
    if type(key) is not tuple:
        classes[key] = None  # a leaf
        return
    kind = key[0]
    if kind is dict:
        classes[dict] = _SORTED_DICT_DEFAULT
        classes.update(dict.fromkeys(key[2]))
        return
    if kind is not tuple and kind is not list:
        classes[kind] = _NAMED_TUPLE_DEFAULT
    for child in key[1:]:
        _classes_of(child, classes)


def _paths_of(key: Any, path: tuple[Any, ...], paths: list[tuple[Any, ...]]) -> None:
    """Appends the path of each described leaf, in insertion order, as optree writes
    paths: a dict's key, a sequence's or named tuple's index."""
    if key is None:
        return
    if type(key) is not tuple:
        paths.append(path)
    elif key[0] is dict:
        paths += [(*path, k) for k in key[1]]
    else:
        for i, child in enumerate(key[1:]):
            _paths_of(child, (*path, i), paths)


class TracedSpec(NamedTuple):
    """A tree's structure as :func:`tree_flatten` gives it while ``torch.compile`` traces.

    ``key`` describes every node: ``None``; a leaf (:data:`_LEAF`); ``(dict, sorted keys,
    *children by sorted key)``; ``(list or tuple or a named tuple's class, *children)``;
    ``(a library node's class, its static metadata, *children)``; ``orders`` holds each
    dict's keys in insertion order (the order :func:`tree_unflatten` rebuilds it in), in
    the walk's order. Two specs are equal exactly when ``optree``'s are (the same nodes,
    a dict's keys as a set); a tree with another kind of node keeps ``optree``'s spec.
    """

    key: Any
    num_leaves: int
    optree_spec: Any = None  # optree's spec, where the walk did not describe the tree
    orders: tuple = ()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TracedSpec)
            and self.key == other.key
            and self.optree_spec == other.optree_spec
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((self.key, self.optree_spec))


_LEAF = "*"
_TRACED_NODES: dict[type, tuple[Callable, Callable]] = {}  # register_node's (flatten, unflatten)


def _traced_flatten(tree: PyTree) -> tuple[list[Any], TracedSpec]:
    """``optree``'s leaves of ``tree``, and a :class:`TracedSpec`, by a walk that Dynamo
    traces in a few bytecodes a node.

    ``optree``'s functions are traced through Dynamo's polyfill, which builds a spec
    object per node and looks each node's class up in the registry: about a millisecond
    a leaf, half the tracing of an update. The walk knows the node kinds an update's
    trees hold, in ``optree``'s order (a dict's values by sorted key, a named tuple's
    fields, ``None`` an empty node); the registry is asked once per walk whether
    ``dict`` and each named tuple class still have ``optree``'s defaults (as
    :func:`_proven` asks eagerly). Any other node (or a dict with a key that is not a
    ``str``) leaves the tree to ``optree``.
    """
    leaves: list[Any] = []
    orders: list[tuple] = []
    try:
        key = _traced_describe(tree, leaves, {}, orders)
    except _Unknown:
        found, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
        return found, TracedSpec(None, len(found), spec)
    return leaves, TracedSpec(key, len(leaves), None, tuple(orders))


def _traced_default(cls: type, default: Any, checked: dict) -> None:
    """Raises :class:`_Unknown` where ``optree``'s registry holds another entry for ``cls``
    than ``default`` (asked once per class and walk)."""
    if cls not in checked:
        checked[cls] = _registry_entry(cls, namespace=NAMESPACE) is default
    if not checked[cls]:
        raise _Unknown


def _traced_describe(tree: PyTree, leaves: list[Any], checked: dict, orders: list) -> Any:
    kind = type(tree)
    if kind in _PLAIN_LEAVES or isinstance(tree, torch.Tensor):
        leaves.append(tree)
        return _LEAF
    if tree is None:
        return None
    if kind is dict:
        _traced_default(dict, _SORTED_DICT_DEFAULT, checked)
        keys = tuple(tree)
        for k in keys:
            if type(k) is not str:
                raise _Unknown
        orders.append(keys)
        order = tuple(sorted(keys))
        children = [_traced_describe(tree[k], leaves, checked, orders) for k in order]
        return (dict, order, *children)
    if kind is list or kind is tuple:
        return (kind, *[_traced_describe(child, leaves, checked, orders) for child in tree])
    if kind in _TRACED_NODES:
        children, metadata = _TRACED_NODES[kind][0](tree)
        return (kind, metadata, *[_traced_describe(c, leaves, checked, orders) for c in children])
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):
        _traced_default(kind, _NAMED_TUPLE_DEFAULT, checked)
        return (kind, *[_traced_describe(c, leaves, checked, orders) for c in tuple.__iter__(tree)])
    _traced_default(kind, None, checked)  # a leaf, unless registered as a node
    leaves.append(tree)
    return _LEAF


def _traced_build(key: Any, leaves: Any, orders: Any) -> PyTree:
    """The tree :func:`_traced_describe` described as ``key``, with the next of ``leaves``
    (and of ``orders``, each dict's keys in insertion order)."""
    if key is None:
        return None
    if key is _LEAF or key == _LEAF:
        return next(leaves)
    kind = key[0]
    if kind is dict:
        inserted = next(orders)
        by_key = {k: _traced_build(c, leaves, orders) for k, c in zip(key[1], key[2:])}
        return {k: by_key[k] for k in inserted}
    children = [
        _traced_build(c, leaves, orders) for c in key[(2 if kind in _TRACED_NODES else 1) :]
    ]
    if kind is list:
        return children
    if kind is tuple:
        return tuple(children)
    if kind in _TRACED_NODES:
        return _TRACED_NODES[kind][1](key[1], children)
    return kind(*children)


def tree_unflatten(spec: optree.PyTreeSpec | TracedSpec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of :func:`tree_flatten`."""
    if isinstance(spec, TracedSpec):
        if spec.optree_spec is not None:
            return optree.tree_unflatten(spec.optree_spec, leaves)
        return _traced_build(spec.key, iter(leaves), iter(spec.orders))
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
    if isinstance(spec, TracedSpec) and spec.optree_spec is None:
        return _traced_build(spec.key, iter(leaves), iter(spec.orders))
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
