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

from functional_fp16._fused import plain_kernels, stored, triton_stored
from functional_fp16._fused.chains import Path, in_order
from functional_fp16._fused.groups import INDEX
from functional_fp16._fused.op_library import define_step
from functional_fp16._fused.plain_kernels import f32
from functional_fp16._fused.step_schema import StepSpec
from functional_fp16._fused.steps import Fusable, incremented, register
from functional_fp16._fused.stored import ROUNDINGS, STORED_DTYPES
from functional_fp16._util import validate
from functional_fp16.precision.moment_storage import (
    DEFAULT_BLOCK,
    FLOAT32,
    BlockCodes,
    MomentFormat,
    decode,
    encode,
)
from functional_fp16.precision.stochastic_rounding import salt
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
    mu_format: MomentFormat = FLOAT32

    @property
    def stored(self) -> bool:
        """Whether the momentum is stored in fewer bits (the ``lion_stored_step`` op)."""
        return self.mu_format is not FLOAT32

    @property
    def state_dtypes(self) -> tuple:
        """The dtypes the momentum of this plan's leaves may have."""
        return STORED_DTYPES if self.stored else (torch.float32,)


_ORDER = (ClipSpec, LionSpec, DecaySpec, LearningRateSpec)


def _read(parts: list[tuple[Any, Path]]) -> LionPlan | None:
    parts = [
        (s, p)
        for s, p in parts
        if not (isinstance(s, DecaySpec) and validate.is_zero(s.weight_decay))
    ]
    found = in_order(parts, _ORDER)
    if found is None or LionSpec not in found or LearningRateSpec not in found:
        return None
    lion, lion_path = found[LionSpec]
    if lion.mode != "hard":
        return None
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
        mu_format=lion.mu_format,
    )


def _positions(plan: LionPlan, by_key: dict) -> tuple[dict[str, int], dict[str, int]]:
    """A leaf's momentum position and the group's step count."""
    where = by_key[plan.lion_path]
    roles = {"mu": where["mu"]}
    if plan.stored:  # block scales where the momentum is coded, else -1
        roles["mu_scales"] = where.get("mu_scales", -1)
    return roles, {"count": where["count"]}


def _index(plan: LionPlan, by_key: dict) -> int:
    """A leaf's index among its ``scale_by_lion``'s leaves (the rounding's leaf salt)."""
    return by_key[plan.lion_path][INDEX]


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
        return _lists(
            grads, master, mu, params, master_out, mu_out, params_out, inv, clip_div,
            clip_mul, lr, apply.reshape(()), w1, b1, w2, b2, decoupled,
        )  # fmt: skip
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


def _lists(
    grads, master, mu, params, master_out, mu_out, params_out, inv, clip_div, clip_mul, lr,
    apply, w1, b1, w2, b2, decoupled,
) -> None:  # fmt: skip
    r"""One group of one member in multi-tensor ops, each sum of two products rounded
    as the C kernel rounds it (:math:`\operatorname{fl}(\operatorname{fl}(x) +
    \operatorname{fl}(y))`, never contracted: the sign of :math:`d` depends on it).

    Temporaries, in bytes a parameter: a pure step computes in its fresh outputs
    (:math:`u` in the new master's buffers, the products in the new momentum's) and
    keeps only :math:`d`: 4. A donated one may not write its state before the
    decision is applied, so it keeps :math:`u` beside :math:`d`, steps the master,
    then forms :math:`u` again for :math:`a'`: it does so a piece of at most
    :data:`PIECE` elements at a time (:func:`~.plain_kernels.pieces`), so that those
    temporaries are a piece's (about 16 MiB), not 8 B a parameter; then the working
    copies' refresh, 2 B a parameter for FP16 copies.
    """
    pure = any(o is not x for o, x in zip(mu_out, mu))
    if not pure:
        for g, m, a in plain_kernels.pieces([grads, master, mu], PIECE):
            _donated_piece(g, m, a, inv, clip_div, clip_mul, lr, apply, w1, b1, w2, b2, decoupled)
        plain_kernels.refresh_params(apply, master_out, params, params_out)
        return
    u = plain_kernels.unscaled_into(master_out, grads, inv, clip_div, clip_mul)
    d = plain_kernels.start_from([torch.empty_like(m) for m in master], mu)
    torch._foreach_mul_(d, b1)
    torch._foreach_mul_(plain_kernels.start_from(mu_out, u), w1)
    torch._foreach_add_(d, mu_out)  # fl(a b1) + fl(u w1)
    torch._foreach_mul_(plain_kernels.start_from(mu_out, u), w2)
    torch._foreach_mul_(plain_kernels.start_from(master_out, mu), b2)  # u is spent
    torch._foreach_add_(mu_out, master_out)  # a' = fl(u w2) + fl(a b2)
    plain_kernels.restore_skipped_(apply, mu_out, mu)
    _direction_step(d, master, master_out, lr, apply, decoupled)
    plain_kernels.refresh_params(apply, master_out, params, params_out)


