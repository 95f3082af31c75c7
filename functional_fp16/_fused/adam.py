r"""The fused Adam/AdamW step: its plan, its ``torch.library`` ops and its plain PyTorch kernel.

:func:`adam_plan`
reads the transforms' declared ``spec`` only, never code, and returns the
hyperparameters of the single-pass kernel when the chain, flattened, has the
form::

    [clip_by_global_norm(c)]  [add_decayed_weights(wd)]  scale_by_adam(b1, b2, eps)
        [add_decayed_weights(wd)]  scale_by_learning_rate(lr)

(brackets: optional; a weight decay of 0 is dropped). The decay before
``scale_by_adam`` is ``torch.optim.Adam``'s L2 term, added to the gradient;
the one after it is AdamW's decoupled decay. ``eps_root`` must be 0 (the
kernel computes torch's denominator). Anything else returns ``None`` and runs
as written.

Per element, with :math:`u` the unscaled (clipped) gradient, :math:`w =
\operatorname{fl}_{32}(1 - \beta_1)` and :math:`c = 1 - \beta_2`, the ops compute

.. math::
    u &\leftarrow \operatorname{fma}(m, \lambda_2, u), \qquad
    a' = \operatorname{lerp}(a, u, w), \qquad
    v' = \operatorname{addcmul}(\operatorname{fl}(v \beta_2), u, u, c) \\
    \sigma &= \frac{a'}{\sqrt{v'} / \sqrt{1 - \beta_2^t} + \epsilon}\,
              \frac{1}{1 - \beta_1^t}, \qquad
    \sigma \leftarrow \operatorname{fma}(m, \lambda_d, \sigma), \qquad
    m' = \operatorname{fma}(\sigma, \mathrm{lr}, m)

as ``torch.optim.Adam``/``AdamW`` compute it: the moments bitwise (the
contractions of torch's CPU ``lerp`` and ``addcmul``), the bias corrections as
float32 factors made in float64 on the device, the master within one ulp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._fused import op_checks, op_library, plain_kernels
from functional_fp16._fused.adam_stored import ADAM_STORED_OPS, ROUNDINGS, STORED_DTYPES
from functional_fp16._fused.adam_stored import _generic as adam_stored_generic
from functional_fp16._fused.chains import Path, chain_parts
from functional_fp16._fused.groups import INDEX
from functional_fp16._fused.op_library import define_step
from functional_fp16._fused.plain_kernels import f32
from functional_fp16._fused.step_scalars import count_after
from functional_fp16._fused.step_schema import StepSpec
from functional_fp16._fused.steps import Fusable, incremented, register
from functional_fp16._util import validate
from functional_fp16.precision.master_split import holds_residuals
from functional_fp16.precision.moment_storage import DEFAULT_BLOCK, FLOAT32, MomentFormat
from functional_fp16.transforms.adam import AdamSpec, bias_corrections, sqrt_rn
from functional_fp16.transforms.base import (
    GradientTransformation,
)
from functional_fp16.transforms.clipping import ClipSpec
from functional_fp16.transforms.sgd import DecaySpec, LearningRateSpec

__all__ = ["AdamPlan", "adam_plan", "adam_step", "adam_step_"]


class AdamPlan(NamedTuple):
    """The hyperparameters of a fusable Adam chain, and where its state lives."""

    max_norm: float | None  # None: no clipping
    l2_decay: float  # torch.optim.Adam's weight_decay, added to the gradient
    b1: float
    b2: float
    eps: float
    decoupled_decay: float  # AdamW's weight decay, added to the Adam direction
    learning_rate: float | Callable[[torch.Tensor], torch.Tensor]
    sign: float  # -1.0 to descend
    adam_path: Path
    lr_path: Path
    mu_format: MomentFormat = FLOAT32
    nu_format: MomentFormat = FLOAT32

    @property
    def stored(self) -> bool:
        """Whether a moment is stored in fewer bits (the ``adam_stored_step`` op)."""
        return self.mu_format is not FLOAT32 or self.nu_format is not FLOAT32

    @property
    def state_dtypes(self) -> tuple:
        """The dtypes the moments of this plan's leaves may have."""
        return STORED_DTYPES if self.stored else (torch.float32,)


_ORDER = (ClipSpec, DecaySpec, AdamSpec, DecaySpec, LearningRateSpec)


