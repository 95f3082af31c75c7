"""The Triton kernel of the Adam/AdamW step: ``fused_step.c``'s ``ff_adam_update``, element by element.

With ``u`` the unscaled, clipped gradient, ``m`` the float32 master and
``a``/``v`` Adam's moments (see ``triton_blocks`` for ``u``, ``m'`` and ``p'``):

.. math::
    u &\\leftarrow \\operatorname{fma}(m, \\lambda_2, u), \\quad
         a' = \\operatorname{lerp}(a, u, w), \\quad
         v' = \\operatorname{fma}(c_2 u, u, \\beta_2 v), \\\\
    d &= \\frac{a'}{\\sqrt{v'} / \\sqrt{c_2^{(t)}} + \\epsilon}\\, c_1^{(t)\\,-1}, \\quad
         d \\leftarrow \\operatorname{fma}(m, \\lambda_w, d) \\text{ (decoupled)}, \\quad
         m' = \\operatorname{fma}(d, f, m)

where ``lerp(a, u, w)`` is ``fma(w, u - a, a)`` for ``|w| < 0.5`` and
``fma(w - 1, u - a, u)`` otherwise (torch.lerp), divisions and square roots
are correctly rounded (``div_rn``, ``sqrt_rn``), and the kernel is compiled
with ``enable_fp_fusion=False`` so that only the explicit ``tl.fma`` calls
contract. ``triton_steps.adam_update`` launches it, once per class of leaves.
"""

from __future__ import annotations

from functional_fp16._kernels.triton_blocks import tl, triton

if triton is not None:
    from functional_fp16._kernels.triton_blocks import (
        chunk_of,
        load_block,
        ptr_at,
        store_master,
        unscaled,
    )

    @triton.jit
    def _adam_block(
        ptrs,
        offs,
        mask,
        scalars,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        L2: tl.constexpr,
        DECOUPLED: tl.constexpr,
        SMALL_W: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
    ):
        g_ptr, m_ptr, a_ptr, v_ptr, p_ptr, mo_ptr, ao_ptr, vo_ptr, po_ptr = ptrs
        apply, lr, inv, cdiv, cmul, inv_c1, sqrt_c2, l2, w, b2, c2, eps, wd = scalars
        m = load_block(m_ptr + offs, mask)
        u = unscaled(g_ptr, offs, mask, inv, cdiv, cmul, HAS_INV, CLIP)
        if L2:
            u = tl.fma(m, l2, u)
        a = load_block(a_ptr + offs, mask)
        v = load_block(v_ptr + offs, mask)
        if SMALL_W:  # torch.lerp(a, u, w)
            na = tl.fma(w, u - a, a)
        else:
            na = tl.fma(w - 1.0, u - a, u)
        nv = tl.fma(c2 * u, u, v * b2)  # torch.addcmul(v * b2, u, u, value=c2)
        d = tl.div_rn(na, tl.div_rn(tl.sqrt_rn(nv), sqrt_c2) + eps) * inv_c1
        if DECOUPLED:
            d = tl.fma(m, wd, d)
        tl.store(ao_ptr + offs, tl.where(apply, na, a), mask=mask)
        tl.store(vo_ptr + offs, tl.where(apply, nv, v), mask=mask)
        store_master(mo_ptr, po_ptr, p_ptr, offs, mask, m, tl.fma(d, lr, m), apply, P_IS_MASTER)

    @triton.jit
    def _adam_kernel(
        leaves,
        chunks,
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
        G_TY: tl.constexpr,
        P_TY: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        L2: tl.constexpr,
        DECOUPLED: tl.constexpr,
        SMALL_W: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One Adam step of chunk i (absent per-group scalars point at lr, unused)."""
        # leaf row: grads, master, mu, nu, params, master_out, mu_out, nu_out, params_out,
        # numel, group
        row, start, end, grp, _ = chunk_of(leaves, chunks, 11, 2, CHUNK)
        f32 = tl.float32
        ptrs = (
            ptr_at(row, 0, G_TY, ALIGNED),
            ptr_at(row, 1, f32, ALIGNED),
            ptr_at(row, 2, f32, ALIGNED),
            ptr_at(row, 3, f32, ALIGNED),
            ptr_at(row, 4, P_TY, ALIGNED),
            ptr_at(row, 5, f32, ALIGNED),
            ptr_at(row, 6, f32, ALIGNED),
            ptr_at(row, 7, f32, ALIGNED),
            ptr_at(row, 8, P_TY, ALIGNED),
        )
        scalars = (
            tl.load(apply_ptr + grp) != 0,
            tl.load(lr_ptr + grp),
            tl.load(inv_ptr + grp),
            tl.load(cdiv_ptr + grp),
            tl.load(cmul_ptr + grp),
            tl.load(ic1_ptr + grp),
            tl.load(sc2_ptr + grp),
            l2,
            w,
            b2,
            c2,
            eps,
            wd,
        )
        flags = (HAS_INV, CLIP, L2, DECOUPLED, SMALL_W, P_IS_MASTER)
        n_full = (end - start) // BLOCK
        for i in range(0, n_full):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _adam_block(ptrs, offs, None, scalars, *flags)
        offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
        _adam_block(ptrs, offs, offs < end, scalars, *flags)
