"""The fused ops' plain PyTorch kernel: any device, and the CPU without a C compiler.

The same steps as ``_kernels/fused_step.c``, one leaf (of one member) at a
time, written with the PyTorch operations whose CPU kernels contract exactly
where the C kernel does (``torch.add(..., alpha=)`` is :math:`\\operatorname{fma}`,
``addcmul``/``lerp`` as ``torch.optim`` computes them), so on the CPU it agrees
with the C kernel bit for bit. Every per-group scalar is indexed, never read on
the host; a skipped group's outputs are written from its inputs.
"""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from functional_fp16.adam import sqrt_rn

__all__ = ["member_views", "grad_stats_into", "sgd_into", "adam_into"]


def member_views(xs: list[Tensor] | None, members: int) -> list[Tensor] | None:
    """Each leaf's members as separate views, member-major (``[x[b] for b for x]``)."""
    if xs is None or members == 1:
        return xs
    return [x[b] for b in range(members) for x in xs]


def _walk(n_leaves: int, groups: int, members: int):
    """``(b, l, k)`` for member ``b``, leaf ``l`` and its group ``k``."""
    per_member = groups // members
    per_group = n_leaves // per_member
    for b in range(members):
        for l in range(n_leaves):
            yield b, l, b * per_member + l // per_group


def _at(x: Tensor, b: int, members: int) -> Tensor:
    return x if members == 1 else x[b]


def _unscaled(g: Tensor, inv, clip_div, clip_mul, k: int) -> Tensor:
    u = g.float()
    if inv is not None:
        u = u * inv[k]
    if clip_div is not None:
        u = (u / clip_div[k]) * clip_mul[k]
    return u


def grad_stats_into(grads, inv, groups, members, sum_squares, peak, sq) -> None:
    """Per group: largest ``|g|`` (+inf for inf/NaN) into ``peak``, float64 sum of squares into ``sq``."""
    peaks: list[list[Tensor]] = [[] for _ in range(groups)]
    sums: list[list[Tensor]] = [[] for _ in range(groups)]
    for b, l, k in _walk(len(grads), groups, members):
        g = _at(grads[l], b, members)
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


def _write(out: Tensor, apply: Tensor, new: Tensor, old: Tensor) -> None:
    out.copy_(torch.where(apply, new, old))


def sgd_into(*, members, grads, master, trace, params, master_out, trace_out, params_out, inv,
             clip_div, clip_mul, lr, apply, started, weight_decay, momentum, take_started,
             nesterov) -> None:  # fmt: skip
    """The SGD step (see :func:`functional_fp16._fused.ops.sgd_step`) into the outputs."""
    take = struct.unpack("f", struct.pack("f", take_started))[0]  # rounded once to float32
    results = []
    for b, l, k in _walk(len(grads), lr.numel(), members):
        m = _at(master[l], b, members)
        u = _unscaled(_at(grads[l], b, members), inv, clip_div, clip_mul, k)
        if weight_decay != 0.0:
            u = torch.add(u, m, alpha=weight_decay)
        v, nb = u, None
        if momentum != 0.0:
            on = started[k]
            keep = torch.where(on, momentum, 0.0).float()
            nb = _at(trace[l], b, members) * keep + u * torch.where(on, take, 1.0).float()
            v = torch.add(u, nb, alpha=momentum) if nesterov else nb
        nm = torch.addcmul(m, v, lr[k])
        results.append((b, l, k, nm, nb))
    # Every new value is computed before any output is written (donation).
    for b, l, k, nm, nb in results:
        a = apply[k]
        m, mo = _at(master[l], b, members), _at(master_out[l], b, members)
        p, po = _at(params[l], b, members), _at(params_out[l], b, members)
        if po.data_ptr() != mo.data_ptr():
            _write(po, a, nm.to(po.dtype), p)
        _write(mo, a, nm, m)
        if nb is not None:
            _write(_at(trace_out[l], b, members), a, nb, _at(trace[l], b, members))


def adam_into(*, members, grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out,
              inv, clip_div, clip_mul, lr, apply, inv_c1, sqrt_c2, l2, w, b2, c2, eps,
              decoupled) -> None:  # fmt: skip
    """The Adam step (see :func:`functional_fp16._fused.ops.adam_step`) into the outputs."""
    c2 = struct.unpack("f", struct.pack("f", c2))[0]
    results = []
    for b, l, k in _walk(len(grads), lr.numel(), members):
        m = _at(master[l], b, members)
        u = _unscaled(_at(grads[l], b, members), inv, clip_div, clip_mul, k)
        if l2 != 0.0:
            u = torch.add(u, m, alpha=l2)
        na = torch.lerp(_at(mu[l], b, members), u, w)
        nv = torch.addcmul(_at(nu[l], b, members) * b2, u, u, value=c2)
        step = na / (sqrt_rn(nv) / sqrt_c2[k] + eps) * inv_c1[k]
        if decoupled != 0.0:
            step = torch.add(step, m, alpha=decoupled)
        results.append((b, l, k, torch.addcmul(m, step, lr[k]), na, nv))
    for b, l, k, nm, na, nv in results:
        a = apply[k]
        m, mo = _at(master[l], b, members), _at(master_out[l], b, members)
        p, po = _at(params[l], b, members), _at(params_out[l], b, members)
        if po.data_ptr() != mo.data_ptr():
            _write(po, a, nm.to(po.dtype), p)
        _write(mo, a, nm, m)
        _write(_at(mu_out[l], b, members), a, na, _at(mu[l], b, members))
        _write(_at(nu_out[l], b, members), a, nv, _at(nu[l], b, members))
