"""How the Triton step kernels are launched: argument checks, leaf classes, tables, launches.

**Argument checks.** :class:`Checker` holds one call's arguments to the
declaration of its entry point (``signatures.py``, shared with the C kernel)
and names the culprit of a refusal, before anything is launched.

**Multi-tensor launches.** Leaf ``l`` of ``L`` belongs to group
``l // (L // G)``; per-group scalars are ``(G,)`` device tensors read by the
kernel by group index (no host read of any value). The non-empty leaves are
sorted into classes by what the kernel is compiled for (gradient dtype,
working-copy dtype, whether the working copy is the master, and whether all
of the leaf's addresses are 16-byte aligned), and each class runs as ONE
launch over all its leaves (:func:`classes`). For each class the host builds
an ``int64`` table: one row per leaf (the data address of each of its
tensors, its numel, its group) followed by one row per chunk of at most
``CHUNK`` elements (its leaf's row, its first element and, for the
statistics, its slot; :func:`chunk_rows`). All the classes' tables of a call
reach the device in one copy (:class:`Tables`): a pinned host tensor copied
with ``non_blocking=True`` (no host sync; PyTorch records the copy on the
pinned block, which is not reused before the copy has run). A copy made
while a CUDA graph is being captured is replayed from the same pinned
memory, so that memory (and the device table) is then kept for the life of
the process.

:func:`launch` compiles with ``enable_fp_fusion=False`` (only the kernels'
explicit ``tl.fma`` calls contract) and counts every launch in
:data:`launch_counts`.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from functional_fp16._kernels.signatures import SIGNATURES, Arg, Signature, dense
from functional_fp16._kernels.triton_blocks import TRITON_DTYPES

__all__ = [
    "INTERPRET",
    "launch_counts",
    "launch",
    "Checker",
    "chunk_rows",
    "Tables",
    "LeafClass",
    "classes",
    "f32",
    "device_context",
    "launch_step",
]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
"""Whether Triton's interpreter runs the kernels (on CPU tensors)."""
_DEVICE_TYPE = "cpu" if INTERPRET else "cuda"  # the interpreter reads CPU memory

launch_counts: Counter[str] = Counter()
"""Kernel launches so far, by kernel name (for tests and profiling)."""

_GRAPH_TABLES: list[torch.Tensor] = []  # tables copied inside a CUDA graph capture: kept


def launch(name: str, kernel: Any, grid: int, *args: Any, **constexprs: Any) -> None:
    """Launches ``kernel`` over ``grid`` programs, counted in :data:`launch_counts`."""
    options = {} if INTERPRET else {"enable_fp_fusion": False}
    launch_counts[name] += 1
    kernel[(grid,)](*args, **constexprs, **options)


# ---------------------------------------------------------------------------
# Argument checks (device-agnostic; the declarations are signatures.py's)
# ---------------------------------------------------------------------------


