"""The fused kernels' arguments, declared once by name.

Every entry point of ``fused_step.c`` is described here as a list of
:class:`Arg`\\ s. The ctypes signature is derived from that list, and so is
the packing of a call: :func:`pack` takes the arguments *by name*, checks each
one (count, dtype, device, shape, layout) and only then turns it into
pointers. A call with a missing, extra or malformed argument raises a
``TypeError`` or ``ValueError`` naming it; no pointer reaches C unchecked.

Every entry point begins with two implicit ``int64`` arguments, the number
of leaves ``L`` and the number of groups ``G`` (``G`` divides ``L``; leaf
``l`` belongs to group ``l // (L // G)``). Then, in declared order:

* ``leaves``: one tensor per leaf, passed as an array of data pointers;
* ``numel``/``codes``: derived from a ``leaves`` argument, the per-leaf
  element counts (``int64``) and dtype codes (``int32``);
* ``group``: a 1-d contiguous tensor of ``G`` scalars (or ``None`` where
  ``optional``), passed by address;
* ``leafwise``: a 1-d contiguous tensor of one value per leaf (``members * L``
  of them, member-major), passed by address;

A call may stack ``members`` states in every leaf (a ``vmap`` batch): each
leaf tensor then holds ``members`` equal, consecutive blocks along its
outermost dimension, and :func:`pack` passes them to C as ``members * L``
leaves, member-major, by pointer arithmetic (no views are made). Member
``b``'s leaves form groups ``b * G0 .. (b + 1) * G0 - 1`` of the
``G = members * G0`` groups.
* ``float``/``int``: a Python number, passed by value.

This module imports nothing of the rest of the package.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["Arg", "Signature", "DTYPE_CODES", "SIGNATURES", "step_signature", "pack", "dense"]
__all__ += ["members_outermost"]

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The dtypes the kernels read and write, with their codes in the C source."""

STORED = tuple(DTYPE_CODES)  # a gradient or a working copy: float32, float16 or bfloat16
F32 = (torch.float32,)


class Arg(NamedTuple):
    """One declared argument of a kernel entry point."""

    name: str
    kind: str  # "leaves", "numel", "codes", "group", "leafwise", "float", "int"
    dtypes: tuple[torch.dtype, ...] = ()  # allowed dtypes ("leaves", "group")
    optional: bool = False  # None allowed ("group": a NULL pointer)
    of: str = ""  # "numel"/"codes": the leaves argument it is derived from
    like: str = ""  # "leaves": each tensor has the shape and strides of this argument's
    same_dtype: str = ""  # "leaves": each tensor has the dtype of this argument's tensors


class Signature(NamedTuple):
    """A C entry point: its symbol, its declared arguments and how they depend on each other."""

    symbol: str
    args: tuple[Arg, ...]
    together: tuple[tuple[str, ...], ...] = ()  # optional arguments given all or none
    needs: tuple[tuple[str, str], ...] = ()  # (a, b): when a is given (or true), b is required
    one_of: tuple[tuple[str, str], ...] = ()  # (a, b): exactly one of the two is given

    def argtypes(self) -> list[Any]:
        """The ctypes argument types, derived from the declaration."""
        c = {
            "leaves": ctypes.c_void_p,
            "numel": ctypes.c_void_p,
            "codes": ctypes.c_void_p,
            "group": ctypes.c_void_p,
            "leafwise": ctypes.c_void_p,
            "float": ctypes.c_float,
            "int": ctypes.c_int32,
        }
        return [ctypes.c_int64, ctypes.c_int64] + [c[a.kind] for a in self.args]

    def inputs(self) -> list[str]:
        """The names a caller passes (derived arguments excluded)."""
        return [a.name for a in self.args if a.kind not in ("numel", "codes")]


def _leaves(
    name: str,
    *,
    dtypes=F32,
    like: str = "grads",
    optional=False,
    same_dtype: str = "",
) -> Arg:
    return Arg(name, "leaves", dtypes, optional, "", like, same_dtype)


def _group(name: str, dtype: torch.dtype, *, optional: bool = False) -> Arg:
    return Arg(name, "group", (dtype,), optional=optional)


def _leafwise(name: str, dtype: torch.dtype, *, optional: bool = False) -> Arg:
    return Arg(name, "leafwise", (dtype,), optional=optional)


_STEP_SCALARS = (
    _group("inv", torch.float32, optional=True),
    _group("clip_div", torch.float32, optional=True),
    _group("clip_mul", torch.float32, optional=True),
    _group("lr", torch.float32),
)

