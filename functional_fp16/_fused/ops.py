"""The fused optimiser steps as ``torch.library`` ops in the ``functional_fp16`` namespace.

Five ops, each with a fake (meta) kernel, a CPU kernel (the compiled C
library), a CUDA kernel (multi-tensor Triton launches) and a plain PyTorch
kernel for any other device or where no compiler exists:

* ``grad_stats(grads, inv, groups, members, sum_squares) -> (peak, sum_sq)``:
  per group, :math:`\\max |g|` (``+inf`` if any element is not finite) and
  :math:`\\sum (\\operatorname{fl}_{32}(g)\\, s^{-1})^2` in float64;
* ``sgd_step(...) -> (master', trace', params', finite)`` and its donated form
  ``sgd_step_(...) -> finite``, which writes ``master``, ``trace`` and
  ``params`` in place (``mutates_args``);
* ``adam_step(...) -> (master', mu', nu', params', finite)`` and
  ``adam_step_(...) -> finite``.

The arithmetic per element is in ``_kernels/fused_step.c`` and
:mod:`functional_fp16._fused.generic`. Conventions shared by the step ops:

* ``grads``, ``master`` and the optimiser state are lists with one tensor per
  leaf; ``params`` holds the working copies of the leaves whose ``separate``
  flag is set (a leaf without one works on its FP32 master directly);
* every per-step scalar is a 1-d tensor with one entry per *group* (the
  learning rate ``lr`` gives the count ``G``): leaf ``l`` of member ``b``
  belongs to group ``b * G0 + l // (L // G0)``, ``G0 = G / members``. A plain
  update is one member and one group; ``vmap`` makes ``K`` members ``K`` more
  groups of the same call (see :func:`_vmap_step`), each with its own scale,
  decision and counters;
* ``apply=None`` lets the op decide itself: a group is applied when all its
  unscaled gradients are finite and ``require`` (if given) holds; a given
  ``apply`` is the decision (still ANDed with ``require``). The decision is
  returned either way.

A skipped group's outputs are bitwise its inputs. The ops never read a value
on the host, so they run under ``torch.compile`` (Inductor calls them as
extern kernels), in CUDA graphs and under ``vmap``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from functional_fp16._fused import generic
from functional_fp16._fused.memory import fresh_like
from functional_fp16._kernels import cpu as c_kernel
from functional_fp16._kernels.signatures import DTYPE_CODES, dense, members_outermost

__all__ = ["grad_stats", "sgd_step", "sgd_step_", "adam_step", "adam_step_", "kernel_for"]

NS = "functional_fp16"
STORED = tuple(DTYPE_CODES)


def kernel_for(device: torch.device) -> str:
    """The kernel that runs on ``device``: ``"c"``, ``"triton"`` or ``"generic"``.

    Set ``$FUNCTIONAL_FP16_NO_KERNEL`` to run the plain PyTorch kernel everywhere.
    """
    if device.type == "cpu" and c_kernel.available():
        return "c"
    if device.type == "cuda" and _triton().available():
        return "triton"
    return "generic"


def _triton():
    """The Triton kernels' module (imported on first use: it imports triton)."""
    from functional_fp16._kernels import triton_steps

    return triton_steps


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (on the host: a Python number, not a tensor)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _threads() -> int:
    return torch.get_num_threads()


# ---------------------------------------------------------------------------
# Argument checks (before anything reaches a kernel).
# ---------------------------------------------------------------------------


def _fail(op: str, message: str, kind: type[Exception] = ValueError) -> None:
    raise kind(f"{NS}::{op}: {message}")


def _check_list(op: str, name: str, xs: list[Tensor], like: list[Tensor], dtypes) -> None:
    if len(xs) != len(like):
        _fail(op, f"{name} has {len(xs)} tensors, expected {len(like)} (one per leaf)")
    for i, (x, ref) in enumerate(zip(xs, like)):
        if x.dtype not in dtypes:
            _fail(op, f"{name}[{i}] has dtype {x.dtype}, expected one of {dtypes}", TypeError)
        if x.device != ref.device:
            _fail(op, f"{name}[{i}] is on {x.device}, the gradients on {ref.device}")
        if x.shape != ref.shape or x.stride() != ref.stride():
            _fail(
                op,
                f"{name}[{i}] has shape {tuple(x.shape)} and strides {x.stride()}; "
                f"grads[{i}] has {tuple(ref.shape)} and {ref.stride()}",
            )