def _read(parts: list[tuple[Any, Path]]) -> AdamPlan | None:
    parts = [
        (s, p)
        for s, p in parts
        if not (isinstance(s, DecaySpec) and validate.is_zero(s.weight_decay))
    ]
    slots: list[tuple[Any, Path] | None] = [None] * len(_ORDER)
    position = 0
    for spec, path in parts:
        while position < len(_ORDER) and type(spec) is not _ORDER[position]:
            position += 1
        if position == len(_ORDER):  # out of order, twice, or unknown
            return None
        slots[position] = (spec, path)
        position += 1
    clip, l2, adam, decoupled, lr = slots
    if adam is None or lr is None or adam[0].eps_root != 0.0:
        return None
    spec: AdamSpec = adam[0]
    if spec.nu_format.scale is not None or spec.mu_format.scale is not None:
        return None  # a per-tensor scale needs the whole new moment first: runs as written
    return AdamPlan(
        max_norm=clip[0].max_norm if clip else None,
        l2_decay=l2[0].weight_decay if l2 else 0.0,
        b1=spec.b1,
        b2=spec.b2,
        eps=spec.eps,
        decoupled_decay=decoupled[0].weight_decay if decoupled else 0.0,
        learning_rate=lr[0].learning_rate,
        sign=lr[0].sign,
        adam_path=adam[1],
        lr_path=lr[1],
        mu_format=spec.mu_format,
        nu_format=spec.nu_format,
    )


def adam_plan(tx: GradientTransformation) -> AdamPlan | None:
    """The :class:`AdamPlan` of ``tx``, or ``None`` if it is not a fusable Adam chain.

    Read from the transforms' declared ``spec`` only (a chain without masks or labels).
    """
    parts = chain_parts(getattr(tx, "spec", None))
    return _read(parts) if parts else None


def _positions(plan: AdamPlan, by_key: dict) -> tuple[dict[str, int], dict[str, int]]:
    """A leaf's moment positions and the group's step count."""
    where = by_key[plan.adam_path]
    roles = {"mu": where["mu"], "nu": where["nu"]}
    if plan.stored:  # block scales where a moment is coded, else -1
        roles.update(mu_scales=where.get("mu_scales", -1), nu_scales=where.get("nu_scales", -1))
    return roles, {"count": where["count"]}


def _index(plan: AdamPlan, by_key: dict) -> int:
    """A leaf's index among its ``scale_by_adam``'s leaves (the rounding's leaf salt)."""
    return by_key[plan.adam_path][INDEX]


# ---------------------------------------------------------------------------
# The ops.
# ---------------------------------------------------------------------------


def _kernel_args(a: dict, used: list[str]) -> dict:
    """The op's arguments as the kernel entry ``adam_update`` takes them."""
    del used
    names = ("grads", "master", "mu", "nu", "params", "master_out", "mu_out", "nu_out")
    names += ("params_out", "inv", "clip_div", "clip_mul", "lr", "inv_c1", "sqrt_c2", "l2")
    names += ("count", "b1")  # PyTorch's fused kernel's (the plain kernel's alone)
    return dict(
        {n: a[n] for n in names},
        w=f32(1.0 - a["b1"]),  # torch.lerp's weight, rounded once to float32
        b2=a["b2"],
        c2=1.0 - a["b2"],  # addcmul's value, rounded once to float32 by the kernel
        eps=a["eps"],
        decoupled=a["decoupled"],
    )


