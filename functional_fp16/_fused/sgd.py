r"""The fused SGD step: its plan, its ``torch.library`` ops and its plain PyTorch kernel.

:func:`sgd_plan` reads the transforms' declared specs, never code, and
returns the hyperparameters of the single-pass kernel when the chain,
flattened, has the form::

    [clip_by_global_norm(c)]  [add_decayed_weights(wd)]  [trace(mu, ...)]  scale_by_learning_rate(lr)

(brackets: optional; parts with a coefficient of 0 pass their input through
and are dropped; ``identity()`` is an empty chain). Anything else, including
any transform without a spec, returns ``None`` and runs as written.

Per element, with :math:`u = \operatorname{fl}_{32}(g)\, s^{-1}` (then
``(u / clip_div) * clip_mul`` when clipping), the ops compute

.. math::
    u &\leftarrow \operatorname{fma}(m, \lambda, u), \qquad
    b' = \operatorname{fl}(b \mu) + \operatorname{fl}(u (1 - d))
         \quad (b' = u \text{ before momentum has started}) \\
    v &= \operatorname{fma}(b', \mu, u) \text{ (Nesterov) or } b', \qquad
    m' = \operatorname{fma}(v, \mathrm{lr}, m), \qquad p' = \operatorname{fl}_{16}(m')

``torch.optim.SGD``'s arithmetic, multiply-adds contracted as its vectorised
kernels contract them: within one ulp of the reference chain's master per
step; the momentum and every decision bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._fused import op_checks, plain_kernels, stored, triton_stored
from functional_fp16._fused.chains import Path, chain_parts, in_order, lr_state_fits
from functional_fp16._fused.op_library import define_step
from functional_fp16._fused.plain_kernels import f32
from functional_fp16._fused.step_schema import StepSpec
from functional_fp16._fused.steps import Fusable, register
from functional_fp16._fused.stored import STORED_DTYPES
from functional_fp16._util import validate
from functional_fp16._util.tree import tree_flatten
from functional_fp16.precision.moment_storage import (
    DEFAULT_BLOCK,
    FLOAT32,
    BlockCodes,
    MomentFormat,
    decode,
    encode,
)
from functional_fp16.transforms.base import GradientTransformation, state_at
from functional_fp16.transforms.clipping import ClipSpec
from functional_fp16.transforms.sgd import (
    DecaySpec,
    LearningRateSpec,
    TraceSpec,
    TraceState,
)

__all__ = ["SGDPlan", "sgd_plan", "state_fits", "sgd_step", "sgd_step_"]


class SGDPlan(NamedTuple):
    """The hyperparameters of a fusable chain, and where its state lives.

    ``trace_path`` and ``lr_path`` index into the (nested tuple) optimiser
    state; ``trace_path`` is ``None`` without momentum.
    """

    max_norm: float | None  # None: no clipping
    weight_decay: float  # 0.0: no decay
    momentum: float  # 0.0: no momentum
    nesterov: bool
    dampening: float
    learning_rate: float | Callable[[torch.Tensor], torch.Tensor]
    sign: float  # -1.0 to descend
    trace_path: Path | None
    lr_path: Path
    trace_format: MomentFormat = FLOAT32

    @property
    def stored(self) -> bool:
        """Whether the trace is stored in fewer bits (the ``sgd_stored_step`` op)."""
        return self.trace_format is not FLOAT32

    @property
    def state_dtypes(self) -> tuple:
        """The dtypes the trace of this plan's leaves may have."""
        return STORED_DTYPES if self.stored else (torch.float32,)