SIGNATURES: dict[str, Signature] = {
    "grad_stats": Signature(
        "ff_grad_stats",
        (
            _leaves("grads", dtypes=STORED, like=""),
            Arg("grads_numel", "numel", of="grads"),
            Arg("grads_codes", "codes", of="grads"),
            _group("inv", torch.float32, optional=True),
            Arg("sum_squares", "int"),
            Arg("threads", "int"),
            _leafwise("peak_out", torch.float32),
            _group("sum_sq_out", torch.float64, optional=True),
        ),
        needs=(("sum_squares", "sum_sq_out"),),
    ),
    "sgd_update": Signature(
        "ff_sgd_update",
        (
            _leaves("grads", dtypes=STORED, like=""),
            _leaves("master", dtypes=(torch.float32, torch.int16)),
            _leaves("trace", optional=True),  # None without momentum
            _leaves("params", dtypes=STORED),
            _leaves("master_out", dtypes=(torch.float32, torch.int16), same_dtype="master"),
            _leaves("trace_out", optional=True),
            _leaves("params_out", dtypes=STORED, same_dtype="params"),
            Arg("numel", "numel", of="grads"),
            Arg("grads_codes", "codes", of="grads"),
            Arg("params_codes", "codes", of="params_out"),
            *_STEP_SCALARS,
            _group("apply", torch.bool, optional=True),  # None: decide after a speculative step
            _group("require", torch.bool, optional=True),
            _group("started", torch.bool, optional=True),
            Arg("weight_decay", "float"),
            Arg("momentum", "float"),
            Arg("take_started", "float"),
            Arg("nesterov", "int"),
            Arg("split", "int"),  # master/master_out: int16 residuals of params (fused_step.c)
            Arg("threads", "int"),
            _group("decided_out", torch.bool, optional=True),
            _leafwise("leaf_finite_out", torch.bool, optional=True),
        ),
        together=(
            ("clip_div", "clip_mul"),
            ("trace", "trace_out"),
            ("decided_out", "leaf_finite_out"),
        ),
        one_of=(("apply", "decided_out"),),
    ),
    "adam_update": Signature(
        "ff_adam_update",
        (
            _leaves("grads", dtypes=STORED, like=""),
            _leaves("master", dtypes=(torch.float32, torch.int16)),
            _leaves("mu"),
            _leaves("nu"),
            _leaves("params", dtypes=STORED),
            _leaves("master_out", dtypes=(torch.float32, torch.int16), same_dtype="master"),
            _leaves("mu_out"),
            _leaves("nu_out"),
            _leaves("params_out", dtypes=STORED, same_dtype="params"),
            Arg("numel", "numel", of="grads"),
            Arg("grads_codes", "codes", of="grads"),
            Arg("params_codes", "codes", of="params_out"),
            *_STEP_SCALARS,
            _group("apply", torch.bool),
            _group("inv_c1", torch.float32),
            _group("sqrt_c2", torch.float32),
            Arg("l2", "float"),
            Arg("w", "float"),
            Arg("b2", "float"),
            Arg("c2", "float"),
            Arg("eps", "float"),
            Arg("decoupled", "float"),
            Arg("split", "int"),  # master/master_out: int16 residuals of params (fused_step.c)
            Arg("threads", "int"),
        ),
        together=(("clip_div", "clip_mul"),),
    ),
}
"""Every entry point of ``fused_step.c``. The C prototypes follow this order."""


def step_signature(
    entry: str, states: tuple[str, ...], scalars: tuple[str, ...], floats: tuple[str, ...]
) -> Signature:
    """The declaration of a step entry in the argument-block convention (``fused_step.h``).

    Its arguments by name, in the conventional order: the gradients, master,
    each state, working copies and their outputs, the common per-group scalars,
    ``apply``, the optimiser's own float32 per-group ``scalars`` and its fixed
    ``floats``.
    """
    lists = ["master", *states]
    return Signature(
        f"ff_{entry}",
        (
            _leaves("grads", dtypes=STORED, like=""),
            *[_leaves(n) for n in lists],
            _leaves("params", dtypes=STORED),
            *[_leaves(f"{n}_out") for n in lists],
            _leaves("params_out", dtypes=STORED, same_dtype="params"),
            Arg("numel", "numel", of="grads"),
            Arg("grads_codes", "codes", of="grads"),
            Arg("params_codes", "codes", of="params_out"),
            *_STEP_SCALARS,
            _group("apply", torch.bool),
            *[_group(n, torch.float32) for n in scalars],
            *[Arg(n, "float") for n in floats],
        ),
        together=(("clip_div", "clip_mul"),),
    )


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its storage span exactly, in some order of dimensions."""
    if t.is_contiguous() or t.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def members_outermost(t: torch.Tensor, members: int) -> bool:
    """Whether ``t``'s ``members`` blocks are consecutive along its first dimension."""
    if members == 1:
        return True
    return (
        t.dim() >= 1
        and t.shape[0] == members
        and (t.numel() == 0 or t.stride(0) * members == t.numel())
    )