def _generic(
    *,
    members,
    grads,
    master,
    mu,
    nu,
    params,
    master_out,
    mu_out,
    nu_out,
    params_out,
    inv,
    clip_div,
    clip_mul,
    lr,
    apply,
    inv_c1,
    sqrt_c2,
    l2,
    count,
    b1,
    w,
    b2,
    c2,
    eps,
    decoupled,
) -> None:
    """The plain PyTorch kernel: one group of one member through PyTorch's fused Adam
    (:func:`_fused`, given the step ``count``); else one leaf of one member at a time
    (bitwise the C one on the CPU)."""
    if count is not None and not (l2 and decoupled):
        # A call of several groups or members (vmap) steps each as a call of its own
        # would: a batched update is bitwise its members' updates.
        for _, of, at in plain_kernels.calls(len(grads), lr.numel(), members):
            _fused(
                of(grads), of(master), of(mu), of(nu), of(params), of(master_out), of(mu_out),
                of(nu_out), of(params_out), at(inv), at(clip_div), at(clip_mul), at(lr),
                at(apply), at(count), l2, b1, b2, eps, decoupled,
            )  # fmt: skip
        return
    inv_c1, sqrt_c2 = _corrections_given(inv_c1, sqrt_c2, count, b1, b2)
    c2 = f32(c2)
    if plain_kernels.one_group(lr, members):
        return _lists(
            grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out, inv,
            clip_div, clip_mul, lr, apply, inv_c1, sqrt_c2, l2, w, b2, c2, eps, decoupled,
        )  # fmt: skip
    results = []
    for b, leaf, k in plain_kernels.walk(len(grads), lr.numel(), members):
        m = plain_kernels.member(master[leaf], b, members)
        u = plain_kernels.unscaled(
            plain_kernels.member(grads[leaf], b, members), inv, clip_div, clip_mul, k
        )
        if l2 != 0.0:
            u = torch.add(u, m, alpha=l2)
        na = torch.lerp(plain_kernels.member(mu[leaf], b, members), u, w)
        nv = torch.addcmul(plain_kernels.member(nu[leaf], b, members) * b2, u, u, value=c2)
        step = na / (sqrt_rn(nv) / sqrt_c2[k] + eps) * inv_c1[k]
        if decoupled != 0.0:
            step = torch.add(step, m, alpha=decoupled)
        results.append((b, leaf, k, torch.addcmul(m, step, lr[k]), na, nv))
    for b, leaf, k, nm, na, nv in results:
        plain_kernels.write_member(
            b,
            leaf,
            members,
            apply[k],
            {"master": nm, "mu": na, "nu": nv},
            master=master,
            mu=mu,
            nu=nu,
            params=params,
            master_out=master_out,
            mu_out=mu_out,
            nu_out=nu_out,
            params_out=params_out,
        )


def _fused(
    grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out, inv, clip_div,
    clip_mul, lr, apply, count, l2, b1, b2, eps, decoupled,
) -> None:  # fmt: skip
    r"""One group of one member through PyTorch's fused Adam/AdamW kernel
    (``torch._fused_adam_`` / ``torch._fused_adamw_``), as ``torch.optim.Adam``/``AdamW``
    with ``fused=True`` steps: on the unscaled (clipped) gradients ``u`` of
    :func:`~functional_fp16._fused.plain_kernels.read_unscaled` (the float32 gradients
    themselves where the update unscaled them before: ``across_groups``), the step count
    ``t`` (this step's, float32, one tensor for every leaf), the learning rate
    :math:`\eta = -\mathrm{lr}` (the op's ``lr`` is the signed factor, PyTorch's kernels
    descend) and ``found_inf`` the skip, on which the kernel writes nothing. It
    computes, per element,

    .. math::
        a' &= \beta_1 a + (1 - \beta_1) u, \qquad v' = \beta_2 v + (1 - \beta_2) u^2, \\
        m' &= m(1 - \eta\lambda_d) - \frac{\eta}{1 - \beta_1^t}\,
              \frac{a'}{\sqrt{v'} / \sqrt{1 - \beta_2^t} + \epsilon}

    (Adam's L2 term :math:`u \leftarrow u + \lambda_2 m` instead of the decoupled one):
    the master and the moments bitwise ``torch.optim``'s fused step from the same state,
    within the bound ``tests/test_fused_adam.py`` states of the reference's (whose
    moments are ``lerp`` and ``addcmul``, its corrections float32 factors). A chain with
    both decays runs :func:`_lists`.

    Temporaries, in bytes a parameter: ``u`` (4; none where it is the gradients
    themselves), then the FP16 working copies' rounding (2) once ``u`` is freed: 4 at
    most, pure or donated (a pure step's new state is copied from the old one and stepped
    in place).
    """
    u = plain_kernels.read_unscaled(grads, master, inv, clip_div, clip_mul)  # only read
    plain_kernels.start_from(master_out + mu_out + nu_out, master + mu + nu)  # one copy
    fused = torch._fused_adam_ if l2 else torch._fused_adamw_  # l2 and decoupled: not both
    fused(
        master_out, u, mu_out, nu_out, [], [count.reshape(())] * len(u), lr=plain_kernels.descending(lr),
        beta1=b1, beta2=b2, weight_decay=decoupled or l2, eps=eps, amsgrad=False,
        maximize=False, grad_scale=None, found_inf=plain_kernels.skip_flag(apply),
    )  # fmt: skip
    del u
    plain_kernels.refresh_params(apply, master_out, params, params_out)


