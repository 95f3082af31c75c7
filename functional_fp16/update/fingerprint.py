"""Fingerprints of a configuration, and the ranks' agreement on one before they communicate.

A collective that the ranks enter with different arguments (another tree, a
shape, a dtype, a bucket size, an optimiser) does not fail: it waits until the
timeout, or pairs up buffers that mean different things. So the library's
collectives first agree on a description of what every rank is about to do.

* :func:`describe_tree` lists ``(path, description)`` entries, in flattening
  order: every node's type; the static configuration of the library's nodes
  (an :class:`~functional_fp16.FP16State`'s ``tx.spec`` and shard layout, a
  loss scale's settings); and every leaf's dtype, shape and device type. The
  pieces of a sharded state (its ``master`` and ``opt_state``) are described
  by dtype and device alone, since their lengths differ from rank to rank;
  the layout's world size and leaf sizes stand for them.
* :func:`describe_static` describes a static value (a ``tx.spec``, a
  schedule) without memory addresses: numbers by ``repr``, containers and
  NamedTuples field by field, functions by qualified name and the values they
  close over.
* :func:`agree` all-gathers a SHA-256 digest of the entries, one small
  collective. Only when the digests differ are the entries themselves gathered,
  to name the first rank that differs from rank 0 and the first entry where it
  does; every rank then raises the same ``ValueError``.
* :func:`agree_once` agrees once per configuration: a cheap local key (tree
  structures and leaf metadata, hashed by value) is remembered per process
  group, so later calls with the same configuration cost a dictionary lookup
  and no communication. A rank that changes its configuration while the
  others keep theirs is therefore caught only if it is the first use of that
  configuration on every rank.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import inspect
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import optree
import torch
import torch.distributed as dist

from functional_fp16._util.dtensors import is_dtensor
from functional_fp16._util.tree import NAMESPACE, PyTree, child_steps
from functional_fp16.transforms.base import GradientTransformation
from functional_fp16.update.mesh_reduce import describe_mesh
from functional_fp16.update.state import FP16State

ProcessGroup = Any  # a ``torch.distributed.ProcessGroup``, or ``None`` for the default group

__all__ = ["describe_tree", "describe_static", "agree", "agree_once"]

Entries = list[tuple[str, str]]

_MAX_DEPTH = 12  # nesting followed inside a static value
_MAX_ENTRIES = 10_000  # entries one static value contributes at most
_SMALL_TENSOR = 16  # a static tensor of at most this many elements is described by value
_REMEMBERED = 256  # agreed configurations kept per process group
_BUILTIN_NODES = (
    dict,
    list,
    tuple,
    collections.OrderedDict,
    collections.defaultdict,
    collections.deque,
    type(None),
)


def _type_name(x: Any) -> str:
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _callable_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def describe_static(value: Any, path: str = "") -> Entries:
    """``(path, description)`` entries for a static value, with no memory addresses in them.

    Numbers, strings, ``None``, enums and dtypes by ``repr``; tensors by dtype
    and shape (and values, up to 16 elements); tuples, lists, dicts (in key
    order), NamedTuples and dataclasses item by item; a
    :class:`~functional_fp16.GradientTransformation` by its ``spec`` alone
    (``init`` and ``update`` are code); a function by its qualified name and,
    one entry each, the values it closes over (a schedule's hyperparameters);
    ``functools.partial`` by function, arguments and keywords; anything else
    by its type. Cycles and nesting deeper than 12 levels end in an entry
    that says so; one value gives at most 10,000 entries.
    """
    out: Entries = []
    _static(value, path, out, 0, set())
    return out


def _static(value: Any, path: str, out: Entries, depth: int, active: set[int]) -> None:
    if len(out) >= _MAX_ENTRIES:
        return
    if isinstance(value, (bool, int, float, complex, str, bytes, type(None), enum.Enum)):
        out.append((path, repr(value)))
        return
    if isinstance(value, torch.dtype):
        out.append((path, str(value)))
        return
    if isinstance(value, torch.device):
        out.append((path, f"device {value.type}"))
        return
    if isinstance(value, torch.Tensor):
        desc = f"{value.dtype} tensor of shape {tuple(value.shape)}"
        if value.numel() <= _SMALL_TENSOR and not value.is_meta:
            desc += f" {value.detach().cpu().tolist()}"
        out.append((path, desc))
        return
    if depth > _MAX_DEPTH or id(value) in active:
        out.append((path, f"{_type_name(value)} (not compared further)"))
        return
    active.add(id(value))
    try:
        _composite(value, path, out, depth + 1, active)
    finally:
        active.discard(id(value))


def _composite(value: Any, path: str, out: Entries, depth: int, active: set[int]) -> None:
    if isinstance(value, GradientTransformation):
        out.append((path, "GradientTransformation"))
        _static(value.spec, f"{path}.spec", out, depth, active)
    elif optree.is_namedtuple(value):
        out.append((path, _type_name(value)))
        for field in value._fields:
            _static(getattr(value, field), f"{path}.{field}", out, depth, active)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.append((path, _type_name(value)))
        for field in dataclasses.fields(value):
            _static(getattr(value, field.name, None), f"{path}.{field.name}", out, depth, active)
    elif isinstance(value, (tuple, list)):
        out.append((path, f"{_type_name(value)} of {len(value)}"))
        for i, item in enumerate(value):
            _static(item, f"{path}[{i}]", out, depth, active)
    elif isinstance(value, dict):
        out.append((path, f"{_type_name(value)} of {len(value)}"))
        for key in sorted(value, key=repr):
            _static(value[key], f"{path}[{key!r}]", out, depth, active)
    elif isinstance(value, functools.partial):
        out.append((path, "functools.partial"))
        _static(value.func, f"{path}.func", out, depth, active)
        _static(value.args, f"{path}.args", out, depth, active)
        _static(dict(value.keywords), f"{path}.keywords", out, depth, active)
    elif inspect.isfunction(value):
        out.append((path, f"function {_callable_name(value)}"))
        cells = value.__closure__ or ()
        for name, cell in zip(value.__code__.co_freevars, cells, strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:  # a cell not yet filled
                out.append((f"{path}(closure {name})", "<empty>"))
                continue
            _static(contents, f"{path}(closure {name})", out, depth, active)
    elif isinstance(value, type) or callable(value):
        out.append((path, f"callable {_callable_name(value)}"))
    else:
        out.append((path, f"{_type_name(value)} object"))


def describe_leaf(x: Any) -> str:
    """A leaf's description: ``a float32 tensor of shape (3, 4) on cpu``, ``an int``; a DTensor's
    global shape, placements and mesh (``a float16 DTensor of shape (8, 4) on cpu,
    (Shard(dim=0),) on a mesh ('dp',) of shape (2,) over ranks [0, 1]``: see
    :func:`~functional_fp16.update.mesh_reduce.describe_mesh`), what every rank holds alike."""
    if is_dtensor(x):
        return (
            f"a {x.dtype} DTensor of shape {tuple(x.shape)} on {x.device.type}, "
            f"{tuple(x.placements)} on {describe_mesh(x.device_mesh)}"
        )
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device.type}"
    name = type(x).__name__
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _is_builtin(node: Any) -> bool:
    return type(node) in _BUILTIN_NODES or optree.is_namedtuple(node) or optree.is_structseq(node)


def describe_tree(tree: PyTree, *, leaves: bool = True, tx: bool = True) -> Entries:
    """``(path, description)`` for every node and leaf of ``tree`` (see the module docstring).

    Args:
      tree: any pytree of the library's namespace.
      leaves: include the leaves (else only the nodes and their static configuration).
      tx: include every ``FP16State``'s ``tx`` (its ``spec``).

    Returns:
      The entries in flattening order; paths as :func:`~functional_fp16._util.tree.tree_paths`
      writes them (``""`` for the root).
    """
    out: Entries = []
    stack: list[tuple[Any, str]] = [(tree, "")]
    while stack:
        node, path = stack.pop()
        if optree.tree_is_leaf(node, namespace=NAMESPACE):
            if leaves:
                out.append((path, describe_leaf(node)))
            continue
        children, meta, _, _ = optree.tree_flatten_one_level(node, namespace=NAMESPACE)
        name = type(node).__qualname__
        out.append((path, f"{'an' if name[:1] in 'AEIOUaeiou' else 'a'} {name}"))
        if isinstance(node, FP16State):
            if tx:
                out.extend(describe_static(node.tx, f"{path}.tx"))
        elif not _is_builtin(node) and meta is not None:
            if optree.is_namedtuple(meta):
                for field in meta._fields:
                    out.extend(describe_static(getattr(meta, field), f"{path}.{field}"))
            else:
                out.extend(describe_static(meta, f"{path}<static>"))
        steps = child_steps(node)
        for child, step in reversed(list(zip(children, steps, strict=True))):
            stack.append((child, path + step))
    return out


def first_difference(name: str, ref: Entries, ref_rank: int, other: Entries, rank: int) -> str:
    """The first entry where ``other`` (rank ``rank``) differs from ``ref`` (rank ``ref_rank``), in words.

    A path is shown after ``name`` (``state.params['w']``), except the entries
    of arguments and the world size, whose paths are words (``argument bucket_bytes``).
    """

    def label(path: str) -> str:
        return path if path.startswith(("argument ", "the ")) else f"{name}{path}"

    ref_paths, other_paths = {p for p, _ in ref}, {p for p, _ in other}
    for (p, d), (q, e) in zip(ref, other):
        if (p, d) == (q, e):
            continue
        if p == q:
            return f"{label(p)} is {d} on rank {ref_rank} but {e} on rank {rank}"
        if p not in other_paths:
            return f"{label(p)} ({d}) exists on rank {ref_rank} but not on rank {rank}"
        if q not in ref_paths:
            return f"{label(q)} ({e}) exists on rank {rank} but not on rank {ref_rank}"
        return (
            f"{name} flattens in a different order on rank {rank} than on rank {ref_rank} "
            f"({label(q)} where rank {ref_rank} has {label(p)})"
        )
    if len(ref) > len(other):
        p, d = ref[len(other)]
        return f"{label(p)} ({d}) exists on rank {ref_rank} but not on rank {rank}"
    if len(other) > len(ref):
        q, e = other[len(ref)]
        return f"{label(q)} ({e}) exists on rank {rank} but not on rank {ref_rank}"
    return f"{name} is described differently on rank {rank} than on rank {ref_rank}"


def describe_arguments(world: int, **arguments: Any) -> Entries:
    """Fingerprint entries for the world size and a call's arguments (``argument NAME``)."""
    out = [("the world size", str(world))]
    for key, value in arguments.items():
        out.extend(describe_static(value, f"argument {key}"))
    return out


def digest(entries: Entries) -> str:
    """SHA-256 (hex) of the entries."""
    return hashlib.sha256(repr(entries).encode("utf-8", "backslashreplace")).hexdigest()


def _groups(groups) -> list:
    return list(groups) if isinstance(groups, (list, tuple)) else [groups]


def gather_everywhere(obj: Any, groups) -> list[tuple[int, Any]]:
    """``(global rank, obj)`` of every rank that the process groups ``groups`` span together,
    on every one of them, ordered by rank: one ``all_gather_object`` over each group in
    turn (the ranks of a mesh, gathered over each of its dimensions, span all of it)."""
    items = [(dist.get_rank(), obj)]
    for group in _groups(groups):
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, items, group=group)
        items = [item for part in parts for item in part]
    return sorted(items, key=lambda item: item[0])