def _check_group(op: str, name: str, x: Tensor | None, groups: int, dtype, device) -> None:
    if x is None:
        return
    if x.dtype != dtype or x.device != device:
        _fail(op, f"{name} must be {dtype} on {device}, got {x.dtype} on {x.device}", TypeError)
    if x.shape != (groups,):
        _fail(op, f"{name} must have shape ({groups},) (one per group), got {tuple(x.shape)}")


def _check_step(op: str, grads, master, states, params, separate, scalars, members) -> int:
    """Checks a step's arguments; returns the number of groups."""
    if not grads:
        _fail(op, "grads is empty")
    for i, g in enumerate(grads):
        if g.dtype not in STORED:
            _fail(op, f"grads[{i}] has dtype {g.dtype}, expected one of {STORED}", TypeError)
        if not dense(g):
            _fail(op, f"grads[{i}] is not dense")
        if not members_outermost(g, members):
            _fail(op, f"grads[{i}] does not hold {members} members along its first dimension")
    _check_list(op, "master", master, grads, (torch.float32,))
    for name, xs in states.items():
        _check_list(op, name, xs, grads, (torch.float32,))
    if len(separate) != len(grads):
        _fail(op, f"separate has {len(separate)} flags, expected {len(grads)}")
    _check_list(op, "params", params, [g for g, s in zip(grads, separate) if s], STORED)
    lr = scalars["lr"]
    if lr.dim() != 1 or lr.numel() % members or len(grads) % (lr.numel() // members):
        _fail(
            op,
            f"lr has shape {tuple(lr.shape)}: expected one entry per group, {members} member(s) "
            f"of groups that split {len(grads)} leaves evenly",
        )
    groups = lr.numel()
    device = grads[0].device
    for name, x in scalars.items():
        dtype = torch.bool if name in ("apply", "require", "started") else torch.float32
        _check_group(op, name, x, groups, dtype, device)
    if (scalars.get("clip_div") is None) != (scalars.get("clip_mul") is None):
        _fail(op, "clip_div and clip_mul are given together or not at all")
    return groups


def _full(master: list[Tensor], params: list[Tensor], separate: list[bool]) -> list[Tensor]:
    """One working copy per leaf: ``params`` where ``separate``, else the master itself."""
    it = iter(params)
    return [next(it) if s else m for m, s in zip(master, separate)]


def _finite_from_peak(peak: Tensor, inv: Tensor | None, require: Tensor | None) -> Tensor:
    """Per group: whether ``fl32(peak) * inv`` is finite (as ``grads_finite`` decides) and ``require``."""
    finite = torch.isfinite(peak if inv is None else peak * inv)
    return finite if require is None else finite & require


def _decide(s: dict, grads, groups: int, members: int) -> Tensor:
    """The decision of a step that is not speculative: given, or from one read of the gradients."""
    if s["apply"] is not None:
        return s["apply"].clone() if s["require"] is None else s["apply"] & s["require"]
    peak, _ = _stats(grads, s["inv"], groups, members, False)
    return _finite_from_peak(peak, s["inv"], s["require"])


# ---------------------------------------------------------------------------
# grad_stats
# ---------------------------------------------------------------------------


def _stats_into(kernel: str, grads, inv, groups, members, sum_squares, peak, sq) -> None:
    if kernel == "c":
        c_kernel.call(
            "grad_stats",
            n_groups=groups,
            members=members,
            grads=grads,
            inv=inv,
            sum_squares=sum_squares,
            threads=_threads(),
            peak_out=peak,
            sum_sq_out=sq if sum_squares else None,
        )
    elif kernel == "triton":
        _triton().grad_stats(
            n_groups=groups,
            grads=generic.member_views(grads, members),
            inv=inv,
            sum_squares=sum_squares,
            peak_out=peak,
            sum_sq_out=sq if sum_squares else None,
        )
    else:
        generic.grad_stats_into(grads, inv, groups, members, sum_squares, peak, sq)


def _stats(grads, inv, groups, members, sum_squares) -> tuple[Tensor, Tensor]:
    device = grads[0].device
    peak = torch.empty(groups, dtype=torch.float32, device=device)
    sq = torch.zeros(groups, dtype=torch.float64, device=device)
    _stats_into(kernel_for(device), grads, inv, groups, members, sum_squares, peak, sq)
    return peak, sq


@torch.library.custom_op(f"{NS}::grad_stats", mutates_args=())
def grad_stats(
    grads: list[Tensor], inv: Optional[Tensor], groups: int, members: int, sum_squares: bool
) -> tuple[Tensor, Tensor]:
    r"""Per group: the gradients' peak magnitude and the sum of squares of the unscaled ones.

    .. math:: M_k = \max_{i \in k} |g_i|, \qquad
              S_k = \textstyle\sum_{i \in k} \big(\operatorname{fl}_{32}(g_i)\, s_k^{-1}\big)^2

    ``M_k`` is ``+inf`` if any element is inf or NaN; ``S_k`` is accumulated in
    float64 (zeros unless ``sum_squares``). Returns two ``(groups,)`` tensors.
    """
    for i, g in enumerate(grads):
        if g.dtype not in STORED or not dense(g) or not members_outermost(g, members):
            _fail("grad_stats", f"grads[{i}] must be dense float32/float16/bfloat16")
    if groups < 1 or groups % members or (len(grads) * members) % groups:
        _fail("grad_stats", f"{len(grads)} leaves of {members} member(s) in {groups} groups")
    if grads:
        _check_group("grad_stats", "inv", inv, groups, torch.float32, grads[0].device)
    return _stats(grads, inv, groups, members, sum_squares)


@grad_stats.register_fake
def _(grads, inv, groups, members, sum_squares):
    device = grads[0].device
    return (
        torch.empty(groups, dtype=torch.float32, device=device),
        torch.empty(groups, dtype=torch.float64, device=device),
    )


# ---------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------


def _sgd_into(
    kernel, grads, master, trace, params, m_out, t_out, p_out, s, hyper, members, speculate
) -> Tensor:
    """Runs one SGD step of ``kernel`` into the given outputs; returns the decision per group.

    ``params``/``p_out`` hold one working copy per leaf (the master where it
    has none). ``speculate``: outputs are fresh, so a CPU step may run before
    the decision and be undone where it skips.
    """
    groups = s["lr"].numel()
    apply, inv = s["apply"], s["inv"]
    momentum = hyper["momentum"]
    trace = trace if momentum != 0.0 else None
    t_out = t_out if momentum != 0.0 else None
    started = s["started"] if momentum != 0.0 else None
    args = dict(
        grads=grads,
        master=master,
        trace=trace,
        params=params,
        master_out=m_out,
        trace_out=t_out,
        params_out=p_out,
        inv=inv,
        clip_div=s["clip_div"],
        clip_mul=s["clip_mul"],
        lr=s["lr"],
        started=started,
        weight_decay=hyper["weight_decay"],
        momentum=momentum,
        take_started=1.0 - hyper["dampening"],  # rounded once to float32 by the kernel
        nesterov=hyper["nesterov"],
    )
    if kernel == "c" and apply is None and speculate:
        peak = torch.empty(groups, dtype=torch.float32)
        c_kernel.call(
            "sgd_update",
            n_groups=groups,
            members=members,
            apply=None,
            threads=_threads(),
            peak_out=peak,
            **args,
        )
        finite = _finite_from_peak(peak, inv, s["require"])
        c_kernel.call(
            "keep_unless",
            n_groups=groups,
            members=members,
            master=master,
            trace=trace,
            params=params,
            master_out=m_out,
            trace_out=t_out,
            params_out=p_out,
            apply=finite,
            threads=_threads(),
        )
        return finite
    finite = _decide(s, grads, groups, members)
    if kernel == "c":
        c_kernel.call(
            "sgd_update",
            n_groups=groups,
            members=members,
            apply=finite,
            threads=_threads(),
            peak_out=None,
            **args,
        )
    elif kernel == "triton":
        views = generic.member_views
        _triton().sgd_update(
            n_groups=groups,
            apply=finite,
            **{
                k: (views(v, members) if isinstance(v, list) else v)
                for k, v in args.items()
            },
        )
    else:
        generic.sgd_into(members=members, apply=finite, **args)
    return finite


def _sgd_hyper(weight_decay, momentum, dampening, nesterov) -> dict:
    return dict(
        weight_decay=weight_decay, momentum=momentum, dampening=dampening, nesterov=nesterov
    )


def _sgd_checked(op, grads, master, trace, params, separate, scalars, momentum, members) -> None:
    states = {"trace": trace} if momentum != 0.0 else {}
    if momentum != 0.0 and scalars["started"] is None:
        _fail(op, "started is required with momentum", TypeError)
    if momentum == 0.0 and trace:
        _fail(op, "trace must be empty without momentum")
    _check_step(op, grads, master, states, params, separate, scalars, members)


@torch.library.custom_op(f"{NS}::sgd_step", mutates_args=())
def sgd_step(
    grads: list[Tensor],
    master: list[Tensor],
    trace: list[Tensor],
    params: list[Tensor],
    separate: list[bool],
    inv: Optional[Tensor],
    clip_div: Optional[Tensor],
    clip_mul: Optional[Tensor],
    lr: Tensor,
    apply: Optional[Tensor],
    require: Optional[Tensor],
    started: Optional[Tensor],
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    members: int,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], Tensor]:
    r"""One fused SGD step into fresh tensors: ``(master', trace', params', finite)``.

    Per element, with :math:`u = \operatorname{fl}_{32}(g)\, s^{-1}` (then
    ``(u / clip_div) * clip_mul`` when clipping):

    .. math::
        u &\leftarrow \operatorname{fma}(m, \lambda, u), \qquad
        b' = \operatorname{fl}(b \mu) + \operatorname{fl}(u (1 - d))
             \quad (b' = u \text{ before momentum has started}) \\
        v &= \operatorname{fma}(b', \mu, u) \text{ (Nesterov) or } b', \qquad
        m' = \operatorname{fma}(v, \mathrm{lr}, m), \qquad p' = \operatorname{fl}_{16}(m')

    ``lr`` is the signed step factor (minus the learning rate). ``trace`` is
    empty without momentum (and so is ``trace'``); ``params'`` holds the new
    working copies of the ``separate`` leaves.
    """
    s = dict(inv=inv, clip_div=clip_div, clip_mul=clip_mul, lr=lr, apply=apply, started=started)
    s["require"] = require
    _sgd_checked("sgd_step", grads, master, trace, params, separate, s, momentum, members)
    m_out = fresh_like(master)
    t_out = fresh_like(trace) if momentum != 0.0 else []
    p_new = fresh_like(params)
    finite = _sgd_into(
        kernel_for(grads[0].device),
        grads,
        master,
        trace,
        _full(master, params, separate),
        m_out,
        t_out,
        _full(m_out, p_new, separate),
        s,
        _sgd_hyper(weight_decay, momentum, dampening, nesterov),
        members,
        speculate=True,
    )
    return m_out, t_out, p_new, finite