def _lists(
    grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out, inv, clip_div,
    clip_mul, lr, apply, inv_c1, sqrt_c2, l2, w, b2, c2, eps, decoupled,
) -> None:  # fmt: skip
    """The plain kernel of one group of one member: the same operations on flat lists,
    a fixed number of multi-tensor ops (``torch._foreach_*``) whatever the leaves.

    Its temporaries, in bytes a parameter: the FP32 gradient list ``u`` (4),
    which later holds the step. A pure step computes the moments in their new
    buffers (restoring the old bits where it skips) and the denominator in the
    new master's buffer before the master is written: 4 in all. A donated step
    must keep the old moments until it knows, so each new moment is a
    temporary in turn, and so is the denominator: 8 at most. (On the CPU the
    correctly rounded square root adds a float64 temporary, see
    :func:`~functional_fp16._fused.plain_kernels.correct_sqrt`.)
    """
    apply = apply.reshape(())
    u = plain_kernels.unscaled_lists(grads, master, inv, clip_div, clip_mul)
    if l2 != 0.0:
        torch._foreach_add_(u, master, alpha=l2)
    pure = any(o is not x for o, x in zip(mu_out, mu))
    if pure:
        torch._foreach_lerp_(plain_kernels.start_from(mu_out, mu), u, w)
        torch._foreach_mul_(plain_kernels.start_from(nu_out, nu), b2)
        torch._foreach_addcmul_(nu_out, u, u, value=c2)
        plain_kernels.restore_skipped_(apply, mu_out, mu)
        plain_kernels.restore_skipped_(apply, nu_out, nu)
        denom = plain_kernels.correct_sqrt(nu_out, out=master_out)  # master_out: scratch
    else:
        na = torch._foreach_lerp(mu, u, w)
        plain_kernels.select_into(apply, na, mu, mu_out, consume=True)
        del na
        nv = torch._foreach_mul(nu, b2)
        torch._foreach_addcmul_(nv, u, u, value=c2)
        plain_kernels.select_into(apply, nv, nu, nu_out, consume=True)
        del nv
        denom = plain_kernels.correct_sqrt(nu_out)
    # Where the step applies, mu_out and nu_out hold the new moments; where it skips, the
    # step is computed from the old ones and not applied.
    step = plain_kernels.adam_direction_(u, mu_out, denom, master, inv_c1, sqrt_c2, eps, decoupled)
    del denom
    plain_kernels.fma_step_(master_out, master, step, lr, plain_kernels.skip_flag(apply))
    del step, u
    plain_kernels.refresh_params(apply, master_out, params, params_out)


def _split_generic(*, members, apply, used, mu, nu, **kw) -> bool:
    """A split master on the plain kernels: the stored step's (a Triton launch a leaf on
    CUDA, joining and splitting in its one pass), its moments float32, rounded to
    nearest (a float32 moment is stored as it is)."""
    del used
    count, b1 = kw.pop("count"), kw.pop("b1")
    kw["inv_c1"], kw["sqrt_c2"] = _corrections_given(
        kw["inv_c1"], kw["sqrt_c2"], count, b1, kw["b2"]
    )
    adam_stored_generic(
        members=members, apply=apply, mu=mu, nu=nu, mu_scales=[], nu_scales=[],
        mu_scales_out=[], nu_scales_out=[], count=kw["lr"], block_size=DEFAULT_BLOCK,
        rounding=0, salt_ids=[0] * len(mu), **kw,
    )  # fmt: skip
    return True


