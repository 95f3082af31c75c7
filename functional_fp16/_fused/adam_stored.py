r"""The fused Adam/AdamW step with stored moments: BF16, FP16 or 8-bit E4M3 block codes.

The chain :func:`~functional_fp16._fused.adam.adam_plan` recognises, with
``mu_dtype``/``nu_dtype`` storing the moments in fewer bytes
(:mod:`~functional_fp16.precision.moment_storage`; a float16 second moment with
a per-tensor scale is not taken: its scale needs the whole new moment first).
Per element the arithmetic is the FP32 step's (:mod:`.adam`) between a decode
and an encode, inside the one pass that updates the master:

.. math::
    a = \operatorname{dec}(\hat a), \quad v = \operatorname{dec}(\hat v), \quad
    (m', a', v') = \operatorname{adam}(m, a, v, u), \quad
    \hat a' = \operatorname{enc}(a'), \quad \hat v' = \operatorname{enc}(v')

where for block codes ``dec`` multiplies each code's E4M3 value by its
block's scale (and squares it for the second moment) and ``enc`` finds each
new block's scale from its largest finite magnitude, then codes every
element; the rounding is to nearest or stochastic, salted with
``(count, moment, leaf)`` (:mod:`~functional_fp16.precision.stochastic_rounding`).
The step uses the float32 :math:`a', v'`, as the reference chain does, so the
master is within one ulp of it and the codes and scales equal to its codes
and scales (a code moves only where that ulp moves a decoded value across a
rounding boundary).

The op ``functional_fp16::adam_stored_step`` takes each moment as one tensor
per leaf (float32, float16, bfloat16, or ``uint8`` codes laid out like the
leaf) and the block scales of the coded ones as ``mu_scales`` / ``nu_scales``:
one tensor per coded moment, in leaf order. On the CPU the C kernel
(``ff_adam_stored_step``) runs it; on CUDA one Triton kernel launch per leaf with a
stored moment (:mod:`.triton_stored`), the multi-tensor ops of the FP32 step for
the leaves with FP32 moments, and the plain kernel below (the reference's
operations, leaf by leaf) for a call of several members or groups.
"""

from __future__ import annotations

import torch

from functional_fp16._fused import plain_kernels, stored, triton_stored
from functional_fp16._fused.op_library import define_step
from functional_fp16._fused.plain_kernels import f32
from functional_fp16._fused.step_schema import StepSpec
from functional_fp16._fused.stored import ROUNDINGS, STORED_DTYPES
from functional_fp16.precision import master_split
from functional_fp16.precision.moment_storage import BlockCodes, decode, encode
from functional_fp16.precision.stochastic_rounding import salt, salt_table
from functional_fp16.transforms.adam import sqrt_rn

__all__ = ["ADAM_STORED_OPS", "STORED_DTYPES", "ROUNDINGS"]  # the last two: from .stored