def _read(parts: list[tuple[Any, Path]]) -> SGDPlan | None:
    # Pass-through parts change nothing; drop them.
    parts = [
        (s, p)
        for s, p in parts
        if not (isinstance(s, DecaySpec) and validate.is_zero(s.weight_decay))
        and not (isinstance(s, TraceSpec) and validate.is_zero(s.decay))
    ]
    found = in_order(parts, (ClipSpec, DecaySpec, TraceSpec, LearningRateSpec))
    if found is None or LearningRateSpec not in found:
        return None
    clip = found.get(ClipSpec, (None, None))[0]
    decay = found.get(DecaySpec, (None, None))[0]
    trace, trace_path = found.get(TraceSpec, (None, None))
    lr, lr_path = found[LearningRateSpec]
    return SGDPlan(
        max_norm=clip.max_norm if clip is not None else None,
        weight_decay=decay.weight_decay if decay is not None else 0.0,
        momentum=trace.decay if trace is not None else 0.0,
        nesterov=trace.nesterov if trace is not None else False,
        dampening=trace.dampening if trace is not None else 0.0,
        learning_rate=lr.learning_rate,
        sign=lr.sign,
        trace_path=trace_path,
        lr_path=lr_path,
        trace_format=trace.accumulator_format if trace is not None else FLOAT32,
    )


def sgd_plan(tx: GradientTransformation) -> SGDPlan | None:
    """The :class:`SGDPlan` of ``tx``, or ``None`` if it is not a fusable SGD chain.

    Read from the transforms' declared ``spec`` only (a chain without masks or labels).
    """
    parts = chain_parts(getattr(tx, "spec", None))
    return _read(parts) if parts else None


def state_fits(plan: SGDPlan, opt_state: Any, master_spec: Any) -> bool:
    """Whether ``opt_state`` has the plan's layout, its momentum shaped like the master."""
    try:
        if plan.trace_path is not None:
            trace = state_at(opt_state, plan.trace_path)
            if not isinstance(trace, TraceState) or tree_flatten(trace.trace)[1] != master_spec:
                return False
        return lr_state_fits(plan, opt_state)
    except (TypeError, IndexError, KeyError):
        return False


def _positions(plan: SGDPlan, by_key: dict) -> tuple[dict[str, int], dict[str, int]]:
    """A leaf's momentum position and the group's ``started`` flag (none without momentum)."""
    if plan.trace_path is None:
        return {}, {}
    where = by_key[plan.trace_path]
    roles = {"trace": where["trace"]}
    if plan.stored:  # block scales where the trace is coded, else -1
        roles["trace_scales"] = where.get("trace_scales", -1)
    return roles, {"started": where["initialized"]}


# ---------------------------------------------------------------------------
# The ops.
# ---------------------------------------------------------------------------


def _check(op: str, a: dict) -> list[str]:
    if a["momentum"] != 0.0:
        if a["started"] is None:
            op_checks.fail(op, "started is required with momentum", TypeError)
        return ["trace"]
    return []


def _kernel_args(a: dict, used: list[str]) -> dict:
    """The op's arguments as the kernel entry ``sgd_update`` takes them."""
    on = "trace" in used
    return dict(
        grads=a["grads"],
        master=a["master"],
        trace=a["trace"] if on else None,
        params=a["params"],
        master_out=a["master_out"],
        trace_out=a["trace_out"] if on else None,
        params_out=a["params_out"],
        inv=a["inv"],
        clip_div=a["clip_div"],
        clip_mul=a["clip_mul"],
        lr=a["lr"],
        started=a["started"] if on else None,
        weight_decay=a["weight_decay"],
        momentum=a["momentum"],
        take_started=1.0 - a["dampening"],  # rounded once to float32 by the kernel
        nesterov=bool(a["nesterov"]) and on,  # Nesterov needs momentum
    )


