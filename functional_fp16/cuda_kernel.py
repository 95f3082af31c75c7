"""The single-pass SGD and Adam kernels for CUDA tensors, written in Triton.

The same arithmetic as the CPU kernel (``_sgd_kernel.c``), element by element:

.. math::
    u &= \\operatorname{fl}_{32}(g)\\cdot s^{-1}, \\quad u \\leftarrow (u / c_d)\\, c_m
         \\text{ (clipping)}, \\quad u \\leftarrow \\operatorname{fma}(m, \\lambda, u)
         \\text{ (decay)} \\\\
    b' &= \\operatorname{fl}(\\operatorname{fl}(b \\cdot k) + \\operatorname{fl}(u \\cdot t)),
          \\qquad v = \\operatorname{fma}(b', \\mu, u) \\text{ (Nesterov) or } b' \\\\
    m' &= \\operatorname{fma}(v, f, m), \\qquad p' = \\operatorname{fl}_{16}(m')

launched with ``enable_fp_fusion=False`` so that only the explicit
``tl.fma`` calls contract (``ptxas`` would otherwise fuse the momentum sum).
Scalars held in tensors (the skip flag, 1/scale, the clip factors, the learning
rate, whether momentum has started) are loaded by the kernel: no host read,
so the update stays capturable in a CUDA graph. One launch per leaf; the
kernel is compiled once per combination of flags and dtypes, never per shape.
"""

from __future__ import annotations

import os

import torch

from functional_fp16.kernel_args import AdamScalars, AdamTensors, KernelScalars, KernelTensors

__all__ = ["available", "unavailable_reason", "sgd_update", "adam_update"]

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR: str | None = None
except ImportError as err:  # pragma: no cover - triton ships with CUDA builds of torch
    triton = tl = None
    _IMPORT_ERROR = f"triton is not importable ({err})"

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 2048


def available() -> bool:
    """Whether the kernel can run on CUDA tensors here."""
    return _IMPORT_ERROR is None and torch.cuda.is_available()


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, or ``None``."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    return None if torch.cuda.is_available() else "no CUDA device"