def _explain_leaves(sig: Signature, arg: Arg, value: Any, n_leaves: int, kw: dict, members: int):
    """Raises the error that says what is wrong with the leaves argument ``arg``."""
    where = f"{sig.symbol}: {arg.name}"
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in value):
        raise TypeError(f"{where} must be a list of tensors, got {type(value).__name__}")
    if len(value) != n_leaves:
        raise ValueError(f"{where} has {len(value)} tensors, expected {n_leaves} (one per leaf)")
    ref = kw[arg.like] if arg.like else None
    twin = kw[arg.same_dtype] if arg.same_dtype else None
    for i, t in enumerate(value):
        if twin is not None and t.dtype != twin[i].dtype:
            raise TypeError(
                f"{where}[{i}] has dtype {t.dtype}, but {arg.same_dtype}[{i}] has {twin[i].dtype}"
            )
        if t.device.type != "cpu":
            raise ValueError(f"{where}[{i}] is on {t.device}; the C kernel takes CPU tensors")
        if t.dtype not in arg.dtypes:
            raise TypeError(f"{where}[{i}] has dtype {t.dtype}, expected one of {arg.dtypes}")
        if not dense(t):
            raise ValueError(f"{where}[{i}] is not dense (it has gaps or overlaps)")
        if not members_outermost(t, members):
            raise ValueError(
                f"{where}[{i}] of shape {tuple(t.shape)} does not hold {members} members "
                "as consecutive blocks along its first dimension"
            )
        if ref is not None and (t.shape != ref[i].shape or t.stride() != ref[i].stride()):
            raise ValueError(
                f"{where}[{i}] has shape {tuple(t.shape)} and strides {t.stride()}, but "
                f"{arg.like}[{i}] has {tuple(ref[i].shape)} and {ref[i].stride()}"
            )
    raise AssertionError(f"{where}: no error found")  # unreachable: the fast check failed


def _check_leaves(
    sig: Signature, arg: Arg, value: Any, n_leaves: int, kw: dict, members: int, layouts: dict
) -> None:
    """Checks one leaves argument: count, type, device, dtype, density, members, layout.

    The common case (everything right) is checked in bulk; only a failure walks
    the leaves one by one (:func:`_explain_leaves`) to say which is wrong.
    ``layouts`` holds the ``(shape, strides)`` of the arguments checked so far:
    a tensor with a checked tensor's shape and strides is dense like it.
    """
    if arg.optional and value is None:
        return
    ok = (
        isinstance(value, (list, tuple))
        and len(value) == n_leaves
        and all(isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in arg.dtypes for t in value)
    )
    if ok and arg.same_dtype:
        ok = all(t.dtype == u.dtype for t, u in zip(value, kw[arg.same_dtype]))
    if ok:
        mine = [(t.shape, t.stride()) for t in value]
        if arg.like and arg.like in layouts:
            ok = mine == layouts[arg.like]
        else:
            ok = all(dense(t) and members_outermost(t, members) for t in value)
            if ok and arg.like:  # the reference itself is checked with its own argument
                ok = mine == [(t.shape, t.stride()) for t in kw[arg.like]]
        layouts[arg.name] = mine
    if not ok:
        _explain_leaves(sig, arg, value, n_leaves, kw, members)


def _check_group(sig: Signature, arg: Arg, value: Any, n_groups: int, per: str = "group") -> None:
    where = f"{sig.symbol}: {arg.name}"
    if value is None:
        if not arg.optional:
            raise TypeError(f"{where} is required")
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a tensor, got {type(value).__name__}")
    if value.device.type != "cpu" or value.dtype not in arg.dtypes:
        raise TypeError(
            f"{where} must be a CPU tensor of dtype {arg.dtypes[0]}, "
            f"got {value.dtype} on {value.device}"
        )
    if value.shape != (n_groups,) or not value.is_contiguous():
        raise ValueError(
            f"{where} must be contiguous of shape ({n_groups},) (one per {per}), "
            f"got shape {tuple(value.shape)}"
        )


