r"""The CUDA default of the stored-state steps: one Triton kernel launch per leaf.

For a leaf with a state stored in fewer bytes (8-bit E4M3 block codes, a second
moment through its root; bfloat16; float16; float32 beside a stored one), one
program per run of whole blocks (``TILE`` elements on a GPU) runs the whole step
of its elements as the C kernel does. Adam/AdamW (:func:`adam_leaf`):

.. math::
    u = \operatorname{fl}_{32}(g)\, \iota\;[/\, c_d \cdot c_m], \quad
    a = \operatorname{dec}(\hat a), \quad v = \operatorname{dec}(\hat v), \\
    a' = \operatorname{lerp}(a, u, w), \quad v' = \operatorname{fma}(c_2 u, u, v \beta_2),
    \quad \sigma = \frac{a'}{\sqrt{v'} / \sqrt{c_2^t} + \epsilon}\, c_1^{-1}\;
    [+\, \lambda m], \quad m' = \operatorname{fma}(\sigma, \eta, m)

Lion (:func:`lion_leaf`): :math:`d = \operatorname{sign}(u w_1 + a \beta_1)\,[+\lambda m]`,
:math:`m' = \operatorname{fma}(d, \eta, m)`, :math:`a' = u w_2 + a \beta_2`. SGD's trace
(:func:`sgd_leaf`): :math:`b' = b\,k + u\,t` (:math:`k, t` by ``started``),
:math:`m' = \operatorname{fma}(b' [+ \mu\text{-Nesterov}], \eta, m)`.

Then each coded block's new scale (its largest finite magnitude over 448) and
codes, rounded to nearest or stochastically with the reference's hash
(:mod:`~functional_fp16.precision.stochastic_rounding`), and the FP16 working
copy. Nothing is read on the host: the loss-scale factor, clip factors,
learning rate, bias corrections, applied-step count, ``started`` and the skip
flag are read by the kernel from device memory, and a skipped step stores every
input back unchanged (bit for bit). It allocates nothing beyond the outputs.

Divisions and square roots are the correctly rounded ones (``div_rn``,
``sqrt_rn``), multiply-adds are ``tl.fma`` where the C kernel has ``fmaf`` and
nowhere else (GPU launches pass ``enable_fp_fusion=False``), so the arithmetic
is the C kernel's. On the CPU (``$FUNCTIONAL_FP16_CPU_KERNEL=cuda-default`` with
``TRITON_INTERPRET=1``) the same kernels run in Triton's interpreter, whose
``tl.fma`` is given a single rounding (:func:`_exact_fma`), as a GPU's is.
"""

from __future__ import annotations

import functools
import math
from contextlib import nullcontext

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's builds
    triton = tl = None

from functional_fp16._fused.plain_kernels import f32
from functional_fp16.precision.stochastic_rounding import salt_base

__all__ = ["available", "adam_leaf", "takes"]

BF16_PIECE = 256
"""A leaf with bfloat16 moments is cut into pieces of this many elements (its blocks)."""

LAUNCH_LABEL = "triton::stored_leaf"
"""The profiler range of one launch in the interpreter (``bench_cuda_default`` counts it)."""

TILE = 2048
"""Elements a program takes on a GPU: whole blocks, at least one."""

INTERPRETED_TILE = 1 << 16
"""Elements a program takes in Triton's interpreter (whose cost is per program)."""


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: CUDA with Triton, or the CPU where Triton
    was imported in its interpreter (``TRITON_INTERPRET=1``; the CUDA default forced on
    the CPU runs the plain kernel otherwise)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    if device.type == "cpu" and _interpreted():
        _exact_fma()
        return True
    return False


def takes(states, grad, param, float32=False) -> bool:
    """Whether one leaf goes through a kernel: ``states`` its states as ``(tensor, block
    scales or None)``, stored in fewer bits (E4M3 codes with contiguous float32 scales,
    bfloat16 or float16) or float32, at least one not float32 unless ``float32`` (Adam's
    leaves of float32 moments go through the FP32 step's multi-tensor ops; Lion's and
    SGD's stored steps have no such form); 16- or 32-bit float gradients and working copy;
    dense row-major tensors (the op's checks have passed: the shapes agree)."""
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if grad.dtype not in floats or param.dtype not in floats:
        return False
    if not (grad.is_contiguous() and param.is_contiguous()):
        return False
    if not float32 and all(x.dtype == torch.float32 for x, _ in states):
        return False
    for x, scales in states:
        if x.dtype not in KINDS or not x.is_contiguous():
            return False
        if x.dtype == torch.uint8 and not (
            scales is not None and scales.dtype == torch.float32 and scales.is_contiguous()
        ):
            return False
    return True


