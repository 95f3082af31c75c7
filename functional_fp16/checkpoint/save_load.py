"""Checkpoints: a pytree's leaves and structure, in one atomic, self-checking file.

``save_checkpoint(path, tree)`` stores any pytree the library can flatten (an
:class:`~functional_fp16.FP16State`, or dicts, lists, tuples and NamedTuples
holding states, loss scales, tensors, numbers, strings and ``None``).
``load_checkpoint(path, like)`` reads it back, checks it against the template
``like`` and rebuilds it with ``optree.tree_unflatten(tree_structure(like),
leaves)``: the registered node types rebuild themselves, and static
configuration that is not data (an ``FP16State``'s ``tx``) comes from ``like``.

File format (version 2): one ``torch.save`` of a dict made only of tensors,
numbers, strings, lists and dicts, so ``torch.load(path, weights_only=True)``
opens it without running pickled code::

    {
      "format": "functional_fp16.checkpoint",
      "version": 2,
      "structure": NODE,              # the tree's optree structure, see below
      "leaves": [LEAF, ...],          # one per optree leaf (dicts in insertion order)
      "tensors": [Tensor, ...],       # the tensor leaves' data: on CPU, compact
      "checksum": "<sha256 hex>",     # over everything above, tensor bytes included
    }

A ``LEAF`` is ``{"path": "['state'].master['w']", "tensor": i, "dtype":
"torch.float32", "shape": [3, 4], "device": "cuda:0"}`` or ``{"path": ...,
"value": v}`` with ``v`` a bool, int, float or str. A ``NODE`` is ``{"leaf":
i}`` or ``{"type": "FP16State", "kind": "CUSTOM", "entries": [...],
"children": [NODE, ...]}``: the class name, optree's node kind, the child
keys (dict keys, field names or indices), and, for a registered node whose
static metadata is plain data (a loss scale's configuration), ``"meta"``.

Tensors are stored bitwise and come back detached, each with storage of its
own, whatever the pickled tensor records say about autograd or sharing. The
checksum covers the format, version, structure, leaf table, and every
tensor's dtype, shape and bytes: everything a load restores.

Writes are atomic (:mod:`functional_fp16.checkpoint.atomic_file`). A tree nests at most
:data:`MAX_DEPTH` levels deep. A long string that the tree holds in several
places is stored at each of them, so that what the file stands for is
proportional to its size (the bound of step 4 below).

Loading opens the file once (a file renamed over ``path`` meanwhile is not
read) and checks, in order, never walking anything recursively or writing
anything out before its size and depth are known to be bounded by the
file's size:

1. the zip container, before ``torch.load`` reads it: records stored
   uncompressed, adding up to no more than the file;
2. the pickle's opcodes, before ``torch.load`` runs them: it refers to
   nothing but the tensor rebuild functions, storage classes, dtypes and
   ``collections.OrderedDict``, calls nothing but a tensor's rebuild (a view
   of a storage read from a record, which allocates nothing) and an empty
   ``OrderedDict()``, and each storage it declares has exactly its record's
   size (:mod:`functional_fp16.checkpoint.archive`);
3. the file opens with ``weights_only=True`` (else it is truncated or not
   ours);
4. what it holds is a tree (no shared or cyclic nodes) of dicts, lists,
   plain values and tensors, no deeper than a saved tree can be, with no
   more objects than its pickle has bytes and no more text than 16
   characters per byte of pickle plus 1 MiB, counting a shared string or
   number at each reference to it (the checksum's ``repr`` writes it out at
   each); tensors only in the tensor table, each dense, on CPU, owning
   exactly its bytes, shared with no other;
5. the format marker and version, the checksum;
6. the tables: well-formed nodes, unique keys, each leaf record and each
   tensor used once, records that agree with their tensors, no stored device
   ``meta``;
7. with ``like``: the structure, class names, keys, static configuration,
   tensor shapes and dtypes and value types.

The checksum finds damage; it proves nothing about who wrote the file, since
anyone who can write the file can compute it. That is why steps 1, 2, 4 and
6 hold for files whose checksum is right. Each failure is a
:class:`CheckpointError` that names the file and the path, with control
characters escaped. A stored device is used only if neither ``like`` nor
``map_location`` gives one, and only if this torch build has it. Files of
format version 1 load through :mod:`functional_fp16.checkpoint._v1`. The
reading side is :mod:`functional_fp16.checkpoint._read`.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from functional_fp16._util.dtensors import is_dtensor
from functional_fp16._util.tree import NAMESPACE, PyTree, describe_tensor, tree_leaves, tree_paths
from functional_fp16.checkpoint import _read
from functional_fp16.checkpoint.atomic_file import (
    PathLike,
    atomic_torch_save,
    remove_stale_temporaries,
)
from functional_fp16.checkpoint.format import (
    FORMAT,
    KEYS,
    MAX_DEPTH,
    TEXT_PER_PICKLE_BYTE,
    VALUES,
    VERSION,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    checksum,
    node_kind,
    one_level,
    plain_meta,
    text_cost,
)
from functional_fp16.precision.master_split import valid_residuals
from functional_fp16.update import FP16State
from functional_fp16.update.master import master_form

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "atomic_torch_save",
    "remove_stale_temporaries",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "FORMAT",
    "VERSION",
    "MAX_DEPTH",
]

# -- saving ---------------------------------------------------------------------


def _stored(x: Any) -> Any:
    """``x``, or for a long str a copy of its own, which the pickle stores again.

    A pickle refers to a str it has stored in a few bytes, but a load charges
    each reference what ``repr`` writes for the str (see
    :func:`~functional_fp16.checkpoint.format.check_objects`), so a long str
    held in many places is stored in each.
    """
    if type(x) is str and text_cost(x) > 2 * TEXT_PER_PICKLE_BYTE:
        return x[:1] + x[1:]  # a new object: both halves are non-empty
    return x


class _Writer:
    def __init__(self) -> None:
        self.leaves: list[dict[str, Any]] = []
        self.tensors: list[torch.Tensor] = []
        self.storages: set[int] = set()

    def leaf(self, x: Any, path: str) -> dict[str, Any]:
        shown = path or "<root>"
        if type(x) in VALUES:
            self.leaves.append({"path": shown, "value": _stored(x)})
        elif isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_meta or x.is_quantized:
                raise TypeError(f"tree{path}: cannot store {describe_tensor(x)} ({x.layout})")
            data = x.detach().resolve_conj().resolve_neg().to("cpu")
            compact = (
                data.is_contiguous()
                and data.storage_offset() == 0
                and data.untyped_storage().nbytes() == data.numel() * data.element_size()
            )
            if not compact or data.untyped_storage().data_ptr() in self.storages:
                # A view would drag its whole storage into the file; a storage
                # shared by two leaves is stored twice, as two values.
                data = data.clone(memory_format=torch.contiguous_format)
            self.storages.add(data.untyped_storage().data_ptr())
            self.leaves.append(
                {
                    "path": shown,
                    "tensor": len(self.tensors),
                    "dtype": str(data.dtype),
                    "shape": list(data.shape),
                    "device": str(x.device),
                }
            )
            self.tensors.append(data)
        else:
            raise TypeError(
                f"tree{path}: cannot store {describe_tensor(x)}; a checkpoint holds pytrees "
                "(dicts, lists, tuples, NamedTuples, the library's states) of tensors, "
                "bool, int, float, str and None"
            )
        return {"leaf": len(self.leaves) - 1}

    def node(self, tree: Any, path: str, depth: int = 0) -> dict[str, Any]:
        if depth > MAX_DEPTH:
            raise ValueError(
                f"tree{path}: nested deeper than {MAX_DEPTH} levels, more than a checkpoint holds"
            )
        if optree.tree_is_leaf(tree, namespace=NAMESPACE):
            return self.leaf(tree, path)
        if isinstance(tree, FP16State) and any(
            is_dtensor(x) for x in optree.tree_leaves(tree, namespace=NAMESPACE)
        ):
            raise TypeError(
                f"tree{path} holds DTensors (a sharded or FSDP2 state): save it with "
                "functional_fp16.distributed.save_dcp_state on every rank (each writes its "
                "shards), or with save_checkpoint_rank0, which gathers a sharded state first"
            )
        children, meta, entries, steps = one_level(tree)
        if isinstance(tree, dict):
            for key in entries:
                if type(key) not in KEYS:
                    raise TypeError(
                        f"tree{path}: dict key {key!r} of type {type(key).__name__} cannot be "
                        "stored; use str, int, float, bool or None keys"
                    )
            # Stored in insertion order, so a plain load gives the dict back as it was.
            order = [entries.index(k) for k in tree]
            children, entries, steps = ([xs[i] for i in order] for xs in (children, entries, steps))
        node = {
            "type": _stored(type(tree).__name__),
            "kind": node_kind(tree),
            "entries": [_stored(k) for k in entries],
        }
        plain = plain_meta(tree, meta)
        if plain is not None:
            node["meta"] = {k: _stored(v) for k, v in plain.items()}
        node["children"] = [
            self.node(child, path + step, depth + 1)
            for child, step in zip(children, steps, strict=True)
        ]
        return node


def save_checkpoint(path: PathLike, tree: PyTree) -> None:
    """Writes ``tree`` to ``path`` atomically, in the documented plain format.

    Args:
      path: the file to write; its directory must exist. An existing file is
        replaced only once the new one is completely on disk.
      tree: an :class:`~functional_fp16.FP16State`, or any pytree (dicts with
        str, int, float, bool or None keys, lists, tuples, NamedTuples, the
        library's states and loss scales) of tensors, bool, int, float, str
        and None.

    Raises:
      TypeError: a part of ``tree`` cannot be stored; the message names its path.
      ValueError: ``tree`` nests deeper than :data:`MAX_DEPTH` levels.
    """
    writer = _Writer()
    structure = writer.node(tree, "")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "structure": structure,
        "leaves": writer.leaves,
        "tensors": writer.tensors,
        "checksum": checksum((FORMAT, VERSION, structure, writer.leaves), writer.tensors),
    }
    atomic_torch_save(path, payload)


# -- loading --------------------------------------------------------------------


def load_checkpoint(
    path: PathLike, like: PyTree | None = None, *, map_location: Any = None
) -> PyTree:
    """Reads a checkpoint written by :func:`save_checkpoint` and verifies it.

    The file is opened once. Its zip container and pickle are checked before
    ``torch.load(weights_only=True)`` reads that same handle, what it returns
    is checked before the checksum is computed, and the checksum and tables
    are verified before anything is returned: a forged file is refused before
    it can make the load allocate, walk or write out more than the file's
    size allows (see the module's description).

    With ``like`` (a template tree, e.g. a freshly ``fp16_init``-ed state, or the
    whole ``{"state": ..., "epoch": 0, ...}`` dict) the checkpoint must have the
    template's structure: class names, dict keys and fields, static
    configuration (a loss scale's), tensor shapes and dtypes, and value types.
    The result is ``optree.tree_unflatten(tree_structure(like), leaves)``: built
    in the template's types, every :class:`~functional_fp16.FP16State` with the
    template's ``tx``, each tensor on the device of the template's tensor at the
    same path.

    Without ``like`` the plain structure comes back: dicts, lists, tuples and
    ``None`` as themselves, and every other node (an ``FP16State``, a loss
    scale, a NamedTuple) as a dict of its children keyed by field; tensors on
    the device they were saved from.

    Args:
      path: the file (or an open binary file object, read from where it is).
      like: the template, or ``None``.
      map_location: if given, every tensor goes to this device instead.

    Returns:
      The stored tree. Every tensor is detached and owns its storage.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      CheckpointCorruptError: the file is truncated, modified after writing,
        forged (its checksum proves nothing: see the module's description of
        what is checked, before anything large is allocated, walked or written
        out), or not a checkpoint of this library. Messages name the file and
        show what it holds with control characters escaped.
      CheckpointError: a tensor's stored device is to be used (no ``like``, no
        ``map_location``) and this torch build lacks it, or it cannot be placed.
      CheckpointMismatchError: the file differs from ``like``; the message names
        the path and what differs.
      TypeError: ``like`` holds something that cannot be a template (its path is named).

    A state with a split master (``fp16_init(..., master="split")``) is checked once
    loaded: every residual must be one that splitting its master makes beside its param
    (:func:`~functional_fp16.precision.master_split.valid_residuals`), else
    ``CheckpointCorruptError`` names the leaf.
    """
    tree = _read.load(path, like, map_location)
    check_split_masters(path, tree)
    return tree


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if is_dtensor(x) else x


def check_split_masters(path: Any, tree: PyTree) -> None:
    """Refuses a loaded state whose split master's residuals do not fit its params
    (``CheckpointCorruptError`` naming the leaf; DTensors checked on this rank's shards)."""
    states = optree.tree_leaves(
        tree, is_leaf=lambda x: isinstance(x, FP16State), namespace=NAMESPACE
    )
    for state in states:
        if not isinstance(state, FP16State) or master_form(state) != "split":
            continue
        params, residuals = tree_leaves(state.params), tree_leaves(state.master)
        for where, p, q in zip(tree_paths(state.params), params, residuals):
            fits = (
                p.dtype == torch.float16
                and p.shape == q.shape
                and bool(valid_residuals(_local(p).detach().cpu(), _local(q).detach().cpu()))
            )
            if not fits:
                raise CheckpointCorruptError(
                    f"{path}: state.master{where}: residuals that do not fit their params "
                    f"(params{where}: {p.dtype} of shape {tuple(p.shape)}); not a split master "
                    "this library wrote"
                )
