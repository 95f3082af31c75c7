r"""The plain PyTorch kernels' parts: the kernel for any device without a compiled one.

Where neither the C library (CPU) nor Triton (CUDA) runs, an op computes
with ordinary tensor operations, leaf by leaf and member by member, the same
arithmetic as the compiled kernels. This module holds what every such kernel
shares: the walk over ``(member, leaf, group)``, a member's view of a leaf,
the unscaled and clipped gradient

.. math:: u = \operatorname{fl}_{32}(g)\cdot \mathrm{inv}_k, \qquad
          u \leftarrow (u / c_{d,k})\, c_{m,k} \text{ (clipping)}

and the write of ``where(apply, new, old)`` into the outputs, plus
:func:`stats_generic`, the plain kernel of ``grad_stats``. Each optimiser's
own plain kernel (its update rule) lives with its op (``sgd.py``,
``adam.py``).
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

__all__ = ["f32", "walk", "member", "unscaled", "write_member", "stats_generic"]


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32, as a Python number (no tensor, no device)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def walk(n_leaves: int, groups: int, members: int):
    """``(b, leaf, k)`` for every member ``b`` and leaf, with the leaf's group ``k``."""
    per_member = groups // members
    per_group = n_leaves // per_member
    for b in range(members):
        for leaf in range(n_leaves):
            yield b, leaf, b * per_member + leaf // per_group


def member(x: Tensor, b: int, members: int) -> Tensor:
    """Member ``b`` of a leaf tensor that holds ``members`` of them."""
    return x if members == 1 else x[b]


def unscaled(g: Tensor, inv, clip_div, clip_mul, k: int) -> Tensor:
    """``fl32(g) * inv[k]``, then ``(u / clip_div[k]) * clip_mul[k]`` when clipping."""
    u = g.float()
    if inv is not None:
        u = u * inv[k]
    if clip_div is not None:
        u = (u / clip_div[k]) * clip_mul[k]
    return u


def write_member(b: int, leaf: int, members: int, apply: Tensor, new: dict, **lists) -> None:
    """Writes ``where(apply, new, old)`` into the outputs of one leaf of one member.

    ``new`` maps ``"master"`` and the state names to their new values (``None``:
    a state not in use); ``lists`` holds each name's input and ``<name>_out``
    lists, and ``params``/``params_out`` (one working copy per leaf, the master
    itself where it has none).
    """

    def at(name: str) -> Tensor:
        return member(lists[name][leaf], b, members)

    mo, po = at("master_out"), at("params_out")
    if po.data_ptr() != mo.data_ptr():
        po.copy_(torch.where(apply, new["master"].to(po.dtype), at("params")))
    for name, value in new.items():
        if value is not None:
            at(f"{name}_out").copy_(torch.where(apply, value, at(name)))


def stats_generic(grads, inv, groups, members, sum_squares, peak, sq) -> None:
    """``grad_stats`` into ``peak`` and ``sq``: per group the largest ``|g|`` (+inf if any
    element is inf or NaN) and, if ``sum_squares``, the float64 sum of ``fl32(g * inv)^2``."""
    per_member = groups // members
    per_group = len(grads) // per_member
    peaks: list[list[Tensor]] = [[] for _ in range(groups)]
    sums: list[list[Tensor]] = [[] for _ in range(groups)]
    for b in range(members):
        for leaf, x in enumerate(grads):
            k = b * per_member + leaf // per_group
            g = x if members == 1 else x[b]
            if g.numel() == 0:
                continue
            top = g.abs().amax().float()
            peaks[k].append(torch.where(torch.isfinite(g).all(), top, float("inf")))
            if sum_squares:
                w = g.float() if inv is None else g.float() * inv[k]
                sums[k].append(w.double().square().sum())
    for k in range(groups):
        peak[k] = torch.stack(peaks[k]).amax() if peaks[k] else 0.0
        if sum_squares:
            sq[k] = torch.stack(sums[k]).sum() if sums[k] else 0.0