if triton is not None:

    @triton.jit
    def mix32(h):
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x846CA68B
        return h ^ (h >> 16)

    @triton.jit
    def bits(x):
        return x.to(tl.uint32, bitcast=True)

    @triton.jit
    def value(b):
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def salt_of(count_ptr, fixed):
        """stochastic_rounding.salt: mix(count * phi + fixed), the count read on the device."""
        return mix32(tl.load(count_ptr).to(tl.uint32) * 0x9E3779B1 + fixed.to(tl.uint32))

    @triton.jit
    def tile(GB: tl.constexpr, BS: tl.constexpr, row_len, per_row, n_blocks, block):
        """The program's GB blocks, one a row of the tile: block k is row k // per_row's
        (k % per_row)-th piece of ``block`` elements. (k, live, offsets, mask)."""
        k = tl.program_id(0).to(tl.int64) * GB + tl.arange(0, GB)
        live = k < n_blocks
        lane = tl.arange(0, BS)
        col = (k % per_row)[:, None] * block + lane[None, :]
        mask = live[:, None] & (lane < block)[None, :] & (col < row_len)
        return k, live, (k // per_row)[:, None] * row_len + col, mask

    @triton.jit
    def unscaled(g_ptr, off, mask, inv_ptr, cd_ptr, cm_ptr, G_BF16: tl.constexpr,
                 HAS_INV: tl.constexpr, CLIP: tl.constexpr):  # fmt: skip
        """fl32(g) * inv, then (u / c_d) * c_m when clipping (bfloat16 g passed as int16)."""
        if G_BF16:
            h = tl.load(g_ptr + off, mask=mask, other=0).to(tl.uint16, bitcast=True)
            u = value(h.to(tl.uint32) << 16)
        else:
            u = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if HAS_INV:
            u = u * tl.load(inv_ptr)
        if CLIP:
            u = tl.math.div_rn(u, tl.load(cd_ptr)) * tl.load(cm_ptr)
        return u

    @triton.jit
    def bf16_bits(x):
        """float32 -> bfloat16's bits, to nearest even (NaN: 0x7FC0), as int16."""
        u = bits(x)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def bf16_sr_bits(x, salt):
        """Stochastic rounding onto bfloat16 (the reference's rule), as int16 bits: adding
        2^16 - 1 - (r >> 16) to the pattern carries where r >> 16 is under its low bits."""
        u = bits(x)
        r = mix32(u ^ salt)
        b = (u + ((r ^ 0xFFFFFFFF) >> 16)) >> 16
        b = tl.where(x != x, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def f16_sr(x, salt):
        """round_stochastic(x, 10, -14, random_bits(x, salt)) as float16 (on its grid)."""
        bx = bits(x)
        r = mix32(bx ^ salt)
        mag = bx & 0x7FFFFFFF
        b = (mag >> 23).to(tl.int32)
        t = tl.maximum(b - 127, -14) - 10  # the spacing 2^t, t >= -24: a normal float32
        d = t - (tl.maximum(b, 1) - 150)
        tiny = d > 23
        dn = tl.minimum(d, 23).to(tl.uint32)
        low = mag & ((tl.full(mag.shape, 1, tl.uint32) << dn) - 1)
        lo = value(tl.where(tiny, 0, mag - low))
        s = value((t + 127).to(tl.uint32) << 23)
        xa = value(mag)
        uu = (r >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
        away = tl.where(tiny, uu * s < xa, (r >> (32 - dn)) < low)
        out = value(bits(tl.where(away, lo + s, lo)) | (bx & 0x80000000))
        return tl.where(b == 255, x, out).to(tl.float16)

    @triton.jit
    def e4m3_value(code):
        c = code.to(tl.uint32) & 0x7F
        normal = value((c << 20) + (120 << 23))
        sub = c.to(tl.float32) * 0.001953125  # 2^-9
        v = tl.where(c < 8, sub, normal)
        v = tl.where(c == 0x7F, float("nan"), v)
        return tl.where((code.to(tl.uint32) & 0x80) != 0, -v, v)

    @triton.jit
    def e4m3_code(v):
        """The E4M3 code of v (|v| <= 448 or NaN), to nearest even."""
        u = bits(v)
        sign = (u >> 24) & 0x80
        a = u & 0x7FFFFFFF
        s = (value(a) * 512.0 + 8388608.0) - 8388608.0  # to nearest even: 2^23's spacing is 1
        sub = s.to(tl.uint32)
        rounded = a + 0x7FFFF + ((a >> 20) & 1)
        normal = ((((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)) & 0x7F
        code = tl.where(a > 0x7F800000, 0x7F, tl.where(a < 0x3C800000, sub, normal))
        return (sign | code).to(tl.uint8)

    @triton.jit
    def e4m3_sr_code(v, salt, SQ: tl.constexpr):
        """The C kernel's e4m3_sr_code: the reference's stochastic rounding onto E4M3."""
        bx = bits(v)
        r = mix32(bx ^ salt)
        mag = bx & 0x7FFFFFFF
        sign = (bx >> 24) & 0x80
        b = (mag >> 23).to(tl.int32)
        normal = b >= 121
        tiny = b < 118
        d = tl.where(normal, 20, tl.where(tiny, 23, 141 - b)).to(tl.uint32)
        low = mag & ((tl.full(mag.shape, 1, tl.uint32) << d) - 1)
        sig = (mag & 0x7FFFFF) | 0x800000
        base = tl.where(normal, (mag >> 20) - 960, tl.where(tiny, 0, sig >> d))
        xa = value(mag)
        uu = (r >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
        if SQ:
            lo = value(tl.where(tiny, 0, mag - low))
            s = value((tl.where(normal, b - 3, 118).to(tl.uint32)) << 23)
            inv_s = value((tl.where(normal, 257 - b, 136).to(tl.uint32)) << 23)
            away = uu * (lo + lo + s) < ((xa - lo) * inv_s) * (xa + lo)
        else:
            away = tl.where(tiny, uu * 0.001953125 < xa, (r >> (32 - d)) < low)
        code = tl.where(b == 255, 0x7F, base + away.to(tl.uint32))
        return (sign | code).to(tl.uint8)

    @triton.jit
    def load_state(ptr, s_ptr, off, mask, k, live, KIND: tl.constexpr, ROOT: tl.constexpr):
        """A stored state's raw bits (codes, or int16 bits), its block scales (E4M3; else
        ones) and its float32 values (a root's square)."""
        raw = tl.load(ptr + off, mask=mask, other=0)
        scale = tl.load(s_ptr + k, mask=live & (KIND == 3), other=1.0)
        if KIND == 3:
            x = e4m3_value(raw) * scale[:, None]
            if ROOT:
                x = x * x
        elif KIND == 2:
            x = value(raw.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
        elif KIND == 1:
            x = raw.to(tl.float16, bitcast=True).to(tl.float32)
        else:
            x = raw
        return raw, scale, x

    @triton.jit
    def store_state(out_ptr, so_ptr, off, mask, k, live, ok, x, raw, scale, salt,
                    KIND: tl.constexpr, SR: tl.constexpr, SQ: tl.constexpr):  # fmt: skip
        """x encoded as the state is stored (E4M3: each block's scale from its largest
        finite |x|, SQ: x is a second moment's root), where ok; else the old bits."""
        if KIND == 3:
            ax = tl.abs(x)
            peak = tl.max(tl.where(mask & (ax < float("inf")), ax, 0.0), axis=1)
            new_scale = tl.math.div_rn(peak, 448.0)
            new_scale = tl.where(new_scale > 0.0, new_scale, 1.0)
            q = tl.math.div_rn(x, new_scale[:, None])
            q = tl.where(q > 448.0, 448.0, tl.where(q < -448.0, -448.0, q))
            if SR:
                codes = e4m3_sr_code(q, salt, SQ)
            else:
                codes = e4m3_code(q)
            tl.store(out_ptr + off, tl.where(ok, codes, raw), mask=mask)
            tl.store(so_ptr + k, tl.where(ok, new_scale, scale), mask=live)
        elif KIND == 2:
            new = bf16_sr_bits(x, salt) if SR else bf16_bits(x)
            tl.store(out_ptr + off, tl.where(ok, new, raw), mask=mask)
        elif KIND == 0:
            tl.store(out_ptr + off, tl.where(ok, x, raw), mask=mask)
        else:
            h = f16_sr(x, salt) if SR else x.to(tl.float16)
            tl.store(out_ptr + off, tl.where(ok, h.to(tl.int16, bitcast=True), raw), mask=mask)

    @triton.jit
    def unit_bits(pf):
        """``(e, sign)`` of FP16 params as float32: the biased float32 exponent of p, at
        least -14's (113), and p's sign bit; u(p) has exponent e - 25, 1/u(p) 279 - e."""
        b = pf.to(tl.int32, bitcast=True)
        e = tl.maximum((b >> 23) & 0xFF, 113)  # the biased exponent, subnormals and 0 at -14
        return e, (b >> 31) << 31  # and p's sign bit

    @triton.jit
    def join_tile(p_ptr, q_ptr, off, mask):
        """The master p + q u(p) of FP16 params and int16 residuals (master_split.join)."""
        pf = tl.load(p_ptr + off, mask=mask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + off, mask=mask, other=0).to(tl.float32)
        e, sign = unit_bits(pf)
        return pf + q * (((e - 25) << 23) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def split_tile(x):
        """``(p, q)`` of float32 masters (master_split.split): below 2^-16 x on the grid of
        2^-39 (|x| 2^39 rounded to an integer by adding and taking off 2^23, exact there),
        p = fl16 of that, q = (that - p) / u(p); 0 where p is inf or NaN."""
        xb = x.to(tl.int32, bitcast=True)
        ax = (xb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        r = (ax * 549755813888.0 + 8388608.0) - 8388608.0  # 2^39, 2^23
        g = (r * 1.8189894035458565e-12).to(tl.int32, bitcast=True) | ((xb >> 31) << 31)
        t = tl.where(ax < 1.52587890625e-05, g.to(tl.float32, bitcast=True), x)  # 2^-16
        h = t.to(tl.float16)
        pf = h.to(tl.float32)
        e, sign = unit_bits(pf)
        r = (t - pf) * (((279 - e) << 23) | sign).to(tl.float32, bitcast=True)
        return h, tl.where(e == 255, 0.0, r).to(tl.int32).to(tl.int16)

    @triton.jit
    def store_master(m_ptr, mo_ptr, p_ptr, po_ptr, off, mask, ok, nm, m, P_KIND: tl.constexpr,
                     OWN_P: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
        """The master where ok (else the old one) and its working copy where it is its own
        tensor (0 float32, 1 float16, 2 bfloat16 as int16 bits); a split master's params
        and residuals (split_tile) where ok, else the old ones bit for bit."""
        if SPLIT:
            h, q = split_tile(nm)
            old_h = tl.load(p_ptr + off, mask=mask, other=0.0)
            tl.store(po_ptr + off, tl.where(ok, h, old_h), mask=mask)
            tl.store(mo_ptr + off, tl.where(ok, q, tl.load(m_ptr + off, mask=mask, other=0)),
                     mask=mask)  # fmt: skip
            return
        tl.store(mo_ptr + off, tl.where(ok, nm, m), mask=mask)
        if OWN_P:
            old_p = tl.load(p_ptr + off, mask=mask, other=0)
            if P_KIND == 2:
                new_p = bf16_bits(nm)
            elif P_KIND == 1:
                new_p = nm.to(tl.float16)
            else:
                new_p = nm
            tl.store(po_ptr + off, tl.where(ok, new_p, old_p), mask=mask)

    @triton.jit
    def front(g_ptr, m_ptr, p_ptr, inv_ptr, cd_ptr, cm_ptr, apply_ptr, row_len, per_row,
              n_blocks, block, GB: tl.constexpr, BS: tl.constexpr, G_BF16: tl.constexpr,
              HAS_INV: tl.constexpr, CLIP: tl.constexpr, SPLIT: tl.constexpr):  # fmt: skip
        """What every step reads first: the tile, the skip flag, the master (joined from
        params and residuals where SPLIT), the unscaled (and clipped) gradient."""
        k, live, off, mask = tile(GB, BS, row_len, per_row, n_blocks, block)
        if SPLIT:
            m = join_tile(p_ptr, m_ptr, off, mask)
        else:
            m = tl.load(m_ptr + off, mask=mask, other=0.0)
        u = unscaled(g_ptr, off, mask, inv_ptr, cd_ptr, cm_ptr, G_BF16, HAS_INV, CLIP)
        return k, live, off, mask, tl.load(apply_ptr) != 0, m, u

    @triton.jit
    def adam_leaf_kernel(
        g_ptr, m_ptr, a_ptr, v_ptr, sa_ptr, sv_ptr, p_ptr,
        mo_ptr, ao_ptr, vo_ptr, sao_ptr, svo_ptr, po_ptr,
        inv_ptr, cd_ptr, cm_ptr, lr_ptr, apply_ptr, ic1_ptr, sc2_ptr, count_ptr,
        row_len, per_row, n_blocks, block, fixed_a, fixed_v,
        l2, coef, b2, c2, eps, wd,
        GB: tl.constexpr, BS: tl.constexpr, KIND_A: tl.constexpr, KIND_V: tl.constexpr,
        SR: tl.constexpr, HAS_INV: tl.constexpr, CLIP: tl.constexpr, L2: tl.constexpr,
        DECOUPLED: tl.constexpr, SMALL_W: tl.constexpr, G_BF16: tl.constexpr,
        P_KIND: tl.constexpr, OWN_P: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        k, live, off, mask, ok, m, u = front(
            g_ptr, m_ptr, p_ptr, inv_ptr, cd_ptr, cm_ptr, apply_ptr, row_len, per_row,
            n_blocks, block, GB, BS, G_BF16, HAS_INV, CLIP, SPLIT,
        )  # fmt: skip
        raw_a, scale_a, a = load_state(a_ptr, sa_ptr, off, mask, k, live, KIND_A, False)
        raw_v, scale_v, v = load_state(v_ptr, sv_ptr, off, mask, k, live, KIND_V, True)
        if L2:
            u = tl.fma(m, l2, u)
        if SMALL_W:
            na = tl.fma(coef, u - a, a)
        else:
            na = tl.fma(coef, u - a, u)
        nv = tl.fma(c2 * u, u, v * b2)
        nr = tl.math.sqrt_rn(nv)
        step = tl.math.div_rn(na, tl.math.div_rn(nr, tl.load(sc2_ptr)) + eps) * tl.load(ic1_ptr)
        if DECOUPLED:
            step = tl.fma(m, wd, step)
        nm = tl.fma(step, tl.load(lr_ptr), m)
        store_master(m_ptr, mo_ptr, p_ptr, po_ptr, off, mask, ok, nm, m, P_KIND, OWN_P, SPLIT)
        salt_a = 0
        salt_v = 0
        if SR:
            salt_a = salt_of(count_ptr, fixed_a)
            salt_v = salt_of(count_ptr, fixed_v)
        store_state(ao_ptr, sao_ptr, off, mask, k, live, ok, na, raw_a, scale_a, salt_a,
                    KIND_A, SR, False)  # fmt: skip
        if KIND_V == 3:  # the second moment is coded through its root
            store_state(vo_ptr, svo_ptr, off, mask, k, live, ok, nr, raw_v, scale_v, salt_v,
                        KIND_V, SR, True)  # fmt: skip
        else:
            store_state(vo_ptr, svo_ptr, off, mask, k, live, ok, nv, raw_v, scale_v, salt_v,
                        KIND_V, SR, False)  # fmt: skip

    @triton.jit
    def lion_leaf_kernel(
        g_ptr, m_ptr, a_ptr, sa_ptr, p_ptr, mo_ptr, ao_ptr, sao_ptr, po_ptr,
        inv_ptr, cd_ptr, cm_ptr, lr_ptr, apply_ptr, count_ptr,
        row_len, per_row, n_blocks, block, fixed_a,
        w1, b1, w2, b2, wd,
        GB: tl.constexpr, BS: tl.constexpr, KIND_A: tl.constexpr, SR: tl.constexpr,
        HAS_INV: tl.constexpr, CLIP: tl.constexpr, DECOUPLED: tl.constexpr,
        G_BF16: tl.constexpr, P_KIND: tl.constexpr, OWN_P: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        k, live, off, mask, ok, m, u = front(
            g_ptr, m_ptr, p_ptr, inv_ptr, cd_ptr, cm_ptr, apply_ptr, row_len, per_row,
            n_blocks, block, GB, BS, G_BF16, HAS_INV, CLIP, SPLIT,
        )  # fmt: skip
        raw_a, scale_a, a = load_state(a_ptr, sa_ptr, off, mask, k, live, KIND_A, False)
        c = u * w1 + a * b1  # two products and a sum, each rounded (no fusion: see launch)
        d = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, 0.0))
        if DECOUPLED:
            d = tl.fma(m, wd, d)
        nm = tl.fma(d, tl.load(lr_ptr), m)
        store_master(m_ptr, mo_ptr, p_ptr, po_ptr, off, mask, ok, nm, m, P_KIND, OWN_P, SPLIT)
        salt_a = 0
        if SR:
            salt_a = salt_of(count_ptr, fixed_a)
        store_state(ao_ptr, sao_ptr, off, mask, k, live, ok, u * w2 + a * b2, raw_a, scale_a,
                    salt_a, KIND_A, SR, False)  # fmt: skip

    @triton.jit
    def sgd_leaf_kernel(
        g_ptr, m_ptr, a_ptr, sa_ptr, p_ptr, mo_ptr, ao_ptr, sao_ptr, po_ptr,
        inv_ptr, cd_ptr, cm_ptr, lr_ptr, apply_ptr, started_ptr,
        row_len, per_row, n_blocks, block,
        wd, mu, take,
        GB: tl.constexpr, BS: tl.constexpr, KIND_A: tl.constexpr, HAS_INV: tl.constexpr,
        CLIP: tl.constexpr, DECAY: tl.constexpr, NESTEROV: tl.constexpr,
        G_BF16: tl.constexpr, P_KIND: tl.constexpr, OWN_P: tl.constexpr, SPLIT: tl.constexpr,
    ):  # fmt: skip
        k, live, off, mask, ok, m, u = front(
            g_ptr, m_ptr, p_ptr, inv_ptr, cd_ptr, cm_ptr, apply_ptr, row_len, per_row,
            n_blocks, block, GB, BS, G_BF16, HAS_INV, CLIP, SPLIT,
        )  # fmt: skip
        on = tl.load(started_ptr) != 0.0
        keep = tl.where(on, mu, 0.0)
        take_ = tl.where(on, take, 1.0)
        if DECAY:
            u = tl.fma(m, wd, u)
        raw_a, scale_a, b = load_state(a_ptr, sa_ptr, off, mask, k, live, KIND_A, False)
        nb = b * keep + u * take_
        if NESTEROV:
            v = tl.fma(nb, mu, u)
        else:
            v = nb
        nm = tl.fma(v, tl.load(lr_ptr), m)
        store_master(m_ptr, mo_ptr, p_ptr, po_ptr, off, mask, ok, nm, m, P_KIND, OWN_P, SPLIT)
        store_state(ao_ptr, sao_ptr, off, mask, k, live, ok, nb, raw_a, scale_a, 0,
                    KIND_A, False, False)  # fmt: skip


def _interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` when it was
    imported): then on the CPU, the CUDA default's kernel."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(adam_leaf_kernel, InterpretedFunction)


def _exact_fma() -> None:
    """Gives Triton's interpreter a once-rounded ``tl.fma``: it computes ``x * y + z`` in
    the operands' precision, rounding twice, where a GPU rounds once. The float64 product
    of float32 operands is exact; the sum is made round-to-odd (its error by TwoSum), so
    that rounding it to float32 is the correctly rounded fused result."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_ff_exact_fma", False):
        return

    def create_fma(self, x, y, z):
        if x.data.dtype != np.float32:
            return interpreter.TensorHandle(x.data * y.data + z.data, z.dtype.scalar)
        with np.errstate(all="ignore"):
            p = x.data.astype(np.float64) * y.data.astype(np.float64)
            c = np.broadcast_to(z.data.astype(np.float64), p.shape)
            s = p + c
            bp = s - c  # TwoSum: err is exactly (p + c) - s
            err = (p - bp) + (c - (s - bp))
            even = (s.view(np.int64) & 1) == 0
            fix = np.isfinite(s) & (err != 0) & even
            s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return interpreter.TensorHandle(s.astype(np.float32), z.dtype.scalar)

    builder.create_fma = create_fma
    builder._ff_exact_fma = True


def _next_pow2(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def _blocks_per_program(bs: int, interpreted: bool) -> int:
    """Blocks a program takes (a power of two): the tile over the padded block size. The
    results do not depend on it: each block is computed alone."""
    return max(1, (INTERPRETED_TILE if interpreted else TILE) // bs)


KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3}
"""A state's kind in the kernels (the C kernel's ST_F32, ST_F16, ST_BF16, ST_E4M3)."""

_P_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _geometry(master: torch.Tensor, coded: bool, block_size: int) -> tuple[int, int, int, int]:
    """(row length, blocks a row, blocks, block): E4M3 blocks cut each row (everything after
    the first dimension; a vector is one row); otherwise pieces of the flat tensor."""
    n = master.numel()
    if coded:
        rows = master.shape[0] if master.ndim >= 2 else 1
        row_len, block = (n // rows if rows else 0), block_size
    else:
        rows, row_len, block = 1, n, BF16_PIECE
    per_row = math.ceil(row_len / block) if row_len else 0
    return row_len, per_row, rows * per_row, block


def _bits(t: torch.Tensor | None) -> torch.Tensor | None:
    """A bfloat16 tensor as int16 (the kernels convert it by its bits)."""
    return t.view(torch.int16) if t is not None and t.dtype == torch.bfloat16 else t


def _state(t: torch.Tensor) -> torch.Tensor:
    """A stored state as the kernels read it: 16-bit floats as int16 bits, codes as they are."""
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _run(kernel, master, coded, block_size, args, constants) -> None:
    """One launch of ``kernel`` over the leaf's blocks: ``args`` (positional, after the
    geometry's) and ``constants`` (the flags)."""
    row_len, per_row, n_blocks, block = _geometry(master, coded, block_size)
    if n_blocks == 0:
        return
    bs = _next_pow2(block)
    interpreted = master.device.type != "cuda"
    gb = _blocks_per_program(bs, interpreted)
    head, tail = args
    options = {} if interpreted else {"enable_fp_fusion": False}  # the C kernel's roundings
    # In the interpreter a launch is a profiler range (on a GPU, the kernel's own event).
    with torch.profiler.record_function(LAUNCH_LABEL) if interpreted else nullcontext():
        kernel[(math.ceil(n_blocks / gb),)](
            *head,
            row_len,
            per_row,
            n_blocks,
            block,
            *tail,
            GB=gb,
            BS=bs,
            **constants,
            **options,
        )


def _front(grad, param, param_out, master_out, inv, clip_div, clip_mul, lr) -> tuple:
    """The flags every kernel takes, and the stand-ins for absent scalars."""
    dummy = lr
    scalars = (
        inv if inv is not None else dummy,
        clip_div if clip_div is not None else dummy,
        clip_mul if clip_mul is not None else dummy,
    )
    flags = dict(
        HAS_INV=inv is not None, CLIP=clip_div is not None, G_BF16=grad.dtype == torch.bfloat16,
        P_KIND=_P_KINDS[param.dtype], OWN_P=param_out.data_ptr() != master_out.data_ptr(),
        SPLIT=master_out.dtype == torch.int16,  # a split master's residuals
    )  # fmt: skip
    return scalars, flags


def adam_leaf(
    *, grad, master, mu, nu, mu_scales, nu_scales, param, master_out, mu_out, nu_out,
    mu_scales_out, nu_scales_out, param_out, inv, clip_div, clip_mul, lr, apply, inv_c1,
    sqrt_c2, count, l2, w, b2, c2, eps, decoupled, block_size, rounding, salt_id,
) -> None:  # fmt: skip
    """One kernel launch: the stored Adam step of one leaf of one group (see the module
    docstring) into its outputs (which may be its inputs: a donated step). ``mu``/``nu``:
    ``uint8`` codes with their ``*_scales`` (else ``None``), bfloat16 or float16."""
    scalars, flags = _front(grad, param, param_out, master_out, inv, clip_div, clip_mul, lr)
    small_w = abs(w) < 0.5
    coded = torch.uint8 in (mu.dtype, nu.dtype)
    head = (
        _bits(grad), master, _state(mu), _state(nu), _or(mu_scales, lr), _or(nu_scales, lr),
        _bits(param), master_out, _state(mu_out), _state(nu_out), _or(mu_scales_out, lr),
        _or(nu_scales_out, lr), _bits(param_out), *scalars, lr, apply, inv_c1, sqrt_c2, count,
    )  # fmt: skip
    tail = (
        *_salt_bases(salt_id), float(l2),
        float(w if small_w else f32(w - 1.0)), float(b2), float(c2), float(eps),
        float(decoupled),
    )  # fmt: skip
    flags.update(
        KIND_A=KINDS[mu.dtype], KIND_V=KINDS[nu.dtype], SR=rounding != 0, L2=l2 != 0.0,
        DECOUPLED=decoupled != 0.0, SMALL_W=small_w,
    )  # fmt: skip
    _run(adam_leaf_kernel, master, coded, block_size, (head, tail), flags)


def lion_leaf(
    *, grad, master, mu, mu_scales, param, master_out, mu_out, mu_scales_out, param_out, inv,
    clip_div, clip_mul, lr, apply, count, w1, b1, w2, b2, decoupled, block_size, rounding,
    salt_id,
) -> None:  # fmt: skip
    """One kernel launch: Lion's stored step of one leaf of one group (the C kernel's
    ``lion_block`` between a decode and an encode)."""
    scalars, flags = _front(grad, param, param_out, master_out, inv, clip_div, clip_mul, lr)
    head = (
        _bits(grad), master, _state(mu), _or(mu_scales, lr), _bits(param), master_out,
        _state(mu_out), _or(mu_scales_out, lr), _bits(param_out), *scalars, lr, apply, count,
    )  # fmt: skip
    tail = (_salt_bases(salt_id)[0], float(w1), float(b1), float(w2), float(b2), float(decoupled))
    flags.update(KIND_A=KINDS[mu.dtype], SR=rounding != 0, DECOUPLED=decoupled != 0.0)
    _run(lion_leaf_kernel, master, mu.dtype == torch.uint8, block_size, (head, tail), flags)


def sgd_leaf(
    *, grad, master, trace, trace_scales, param, master_out, trace_out, trace_scales_out,
    param_out, inv, clip_div, clip_mul, lr, apply, started, weight_decay, momentum, take,
    nesterov, block_size,
) -> None:  # fmt: skip
    """One kernel launch: SGD's stored trace step of one leaf of one group (the C kernel's
    ``sgd_block`` with momentum between a decode and an encode; rounded to nearest)."""
    scalars, flags = _front(grad, param, param_out, master_out, inv, clip_div, clip_mul, lr)
    head = (
        _bits(grad), master, _state(trace), _or(trace_scales, lr), _bits(param), master_out,
        _state(trace_out), _or(trace_scales_out, lr), _bits(param_out), *scalars, lr, apply,
        started,
    )  # fmt: skip
    tail = (float(weight_decay), float(momentum), float(take))
    flags.update(KIND_A=KINDS[trace.dtype], DECAY=weight_decay != 0.0, NESTEROV=bool(nesterov))
    _run(sgd_leaf_kernel, master, trace.dtype == torch.uint8, block_size, (head, tail), flags)


@functools.cache
def _salt_bases(salt_id: int) -> tuple[int, int]:
    """Both moments' step-independent salt parts of one leaf (made once per leaf)."""
    return salt_base(0, salt_id), salt_base(1, salt_id)


def _or(x, stand_in):
    return stand_in if x is None else x