def _generic(
    *, members, grads, master, mu, nu, mu_scales, nu_scales, params, master_out, mu_out,
    nu_out, mu_scales_out, nu_scales_out, params_out, inv, clip_div, clip_mul, lr, apply,
    inv_c1, sqrt_c2, count, l2, w, b2, c2, eps, decoupled, block_size, rounding, salt_ids,
) -> None:  # fmt: skip
    """CUDA's default: for one group of one member, the Triton kernel on each leaf with a
    stored moment (:func:`_triton_leaves`; with a split master every leaf it takes) and
    the rest as lists (:func:`_lists`); else, and for a split master's other leaves, the
    reference's decode, arithmetic and encode one leaf of one member at a time (bitwise
    the C kernel on the CPU), a split master joined and split leaf by leaf."""
    c2 = f32(c2)
    formats = stored.formats(block_size, rounding)
    only = None  # the leaves the per-leaf path below takes (None: all)
    if plain_kernels.one_group(lr, members):
        rest = _triton_leaves(
            grads, master, mu, nu, mu_scales, nu_scales, params, master_out, mu_out, nu_out,
            mu_scales_out, nu_scales_out, params_out, inv, clip_div, clip_mul, lr, apply,
            inv_c1, sqrt_c2, count, l2, w, b2, c2, eps, decoupled, block_size, rounding,
            salt_ids,
        )  # fmt: skip
        if not rest:
            return None
        only = set(rest)
    if only is not None and not master_split.holds_residuals(master):  # as lists
        pick = lambda xs: [xs[i] for i in rest]  # noqa: E731
        where = {"mu": _scale_index(mu), "nu": _scale_index(nu)}
        coded = lambda name, scales: [scales[where[name][i]] for i in rest if i in where[name]]  # noqa: E731
        return _lists(
            pick(grads), pick(master), pick(mu), pick(nu), coded("mu", mu_scales),
            coded("nu", nu_scales), pick(params), pick(master_out), pick(mu_out), pick(nu_out),
            coded("mu", mu_scales_out), coded("nu", nu_scales_out), pick(params_out), inv,
            clip_div, clip_mul, lr, apply, inv_c1, sqrt_c2, count, l2, w, b2, c2, eps,
            decoupled, formats, rounding, pick(salt_ids),
        )  # fmt: skip
    scales = {"mu": (mu_scales, mu_scales_out), "nu": (nu_scales, nu_scales_out)}
    where = {name: _scale_index(xs) for name, xs in (("mu", mu), ("nu", nu))}
    n = len(grads)
    for b, leaf, k in plain_kernels.walk(n, lr.numel(), members):
        if only is not None and leaf not in only:
            continue
        at = lambda xs: plain_kernels.member(xs[leaf], b, members)  # noqa: E731
        m = stored.read_master(at(master), at(params))
        u = plain_kernels.unscaled(at(grads), inv, clip_div, clip_mul, k)
        if l2 != 0.0:
            u = torch.add(u, m, alpha=l2)
        old, fmt = {}, {}
        for name, xs, second in (("mu", mu, False), ("nu", nu, True)):
            x = at(xs)
            fmt[name] = formats[(x.dtype, second)]
            if x.dtype == torch.uint8:
                sc = plain_kernels.member(scales[name][0][where[name][leaf]], b, members)
                x = BlockCodes(x, sc)
            old[name] = x
        a = decode(fmt["mu"], old["mu"])
        v = decode(fmt["nu"], old["nu"])
        na = torch.lerp(a, u, w)
        nv = torch.addcmul(v * b2, u, u, value=c2)
        step = na / (sqrt_rn(nv) / sqrt_c2[k] + eps) * inv_c1[k]
        if decoupled != 0.0:
            step = torch.add(step, m, alpha=decoupled)
        nm = torch.addcmul(m, step, lr[k])
        ok = apply[k]
        stored.write_master(ok, nm, m, at(master_out), at(params_out), at(params))
        for name, new, stream in (("mu", na, 0), ("nu", nv, 1)):
            salt_ = None if rounding == 0 else salt(count[k], stream, salt_ids[leaf])
            coded = encode(fmt[name], new, old[name], salt_)
            s_out = scales[name][1][where[name][leaf]] if leaf in where[name] else None
            s_out = None if s_out is None else plain_kernels.member(s_out, b, members)
            stored.write_state(ok, coded, old[name], at(mu_out if name == "mu" else nu_out), s_out)


def _lists(
    grads, master, mu, nu, mu_scales, nu_scales, params, master_out, mu_out, nu_out,
    mu_scales_out, nu_scales_out, params_out, inv, clip_div, clip_mul, lr, apply, inv_c1,
    sqrt_c2, count, l2, w, b2, c2, eps, decoupled, formats, rounding, salt_ids,
) -> None:  # fmt: skip
    """The plain kernel of one group of one member: the arithmetic as multi-tensor ops
    (``torch._foreach_*``, PyTorch's fused SGD kernel for the master) on every leaf at
    once, the decode and the encode leaf by leaf (a coded moment is its own layout), every
    output selected on its bit patterns (a skipped step keeps every byte)."""
    apply = apply.reshape(())
    u = plain_kernels.unscaled_lists(grads, master, inv, clip_div, clip_mul)
    if l2 != 0.0:
        torch._foreach_add_(u, master, alpha=l2)
    old, fmts = {}, {}
    for name, xs, scales, second in (("mu", mu, mu_scales, False), ("nu", nu, nu_scales, True)):
        it = iter(scales)
        old[name] = [BlockCodes(x, next(it)) if x.dtype == torch.uint8 else x for x in xs]
        fmts[name] = [formats[(x.dtype, second)] for x in xs]
    a32 = [decode(f, x) for f, x in zip(fmts["mu"], old["mu"])]
    v32 = [decode(f, x) for f, x in zip(fmts["nu"], old["nu"])]
    na = torch._foreach_lerp(a32, u, w)
    nv = torch._foreach_mul(v32, b2)
    torch._foreach_addcmul_(nv, u, u, value=c2)
    del a32, v32
    denom = plain_kernels.correct_sqrt(nv)
    step = plain_kernels.adam_direction_(u, na, denom, master, inv_c1, sqrt_c2, eps, decoupled)
    del denom
    plain_kernels.fma_step_(master_out, master, step, lr, plain_kernels.skip_flag(apply))
    del step, u
    plain_kernels.refresh_params(apply, master_out, params, params_out)
    salts = salt_table(count.reshape(()), salt_ids) if rounding else None
    outs = {"mu": (mu_out, mu_scales_out), "nu": (nu_out, nu_scales_out)}
    for stream, (name, new) in enumerate((("mu", na), ("nu", nv))):
        values_out, scales_out = outs[name]
        scales_it = iter(scales_out)
        fresh, kept, into = [], [], []
        for i, (x, was, f) in enumerate(zip(new, old[name], fmts[name])):
            coded = encode(f, x, was, None if salts is None else salts[stream, i])
            if isinstance(coded, BlockCodes):
                fresh += [coded.codes, coded.scales]
                kept += [was.codes, was.scales]
                into += [values_out[i], next(scales_it)]
            else:
                fresh.append(coded)
                kept.append(was)
                into.append(values_out[i])
        plain_kernels.select_into(apply, fresh, kept, into, consume=True)


