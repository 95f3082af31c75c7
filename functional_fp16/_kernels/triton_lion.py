"""The Triton kernel of the Lion step and its launch: ``fused_step.c``'s ``ff_lion_step``.

With ``u`` the unscaled, clipped gradient, ``m`` the float32 master and ``a``
the momentum (see ``triton_blocks`` for ``u``, ``m'`` and ``p'``):

.. math::
    c = \\operatorname{fl}(\\operatorname{fl}(u\\,w_1) + \\operatorname{fl}(a\\,\\beta_1)), \\quad
    d = \\operatorname{sign}(c), \\quad
    d \\leftarrow \\operatorname{fma}(m, \\lambda, d), \\quad
    m' = \\operatorname{fma}(d, f, m), \\quad
    a' = \\operatorname{fl}(\\operatorname{fl}(u\\,w_2) + \\operatorname{fl}(a\\,\\beta_2))

with ``w1 = fl32(1 - b1)``, ``w2 = fl32(1 - b2)``; the sign of ``±0`` and NaN
is ``+0``, as ``torch.sign``'s. Compiled with ``enable_fp_fusion=False`` (see ``triton_launch``), so only
the explicit ``tl.fma`` calls contract. :func:`lion_update` launches it once
per class of leaves, with the C entry's argument names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from functional_fp16._kernels import triton_steps
from functional_fp16._kernels.signatures import step_signature
from functional_fp16._kernels.triton_blocks import tl, triton
from functional_fp16._kernels.triton_launch import Checker, f32, launch_step

__all__ = ["SIGNATURE", "lion_update"]

SIGNATURE = step_signature("lion_update", ("mu",), (), ("w1", "b1", "w2", "b2", "decoupled"))
"""The arguments of :func:`lion_update`, checked before any launch."""

if triton is not None:
    from functional_fp16._kernels.triton_blocks import (
        chunk_of,
        load_block,
        ptr_at,
        store_master,
        unscaled,
    )

    @triton.jit
    def _lion_block(
        ptrs,
        offs,
        mask,
        scalars,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        DECOUPLED: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
    ):
        g_ptr, m_ptr, a_ptr, p_ptr, mo_ptr, ao_ptr, po_ptr = ptrs
        apply, lr, inv, cdiv, cmul, w1, b1, w2, b2, wd = scalars
        m = load_block(m_ptr + offs, mask)
        a = load_block(a_ptr + offs, mask)
        u = unscaled(g_ptr, offs, mask, inv, cdiv, cmul, HAS_INV, CLIP)
        c = u * w1 + a * b1  # two products and a sum, each rounded: fusion is off
        d = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, 0.0))
        if DECOUPLED:
            d = tl.fma(m, wd, d)
        tl.store(ao_ptr + offs, tl.where(apply, u * w2 + a * b2, a), mask=mask)
        store_master(mo_ptr, po_ptr, p_ptr, offs, mask, m, tl.fma(d, lr, m), apply, P_IS_MASTER)

    @triton.jit
    def _lion_kernel(
        leaves,
        chunks,
        inv_ptr,
        cdiv_ptr,
        cmul_ptr,
        lr_ptr,
        apply_ptr,
        w1,
        b1,
        w2,
        b2,
        wd,
        G_TY: tl.constexpr,
        P_TY: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        DECOUPLED: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One Lion step of chunk i (absent per-group scalars point at lr, unused)."""
        # leaf row: grads, master, mu, params, master_out, mu_out, params_out, numel, group
        row, start, end, grp, _ = chunk_of(leaves, chunks, 9, 2, CHUNK)
        f32_ = tl.float32
        ptrs = (
            ptr_at(row, 0, G_TY, ALIGNED),
            ptr_at(row, 1, f32_, ALIGNED),
            ptr_at(row, 2, f32_, ALIGNED),
            ptr_at(row, 3, P_TY, ALIGNED),
            ptr_at(row, 4, f32_, ALIGNED),
            ptr_at(row, 5, f32_, ALIGNED),
            ptr_at(row, 6, P_TY, ALIGNED),
        )
        scalars = (
            tl.load(apply_ptr + grp) != 0,
            tl.load(lr_ptr + grp),
            tl.load(inv_ptr + grp),
            tl.load(cdiv_ptr + grp),
            tl.load(cmul_ptr + grp),
            w1,
            b1,
            w2,
            b2,
            wd,
        )
        flags = (HAS_INV, CLIP, DECOUPLED, P_IS_MASTER)
        n_full = (end - start) // BLOCK
        for i in range(0, n_full):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _lion_block(ptrs, offs, None, scalars, *flags)
        offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
        _lion_block(ptrs, offs, offs < end, scalars, *flags)


def lion_update(
    *,
    n_groups: int,
    grads: Sequence[torch.Tensor],
    master: Sequence[torch.Tensor],
    mu: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    master_out: Sequence[torch.Tensor],
    mu_out: Sequence[torch.Tensor],
    params_out: Sequence[torch.Tensor],
    inv: torch.Tensor | None,
    clip_div: torch.Tensor | None,
    clip_mul: torch.Tensor | None,
    lr: torch.Tensor,
    apply: torch.Tensor,
    w1: float,
    b1: float,
    w2: float,
    b2: float,
    decoupled: float,
) -> None:
    """One Lion step of every leaf, with the C kernel's ``ff_lion_step`` arithmetic.

    ``master``, ``mu`` and their outputs are float32; ``grads``, ``params``,
    ``params_out`` float32, float16 or bfloat16. Per-group ``(G,)`` tensors:
    ``inv``, ``clip_div``/``clip_mul``, ``lr`` (the signed step factor) and
    ``apply`` (bool). ``decoupled`` of 0 is no weight decay. One launch per
    (gradient dtype, working-copy dtype, working copy is master).
    """
    kw = dict(
        grads=grads,
        master=master,
        mu=mu,
        params=params,
        master_out=master_out,
        mu_out=mu_out,
        params_out=params_out,
        inv=inv,
        clip_div=clip_div,
        clip_mul=clip_mul,
        lr=lr,
        apply=apply,
        w1=w1,
        b1=b1,
        w2=w2,
        b2=b2,
        decoupled=decoupled,
    )
    check = Checker("lion_update", n_groups, kw, SIGNATURE)
    check.both_or_neither("clip_div", "clip_mul")
    launch_step(
        "lion_update",
        _lion_kernel,
        check,
        [grads, master, mu, params, master_out, mu_out, params_out],
        [inv if inv is not None else lr, clip_div if clip_div is not None else lr]
        + [clip_mul if clip_mul is not None else lr, lr, apply],
        [w1, b1, w2, b2, decoupled],
        dict(HAS_INV=inv is not None, CLIP=clip_div is not None, DECOUPLED=f32(decoupled) != 0.0),
        dict(CHUNK=triton_steps.CHUNK, BLOCK=triton_steps.BLOCK),  # the programs' sizes, shared
    )