PIECE = plain_kernels.SQRT_BATCH
"""The most elements a donated plain step computes at once (its temporaries: :math:`u`,
:math:`d` and a product, float32 lists of this many elements)."""


def _direction_step(d, master, master_out, lr, apply, decoupled) -> None:
    """``d`` (the sum whose sign is the direction) made the direction, plus the decoupled
    decay, and the master stepped by it where the step applies (``d`` is spent)."""
    torch._foreach_sign_(d)
    if decoupled != 0.0:
        torch._foreach_add_(d, master, alpha=decoupled)
    plain_kernels.fma_step_(master_out, master, d, lr, plain_kernels.skip_flag(apply))


def _donated_piece(grads, master, mu, inv, clip_div, clip_mul, lr, apply, w1, b1, w2, b2,
                   decoupled) -> None:  # fmt: skip
    """A donated step of a piece, in place: the master where the step applies, then the
    momentum :math:`a'` (:math:`u` formed again) selected into the old one."""
    u = plain_kernels.unscaled_lists(grads, master, inv, clip_div, clip_mul)
    d = torch._foreach_mul(mu, b1)
    torch._foreach_mul_(u, w1)
    torch._foreach_add_(d, u)  # u is spent
    _direction_step(d, master, master, lr, apply, decoupled)
    del d
    u = plain_kernels.unscaled_into(u, grads, inv, clip_div, clip_mul)
    torch._foreach_mul_(u, w2)
    torch._foreach_add_(u, torch._foreach_mul(mu, b2))
    plain_kernels.select_into(apply, u, mu, mu, consume=True)


def _split_generic(*, members, apply, used, mu, **kw) -> bool:
    """A split master on the plain kernels: the stored step's (a Triton launch a leaf on
    CUDA, joining and splitting in its one pass), its momentum float32."""
    del used
    _stored_generic(
        members=members, apply=apply, mu=mu, mu_scales=[], mu_scales_out=[], count=kw["lr"],
        block_size=DEFAULT_BLOCK, rounding=0, salt_ids=[0] * len(mu), **kw,
    )  # fmt: skip
    return True


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
    split_generic=_split_generic,
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
    if plan.stored:
        return _stored_step(plan, grads, masters, roles, shared, own, common, donate, memo)
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


# ---------------------------------------------------------------------------
# A stored momentum (bf16, fp16, E4M3 block codes).
# ---------------------------------------------------------------------------


def _stored_generic(
    *, members, grads, master, mu, mu_scales, params, master_out, mu_out, mu_scales_out,
    params_out, inv, clip_div, clip_mul, lr, apply, count, w1, b1, w2, b2, decoupled,
    block_size, rounding, salt_ids,
) -> None:  # fmt: skip
    """CUDA's default for a stored momentum: for one group of one member, the Triton
    kernel (:func:`.triton_stored.lion_leaf`) on each leaf it takes; else the reference's
    decode, Lion's arithmetic (as :func:`_generic` computes it) and encode, one leaf of
    one member at a time (bitwise the C kernel on the CPU)."""
    fmts = stored.formats(block_size, rounding)
    coded = {
        leaf: j for j, leaf in enumerate(i for i, x in enumerate(mu) if x.dtype == torch.uint8)
    }
    kernel = plain_kernels.one_group(lr, members) and triton_stored.available(lr.device)
    for b, leaf, k in plain_kernels.walk(len(grads), lr.numel(), members):
        scales = (
            (mu_scales[coded[leaf]], mu_scales_out[coded[leaf]]) if leaf in coded else (None,) * 2
        )
        if kernel and triton_stored.takes([(mu[leaf], scales[0])], grads[leaf], params[leaf], True):
            triton_stored.lion_leaf(
                grad=grads[leaf], master=master[leaf], mu=mu[leaf], mu_scales=scales[0],
                param=params[leaf], master_out=master_out[leaf], mu_out=mu_out[leaf],
                mu_scales_out=scales[1], param_out=params_out[leaf], inv=inv,
                clip_div=clip_div, clip_mul=clip_mul, lr=lr, apply=apply, count=count, w1=w1,
                b1=b1, w2=w2, b2=b2, decoupled=decoupled, block_size=block_size,
                rounding=rounding, salt_id=salt_ids[leaf],
            )  # fmt: skip
            continue
        at = lambda xs: plain_kernels.member(xs[leaf], b, members)  # noqa: E731
        m, was = stored.read_master(at(master), at(params)), at(mu)
        fmt = fmts[(was.dtype, False)]
        if leaf in coded:
            was = BlockCodes(was, plain_kernels.member(mu_scales[coded[leaf]], b, members))
        a = decode(fmt, was)
        u = plain_kernels.unscaled(at(grads), inv, clip_div, clip_mul, k)
        d = torch.sign(u * w1 + a * b1)
        if decoupled != 0.0:
            d = torch.add(d, m, alpha=decoupled)
        nm = torch.addcmul(m, d, lr[k])
        salt_ = None if rounding == 0 else salt(count[k], 0, salt_ids[leaf])
        new = encode(fmt, u * w2 + a * b2, was, salt_)
        ok = apply[k]
        stored.write_master(ok, nm, m, at(master_out), at(params_out), at(params))
        s_out = mu_scales_out[coded[leaf]] if leaf in coded else None
        s_out = None if s_out is None else plain_kernels.member(s_out, b, members)
        stored.write_state(ok, new, was, at(mu_out), s_out)