class Checker:
    """Checks one call's arguments against an entry point's declaration, naming the culprit."""

    def __init__(
        self, entry: str, n_groups: Any, kw: dict[str, Any], signature: Signature | None = None
    ) -> None:
        self.where = f"triton_steps.{entry}"
        self.kw = kw
        if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
            raise TypeError(f"{self.where}: n_groups must be a positive int, got {n_groups!r}")
        grads = kw["grads"]
        if not isinstance(grads, (list, tuple)):
            raise TypeError(f"{self.where}: grads must be a list of tensors")
        self.n_leaves, self.n_groups = len(grads), n_groups
        if self.n_leaves % n_groups:
            raise ValueError(
                f"{self.where}: {self.n_leaves} leaves do not split into {n_groups} groups"
            )
        self.device: torch.device | None = None
        for arg in (signature or SIGNATURES[entry]).args:
            if arg.name in kw:
                getattr(self, "_" + arg.kind)(arg, kw[arg.name])

    def fail(self, message: str, error: type[Exception] = ValueError) -> None:
        raise error(f"{self.where}: {message}")

    def _on_device(self, name: str, t: torch.Tensor) -> None:
        if self.device is None:
            if t.device.type != _DEVICE_TYPE:
                hint = " (CPU tensors only under TRITON_INTERPRET=1)" if INTERPRET else ""
                self.fail(f"{name} is on {t.device}; the kernels take {_DEVICE_TYPE} tensors{hint}")
            self.device = t.device
        elif t.device != self.device:
            self.fail(f"{name} is on {t.device}, but the other tensors are on {self.device}")

    def _leaves(self, arg: Arg, value: Any) -> None:
        if value is None:
            if not arg.optional:
                self.fail(f"{arg.name} is required", TypeError)
            return
        if not isinstance(value, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) for t in value
        ):
            self.fail(f"{arg.name} must be a list of tensors", TypeError)
        if len(value) != self.n_leaves:
            self.fail(f"{arg.name} has {len(value)} tensors, expected {self.n_leaves}")
        ref = self.kw[arg.like] if arg.like else None
        for i, t in enumerate(value):
            name = f"{arg.name}[{i}]"
            self._on_device(name, t)
            if t.dtype not in arg.dtypes:
                self.fail(f"{name} has dtype {t.dtype}, expected one of {arg.dtypes}", TypeError)
            if not dense(t):
                self.fail(f"{name} is not dense (it must cover its storage span exactly)")
            if ref is not None and (t.shape != ref[i].shape or t.stride() != ref[i].stride()):
                self.fail(
                    f"{name} has shape {tuple(t.shape)} and strides {t.stride()}, but "
                    f"{arg.like}[{i}] has {tuple(ref[i].shape)} and {ref[i].stride()}"
                )

    def _group(self, arg: Arg, value: Any, count: int | None = None, per: str = "group") -> None:
        if value is None:
            if not arg.optional:
                self.fail(f"{arg.name} is required", TypeError)
            return
        if not isinstance(value, torch.Tensor) or value.dtype != arg.dtypes[0]:
            got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            self.fail(f"{arg.name} must be a tensor of dtype {arg.dtypes[0]}, got {got}", TypeError)
        self._on_device(arg.name, value)
        count = self.n_groups if count is None else count
        if value.shape != (count,) or not value.is_contiguous():
            self.fail(
                f"{arg.name} must be contiguous of shape ({count},) (one per {per}), "
                f"got shape {tuple(value.shape)}"
            )

    def _leafwise(self, arg: Arg, value: Any) -> None:
        self._group(arg, value, self.n_leaves, "leaf")

    def _float(self, arg: Arg, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(f"{arg.name} must be a number, got {value!r}", TypeError)

    def _int(self, arg: Arg, value: Any) -> None:
        if not isinstance(value, (int, bool)):
            self.fail(f"{arg.name} must be an int, got {value!r}", TypeError)

    def both_or_neither(self, a: str, b: str) -> None:
        if (self.kw[a] is None) != (self.kw[b] is None):
            self.fail(f"{a} and {b} must both be given or both be None")

    def working_copies(self) -> list[bool]:
        """Per leaf: whether its working copy is its master (params_out aliases master_out)."""
        out = []
        for i, (p, po, mo) in enumerate(
            zip(self.kw["params"], self.kw["params_out"], self.kw["master_out"])
        ):
            if p.dtype != po.dtype:
                self.fail(f"params[{i}] is {p.dtype} but params_out[{i}] is {po.dtype}", TypeError)
            is_master = po.numel() > 0 and po.data_ptr() == mo.data_ptr()
            if is_master and po.dtype != torch.float32:
                self.fail(f"params_out[{i}] aliases master_out[{i}] but is {po.dtype}")
            out.append(is_master)
        return out


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------


def chunk_rows(numel: list[int], first_slot: list[int] | None, chunk: int) -> torch.Tensor:
    """One row per chunk of the leaves of a class: (leaf in class, first element[, slot])."""
    n = torch.tensor(numel, dtype=torch.int64)
    count = (n + chunk - 1) // chunk
    leaf = torch.repeat_interleave(torch.arange(len(numel)), count)
    index = torch.arange(leaf.numel()) - (torch.cumsum(count, 0) - count)[leaf]
    cols = [leaf, index * chunk]
    if first_slot is not None:
        cols.append(torch.tensor(first_slot, dtype=torch.int64)[leaf] + index)
    return torch.stack(cols, 1)


class Tables:
    """Every class's table of one call, sent to the device in one copy."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def add(self, values: torch.Tensor) -> tuple[int, int]:
        """Queues ``values``; returns their (offset, length) in the device table."""
        values = values.reshape(-1)
        self.parts.append(values)
        self.size += values.numel()
        return self.size - values.numel(), values.numel()

    def to(self, device: torch.device) -> torch.Tensor:
        """The concatenated table on ``device``, copied without a host sync."""
        host = torch.cat(self.parts) if self.parts else torch.zeros(1, dtype=torch.int64)
        if device.type != "cuda":
            return host
        host = host.pin_memory()
        table = host.to(device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            _GRAPH_TABLES.extend((host, table))  # every replay copies from ``host`` again
        return table


class LeafClass:
    """The leaves of one dtype class: their rows in the table, and the launch's grid."""

    def __init__(self, tables: Tables, rows: list[list[int]], chunks: torch.Tensor) -> None:
        self.leaves = tables.add(torch.tensor(rows, dtype=torch.int64))
        self.chunks = tables.add(chunks)
        self.grid = chunks.shape[0]

    def views(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (a, n), (b, k) = self.leaves, self.chunks
        return table[a : a + n], table[b : b + k]


def classes(
    tables: Tables,
    roles: Sequence[Sequence[torch.Tensor] | None],
    keys: Sequence[tuple],
    per_group: int,
    chunk: int,
    first_slot: Sequence[int] | None = None,
) -> dict[tuple, LeafClass]:
    """Sorts the non-empty leaves into classes and adds each class's rows to ``tables``.

    A leaf's class is its key (the dtypes and flags the kernel is compiled
    for) and whether all its addresses are 16-byte aligned (vector loads), in
    that order. ``roles`` lists the per-leaf tensors in table order (``None``:
    a role the kernel does not use, address 0); a leaf's row is their
    addresses, its numel and its group. ``chunk``: the elements per chunk at
    most. ``first_slot``: each leaf's first partial-result slot.
    """
    grads = roles[0]
    members: dict[tuple, list[int]] = {}
    rows: dict[int, list[int]] = {}
    for leaf, key in enumerate(keys):
        if grads[leaf].numel() > 0:
            addresses = [0 if r is None else r[leaf].data_ptr() for r in roles]
            aligned = all(a % 16 == 0 for a in addresses)
            rows[leaf] = addresses + [grads[leaf].numel(), leaf // per_group]
            members.setdefault((*key, aligned), []).append(leaf)
    found = {}
    for key, leaves in members.items():
        slots = None if first_slot is None else [first_slot[i] for i in leaves]
        chunks = chunk_rows([grads[i].numel() for i in leaves], slots, chunk)
        found[key] = LeafClass(tables, [rows[i] for i in leaves], chunks)
    return found


def f32(x: float) -> float:
    """``x`` rounded to float32, as the kernels receive it."""
    return torch.tensor(x, dtype=torch.float32).item()


def device_context(device: torch.device) -> Any:
    """A context that makes ``device`` current for the launches (nothing on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launch_step(
    entry: str,
    kernel: Any,
    check: Checker,
    roles: Sequence[Sequence[torch.Tensor] | None],
    scalars: Sequence[torch.Tensor],
    numbers: Sequence[float],
    flags: dict[str, Any],
    sizes: dict[str, int],
) -> None:
    """A step's launches, one per class of leaves (see :func:`classes`).

    ``roles`` are the per-leaf tensors in the kernel's table order, the
    gradients first and the working copies' outputs last (``None``: a role
    the kernel does not use); ``scalars`` the per-group tensors the kernel
    takes after its two tables, ``numbers`` its fixed hyperparameters (as
    Python floats), ``flags`` its constexprs beside the classes' own
    (``G_TY``, ``P_TY``, ``ALIGNED``, ``P_IS_MASTER``) and ``sizes``
    (``CHUNK``, ``BLOCK``). ``check`` has checked every argument.
    """
    grads, params_out = roles[0], roles[-1]
    is_master = check.working_copies()
    keys = [(g.dtype, p.dtype, m) for g, p, m in zip(grads, params_out, is_master)]
    tables = Tables()
    leaf_classes = classes(tables, roles, keys, check.n_leaves // check.n_groups, sizes["CHUNK"])
    if not leaf_classes:
        return
    table = tables.to(check.device)
    with device_context(check.device):
        for (g_dtype, p_dtype, p_is_master, aligned), c in leaf_classes.items():
            launch(
                entry,
                kernel,
                c.grid,
                *c.views(table),
                *scalars,
                *[float(x) for x in numbers],
                G_TY=TRITON_DTYPES[g_dtype],
                P_TY=TRITON_DTYPES[p_dtype],
                ALIGNED=aligned,
                P_IS_MASTER=p_is_master,
                **flags,
                **sizes,
            )
