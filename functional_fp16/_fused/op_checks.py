"""The step ops' argument checks: everything an op refuses before anything reaches a kernel.

A refusal names the op and the argument (``functional_fp16::<op>: grads[1] is
on meta, ...``): a ``TypeError`` for a wrong dtype or kind, a ``ValueError``
for a wrong shape, stride, device or count. :func:`first_overlap` finds two
tensors that share memory, for the donated op (which writes in place) and for
the update's state check alike.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import Tensor

from functional_fp16._fused.step_schema import BOOL_SCALARS, COMMON_SCALARS, NS, StepSpec
from functional_fp16._kernels.signatures import DTYPE_CODES, dense, members_outermost
from functional_fp16.precision.master_split import holds_residuals

__all__ = ["STORED", "fail", "first_overlap"]

STORED = tuple(DTYPE_CODES)
"""The dtypes a gradient or a working copy may have."""

_DTYPE = operator.attrgetter("dtype")
_DEVICE = operator.attrgetter("device")
_NBYTES = operator.attrgetter("nbytes")


def fail(op: str, message: str, kind: type[Exception] = ValueError) -> None:
    """Raises ``kind`` with the op's name in front of ``message``."""
    raise kind(f"{NS}::{op}: {message}")


def _layout(xs: list[Tensor]) -> tuple[list, list, set]:
    """``(sizes, strides, devices)`` of a list of tensors, read in bulk."""
    return list(map(Tensor.size, xs)), list(map(Tensor.stride, xs)), set(map(_DEVICE, xs))


def _check_list(
    op: str, name: str, xs: list[Tensor], like: list[Tensor], dtypes, layout=None
) -> None:
    """Every ``xs[i]`` has a dtype of ``dtypes`` and ``like[i]``'s device, shape and strides.

    The common case is checked in bulk (``layout`` is ``_layout(like)`` when the
    caller has it); a failure is then explained leaf by leaf.
    """
    if (
        len(xs) == len(like)
        and all(isinstance(x, Tensor) for x in xs)
        and set(map(_DTYPE, xs)) <= set(dtypes)
    ):
        sizes, strides, devices = _layout(like) if layout is None else layout
        if (
            list(map(Tensor.size, xs)) == sizes
            and list(map(Tensor.stride, xs)) == strides
            and (not xs or set(map(_DEVICE, xs)) == devices)
            and len(devices) <= 1
        ):
            return
    if len(xs) != len(like):
        fail(op, f"{name} has {len(xs)} tensors, expected {len(like)} (one per leaf)")
    for i, (x, ref) in enumerate(zip(xs, like)):
        if x.dtype not in dtypes:
            fail(op, f"{name}[{i}] has dtype {x.dtype}, expected one of {dtypes}", TypeError)
        if x.device != ref.device:
            fail(op, f"{name}[{i}] is on {x.device}, the gradients on {ref.device}")
        if x.shape != ref.shape or x.stride() != ref.stride():
            fail(
                op,
                f"{name}[{i}] has shape {tuple(x.shape)} and strides {x.stride()}; "
                f"grads[{i}] has {tuple(ref.shape)} and {ref.stride()}",
            )


def _check_group(op: str, name: str, x: Tensor | None, groups: int, dtype, device) -> None:
    if x is None:
        return
    if not isinstance(x, Tensor) or x.dtype != dtype or x.device != device:
        got = f"{x.dtype} on {x.device}" if isinstance(x, Tensor) else type(x).__name__
        fail(op, f"{name} must be {dtype} on {device}, got {got}", TypeError)
    if x.shape != (groups,) or not x.is_contiguous():
        fail(
            op,
            f"{name} must be contiguous of shape ({groups},) (one per group), "
            f"got shape {tuple(x.shape)} and strides {x.stride()}",
        )


def _check_grads(op: str, grads: list[Tensor], members: int) -> None:
    if isinstance(members, bool) or not isinstance(members, int) or members < 1:
        fail(op, f"members must be a positive int, got {members!r}", TypeError)
    if not grads:
        fail(op, "grads is empty")
    device = grads[0].device
    if (
        members == 1
        and set(map(_DEVICE, grads)) == {device}
        and set(map(_DTYPE, grads)) <= set(STORED)
        and all(map(Tensor.is_contiguous, grads))
    ):
        return  # the common case in bulk; a failure is explained leaf by leaf below
    for i, g in enumerate(grads):
        if g.device != device:
            fail(op, f"grads[{i}] is on {g.device}, grads[0] on {device}: one device per call")
        if g.dtype not in STORED:
            fail(op, f"grads[{i}] has dtype {g.dtype}, expected one of {STORED}", TypeError)
        if not dense(g):
            fail(op, f"grads[{i}] is not dense")
        if not members_outermost(g, members):
            fail(op, f"grads[{i}] does not hold {members} members along its first dimension")