def _generic(
    *,
    members,
    grads,
    master,
    trace,
    params,
    master_out,
    trace_out,
    params_out,
    inv,
    clip_div,
    clip_mul,
    lr,
    apply,
    started,
    weight_decay,
    momentum,
    take_started,
    nesterov,
) -> None:
    """The plain PyTorch kernel: one leaf of one member at a time.

    ``torch.add(..., alpha=)`` and ``addcmul`` are the multiply-adds the C
    kernel contracts (on the CPU they are fused there too), so on the CPU it
    agrees with the C kernel bit for bit.
    """
    take = f32(take_started)
    if trace is None or take == 1.0:  # PyTorch's fused SGD: each group as a call of its own
        for _, of, at in plain_kernels.calls(len(grads), lr.numel(), members):
            _lists(
                of(grads), of(master), None if trace is None else of(trace), of(params),
                of(master_out), None if trace is None else of(trace_out), of(params_out),
                at(inv), at(clip_div), at(clip_mul), at(lr), at(apply), at(started),
                weight_decay, momentum, take, nesterov,
            )  # fmt: skip
        return
    if plain_kernels.one_group(lr, members):
        return _lists(
            grads, master, trace, params, master_out, trace_out, params_out, inv, clip_div,
            clip_mul, lr, apply, started, weight_decay, momentum, take, nesterov,
        )  # fmt: skip
    results = []
    for b, leaf, k in plain_kernels.walk(len(grads), lr.numel(), members):
        m = plain_kernels.member(master[leaf], b, members)
        u = plain_kernels.unscaled(
            plain_kernels.member(grads[leaf], b, members), inv, clip_div, clip_mul, k
        )
        if weight_decay != 0.0:
            u = torch.add(u, m, alpha=weight_decay)
        v, nb = u, None
        if trace is not None:  # momentum is on (it may round to 0 in float32)
            on = started[k]
            keep = torch.where(on, momentum, 0.0).float()
            old = plain_kernels.member(trace[leaf], b, members)
            nb = old * keep + u * torch.where(on, take, 1.0).float()
            v = torch.add(u, nb, alpha=momentum) if nesterov else nb
        results.append((b, leaf, k, torch.addcmul(m, v, lr[k]), nb))
    # Every new value is computed before any output is written (donation).
    for b, leaf, k, nm, nb in results:
        new = {"master": nm, "trace": nb}
        plain_kernels.write_member(
            b,
            leaf,
            members,
            apply[k],
            new,
            master=master,
            trace=trace,
            params=params,
            master_out=master_out,
            trace_out=trace_out,
            params_out=params_out,
        )


def _lists(
    grads, master, trace, params, master_out, trace_out, params_out, inv, clip_div, clip_mul,
    lr, apply, started, weight_decay, momentum, take, nesterov,
) -> None:  # fmt: skip
    r"""The plain kernel of one group of one member: a fixed number of multi-tensor ops
    whatever the leaves, and one of PyTorch's fused kernels.

    Without dampening (``take == 1``) or without momentum the step is PyTorch's
    fused SGD kernel (``torch._fused_sgd_``) on the unscaled gradients, in place
    in the outputs (copies of the inputs, or the inputs when donated), with
    ``found_inf`` the skip: per element

    .. math:: u \leftarrow u + \lambda m, \quad b' = \mu b + u, \quad
              v = u + \mu b' \text{ (Nesterov) or } b', \quad m' = m - (-\eta)\, v

    Before momentum has started the trace is zero (the state's invariant: it
    starts at zero and changes only on an applied step, which starts it), so
    :math:`\mu b + u = u` there, as the reference's :math:`b' = u`. The only
    temporary is the float32 gradient list (4 B a parameter) and, afterwards,
    the FP16 working copies (2 B). With dampening the first step differs from
    PyTorch's (:math:`b' = u`, not :math:`(1 - d) u`), so it runs as multi-tensor
    ops.
    """
    given, apply = apply, apply.reshape(())
    if trace is None or take == 1.0:
        u = plain_kernels.read_unscaled(grads, master, inv, clip_div, clip_mul)  # only read
        t_out, t_in = (trace_out, trace) if trace is not None else ([], [])
        plain_kernels.start_from(master_out + t_out, master + t_in)  # one copy
        torch._fused_sgd_(
            master_out, u, t_out, weight_decay=weight_decay, momentum=momentum if t_out else 0.0,
            lr=plain_kernels.descending(lr), dampening=0.0, nesterov=bool(nesterov and t_out),
            maximize=False, is_first_step=False, grad_scale=None,
            found_inf=plain_kernels.skip_flag(given),  # the decision's own: once an update
        )  # fmt: skip
        del u
        plain_kernels.refresh_params(given, master_out, params, params_out)
        return
    u = plain_kernels.unscaled_lists(grads, master, inv, clip_div, clip_mul)  # written
    if weight_decay != 0.0:
        torch._foreach_add_(u, master, alpha=weight_decay)
    on = started.reshape(())
    nb = torch._foreach_mul(trace, torch.where(on, momentum, 0.0).float())
    torch._foreach_add_(nb, torch._foreach_mul(u, torch.where(on, take, 1.0).float()))
    if nesterov:
        torch._foreach_add_(u, nb, alpha=momentum)  # v = u + mu b', in u's buffers
    v = u if nesterov else nb
    plain_kernels.write_lists(
        apply, {"trace": nb}, v, lr, master=master, trace=trace, params=params,
        master_out=master_out, trace_out=trace_out, params_out=params_out,
    )  # fmt: skip