def _stored_kernel_args(a: dict, used: list[str]) -> dict:
    del used
    names = ("grads", "master", "mu", "mu_scales", "params", "master_out", "mu_out")
    names += ("mu_scales_out", "params_out", "inv", "clip_div", "clip_mul", "lr", "count")
    names += ("block_size", "rounding", "salt_ids")
    return dict(
        {n: a[n] for n in names}, **dict(zip(("w1", "b1", "w2", "b2", "decoupled"), _hyper(a)))
    )


STORED_SPEC = StepSpec(
    name="lion_stored_step",
    states=("mu", "mu_scales"),
    scalars=("count",),
    bool_scalars=(),
    hyper=(
        ("b1", "float"),
        ("b2", "float"),
        ("decoupled", "float"),
        ("block_size", "int"),
        ("rounding", "int"),
        ("salt_ids", "int[]"),
    ),
    entry="",  # no ctypes entry: the C kernel runs through its C++ op only
    check=lambda op, a: stored.check_stored(op, a, ("mu",), ("count",)),
    kernel_args=_stored_kernel_args,
    generic=_stored_generic,
    cpp_op="stored_step",
    cpp_hyper=_hyper,
    int_scalars=("count",),
    side=("mu_scales",),
    state_dtypes=STORED_DTYPES,
    stored="lion_stored",
)

LION_STORED_OPS = define_step(
    STORED_SPEC,
    r"""One fused Lion step with a stored momentum into fresh tensors:
    ``(master', mu', mu_scales', params', finite, leaf_finite)``.

    Lion's arithmetic (the module docstring) between a decode and an encode of the
    momentum (:mod:`functional_fp16._fused.stored`); ``count`` is each group's applied-step
    count after this step, ``salt_ids`` each leaf's index in the optimiser's tree.
    """,
)


def _stored_step(plan: LionPlan, grads, masters, roles, shared, own, common, donate, memo):
    """:func:`_step` for a stored momentum: one ``lion_stored_step`` call."""
    count = incremented(memo, shared["count"])
    a = dict(grads=grads, master=masters, mu=roles["mu"], mu_scales=roles["mu_scales"])
    a.update(params=own, **common, b1=plan.b1, b2=plan.b2, decoupled=plan.decoupled_decay)
    a.update(count=count.to(torch.int64).reshape(1), block_size=plan.mu_format.block_size)
    a.update(rounding=ROUNDINGS.index(plan.mu_format.rounding), salt_ids=list(memo["indices"]))
    if donate:
        decided = LION_STORED_OPS.call(True, a)
        m_out, mu_out, sc_out, p_new = masters, a["mu"], a["mu_scales"], own
    else:
        m_out, mu_out, sc_out, p_new, *decided = LION_STORED_OPS.call(False, a)
    roles_out = {"mu": list(mu_out), "mu_scales": list(sc_out)}
    return list(m_out), roles_out, list(p_new), tuple(decided), {}


register(Fusable("lion", _read, _positions, _step, _index))