def agree(entries: Entries, groups, *, name: str, what: str) -> None:
    """Raises on every rank unless every rank of ``groups`` passes the same ``entries``.

    ``groups``: one process group (``None``: the default group), or a list of
    groups whose ranks, gathered over each in turn, span every rank concerned
    (a mesh's dimensions). Gathers a 64-character digest (one
    ``all_gather_object`` per group); on a difference the entries themselves,
    so that the error can name the first rank that differs from the lowest
    one and the first entry where it does: ``"<what>: <name><path> is <this>
    on rank 0 but <that> on rank 2"`` (global ranks).

    Raises:
      ValueError: on every rank, with the same message, if the entries differ.
    """
    digests = gather_everywhere(digest(entries), groups)
    if all(d == digests[0][1] for _, d in digests):
        return
    gathered = gather_everywhere(entries, groups)
    first, ref = gathered[0]
    rank, other = next((r, e) for (r, e), (_, d) in zip(gathered, digests) if d != digests[0][1])
    raise ValueError(f"{what}: " + first_difference(name, ref, first, other, rank))


_AGREED: weakref.WeakKeyDictionary[Any, collections.OrderedDict[Hashable, None]] = (
    weakref.WeakKeyDictionary()
)


def agree_once(
    key: Hashable,
    describe: Callable[[], Entries],
    groups,
    *,
    name: str,
    what: str,
) -> None:
    """:func:`agree` on ``describe()``, once per ``key`` and process group(s).

    ``key`` is a local, hashable stand-in for the configuration (tree
    structures, leaf dtypes and shapes, arguments): equal keys must describe
    equal configurations. A key seen before in ``groups`` returns at once,
    with no communication; the last 256 keys are kept per (first) group, and a
    group's keys are dropped with the group (weakly referenced). An unhashable
    key falls back to the digest of ``describe()``, computed locally on every
    call.
    """
    listed = _groups(groups)
    pg = dist.group.WORLD if listed[0] is None else listed[0]
    key = (len(listed), key)
    seen = _AGREED.get(pg)
    try:
        hash(key)
    except TypeError:  # unhashable metadata somewhere in the key
        key = None
    if key is not None and seen is not None and key in seen:
        return
    entries = describe()
    if key is None:
        key = ("digest", digest(entries))
        if seen is not None and key in seen:
            return
    agree(entries, groups, name=name, what=what)
    if seen is None:
        seen = _AGREED.setdefault(pg, collections.OrderedDict())
    seen[key] = None
    while len(seen) > _REMEMBERED:
        seen.popitem(last=False)


def leaf_key(leaves: list[Any]) -> tuple[Any, ...]:
    """A hashable key for leaves: ``(dtype, shape, device)`` of a tensor, the type of anything else."""
    return tuple(
        (x.dtype, x.shape, x.device) if isinstance(x, torch.Tensor) else type(x) for x in leaves
    )
