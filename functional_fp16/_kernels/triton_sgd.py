"""The Triton kernel of the SGD step: ``fused_step.c``'s ``ff_sgd_update``, element by element.

With ``u`` the unscaled, clipped gradient, ``m`` the float32 master and
``b`` the momentum (see ``triton_blocks`` for ``u``, ``m'`` and ``p'``):

.. math::
    u \\leftarrow \\operatorname{fma}(m, \\lambda, u), \\quad
    b' = \\operatorname{fl}(\\operatorname{fl}(b\\,k) + \\operatorname{fl}(u\\,t)), \\quad
    d = \\operatorname{fma}(b', \\mu, u) \\text{ (Nesterov) or } b', \\quad
    m' = \\operatorname{fma}(d, f, m)

where ``(k, t) = (mu, 1 - dampening)`` once momentum has started and
``(0, 1)`` before; without momentum ``d = u``. The kernel is compiled with
``enable_fp_fusion=False`` so that only the explicit ``tl.fma`` calls
contract: ``b'`` is two products and a sum, each rounded.
``triton_steps.sgd_update`` launches it, once per class of leaves.
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
    def _sgd_block(
        ptrs,
        offs,
        mask,
        scalars,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        DECAY: tl.constexpr,
        MOMENTUM: tl.constexpr,
        NESTEROV: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
    ):
        g_ptr, m_ptr, b_ptr, p_ptr, mo_ptr, bo_ptr, po_ptr = ptrs
        apply, lr, inv, cdiv, cmul, wd, mu, keep, take = scalars
        m = load_block(m_ptr + offs, mask)
        u = unscaled(g_ptr, offs, mask, inv, cdiv, cmul, HAS_INV, CLIP)
        if DECAY:
            u = tl.fma(m, wd, u)
        d = u
        if MOMENTUM:
            b = load_block(b_ptr + offs, mask)
            nb = b * keep + u * take  # two roundings: fusion is off
            tl.store(bo_ptr + offs, tl.where(apply, nb, b), mask=mask)
            if NESTEROV:
                d = tl.fma(nb, mu, u)
            else:
                d = nb
        store_master(mo_ptr, po_ptr, p_ptr, offs, mask, m, tl.fma(d, lr, m), apply, P_IS_MASTER)

    @triton.jit
    def _sgd_kernel(
        leaves,
        chunks,
        inv_ptr,
        cdiv_ptr,
        cmul_ptr,
        lr_ptr,
        apply_ptr,
        started_ptr,
        wd,
        mu,
        take_started,
        G_TY: tl.constexpr,
        P_TY: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_INV: tl.constexpr,
        CLIP: tl.constexpr,
        DECAY: tl.constexpr,
        MOMENTUM: tl.constexpr,
        STARTED: tl.constexpr,
        NESTEROV: tl.constexpr,
        P_IS_MASTER: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One SGD step of chunk i (absent per-group scalars point at lr or apply, unused)."""
        # leaf row: grads, master, trace, params, master_out, trace_out, params_out, numel, group
        row, start, end, grp, _ = chunk_of(leaves, chunks, 9, 2, CHUNK)
        f32 = tl.float32
        ptrs = (
            ptr_at(row, 0, G_TY, ALIGNED),
            ptr_at(row, 1, f32, ALIGNED),
            ptr_at(row, 2, f32, ALIGNED),
            ptr_at(row, 3, P_TY, ALIGNED),
            ptr_at(row, 4, f32, ALIGNED),
            ptr_at(row, 5, f32, ALIGNED),
            ptr_at(row, 6, P_TY, ALIGNED),
        )
        keep = 0.0  # before momentum has started: b' = b * 0 + u * 1
        take = 1.0
        if STARTED:
            started = tl.load(started_ptr + grp) != 0
            keep = tl.where(started, mu, 0.0)
            take = tl.where(started, take_started, 1.0)
        scalars = (
            tl.load(apply_ptr + grp) != 0,
            tl.load(lr_ptr + grp),
            tl.load(inv_ptr + grp),
            tl.load(cdiv_ptr + grp),
            tl.load(cmul_ptr + grp),
            wd,
            mu,
            keep,
            take,
        )
        flags = (HAS_INV, CLIP, DECAY, MOMENTUM, NESTEROV, P_IS_MASTER)
        n_full = (end - start) // BLOCK
        for i in range(0, n_full):
            offs = start + i * BLOCK + tl.arange(0, BLOCK)
            _sgd_block(ptrs, offs, None, scalars, *flags)
        offs = start + n_full * BLOCK + tl.arange(0, BLOCK)
        _sgd_block(ptrs, offs, offs < end, scalars, *flags)
