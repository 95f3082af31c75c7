r"""The fused RMSProp step: its plan, its ``torch.library`` ops and its plain PyTorch kernel.

:func:`_read` reads the transforms' declared specs only and returns the
hyperparameters of the step when the chain, flattened, has the form::

    [clip_by_global_norm(c)]  scale_by_rms(rho, eps)  scale_by_learning_rate(lr)  [trace(mu)]

(brackets: optional; a trace with momentum 0 passes its input through and is
dropped), which is :func:`~functional_fp16.rmsprop` without bias correction, its
momentum with or without Nesterov. Anything else (centred, bias-corrected,
dampened, a stored trace) returns ``None`` and runs as written.

Per element, with :math:`u` the unscaled (clipped) gradient, :math:`\nu` the
average of squares, :math:`b` the trace, :math:`f` the signed learning rate and
:math:`\kappa = \mu` once momentum has started (else 0), the ops compute

.. math::
    \nu' &= \operatorname{fma}(\operatorname{fl}(u\,w),\, u,\, \operatorname{fl}(\nu\rho)),
        \quad w = \operatorname{fl}_{32}(1 - \rho) \\
    s &= u \,/\, \sqrt{\nu' + \epsilon}
        \quad\text{or}\quad u \,/\, (\sqrt{\nu'} + \epsilon), \qquad v = \operatorname{fl}(s f) \\
    b' &= \operatorname{fl}(b\kappa) + v, \qquad
    o = b' \text{, or } v + \mu b' \text{ (Nesterov), or } v \text{ (no momentum)}, \qquad
    m' = \operatorname{fl}(m + o)

each operation rounded once as the reference chain rounds it (the multiply-adds
that ``addcmul`` and Nesterov's ``torch.add(alpha=)`` contract on the CPU, the
correctly rounded root), so that on the CPU the step is the chain's bit for bit,
in both kernels: the C kernel (``ff_rmsprop_step``, through the generic C++ op)
and the plain kernel CUDA runs, a fixed number of multi-tensor ops a piece of at
most :data:`PIECE` elements (whatever the number of leaves), whose temporaries
are a piece's, not the parameters'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._fused import op_checks, plain_kernels
from functional_fp16._fused.chains import Path, in_order
from functional_fp16._fused.op_library import define_step
from functional_fp16._fused.plain_kernels import f32
from functional_fp16._fused.step_schema import StepSpec
from functional_fp16._fused.steps import Fusable, register
from functional_fp16._util import validate
from functional_fp16.precision.moment_storage import FLOAT32
from functional_fp16.transforms.clipping import ClipSpec
from functional_fp16.transforms.rmsprop import RmsSpec
from functional_fp16.transforms.sgd import LearningRateSpec, TraceSpec

__all__ = ["RmsPlan", "PIECE", "rmsprop_step", "rmsprop_step_"]


class RmsPlan(NamedTuple):
    """The hyperparameters of a fusable RMSProp chain, and where its state lives."""

    max_norm: float | None  # None: no clipping
    decay: float
    eps: float
    eps_in_sqrt: bool
    learning_rate: float | Callable[[torch.Tensor], torch.Tensor]
    sign: float  # -1.0 to descend
    momentum: float  # 0.0: no trace
    nesterov: bool
    rms_path: Path
    lr_path: Path
    trace_path: Path | None


_ORDER = (ClipSpec, RmsSpec, LearningRateSpec, TraceSpec)


def _plain_trace(spec: TraceSpec) -> bool:
    """A trace the step runs: a float momentum, no dampening, a float32 buffer."""
    return (
        type(spec.decay) is float
        and validate.is_zero(spec.dampening)
        and spec.accumulator_format is FLOAT32
    )


def _read(parts: list[tuple[Any, Path]]) -> RmsPlan | None:
    # A trace of momentum 0 passes its input through: dropped (a float 0 only; a tensor's
    # value is not read, and its trace runs as written).
    parts = [
        (s, p) for s, p in parts if not (isinstance(s, TraceSpec) and validate.is_zero(s.decay))
    ]
    found = in_order(parts, _ORDER)
    if found is None or RmsSpec not in found or LearningRateSpec not in found:
        return None
    rms, rms_path = found[RmsSpec]
    if rms.bias_correction:
        return None
    trace, trace_path = found.get(TraceSpec, (None, None))
    if trace is not None and not _plain_trace(trace):
        return None
    clip = found.get(ClipSpec, (None, None))[0]
    lr, lr_path = found[LearningRateSpec]
    return RmsPlan(
        max_norm=clip.max_norm if clip is not None else None,
        decay=rms.decay,
        eps=rms.eps,
        eps_in_sqrt=rms.eps_in_sqrt,
        learning_rate=lr.learning_rate,
        sign=lr.sign,
        momentum=trace.decay if trace is not None else 0.0,
        nesterov=trace.nesterov if trace is not None else False,
        rms_path=rms_path,
        lr_path=lr_path,
        trace_path=trace_path,
    )


def _positions(plan: RmsPlan, by_key: dict) -> tuple[dict[str, int], dict[str, int]]:
    """A leaf's average and trace positions; the group's count and ``started`` flag."""
    where = by_key[plan.rms_path]
    roles, shared = {"nu": where["nu"]}, {"count": where["count"]}
    if plan.trace_path is not None:
        traced = by_key[plan.trace_path]
        roles["trace"] = traced["trace"]
        shared["started"] = traced["initialized"]
    return roles, shared


# ---------------------------------------------------------------------------
# The ops.
# ---------------------------------------------------------------------------

PIECE = plain_kernels.SQRT_BATCH
"""The most elements the plain kernel steps at once (its temporaries: a few float32 lists
of this many elements, and the CPU's float64 root of as many)."""


def _check(op: str, a: dict) -> list[str]:
    if a["momentum"] != 0.0:
        if a["started"] is None:
            op_checks.fail(op, "started is required with momentum", TypeError)
        return ["nu", "trace"]
    return ["nu"]


def _kernel_args(a: dict, used: list[str]) -> dict:
    """The op's arguments as the plain kernel takes them."""
    on = "trace" in used
    names = ("grads", "master", "nu", "params", "master_out", "nu_out", "params_out")
    return dict(
        {n: a[n] for n in names},
        trace=a["trace"] if on else None,
        trace_out=a["trace_out"] if on else None,
        inv=a["inv"],
        clip_div=a["clip_div"],
        clip_mul=a["clip_mul"],
        lr=a["lr"],
        started=a["started"] if on else None,
        decay=a["decay"],
        eps=a["eps"],
        eps_in_sqrt=bool(a["eps_in_sqrt"]),
        momentum=a["momentum"] if on else 0.0,
        nesterov=bool(a["nesterov"]) and on,
    )


def _generic(*, members, apply, trace, trace_out, started, **kw) -> None:
    """The plain kernel: each group of each member as a call of its own (:func:`_lists`)."""
    for _, of, at in plain_kernels.calls(len(kw["grads"]), kw["lr"].numel(), members):
        lists = {n: of(kw[n]) for n in ("grads", "master", "nu", "params")}
        lists.update({n: of(kw[n]) for n in ("master_out", "nu_out", "params_out")})
        _lists(
            **lists,
            trace=None if trace is None else of(trace),
            trace_out=None if trace_out is None else of(trace_out),
            inv=at(kw["inv"]), clip_div=at(kw["clip_div"]), clip_mul=at(kw["clip_mul"]),
            lr=at(kw["lr"]), apply=at(apply), started=at(started), decay=kw["decay"],
            eps=kw["eps"], eps_in_sqrt=kw["eps_in_sqrt"], momentum=kw["momentum"],
            nesterov=kw["nesterov"],
        )  # fmt: skip


def _lists(
    *, grads, master, nu, trace, params, master_out, nu_out, trace_out, params_out, inv,
    clip_div, clip_mul, lr, apply, started, decay, eps, eps_in_sqrt, momentum, nesterov,
) -> None:  # fmt: skip
    r"""One group of one member, a piece of at most :data:`PIECE` elements at a time: the
    new master, average and trace computed in the piece's temporaries (the unscaled
    gradient's buffers hold :math:`s`, :math:`v`, then :math:`m'`), then selected bit for
    bit into the outputs where the step applies (the old values where it skips); the
    working copies are refreshed from the new master once, whole.

    Temporaries: four float32 lists of a piece (and the CPU root's float64 one), so at
    most about 24 MiB whatever the parameters, where the leaves are contiguous (a leaf
    that is not, larger than a piece, is a piece of its own, whole); a donated step's
    refresh rounds into 2 B a parameter (FP16 working copies).
    """
    f, w = lr.reshape(()), f32(1.0 - decay)
    keep = None
    if trace is not None:
        keep = torch.where(started.reshape(()), momentum, 0.0).float()
    states = [master, nu] + ([trace] if trace is not None else [])
    outs = [master_out, nu_out] + ([trace_out] if trace_out is not None else [])
    donated = all(o is x for o, x in zip(master_out, master))
    k = len(states)
    for piece in plain_kernels.pieces([grads, *states, *([] if donated else outs)], PIECE):
        g, old = piece[0], piece[1 : 1 + k]
        m, nu_old = old[0], old[1]
        u = plain_kernels.unscaled_lists(g, m, inv, clip_div, clip_mul)
        new_nu = torch._foreach_mul(nu_old, decay)
        torch._foreach_addcmul_(new_nu, u, u, value=w)  # fma(fl(u w), u, fl(nu rho))
        if eps_in_sqrt:
            root = torch._foreach_add(new_nu, eps)
            plain_kernels.correct_sqrt(root, out=root)
        else:
            root = plain_kernels.correct_sqrt(new_nu)
            torch._foreach_add_(root, eps)
        torch._foreach_div_(u, root)  # s, in u's buffers
        del root
        torch._foreach_mul_(u, f)  # v
        new = [u, new_nu]
        if trace is not None:
            new_b = torch._foreach_mul(old[2], keep)
            torch._foreach_add_(new_b, u)  # b' = fl(b kappa) + v
            if nesterov:
                torch._foreach_add_(u, new_b, alpha=momentum)  # o = v + mu b'
            else:
                torch._foreach_copy_(u, new_b)  # o = b'
            new.append(new_b)
        torch._foreach_add_(u, m)  # m' = fl(o + m), in u's buffers
        dest = old if donated else piece[1 + k :]
        plain_kernels.select_into(
            apply, [x for xs in new for x in xs], [x for xs in old for x in xs],
            [x for xs in dest for x in xs], consume=True,
        )  # fmt: skip
    plain_kernels.refresh_params(apply, master_out, params, params_out)


SPEC = StepSpec(
    name="rmsprop_step",
    states=("nu", "trace"),
    scalars=("started",),
    bool_scalars=("started",),
    hyper=(
        ("decay", "float"),
        ("eps", "float"),
        ("eps_in_sqrt", "bool"),
        ("momentum", "float"),
        ("nesterov", "bool"),
    ),
    entry="",  # the C kernel runs through its C++ op only
    check=_check,
    kernel_args=_kernel_args,
    generic=_generic,
    cpp_op="rmsprop",
    cpp_hyper=lambda a: (a["decay"], a["eps"], a["eps_in_sqrt"], a["momentum"], a["nesterov"]),
    c_block=True,
)

RMSPROP_OPS = define_step(
    SPEC,
    r"""One fused RMSProp step into fresh tensors:
    ``(master', nu', trace', params', finite, leaf_finite)``.

    See the module docstring for the arithmetic and :mod:`functional_fp16._fused.step_schema`
    for the conventions; ``trace`` is empty (and ``started`` unused) without momentum.
    """,
)
rmsprop_step, rmsprop_step_ = RMSPROP_OPS.functional, RMSPROP_OPS.donated


# ---------------------------------------------------------------------------
# The step of a state.
# ---------------------------------------------------------------------------


def _step(plan: RmsPlan, grads, masters, roles, shared, own, common, donate, memo):
    """One op call for a group: ``(masters', roles', params', decided, shared')``, where
    ``decided`` is the op's ``(finite, leaf_finite)``. The count advances and ``started``
    is set by the update's bookkeeping, on an applied step."""
    trace = roles.get("trace", [])
    started = None
    if plan.trace_path is not None:
        started = memo["opt"][shared["started"]].reshape(1)
    a = dict(grads=grads, master=masters, nu=roles["nu"], trace=trace, params=own)
    a.update(common, started=started, decay=plan.decay, eps=plan.eps)
    a.update(eps_in_sqrt=plan.eps_in_sqrt, momentum=plan.momentum, nesterov=plan.nesterov)
    if donate:
        decided = RMSPROP_OPS.call(True, a)
        m_out, nu_out, t_out, p_new = masters, roles["nu"], trace, own
    else:
        m_out, nu_out, t_out, p_new, *decided = RMSPROP_OPS.call(False, a)
    roles_out = {"nu": list(nu_out)}
    if plan.trace_path is not None:
        roles_out["trace"] = list(t_out)
    return list(m_out), roles_out, list(p_new), tuple(decided), {}


register(Fusable("rmsprop", _read, _positions, _step))