def _triton_leaves(
    grads, master, mu, nu, mu_scales, nu_scales, params, master_out, mu_out, nu_out,
    mu_scales_out, nu_scales_out, params_out, inv, clip_div, clip_mul, lr, apply, inv_c1,
    sqrt_c2, count, l2, w, b2, c2, eps, decoupled, block_size, rounding, salt_ids,
) -> list[int]:  # fmt: skip
    """Runs the Triton kernel (:mod:`.triton_stored`: one launch a leaf) on every leaf of
    one group of one member that it takes; returns the indices of the others."""
    if not grads or not triton_stored.available(grads[0].device):
        return list(range(len(grads)))
    where = {"mu": _scale_index(mu), "nu": _scale_index(nu)}
    rest = []
    for i in range(len(grads)):
        scale = lambda xs, name: xs[where[name][i]] if i in where[name] else None  # noqa: E731
        sa, sv = scale(mu_scales, "mu"), scale(nu_scales, "nu")
        # a split master's leaves of float32 moments too: the lists do not take it
        split = master[i].dtype == torch.int16
        if not triton_stored.takes([(mu[i], sa), (nu[i], sv)], grads[i], params[i], split):
            rest.append(i)
            continue
        triton_stored.adam_leaf(
            grad=grads[i], master=master[i], mu=mu[i], nu=nu[i], mu_scales=sa, nu_scales=sv,
            param=params[i],
            master_out=master_out[i], mu_out=mu_out[i], nu_out=nu_out[i],
            mu_scales_out=scale(mu_scales_out, "mu"), nu_scales_out=scale(nu_scales_out, "nu"),
            param_out=params_out[i], inv=inv, clip_div=clip_div, clip_mul=clip_mul, lr=lr,
            apply=apply, inv_c1=inv_c1, sqrt_c2=sqrt_c2, count=count, l2=l2, w=w, b2=b2, c2=c2,
            eps=eps, decoupled=decoupled, block_size=block_size, rounding=rounding,
            salt_id=salt_ids[i],
        )  # fmt: skip
    return rest


def _scale_index(xs: list[torch.Tensor]) -> dict[int, int]:
    """Leaf -> index of its block scales among the coded moments of ``xs``."""
    coded = [i for i, x in enumerate(xs) if x.dtype == torch.uint8]
    return {leaf: j for j, leaf in enumerate(coded)}


def _kernel_args(a: dict, used: list[str]) -> dict:
    del used
    names = ("grads", "master", "mu", "nu", "mu_scales", "nu_scales", "params", "master_out")
    names += ("mu_out", "nu_out", "mu_scales_out", "nu_scales_out", "params_out", "inv")
    names += ("clip_div", "clip_mul", "lr", "inv_c1", "sqrt_c2", "count", "l2", "eps")
    names += ("decoupled", "block_size", "rounding", "salt_ids")
    return dict(
        {n: a[n] for n in names},
        w=f32(1.0 - a["b1"]),  # torch.lerp's weight, rounded once to float32
        b2=a["b2"],
        c2=1.0 - a["b2"],  # addcmul's value, rounded once to float32
    )


SPEC = StepSpec(
    name="adam_stored_step",
    states=("mu", "nu", "mu_scales", "nu_scales"),
    scalars=("inv_c1", "sqrt_c2", "count"),
    bool_scalars=(),
    hyper=(
        ("l2", "float"),
        ("b1", "float"),
        ("b2", "float"),
        ("eps", "float"),
        ("decoupled", "float"),
        ("block_size", "int"),
        ("rounding", "int"),
        ("salt_ids", "int[]"),
    ),
    entry="",  # no ctypes entry: the C kernel runs through its C++ op only
    check=lambda op, a: stored.check_stored(op, a, ("mu", "nu"), ("inv_c1", "sqrt_c2", "count")),
    kernel_args=_kernel_args,
    generic=_generic,
    cpp_op="stored_step",
    cpp_hyper=lambda a: (
        a["l2"],
        f32(1.0 - a["b1"]),
        a["b2"],
        f32(1.0 - a["b2"]),  # addcmul's value, rounded once to float32
        a["eps"],
        a["decoupled"],
    ),
    int_scalars=("count",),
    side=("mu_scales", "nu_scales"),
    state_dtypes=STORED_DTYPES,
    stored="adam_stored",
    root_state=1,
)

ADAM_STORED_OPS = define_step(
    SPEC,
    r"""One fused Adam/AdamW step with stored moments into fresh tensors:
    ``(master', mu', nu', mu_scales', nu_scales', params', finite, leaf_finite)``.

    See the module docstring; ``count`` is each group's applied-step count
    (int64, after this step), ``salt_ids`` each leaf's index in the optimiser's
    tree: together the stochastic rounding's salt.
    """,
)