def _split_generic(*, members, apply, used, trace, trace_out, started, take_started, **kw):
    """A split master on the plain kernels with momentum: the stored-trace step's (a
    Triton launch a leaf on CUDA, joining and splitting in its one pass; the C kernel's
    arithmetic, where the float32 master's plain step is PyTorch's fused SGD, within an
    ulp of it), its trace float32. Without momentum False: joined, stepped, split."""
    if "trace" not in used:
        return False
    _stored_generic(
        members=members, apply=apply, trace=trace, trace_out=trace_out, trace_scales=[],
        trace_scales_out=[], started=started.float(), take=take_started, count=None,
        block_size=DEFAULT_BLOCK, rounding=0, salt_ids=[], **kw,
    )  # fmt: skip
    return True


SPEC = StepSpec(
    name="sgd_step",
    states=("trace",),
    scalars=("started",),
    bool_scalars=("started",),
    hyper=(
        ("weight_decay", "float"),
        ("momentum", "float"),
        ("dampening", "float"),
        ("nesterov", "bool"),
    ),
    entry="sgd_update",
    check=_check,
    kernel_args=_kernel_args,
    generic=_generic,
    split_generic=_split_generic,
    # split: 0, a split master reaching the C entry here having been joined (run_step)
    c_extra={"require": None, "decided_out": None, "leaf_finite_out": None, "split": 0},
    speculative=True,
    cpp_op="sgd",
    cpp_hyper=lambda a: (
        a["weight_decay"],
        a["momentum"],
        1.0 - a["dampening"],  # rounded once to float32 by the kernel
        bool(a["nesterov"]),
    ),
)

SGD_OPS = define_step(
    SPEC,
    r"""One fused SGD step into fresh tensors:
    ``(master', trace', params', finite, leaf_finite)``.

    See the module docstring for the arithmetic and :mod:`functional_fp16._fused.step_schema`
    for the conventions. ``trace`` is empty without momentum (and so is ``trace'``).
    """,
)
sgd_step, sgd_step_ = SGD_OPS.functional, SGD_OPS.donated


# ---------------------------------------------------------------------------
# The step of a state.
# ---------------------------------------------------------------------------