@sgd_step.register_fake
def _(grads, master, trace, params, separate, inv, clip_div, clip_mul, lr, apply, require, started,
      weight_decay, momentum, dampening, nesterov, members):  # fmt: skip
    new = [torch.empty_like(x) for x in master]
    return (
        new,
        [torch.empty_like(x) for x in trace],
        [torch.empty_like(x) for x in params],
        torch.empty(lr.shape, dtype=torch.bool, device=lr.device),
    )


@torch.library.custom_op(f"{NS}::sgd_step_", mutates_args=("master", "trace", "params"))
def sgd_step_(
    grads: list[Tensor],
    master: list[Tensor],
    trace: list[Tensor],
    params: list[Tensor],
    separate: list[bool],
    inv: Optional[Tensor],
    clip_div: Optional[Tensor],
    clip_mul: Optional[Tensor],
    lr: Tensor,
    apply: Optional[Tensor],
    require: Optional[Tensor],
    started: Optional[Tensor],
    weight_decay: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    members: int,
) -> Tensor:
    """:func:`sgd_step` written into ``master``, ``trace`` and ``params`` (donation); returns ``finite``."""
    s = dict(inv=inv, clip_div=clip_div, clip_mul=clip_mul, lr=lr, apply=apply, started=started)
    s["require"] = require
    _sgd_checked("sgd_step_", grads, master, trace, params, separate, s, momentum, members)
    full = _full(master, params, separate)
    return _sgd_into(
        kernel_for(grads[0].device),
        grads,
        master,
        trace,
        full,
        master,
        trace,
        full,
        s,
        _sgd_hyper(weight_decay, momentum, dampening, nesterov),
        members,
        speculate=False,
    )