SPEC = StepSpec(
    name="adam_step",
    states=("mu", "nu"),
    # The C kernels take the bias corrections; PyTorch's fused kernel (the plain one) the
    # step count, float32 (see _step).
    scalars=("inv_c1", "sqrt_c2", "count"),
    bool_scalars=(),
    hyper=(
        ("l2", "float"),
        ("b1", "float"),
        ("b2", "float"),
        ("eps", "float"),
        ("decoupled", "float"),
    ),
    entry="adam_update",
    # split: 0, a split master reaching the C entry here having been joined (run_step)
    c_extra={"split": 0},
    generic_only=("count", "b1"),
    for_c=lambda a: _with_corrections(a),
    check=lambda op, a: _require_corrections(op, a),
    kernel_args=_kernel_args,
    generic=_generic,
    split_generic=_split_generic,
    cpp_op="adam",
    cpp_hyper=lambda a: (
        a["l2"],
        f32(1.0 - a["b1"]),  # torch.lerp's weight, rounded once to float32
        a["b2"],
        1.0 - a["b2"],  # addcmul's value, rounded once to float32 by the kernel
        a["eps"],
        a["decoupled"],
    ),
)


def _corrections_given(inv_c1, sqrt_c2, count, b1: float, b2: float):
    """The bias corrections ``(inv_c1, sqrt_c2)`` a call gives, or those of its ``count``
    where it gives the count alone (the plain kernel's form)."""
    if inv_c1 is not None:
        return inv_c1, sqrt_c2
    return bias_corrections(count, b1, b2)


def _with_corrections(a: dict) -> dict:
    """``a`` with the bias corrections of its ``count`` where it gives the count alone
    (the form the plain kernel takes; the C kernels take the corrections)."""
    if a["inv_c1"] is not None or a["count"] is None:
        return a
    if a["count"].dtype != torch.float32:  # as the plain kernel's checks refuse it
        op_checks.fail(
            "adam_step", f"count must be torch.float32, got {a['count'].dtype}", TypeError
        )
    inv_c1, sqrt_c2 = bias_corrections(a["count"], a["b1"], a["b2"])
    return {**a, "inv_c1": inv_c1, "sqrt_c2": sqrt_c2}


def _require_corrections(op: str, a: dict) -> list[str]:
    if a["count"] is None or a["inv_c1"] is not None or a["sqrt_c2"] is not None:
        for name in ("inv_c1", "sqrt_c2"):
            if a[name] is None:
                op_checks.fail(op, f"{name} is required (or count alone)", TypeError)
    return ["mu", "nu"]


ADAM_OPS = define_step(
    SPEC,
    r"""One fused Adam/AdamW step into fresh tensors:
    ``(master', mu', nu', params', finite, leaf_finite)``.

    See the module docstring for the arithmetic and :mod:`functional_fp16._fused.step_schema`
    for the conventions; ``inv_c1`` and ``sqrt_c2`` are the bias corrections per group.
    """,
)
adam_step, adam_step_ = ADAM_OPS.functional, ADAM_OPS.donated


# ---------------------------------------------------------------------------
# The step of a state.
# ---------------------------------------------------------------------------


def _step(plan: AdamPlan, grads, masters, roles, shared, own, common, donate, memo):
    """One op call for a group: ``(masters', roles', params', decided, shared')``, where
    ``decided`` is the op's ``(finite, leaf_finite)``."""
    if plan.stored:
        return _stored_step(plan, grads, masters, roles, shared, own, common, donate, memo)
    mu, nu = roles["mu"], roles["nu"]
    # The C kernels take the bias corrections; PyTorch's fused kernel (the plain one, a
    # float32 master) the count. In a torch.compile trace the op chooses its kernel when
    # it runs: it is given both (Inductor fuses the corrections' arithmetic).
    compiling = torch.compiler.is_compiling()
    inv_c1 = sqrt_c2 = count = None
    if compiling or holds_residuals(masters) or op_library.kernel_for(masters[0].device) == "c":
        inv_c1, sqrt_c2 = _corrections(plan, shared["count"], memo)
    if compiling or inv_c1 is None:
        count = _count(shared["count"], memo)
    hyper = dict(l2=plan.l2_decay, b1=plan.b1, b2=plan.b2, eps=plan.eps, count=count)
    hyper.update(decoupled=plan.decoupled_decay, inv_c1=inv_c1, sqrt_c2=sqrt_c2)
    a = dict(grads=grads, master=masters, mu=mu, nu=nu, params=own, **common, **hyper)
    if donate:
        decided = ADAM_OPS.call(True, a)
        m_out, mu_out, nu_out, p_new = masters, mu, nu, own
    else:
        m_out, mu_out, nu_out, p_new, *decided = ADAM_OPS.call(False, a)
    roles_out = {"mu": list(mu_out), "nu": list(nu_out)}
    return list(m_out), roles_out, list(p_new), tuple(decided), {}