if triton is not None:

    @triton.jit
    def _step_inputs(
        g_ptr,
        m_ptr,
        n,
        inv_ptr,
        cdiv_ptr,
        cmul_ptr,
        apply_ptr,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """This program's offsets and mask, the apply flag, the master and the unscaled,
        clipped gradient u = (fl32(g) * inv / c_div) * c_mul."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        apply = tl.load(apply_ptr) != 0
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        u = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_INV:
            u = u * tl.load(inv_ptr)
        if CLIP:
            u = tl.div_rn(u, tl.load(cdiv_ptr)) * tl.load(cmul_ptr)
        return offs, mask, apply, m, u

    @triton.jit
    def _sgd_step(
        g_ptr,
        m_ptr,
        b_ptr,
        p_ptr,
        mo_ptr,
        bo_ptr,
        po_ptr,
        n,
        inv_ptr,
        cdiv_ptr,
        cmul_ptr,
        lr_ptr,
        apply_ptr,
        started_ptr,
        wd,
        mu,
        take_started,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        DECAY: tl.constexpr,
        MOMENTUM: tl.constexpr,
        NESTEROV: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs, mask, apply, m, u = _step_inputs(
            g_ptr, m_ptr, n, inv_ptr, cdiv_ptr, cmul_ptr, apply_ptr, HAS_INV, CLIP, BLOCK
        )
        if DECAY:
            u = tl.fma(m, wd, u)
        v = u
        if MOMENTUM:
            b = tl.load(b_ptr + offs, mask=mask, other=0.0)
            started = tl.load(started_ptr) != 0
            keep = tl.where(started, mu, 0.0)
            take = tl.where(started, take_started, 1.0)
            nb = b * keep + u * take  # two roundings: fusion is off for this launch
            tl.store(bo_ptr + offs, tl.where(apply, nb, b), mask=mask)
            if NESTEROV:
                v = tl.fma(nb, mu, u)
            else:
                v = nb
        nm = tl.where(apply, tl.fma(v, tl.load(lr_ptr), m), m)
        tl.store(mo_ptr + offs, nm, mask=mask)
        if not P_IS_MASTER:
            p_old = tl.load(p_ptr + offs, mask=mask)
            p_new = nm.to(po_ptr.dtype.element_ty)  # round to nearest even
            tl.store(po_ptr + offs, tl.where(apply, p_new, p_old), mask=mask)

    @triton.jit
    def _adam_step(
        g_ptr,
        m_ptr,
        a_ptr,
        v_ptr,
        p_ptr,
        mo_ptr,
        ao_ptr,
        vo_ptr,
        po_ptr,
        n,
        inv_ptr,
        cdiv_ptr,
        cmul_ptr,
        lr_ptr,
        apply_ptr,
        ic1_ptr,
        sc2_ptr,
        l2,
        w,
        b2,
        c2,
        eps,
        wd,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        L2: tl.constexpr,
        DECOUPLED: tl.constexpr,
        SMALL_W: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs, mask, apply, m, u = _step_inputs(
            g_ptr, m_ptr, n, inv_ptr, cdiv_ptr, cmul_ptr, apply_ptr, HAS_INV, CLIP, BLOCK
        )
        if L2:
            u = tl.fma(m, l2, u)
        a = tl.load(a_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        if SMALL_W:  # torch.lerp(a, u, w)
            na = tl.fma(w, u - a, a)
        else:
            na = tl.fma(w - 1.0, u - a, u)
        nv = tl.fma(c2 * u, u, v * b2)  # torch.addcmul(v * b2, u, u, value=c2)
        denom = tl.div_rn(tl.sqrt_rn(nv), tl.load(sc2_ptr)) + eps
        step = tl.div_rn(na, denom) * tl.load(ic1_ptr)
        if DECOUPLED:
            step = tl.fma(m, wd, step)
        nm = tl.where(apply, tl.fma(step, tl.load(lr_ptr), m), m)
        tl.store(mo_ptr + offs, nm, mask=mask)
        tl.store(ao_ptr + offs, tl.where(apply, na, a), mask=mask)
        tl.store(vo_ptr + offs, tl.where(apply, nv, v), mask=mask)
        if not P_IS_MASTER:
            p_old = tl.load(p_ptr + offs, mask=mask)
            p_new = nm.to(po_ptr.dtype.element_ty)  # round to nearest even
            tl.store(po_ptr + offs, tl.where(apply, p_new, p_old), mask=mask)


def sgd_update(
    tensors: KernelTensors, scalars: KernelScalars, peak_out: torch.Tensor | None = None
) -> None:
    """The Triton counterpart of :func:`functional_fp16.cpu_kernel.sgd_update`.

    The same contract, except that ``scalars.apply`` is required: no
    speculative steps (``peak_out`` must be ``None``); on CUDA the separate
    all-finite reduction costs far less than undoing a step would.
    """
    t, s = tensors, scalars
    if s.apply is None or peak_out is not None:
        raise ValueError("the CUDA kernel runs decided steps only (apply given, no peak_out)")
    momentum_on = s.momentum != 0.0
    flags = dict(
        HAS_INV=s.inv is not None,
        CLIP=s.clip is not None,
        DECAY=s.weight_decay != 0.0,
        MOMENTUM=momentum_on,
        NESTEROV=bool(s.nesterov),
        BLOCK=BLOCK,
    )
    options = {} if _INTERPRET else {"enable_fp_fusion": False}
    lr = s.lr.reshape(())
    dummy = lr  # an unused pointer argument
    for i, g in enumerate(t.grads):
        n = g.numel()
        if n == 0:
            continue
        p_is_master = t.params_out[i] is t.master_out[i]
        _sgd_step[(triton.cdiv(n, BLOCK),)](
            g,
            t.master[i],
            t.trace[i] if momentum_on else dummy,
            t.params[i],
            t.master_out[i],
            t.trace_out[i] if momentum_on else dummy,
            t.params_out[i],
            n,
            s.inv if s.inv is not None else dummy,
            s.clip[0] if s.clip is not None else dummy,
            s.clip[1] if s.clip is not None else dummy,
            lr,
            s.apply,
            s.started if s.started is not None else s.apply,
            s.weight_decay,
            s.momentum,
            1.0 - s.dampening,
            P_IS_MASTER=p_is_master,
            **flags,
            **options,
        )


def adam_update(tensors: AdamTensors, scalars: AdamScalars) -> None:
    """The Triton counterpart of :func:`functional_fp16.cpu_kernel.adam_update`.

    The same arithmetic as the C kernel, element by element, with the
    correctly rounded ``div_rn`` and ``sqrt_rn`` and the explicit ``fma``s
    only; one launch per leaf.
    """
    t, s = tensors, scalars
    w = float(torch.tensor(1.0 - s.b1, dtype=torch.float32))  # as torch.lerp's float weight
    flags = dict(
        HAS_INV=s.inv is not None,
        CLIP=s.clip is not None,
        L2=s.l2_decay != 0.0,
        DECOUPLED=s.decoupled_decay != 0.0,
        SMALL_W=abs(w) < 0.5,
        BLOCK=BLOCK,
    )
    options = {} if _INTERPRET else {"enable_fp_fusion": False}
    lr = s.lr.reshape(())
    for i, g in enumerate(t.grads):
        n = g.numel()
        if n == 0:
            continue
        _adam_step[(triton.cdiv(n, BLOCK),)](
            g,
            t.master[i],
            t.mu[i],
            t.nu[i],
            t.params[i],
            t.master_out[i],
            t.mu_out[i],
            t.nu_out[i],
            t.params_out[i],
            n,
            s.inv if s.inv is not None else lr,
            s.clip[0] if s.clip is not None else lr,
            s.clip[1] if s.clip is not None else lr,
            lr,
            s.apply,
            s.inv_c1,
            s.sqrt_c2,
            s.l2_decay,
            w,
            s.b2,
            1.0 - s.b2,
            s.eps,
            s.decoupled_decay,
            P_IS_MASTER=t.params_out[i] is t.master_out[i],
            **flags,
            **options,
        )