@sgd_step_.register_fake
def _(grads, master, trace, params, separate, inv, clip_div, clip_mul, lr, apply, require, started,
      weight_decay, momentum, dampening, nesterov, members):  # fmt: skip
    return torch.empty(lr.shape, dtype=torch.bool, device=lr.device)


# ---------------------------------------------------------------------------
# Adam
# ---------------------------------------------------------------------------


def _adam_into(kernel, grads, master, mu, nu, params, m_out, a_out, v_out, p_out, s, hyper,
               members) -> Tensor:  # fmt: skip
    """Runs one Adam step of ``kernel`` into the given outputs; returns the decision per group."""
    groups = s["lr"].numel()
    finite = _decide(s, grads, groups, members)
    w = _f32(1.0 - hyper["b1"])  # torch.lerp's weight, rounded once to float32
    args = dict(
        grads=grads,
        master=master,
        mu=mu,
        nu=nu,
        params=params,
        master_out=m_out,
        mu_out=a_out,
        nu_out=v_out,
        params_out=p_out,
        inv=s["inv"],
        clip_div=s["clip_div"],
        clip_mul=s["clip_mul"],
        lr=s["lr"],
        apply=finite,
        inv_c1=s["inv_c1"],
        sqrt_c2=s["sqrt_c2"],
        l2=hyper["l2"],
        w=w,
        b2=hyper["b2"],
        c2=1.0 - hyper["b2"],  # addcmul's value, rounded once to float32
        eps=hyper["eps"],
        decoupled=hyper["decoupled"],
    )
    if kernel == "c":
        c_kernel.call(
            "adam_update", n_groups=groups, members=members, threads=_threads(), **args
        )
    elif kernel == "triton":
        views = generic.member_views
        _triton().adam_update(
            n_groups=groups,
            **{k: (views(v, members) if isinstance(v, list) else v) for k, v in args.items()},
        )
    else:
        generic.adam_into(members=members, **args)
    return finite