def _step(plan: SGDPlan, grads, masters, roles, shared, own, common, donate, memo):
    """One op call for a group: ``(masters', roles', params', decided, shared')``, where
    ``decided`` is the op's ``(finite, leaf_finite)``."""
    if plan.stored:
        return _stored_step(plan, grads, masters, roles, shared, own, common, donate, memo)
    trace = roles.get("trace", [])
    started = None
    hyper = dict(weight_decay=plan.weight_decay, momentum=plan.momentum)
    hyper.update(dampening=plan.dampening, nesterov=plan.nesterov)
    old = None
    if plan.trace_path is not None:
        old = memo["opt"][shared["started"]]
        started = old.reshape(1)
    a = dict(grads=grads, master=masters, trace=trace, params=own, started=started)
    if donate:
        decided = SGD_OPS.call(True, {**a, **common, **hyper})
        m_out, t_out, p_new = masters, trace, own
    else:
        m_out, t_out, p_new, *decided = SGD_OPS.call(False, {**a, **common, **hyper})
    # "started" (a bool flag) is set by the update's bookkeeping op, with the counters
    return list(m_out), {"trace": list(t_out)}, list(p_new), tuple(decided), {}


# ---------------------------------------------------------------------------
# A stored trace (bf16, fp16, E4M3 block codes; rounded to nearest: it keeps no count).
# ---------------------------------------------------------------------------


def _stored_generic(
    *, members, grads, master, trace, trace_scales, params, master_out, trace_out,
    trace_scales_out, params_out, inv, clip_div, clip_mul, lr, apply, started, count,
    weight_decay, momentum, take, nesterov, block_size, rounding, salt_ids,
) -> None:  # fmt: skip
    """CUDA's default for a stored trace: for one group of one member, the Triton kernel
    (:func:`.triton_stored.sgd_leaf`) on each leaf it takes; else the reference's decode,
    SGD's arithmetic (as :func:`_generic` computes it) and encode, one leaf of one member
    at a time (bitwise the C kernel on the CPU)."""
    del count, salt_ids  # rounded to nearest
    fmts = stored.formats(block_size, rounding)
    take = f32(take)
    coded = {j: i for i, j in enumerate(x for x, t in enumerate(trace) if t.dtype == torch.uint8)}
    kernel = plain_kernels.one_group(lr, members) and triton_stored.available(lr.device)
    for b, leaf, k in plain_kernels.walk(len(grads), lr.numel(), members):
        scales = (
            (trace_scales[coded[leaf]], trace_scales_out[coded[leaf]])
            if leaf in coded
            else (None, None)
        )
        if kernel and triton_stored.takes(
            [(trace[leaf], scales[0])], grads[leaf], params[leaf], True
        ):
            triton_stored.sgd_leaf(
                grad=grads[leaf], master=master[leaf], trace=trace[leaf],
                trace_scales=scales[0], param=params[leaf], master_out=master_out[leaf],
                trace_out=trace_out[leaf], trace_scales_out=scales[1],
                param_out=params_out[leaf], inv=inv, clip_div=clip_div, clip_mul=clip_mul,
                lr=lr, apply=apply, started=started, weight_decay=weight_decay,
                momentum=momentum, take=take, nesterov=nesterov, block_size=block_size,
            )  # fmt: skip
            continue
        at = lambda xs: plain_kernels.member(xs[leaf], b, members)  # noqa: E731
        m, was = stored.read_master(at(master), at(params)), at(trace)
        fmt = fmts[(was.dtype, False)]
        if leaf in coded:
            was = BlockCodes(was, plain_kernels.member(trace_scales[coded[leaf]], b, members))
        u = plain_kernels.unscaled(at(grads), inv, clip_div, clip_mul, k)
        if weight_decay != 0.0:
            u = torch.add(u, m, alpha=weight_decay)
        on = started[k] != 0
        keep = torch.where(on, momentum, 0.0).float()
        nb = decode(fmt, was) * keep + u * torch.where(on, take, 1.0).float()
        v = torch.add(u, nb, alpha=momentum) if nesterov else nb
        nm = torch.addcmul(m, v, lr[k])
        new = encode(fmt, nb, was)
        ok = apply[k]
        stored.write_master(ok, nm, m, at(master_out), at(params_out), at(params))
        s_out = trace_scales_out[coded[leaf]] if leaf in coded else None
        s_out = None if s_out is None else plain_kernels.member(s_out, b, members)
        stored.write_state(ok, new, was, at(trace_out), s_out)


