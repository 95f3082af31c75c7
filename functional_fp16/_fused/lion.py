r"""The fused Lion step: its plan, its ``torch.library`` ops and its plain PyTorch kernel.

:func:`lion_plan` reads the transforms' declared specs only and returns the
hyperparameters of the single-pass kernel when the chain, flattened, has the
form::

    [clip_by_global_norm(c)]  scale_by_lion(b1, b2)  [add_decayed_weights(wd)]
        scale_by_learning_rate(lr)

(brackets: optional; a weight decay of 0 is dropped), with ``mode="hard"``.
Anything else returns ``None`` and runs as written.

Per element, with :math:`u` the unscaled (clipped) gradient, :math:`a` the
momentum, :math:`w_i = \operatorname{fl}_{32}(1 - \beta_i)`, the ops compute

.. math::
    d = \operatorname{sign}(\operatorname{fl}(u w_1) + \operatorname{fl}(a \beta_1)), \quad
    d \leftarrow \operatorname{fma}(m, \lambda, d), \quad
    m' = \operatorname{fma}(d, \mathrm{lr}, m), \quad
    a' = \operatorname{fl}(u w_2) + \operatorname{fl}(a \beta_2)

as the reference chain computes it: the momentum bitwise, the master within
one ulp (the step's multiply-add is contracted). The C entry is ``ff_lion_step``
(``fused_step.h``'s argument block, through the generic C++ op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from functional_fp16._fused import plain_kernels
from functional_fp16._fused.chains import Path
from functional_fp16._fused.op_library import define_step
from functional_fp16._fused.plain_kernels import f32
from functional_fp16._fused.step_schema import StepSpec
from functional_fp16._fused.steps import Fusable, register
from functional_fp16.transforms.clipping import ClipSpec
from functional_fp16.transforms.lion import LionSpec
from functional_fp16.transforms.sgd import DecaySpec, LearningRateSpec

__all__ = ["LionPlan", "lion_step", "lion_step_"]


class LionPlan(NamedTuple):
    """The hyperparameters of a fusable Lion chain, and where its state lives."""

    max_norm: float | None  # None: no clipping
    b1: float
    b2: float
    decoupled_decay: float  # the weight decay added to the sign direction
    learning_rate: float | Callable[[torch.Tensor], torch.Tensor]
    sign: float  # -1.0 to descend
    lion_path: Path
    lr_path: Path


_ORDER = (ClipSpec, LionSpec, DecaySpec, LearningRateSpec)


def _read(parts: list[tuple[Any, Path]]) -> LionPlan | None:
    parts = [(s, p) for s, p in parts if not (isinstance(s, DecaySpec) and s.weight_decay == 0.0)]
    found: dict[type, tuple[Any, Path]] = {}
    rank = -1
    for spec, path in parts:
        if type(spec) not in _ORDER:
            return None
        r = _ORDER.index(type(spec))
        if r <= rank:  # out of order, or twice
            return None
        rank = r
        found[type(spec)] = (spec, path)
    if LionSpec not in found or LearningRateSpec not in found:
        return None
    lion, lion_path = found[LionSpec]
    if lion.mode != "hard" or lion.mu_format.kind != "float32":
        return None  # coded momentum: the chain runs as written
    clip = found.get(ClipSpec, (None, None))[0]
    decay = found.get(DecaySpec, (None, None))[0]
    lr, lr_path = found[LearningRateSpec]
    return LionPlan(
        max_norm=clip.max_norm if clip is not None else None,
        b1=lion.b1,
        b2=lion.b2,
        decoupled_decay=decay.weight_decay if decay is not None else 0.0,
        learning_rate=lr.learning_rate,
        sign=lr.sign,
        lion_path=lion_path,
        lr_path=lr_path,
    )


def _positions(plan: LionPlan, by_key: dict) -> tuple[dict[str, int], dict[str, int]]:
    """A leaf's momentum position and the group's step count."""
    where = by_key[plan.lion_path]
    return {"mu": where["mu"]}, {"count": where["count"]}


# ---------------------------------------------------------------------------
# The ops.
# ---------------------------------------------------------------------------


def _hyper(a: dict) -> tuple[float, ...]:
    """``(w1, b1, w2, b2, decoupled)``: the fixed hyperparameters as the kernels take them
    (the C entry's ``hyper`` array, in this order), each rounded once to float32."""
    b1, b2 = a["b1"], a["b2"]
    return f32(1.0 - b1), f32(b1), f32(1.0 - b2), f32(b2), f32(a["decoupled"])


def _kernel_args(a: dict, used: list[str]) -> dict:
    """The op's arguments as the kernel entries take them."""
    del used
    names = ("grads", "master", "mu", "params", "master_out", "mu_out", "params_out")
    names += ("inv", "clip_div", "clip_mul", "lr")
    return dict(
        {n: a[n] for n in names}, **dict(zip(("w1", "b1", "w2", "b2", "decoupled"), _hyper(a)))
    )


def _generic(
    *,
    members,
    grads,
    master,
    mu,
    params,
    master_out,
    mu_out,
    params_out,
    inv,
    clip_div,
    clip_mul,
    lr,
    apply,
    w1,
    b1,
    w2,
    b2,
    decoupled,
) -> None:
    """The plain PyTorch kernel (bitwise the C one on the CPU)."""
    if plain_kernels.one_group(lr, members):
        u = plain_kernels.unscaled_lists(grads, master, inv, clip_div, clip_mul)
        d = torch._foreach_mul(u, w1)
        torch._foreach_add_(d, torch._foreach_mul(mu, b1))
        torch._foreach_sign_(d)
        if decoupled != 0.0:
            torch._foreach_add_(d, master, alpha=decoupled)
        na = torch._foreach_mul(u, w2)
        torch._foreach_add_(na, torch._foreach_mul(mu, b2))
        del u
        plain_kernels.write_lists(
            apply.reshape(()), {"mu": na}, d, lr, master=master, mu=mu, params=params,
            master_out=master_out, mu_out=mu_out, params_out=params_out,
        )  # fmt: skip
        return
    results = []
    for b, leaf, k in plain_kernels.walk(len(grads), lr.numel(), members):
        m = plain_kernels.member(master[leaf], b, members)
        a = plain_kernels.member(mu[leaf], b, members)
        u = plain_kernels.unscaled(
            plain_kernels.member(grads[leaf], b, members), inv, clip_div, clip_mul, k
        )
        d = torch.sign(u * w1 + a * b1)
        if decoupled != 0.0:
            d = torch.add(d, m, alpha=decoupled)
        results.append((b, leaf, k, torch.addcmul(m, d, lr[k]), u * w2 + a * b2))
    for b, leaf, k, nm, na in results:
        plain_kernels.write_member(
            b, leaf, members, apply[k], {"master": nm, "mu": na}, master=master, mu=mu,
            params=params, master_out=master_out, mu_out=mu_out, params_out=params_out,
        )  # fmt: skip


SPEC = StepSpec(
    name="lion_step",
    states=("mu",),
    scalars=(),
    bool_scalars=(),
    hyper=(("b1", "float"), ("b2", "float"), ("decoupled", "float")),
    entry="lion_update",
    check=lambda op, a: ["mu"],
    kernel_args=_kernel_args,
    generic=_generic,
    cpp_op="lion",
    cpp_hyper=_hyper,
    c_block=True,
)

LION_OPS = define_step(
    SPEC,
    r"""One fused Lion step into fresh tensors:
    ``(master', mu', params', finite, leaf_finite)``.

    See the module docstring for the arithmetic and :mod:`functional_fp16._fused.step_schema`
    for the conventions.
    """,
)
lion_step, lion_step_ = LION_OPS.functional, LION_OPS.donated


# ---------------------------------------------------------------------------
# The step of a state.
# ---------------------------------------------------------------------------


def _step(plan: LionPlan, grads, masters, roles, shared, own, common, donate, memo):
    """One op call for a group: ``(masters', roles', params', decided, shared')``, where
    ``decided`` is the op's ``(finite, leaf_finite)``."""
    del shared, memo  # the count advances on an applied step (``steps.advanced``)
    mu = roles["mu"]
    hyper = dict(b1=plan.b1, b2=plan.b2, decoupled=plan.decoupled_decay)
    a = dict(grads=grads, master=masters, mu=mu, params=own, **common, **hyper)
    if donate:
        decided = LION_OPS.call(True, a)
        m_out, mu_out, p_new = masters, mu, own
    else:
        m_out, mu_out, p_new, *decided = LION_OPS.call(False, a)
    return list(m_out), {"mu": list(mu_out)}, list(p_new), tuple(decided), {}


register(Fusable("lion", _read, _positions, _step))