class Packed:
    """The ctypes arguments of one call, with the arrays they point into kept alive."""

    def __init__(self) -> None:
        self.keep: list[array] = []
        self.args: list[Any] = []

    def array(self, code: str, values: Sequence[int]) -> int:
        a = array(code, values)
        self.keep.append(a)
        return a.buffer_info()[0]


def pack(
    sig: Signature, *, n_groups: int, members: int = 1, leaves_checked: bool = False, **kw: Any
) -> Packed:
    """Checks ``kw`` against ``sig`` and packs it into ctypes arguments (``Packed.args``).

    ``n_groups`` counts the groups of all members together (the length of
    every per-group scalar); ``members`` is the number of stacked states per
    leaf tensor (see the module docstring).

    ``leaves_checked=True`` is for a caller that has itself checked every
    tensor of every leaves argument by the same rules (the fused ops do,
    before they choose a kernel: ``op_checks``); the lists' lengths, the
    per-group scalars and the arguments' dependencies are still checked here.

    Raises ``TypeError`` for a missing or unknown argument or a wrong type,
    and ``ValueError`` for a wrong count, shape, layout or device.
    """
    expected = sig.inputs()
    missing = [n for n in expected if n not in kw]
    extra = [n for n in kw if n not in expected]
    if missing or extra:
        raise TypeError(f"{sig.symbol}: missing arguments {missing}, unexpected {extra}")
    first = next(a for a in sig.args if a.kind == "leaves")
    leaves0 = kw[first.name]
    if not isinstance(leaves0, (list, tuple)):
        raise TypeError(f"{sig.symbol}: {first.name} must be a list of tensors")
    n_leaves = len(leaves0)
    for name, value in (("n_groups", n_groups), ("members", members)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TypeError(f"{sig.symbol}: {name} must be a positive int, got {value!r}")
    if n_groups % members or (n_leaves * members) % n_groups:
        raise ValueError(
            f"{sig.symbol}: {members} member(s) of {n_leaves} leaves do not split into "
            f"{n_groups} groups"
        )
    for names in sig.together:
        given = [n for n in names if kw[n] is not None]
        if given and len(given) != len(names):
            raise TypeError(f"{sig.symbol}: {', '.join(names)} are given together or not at all")
    for a, b in sig.needs:
        if kw[a] not in (None, 0, False) and kw[b] is None:
            raise TypeError(f"{sig.symbol}: {b} is required when {a} is given")
    for a, b in sig.one_of:
        if (kw[a] is None) == (kw[b] is None):
            raise TypeError(f"{sig.symbol}: give exactly one of {a} and {b}")
    out = Packed()
    out.args = [n_leaves * members, n_groups]
    layouts: dict[str, list] = {}
    for arg in sig.args:
        if arg.kind == "leaves":
            value = kw[arg.name]
            if not leaves_checked:
                _check_leaves(sig, arg, value, n_leaves, kw, members, layouts)
            elif value is not None and len(value) != n_leaves:
                raise ValueError(
                    f"{sig.symbol}: {arg.name} has {len(value)} tensors, not {n_leaves}"
                )
            if value is None:
                out.args.append(None)
                continue
            if members == 1:
                ptrs = list(map(torch.Tensor.data_ptr, value))
            else:
                ptrs = [
                    t.data_ptr() + b * (t.nbytes // members) for b in range(members) for t in value
                ]
            out.args.append(out.array("Q", ptrs))
        elif arg.kind == "numel":
            sizes = list(map(torch.Tensor.numel, kw[arg.of]))
            if members != 1:
                sizes = [n // members for n in sizes]
            out.args.append(out.array("q", sizes * members))
        elif arg.kind == "codes":
            codes = [DTYPE_CODES[t.dtype] for t in kw[arg.of]]  # noqa: C416
            out.args.append(out.array("i", codes * members))
        elif arg.kind == "group":
            value = kw[arg.name]
            _check_group(sig, arg, value, n_groups)
            out.args.append(None if value is None else value.data_ptr())
        elif arg.kind == "leafwise":
            value = kw[arg.name]
            _check_group(sig, arg, value, n_leaves * members, "leaf")
            out.args.append(None if value is None else value.data_ptr())
        elif arg.kind == "float":
            value = kw[arg.name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{sig.symbol}: {arg.name} must be a number, got {value!r}")
            out.args.append(float(value))
        else:  # "int"
            value = kw[arg.name]
            if not isinstance(value, (int, bool)):
                raise TypeError(f"{sig.symbol}: {arg.name} must be an int, got {value!r}")
            out.args.append(int(value))
    return out