def _adam_checked(op, grads, master, mu, nu, params, separate, scalars, members) -> None:
    _check_step(op, grads, master, {"mu": mu, "nu": nu}, params, separate, scalars, members)


def _adam_hyper(l2, b1, b2, eps, decoupled) -> dict:
    return dict(l2=l2, b1=b1, b2=b2, eps=eps, decoupled=decoupled)


@torch.library.custom_op(f"{NS}::adam_step", mutates_args=())
def adam_step(
    grads: list[Tensor],
    master: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    params: list[Tensor],
    separate: list[bool],
    inv: Optional[Tensor],
    clip_div: Optional[Tensor],
    clip_mul: Optional[Tensor],
    lr: Tensor,
    apply: Optional[Tensor],
    require: Optional[Tensor],
    inv_c1: Tensor,
    sqrt_c2: Tensor,
    l2: float,
    b1: float,
    b2: float,
    eps: float,
    decoupled: float,
    members: int,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], Tensor]:
    r"""One fused Adam/AdamW step into fresh tensors: ``(master', mu', nu', params', finite)``.

    Per element, with :math:`u` the unscaled (clipped) gradient, :math:`w =
    \operatorname{fl}_{32}(1 - \beta_1)`, :math:`c = 1 - \beta_2`:

    .. math::
        u &\leftarrow \operatorname{fma}(m, \lambda_2, u), \qquad
        a' = \operatorname{lerp}(a, u, w), \qquad
        v' = \operatorname{addcmul}(\operatorname{fl}(v \beta_2), u, u, c) \\
        \sigma &= \frac{a'}{\sqrt{v'} / \texttt{sqrt\_c2} + \epsilon}\, \texttt{inv\_c1}, \qquad
        \sigma \leftarrow \operatorname{fma}(m, \lambda_d, \sigma), \qquad
        m' = \operatorname{fma}(\sigma, \mathrm{lr}, m)

    as ``torch.optim.Adam``/``AdamW`` compute it, the moments bitwise.
    """
    s = dict(inv=inv, clip_div=clip_div, clip_mul=clip_mul, lr=lr, apply=apply)
    s.update(require=require, inv_c1=inv_c1, sqrt_c2=sqrt_c2)
    _adam_checked("adam_step", grads, master, mu, nu, params, separate, s, members)
    m_out, a_out, v_out = fresh_like(master), fresh_like(mu), fresh_like(nu)
    p_new = fresh_like(params)
    finite = _adam_into(
        kernel_for(grads[0].device),
        grads,
        master,
        mu,
        nu,
        _full(master, params, separate),
        m_out,
        a_out,
        v_out,
        _full(m_out, p_new, separate),
        s,
        _adam_hyper(l2, b1, b2, eps, decoupled),
        members,
    )
    return m_out, a_out, v_out, p_new, finite