def _corrections(plan: AdamPlan, position: int, memo: dict):
    """The bias corrections ``(inv_c1, sqrt_c2)`` of the count at ``position`` after this
    step, as ``(1,)`` tensors, once per call for every group that shares them."""
    key = ("adam", position, plan.b1, plan.b2)
    if key not in memo:
        inv_c1, sqrt_c2 = bias_corrections(incremented(memo, position), plan.b1, plan.b2)
        memo[key] = (inv_c1.reshape(1), sqrt_c2.reshape(1))
    return memo[key]


def _count(position: int, memo: dict) -> torch.Tensor:
    """The count at ``position`` after this step as a ``(1,)`` float32 tensor, the step
    PyTorch's fused Adam reads (``torch.optim`` keeps it in float32 too), once per call
    for every group that shares it: ``fl32(fl32(count) + 1)``, exact below 2^24 steps
    (past them float32 holds no more: so does ``torch.optim``'s step). The update's
    ``step_scalars`` call makes it (:func:`_float_counts`); this is for any other caller."""
    key = ("adam count", position)
    if key not in memo:
        memo[key] = count_after(memo["opt"][position]).reshape(1)
    return memo[key]


def _stored_step(plan: AdamPlan, grads, masters, roles, shared, own, common, donate, memo):
    """:func:`_step` for stored moments: one ``adam_stored_step`` call."""
    count = incremented(memo, shared["count"])
    inv_c1, sqrt_c2 = _corrections(plan, shared["count"], memo)
    rounding = ROUNDINGS.index(
        plan.nu_format.rounding if plan.nu_format is not FLOAT32 else plan.mu_format.rounding
    )
    block = (plan.nu_format if plan.nu_format.kind == "e4m3" else plan.mu_format).block_size
    a = dict(grads=grads, master=masters, params=own, **common)
    a.update({r: roles[r] for r in ("mu", "nu", "mu_scales", "nu_scales")})
    a.update(l2=plan.l2_decay, b1=plan.b1, b2=plan.b2, eps=plan.eps)
    a.update(decoupled=plan.decoupled_decay, inv_c1=inv_c1, sqrt_c2=sqrt_c2)
    a.update(count=count.to(torch.int64).reshape(1), block_size=block, rounding=rounding)
    a.update(salt_ids=list(memo["indices"]))
    names = ("mu", "nu", "mu_scales", "nu_scales")
    if donate:
        decided = ADAM_STORED_OPS.call(True, a)
        m_out, outs, p_new = masters, [a[r] for r in names], own
    else:
        m_out, *outs, p_new, f, leaves = ADAM_STORED_OPS.call(False, a)
        decided = (f, leaves)
    return list(m_out), dict(zip(names, map(list, outs))), list(p_new), tuple(decided), {}


def _float_counts(plan: AdamPlan, shared: dict, masters: list) -> list:
    """What the step reads of its count, made by the update's ``step_scalars`` call: the
    float32 count PyTorch's fused Adam reads (:func:`_count`) and the bias corrections the
    C kernels read (:func:`_corrections`), where the step runs them (both in a trace)."""
    if plan.stored:
        return []
    position = shared["count"]
    compiling = torch.compiler.is_compiling()  # (a trace asks no kernel: it may load one)
    c_kernel = (
        compiling or holds_residuals(masters) or op_library.kernel_for(masters[0].device) == "c"
    )
    out = []
    if c_kernel and not isinstance(plan.b1, torch.Tensor):
        forms = (("inv_c1", plan.b1), ("sqrt_c2", plan.b2))
        out.append((("adam", position, plan.b1, plan.b2), position, forms))
    if compiling or not c_kernel:
        out.append((("adam count", position), position, (("count",),)))
    return out


def _reads_unscaled(plan: AdamPlan) -> bool:
    """Whether the plain kernel steps ``plan`` with PyTorch's fused Adam/AdamW, which only
    reads its float32 gradients (a float32 moment, not both decays)."""
    return not plan.stored and not (plan.l2_decay and plan.decoupled_decay)


register(Fusable("adam", _read, _positions, _step, _index, _float_counts, _reads_unscaled))