def _stored_kernel_args(a: dict, used: list[str]) -> dict:
    del used
    names = ("grads", "master", "trace", "trace_scales", "params", "master_out", "trace_out")
    names += ("trace_scales_out", "params_out", "inv", "clip_div", "clip_mul", "lr", "started")
    names += ("count", "weight_decay", "momentum", "nesterov", "block_size", "rounding")
    return dict({n: a[n] for n in names}, take=1.0 - a["dampening"], salt_ids=a["salt_ids"])


STORED_SPEC = StepSpec(
    name="sgd_stored_step",
    states=("trace", "trace_scales"),
    scalars=("started", "count"),
    bool_scalars=(),
    hyper=(
        ("weight_decay", "float"),
        ("momentum", "float"),
        ("dampening", "float"),
        ("nesterov", "bool"),
        ("block_size", "int"),
        ("rounding", "int"),
        ("salt_ids", "int[]"),
    ),
    entry="",  # no ctypes entry: the C kernel runs through its C++ op only
    check=lambda op, a: stored.check_stored(op, a, ("trace",), ("started", "count")),
    kernel_args=_stored_kernel_args,
    generic=_stored_generic,
    cpp_op="stored_step",
    cpp_hyper=lambda a: (
        a["weight_decay"],
        a["momentum"],
        1.0 - a["dampening"],  # rounded once to float32 by the kernel
        float(bool(a["nesterov"])),
    ),
    int_scalars=("count",),
    side=("trace_scales",),
    state_dtypes=STORED_DTYPES,
    stored="sgd_stored",
)

SGD_STORED_OPS = define_step(
    STORED_SPEC,
    r"""One fused SGD step with momentum and a stored trace into fresh tensors:
    ``(master', trace', trace_scales', params', finite, leaf_finite)``.

    SGD's arithmetic (the module docstring) between a decode and an encode of the trace
    (:mod:`functional_fp16._fused.stored`), rounded to nearest; ``started`` is each
    group's flag as float32 (1: momentum has started).
    """,
)


def _stored_step(plan: SGDPlan, grads, masters, roles, shared, own, common, donate, memo):
    """:func:`_step` for a stored trace: one ``sgd_stored_step`` call."""
    old = memo["opt"][shared["started"]]
    key = ("sgd_stored_count", old.device)
    if key not in memo:  # the rounding is to nearest: the count is not read
        memo[key] = torch.zeros(1, dtype=torch.int64, device=old.device)
    a = dict(grads=grads, master=masters, trace=roles["trace"], trace_scales=roles["trace_scales"])
    a.update(params=own, **common, started=old.reshape(1).float(), count=memo[key])
    a.update(weight_decay=plan.weight_decay, momentum=plan.momentum, dampening=plan.dampening)
    a.update(nesterov=plan.nesterov, block_size=plan.trace_format.block_size, rounding=0)
    a.update(salt_ids=[0] * len(grads))
    if donate:
        decided = SGD_STORED_OPS.call(True, a)
        m_out, t_out, sc_out, p_new = masters, a["trace"], a["trace_scales"], own
    else:
        m_out, t_out, sc_out, p_new, *decided = SGD_STORED_OPS.call(False, a)
    roles_out = {"trace": list(t_out), "trace_scales": list(sc_out)}
    return list(m_out), roles_out, list(p_new), tuple(decided), {}  # "started": as in _step


def _reads_unscaled(plan: SGDPlan) -> bool:
    """Whether the plain kernel steps ``plan`` with PyTorch's fused SGD, which only reads
    its float32 gradients (no momentum, or momentum without dampening)."""
    return not plan.stored and (plan.momentum == 0.0 or f32(1.0 - plan.dampening) == 1.0)


register(Fusable("sgd", _read, _positions, _step, reads_unscaled=_reads_unscaled))