def _check_step(op: str, spec: StepSpec, a: dict[str, Any]) -> list[str]:
    """Checks a step's arguments; returns the names of the state lists in use."""
    grads, members = a["grads"], a["members"]
    _check_grads(op, grads, members)
    layout = _layout(grads)
    split = bool(a["master"]) and holds_residuals(a["master"][:1])  # the first leaf decides
    _check_list(
        op, "master", a["master"], grads, (torch.int16,) if split else (torch.float32,), layout
    )
    if split and not (all(a["separate"]) and all(p.dtype == torch.float16 for p in a["params"])):
        fail(
            op,
            "a split master (int16 residuals) needs a float16 working copy for every leaf",
            TypeError,
        )
    used = spec.check(op, a)
    for name in spec.states:
        if name in spec.side:
            continue  # checked by spec.check
        if name in used:
            _check_list(op, name, a[name], grads, spec.state_dtypes or (torch.float32,), layout)
        elif a[name]:
            fail(op, f"{name} must be empty here (it is not used)")
    if len(a["separate"]) != len(grads):
        fail(op, f"separate has {len(a['separate'])} flags, expected {len(grads)}")
    if all(a["separate"]):
        _check_list(op, "params", a["params"], grads, STORED, layout)
    else:
        own = [g for g, s in zip(grads, a["separate"]) if s]
        _check_list(op, "params", a["params"], own, STORED)
    lr = a["lr"]
    if (
        lr.dim() != 1
        or lr.numel() < 1
        or lr.numel() % members
        or len(grads) % (lr.numel() // members)
    ):
        fail(
            op,
            f"lr has shape {tuple(lr.shape)}: expected one entry per group, {members} member(s) "
            f"of groups that split {len(grads)} leaves evenly",
        )
    for name in (*COMMON_SCALARS, *spec.scalars):
        dtype = torch.bool if name in (*BOOL_SCALARS, *spec.bool_scalars) else torch.float32
        dtype = torch.int64 if name in spec.int_scalars else dtype
        _check_group(op, name, a[name], lr.numel(), dtype, grads[0].device)
    if (a["clip_div"] is None) != (a["clip_mul"] is None):
        fail(op, "clip_div and clip_mul are given together or not at all")
    return used


def first_overlap(tensors: list[Tensor], read: int = 0) -> tuple[int, int] | None:
    """Indices of two dense tensors whose memory overlaps, or ``None``; the first ``read``
    tensors are only read and may overlap each other (not the others).

    A dense tensor covers ``[data_ptr, data_ptr + nbytes)``; empty ones cover nothing.
    Sorted by start, a tensor overlaps an earlier one exactly when it starts before the
    furthest end so far (of any tensor, or of the written ones for a read one).
    """
    starts = list(map(Tensor.data_ptr, tensors))
    sizes = list(map(_NBYTES, tensors))
    spans = sorted(
        (start, start + size, k) for k, (start, size) in enumerate(zip(starts, sizes)) if size
    )
    far = far_written = (0, -1)  # (the furthest end so far, its tensor)
    for start, end, k in spans:
        before = far if k >= read else far_written
        if start < before[0]:
            return before[1], k
        far = max(far, (end, k))
        if k >= read:
            far_written = max(far_written, (end, k))
    return None


def _check_disjoint(op: str, a: dict, names: list[str]) -> None:
    """Refuses written tensors whose memory overlaps another argument's (donation); the
    gradients, only read, may share memory with each other."""
    tensors = [t for name in ["grads", *names] for t in a[name]]
    found = first_overlap(tensors, read=len(a["grads"]))
    if found is not None:
        where = [f"{name}[{i}]" for name in ["grads", *names] for i in range(len(a[name]))]
        fail(
            op,
            f"{where[found[0]]} and {where[found[1]]} share memory; the donated step writes "
            "in place",
        )