@adam_step.register_fake
def _(grads, master, mu, nu, params, separate, inv, clip_div, clip_mul, lr, apply, require, inv_c1,
      sqrt_c2, l2, b1, b2, eps, decoupled, members):  # fmt: skip
    def like(xs):
        return [torch.empty_like(x) for x in xs]

    return like(master), like(mu), like(nu), like(params), torch.empty(
        lr.shape, dtype=torch.bool, device=lr.device
    )


@torch.library.custom_op(f"{NS}::adam_step_", mutates_args=("master", "mu", "nu", "params"))
def adam_step_(
    grads: list[Tensor],
    master: list[Tensor],
    mu: list[Tensor],
    nu: list[Tensor],
    params: list[Tensor],
    separate: list[bool],
    inv: Optional[Tensor],
    clip_div: Optional[Tensor],
    clip_mul: Optional[Tensor],
    lr: Tensor,
    apply: Optional[Tensor],
    require: Optional[Tensor],
    inv_c1: Tensor,
    sqrt_c2: Tensor,
    l2: float,
    b1: float,
    b2: float,
    eps: float,
    decoupled: float,
    members: int,
) -> Tensor:
    """:func:`adam_step` written into ``master``, ``mu``, ``nu`` and ``params``; returns ``finite``."""
    s = dict(inv=inv, clip_div=clip_div, clip_mul=clip_mul, lr=lr, apply=apply)
    s.update(require=require, inv_c1=inv_c1, sqrt_c2=sqrt_c2)
    _adam_checked("adam_step_", grads, master, mu, nu, params, separate, s, members)
    full = _full(master, params, separate)
    return _adam_into(
        kernel_for(grads[0].device),
        grads,
        master,
        mu,
        nu,
        full,
        master,
        mu,
        nu,
        full,
        s,
        _adam_hyper(l2, b1, b2, eps, decoupled),
        members,
    )


@adam_step_.register_fake
def _(grads, master, mu, nu, params, separate, inv, clip_div, clip_mul, lr, apply, require, inv_c1,
      sqrt_c2, l2, b1, b2, eps, decoupled, members):  # fmt: skip
    return torch.empty(lr.shape, dtype=torch.bool, device=lr.device)


# ---------------------------------------------------------------------------
# vmap: K members become K more groups of the same call.
# ---------------------------------------------------------------------------

_LISTS = {
    "grad_stats": ("grads",),
    "sgd_step": ("grads", "master", "trace", "params"),
    "adam_step": ("grads", "master", "mu", "nu", "params"),
}
_MUTATED = {"sgd_step_": ("master", "trace", "params"), "adam_step_": ("master", "mu", "nu", "params")}
_LISTS["sgd_step_"], _LISTS["adam_step_"] = _LISTS["sgd_step"], _LISTS["adam_step"]
_GROUP_SCALARS = ("inv", "clip_div", "clip_mul", "lr", "apply", "require", "started")
_GROUP_SCALARS += ("inv_c1", "sqrt_c2")


def _batched_first(x: Tensor, dim: int | None, size: int, name: str, mutated: bool) -> Tensor:
    """``x`` with the vmapped dimension first, its members consecutive blocks."""
    if dim is None:
        if mutated:
            raise ValueError(
                f"{NS}: under vmap, {name} is written in place but is not batched; "
                "batch every state tensor, or use the pure update"
            )
        return x.unsqueeze(0).expand(size, *x.shape).contiguous()
    x = x.movedim(dim, 0)
    if dense(x) and members_outermost(x, size):
        return x
    if mutated:
        raise ValueError(
            f"{NS}: under vmap, {name} is written in place but its members are not "
            "consecutive blocks of one tensor; pass the pure update instead"
        )
    return x.contiguous()


def _vmap_rule(name: str, op: Callable, n_outputs_batched: Callable):
    names = list(op._opoverload._schema.arguments)
    arg_names = [a.name for a in names]
    mutated = _MUTATED.get(name, ())

    def rule(info, in_dims, *args):
        size = info.batch_size
        values = dict(zip(arg_names, args))
        dims = dict(zip(arg_names, in_dims))
        for key in _LISTS[name]:
            xs, ds = values[key], dims[key]
            ds = ds if isinstance(ds, (list, tuple)) else [ds] * len(xs)
            values[key] = [
                _batched_first(x, d, size, f"{key}[{i}]", key in mutated)
                for i, (x, d) in enumerate(zip(xs, ds))
            ]
        for key in _GROUP_SCALARS:
            x = values.get(key)
            if x is None:
                continue
            d = dims[key]
            x = x.movedim(d, 0) if d is not None else x.unsqueeze(0).expand(size, *x.shape)
            values[key] = x.reshape(-1).contiguous()
        old_members = values["members"]
        values["members"] = old_members * size
        if name == "grad_stats":
            values["groups"] = values["groups"] * size
        out = op(**values)
        return n_outputs_batched(out, size)

    return rule


def _by_member(x: Tensor, size: int) -> Tensor:
    return x.reshape(size, -1)


def _step_outputs(out, size):
    *lists, finite = out
    return (*lists, _by_member(finite, size)), (*([0] * len(lists)), 0)


torch.library.register_vmap(
    grad_stats,
    _vmap_rule(
        "grad_stats",
        grad_stats,
        lambda out, size: ((_by_member(out[0], size), _by_member(out[1], size)), (0, 0)),
    ),
)
torch.library.register_vmap(sgd_step, _vmap_rule("sgd_step", sgd_step, _step_outputs))
torch.library.register_vmap(adam_step, _vmap_rule("adam_step", adam_step, _step_outputs))
torch.library.register_vmap(
    sgd_step_, _vmap_rule("sgd_step_", sgd_step_, lambda out, size: (_by_member(out, size), 0))
)
torch.library.register_vmap(
    adam_step_, _vmap_rule("adam_step_", adam_step_, lambda out, size: (_by_member(out, size), 0))
)
