r"""The CUDA default of Adam's stored-moment step: one Triton kernel launch per leaf.

For a leaf whose two moments are both 8-bit E4M3 block codes (the second through
its root) or both bfloat16, one program per block (per 1024 elements for
bfloat16) runs the whole step of its elements, as the C kernel does:

.. math::
    u = \operatorname{fl}_{32}(g)\, \iota\;[/\, c_d \cdot c_m], \quad
    a = \operatorname{dec}(\hat a), \quad v = \operatorname{dec}(\hat v), \\
    a' = \operatorname{lerp}(a, u, w), \quad v' = \operatorname{fma}(c_2 u, u, v \beta_2),
    \quad \sigma = \frac{a'}{\sqrt{v'} / \sqrt{c_2^t} + \epsilon}\, c_1^{-1}\;
    [+\, \lambda m], \quad m' = \operatorname{fma}(\sigma, \eta, m)

then the block's new scales (its largest finite :math:`|a'|` and :math:`\sqrt{v'}`
over 448) and codes, rounded to nearest or stochastically with the reference's
hash (:mod:`~functional_fp16.precision.stochastic_rounding`), and the FP16
working copy. Nothing is read on the host: the loss-scale factor, clip factors,
learning rate, bias corrections, applied-step count and the skip flag are read
by the kernel from device memory, and a skipped step stores every input back
unchanged (bit for bit). It allocates nothing beyond the outputs.

Divisions and square roots are the correctly rounded ones (``div_rn``,
``sqrt_rn``), multiply-adds are ``tl.fma`` where the C kernel has ``fmaf``, so
the arithmetic is the C kernel's. On the CPU (``$FUNCTIONAL_FP16_CPU_KERNEL=
cuda-default``) the same kernel runs in Triton's interpreter, whose ``tl.fma``
is given a single rounding (:func:`_exact_fma`), as a GPU's is.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's builds
    triton = tl = None

from functional_fp16.precision.stochastic_rounding import _fixed

__all__ = ["available", "adam_leaf", "takes"]

BF16_PIECE = 256
"""A leaf with bfloat16 moments is cut into pieces of this many elements (its blocks)."""

LAUNCH_LABEL = "triton::adam_stored_leaf"
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


def takes(mu, nu, grad, param, scales=(None, None)) -> bool:
    """Whether one leaf goes through the kernel: both moments E4M3 codes (with contiguous
    float32 block scales) or both bfloat16, 16- or 32-bit float gradients and working
    copy, dense row-major tensors (the op's checks have passed: shapes agree)."""
    pair = (mu.dtype, nu.dtype) in ((torch.uint8, torch.uint8), (torch.bfloat16, torch.bfloat16))
    floats = (torch.float16, torch.bfloat16, torch.float32)
    dense = all(t.is_contiguous() for t in (mu, nu, grad, param))
    if mu.dtype == torch.uint8:
        dense = dense and all(
            s is not None and s.dtype == torch.float32 and s.is_contiguous() for s in scales
        )
    return pair and grad.dtype in floats and param.dtype in floats and dense


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
    def load_f32(ptr, off, mask, IS_BF16: tl.constexpr):
        """A 16- or 32-bit float tensor's elements as float32 (bfloat16 through its bits,
        passed as int16)."""
        if IS_BF16:
            h = tl.load(ptr + off, mask=mask, other=0).to(tl.uint16, bitcast=True)
            return value(h.to(tl.uint32) << 16)
        else:
            return tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def bf16_bits(x):
        """float32 -> bfloat16's bits, to nearest even (NaN: 0x7FC0), as int16."""
        u = bits(x)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def bf16_sr_bits(x, salt):
        """Stochastic rounding onto bfloat16 (the reference's rule), as int16 bits."""
        u = bits(x)
        r = mix32(u ^ salt)
        b = (u + ((r ^ 0xFFFFFFFF) >> 16)) >> 16
        b = tl.where(x != x, 0x7FC0, b)
        return b.to(tl.uint16).to(tl.int16, bitcast=True)

    @triton.jit
    def store_f(ptr, off, x, mask, KIND: tl.constexpr):
        """Stores float32 x as the working copy's dtype (0 float32, 1 float16, 2 bfloat16
        through int16 bits)."""
        if KIND == 0:
            tl.store(ptr + off, x, mask=mask)
        elif KIND == 1:
            tl.store(ptr + off, x.to(tl.float16), mask=mask)
        else:
            tl.store(ptr + off, bf16_bits(x), mask=mask)

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
    def encode(x, mask, salt, SR: tl.constexpr, SQ: tl.constexpr):
        """Each block's (row of x's) scale, its largest finite |x| over 448 (1 where that is
        0), and codes."""
        ax = tl.abs(x)
        peak = tl.max(tl.where(mask & (ax < float("inf")), ax, 0.0), axis=1)
        scale = tl.math.div_rn(peak, 448.0)
        scale = tl.where(scale > 0.0, scale, 1.0)
        q = tl.math.div_rn(x, scale[:, None])
        q = tl.where(q > 448.0, 448.0, tl.where(q < -448.0, -448.0, q))
        if SR:
            codes = e4m3_sr_code(q, salt, SQ)
        else:
            codes = e4m3_code(q)
        return scale, codes

    @triton.jit
    def adam_leaf_kernel(
        g_ptr, m_ptr, a_ptr, v_ptr, sa_ptr, sv_ptr, p_ptr,
        mo_ptr, ao_ptr, vo_ptr, sao_ptr, svo_ptr, po_ptr,
        inv_ptr, cd_ptr, cm_ptr, lr_ptr, apply_ptr, ic1_ptr, sc2_ptr, count_ptr,
        row_len, per_row, n_blocks, block, fixed_a, fixed_v,
        l2, coef, b2, c2, eps, wd,
        GB: tl.constexpr, BS: tl.constexpr, CODED: tl.constexpr, SR: tl.constexpr, HAS_INV: tl.constexpr,
        CLIP: tl.constexpr, L2: tl.constexpr, DECOUPLED: tl.constexpr, SMALL_W: tl.constexpr,
        G_BF16: tl.constexpr, P_KIND: tl.constexpr, OWN_P: tl.constexpr,
    ):  # fmt: skip
        # GB blocks a program, one a row of the tile: block k is row k // per_row's
        # (k % per_row)-th piece of `block` elements
        k = tl.program_id(0).to(tl.int64) * GB + tl.arange(0, GB)
        live = k < n_blocks
        lane = tl.arange(0, BS)
        col = (k % per_row)[:, None] * block + lane[None, :]
        mask = live[:, None] & (lane < block)[None, :] & (col < row_len)
        off = (k // per_row)[:, None] * row_len + col
        ok = tl.load(apply_ptr) != 0

        m = tl.load(m_ptr + off, mask=mask, other=0.0)
        u = load_f32(g_ptr, off, mask, G_BF16)
        if HAS_INV:
            u = u * tl.load(inv_ptr)
        if CLIP:
            u = tl.math.div_rn(u, tl.load(cd_ptr)) * tl.load(cm_ptr)
        if CODED:
            ca = tl.load(a_ptr + off, mask=mask, other=0)
            cv = tl.load(v_ptr + off, mask=mask, other=0)
            sa = tl.load(sa_ptr + k, mask=live, other=1.0)
            sv = tl.load(sv_ptr + k, mask=live, other=1.0)
            a = e4m3_value(ca) * sa[:, None]
            root = e4m3_value(cv) * sv[:, None]
            v = root * root
        else:
            ha = tl.load(a_ptr + off, mask=mask, other=0)
            hv = tl.load(v_ptr + off, mask=mask, other=0)
            a = value(ha.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
            v = value(hv.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)
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
        tl.store(mo_ptr + off, tl.where(ok, nm, m), mask=mask)
        if OWN_P:
            if P_KIND == 2:
                old_p = tl.load(p_ptr + off, mask=mask, other=0)
                tl.store(po_ptr + off, tl.where(ok, bf16_bits(nm), old_p), mask=mask)
            else:
                old_p = tl.load(p_ptr + off, mask=mask, other=0.0)
                new_p = nm.to(tl.float16) if P_KIND == 1 else nm
                tl.store(po_ptr + off, tl.where(ok, new_p, old_p), mask=mask)

        salt_a = 0
        salt_v = 0
        if SR:
            t = tl.load(count_ptr).to(tl.uint32) * 0x9E3779B1
            salt_a = mix32(t + fixed_a.to(tl.uint32))
            salt_v = mix32(t + fixed_v.to(tl.uint32))
        if CODED:
            scale_a, codes_a = encode(na, mask, salt_a, SR, False)
            scale_v, codes_v = encode(nr, mask, salt_v, SR, True)
            tl.store(ao_ptr + off, tl.where(ok, codes_a, ca), mask=mask)
            tl.store(vo_ptr + off, tl.where(ok, codes_v, cv), mask=mask)
            tl.store(sao_ptr + k, tl.where(ok, scale_a, sa), mask=live)
            tl.store(svo_ptr + k, tl.where(ok, scale_v, sv), mask=live)
        else:
            if SR:
                new_a = bf16_sr_bits(na, salt_a)
                new_v = bf16_sr_bits(nv, salt_v)
            else:
                new_a = bf16_bits(na)
                new_v = bf16_bits(nv)
            tl.store(ao_ptr + off, tl.where(ok, new_a, ha), mask=mask)
            tl.store(vo_ptr + off, tl.where(ok, new_v, hv), mask=mask)


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


def adam_leaf(
    *, grad, master, mu, nu, mu_scales, nu_scales, param, master_out, mu_out, nu_out,
    mu_scales_out, nu_scales_out, param_out, inv, clip_div, clip_mul, lr, apply, inv_c1,
    sqrt_c2, count, l2, w, b2, c2, eps, decoupled, block_size, rounding, salt_id,
) -> None:  # fmt: skip
    """One kernel launch: the stored Adam step of one leaf of one group (see the module
    docstring) into its outputs (which may be its inputs: a donated step). ``mu``/``nu``:
    ``uint8`` codes with their ``*_scales``, or bfloat16 (scales ``None``)."""
    coded = mu.dtype == torch.uint8
    n = master.numel()
    if coded:
        rows = master.shape[0] if master.ndim >= 2 else 1
        row_len = n // rows if rows else 0
        block = block_size
    else:  # one row of pieces
        rows, row_len, block = 1, n, BF16_PIECE
    per_row = math.ceil(row_len / block) if row_len else 0
    n_blocks = rows * per_row
    if n_blocks == 0:
        return
    bs = _next_pow2(block)
    interpreted = master.device.type != "cuda"
    gb = _blocks_per_program(bs, interpreted)
    # In the interpreter the launch is a profiler range (on a GPU, the kernel's own event).
    label = torch.profiler.record_function(LAUNCH_LABEL) if interpreted else nullcontext()
    with label:
        _launch(
            gb, bs, n_blocks, grad, master, mu, nu, mu_scales, nu_scales, param, master_out,
            mu_out, nu_out, mu_scales_out, nu_scales_out, param_out, inv, clip_div, clip_mul,
            lr, apply, inv_c1, sqrt_c2, count, l2, w, b2, c2, eps, decoupled, rounding,
            salt_id, coded, row_len, per_row, block,
        )  # fmt: skip


def _launch(
    gb, bs, n_blocks, grad, master, mu, nu, mu_scales, nu_scales, param, master_out, mu_out,
    nu_out, mu_scales_out, nu_scales_out, param_out, inv, clip_div, clip_mul, lr, apply, inv_c1,
    sqrt_c2, count, l2, w, b2, c2, eps, decoupled, rounding, salt_id, coded, row_len, per_row,
    block,
) -> None:  # fmt: skip
    small_w = abs(w) < 0.5
    own_p = param_out.data_ptr() != master_out.data_ptr()
    p_kind = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[param.dtype]
    as_bits = lambda t: t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # noqa: E731
    dummy = lr
    adam_leaf_kernel[(math.ceil(n_blocks / gb),)](
        as_bits(grad), master, as_bits(mu), as_bits(nu),
        mu_scales if coded else dummy, nu_scales if coded else dummy, as_bits(param),
        master_out, as_bits(mu_out), as_bits(nu_out),
        mu_scales_out if coded else dummy, nu_scales_out if coded else dummy, as_bits(param_out),
        inv if inv is not None else dummy, clip_div if clip_div is not None else dummy,
        clip_mul if clip_mul is not None else dummy, lr, apply, inv_c1, sqrt_c2, count,
        row_len, per_row, n_blocks, block, _fixed(0, salt_id), _fixed(1, salt_id),
        float(l2), float(w if small_w else _f32(w - 1.0)), float(b2), float(c2), float(eps),
        float(decoupled),
        GB=gb, BS=bs, CODED=coded, SR=rounding != 0, HAS_INV=inv is not None,
        CLIP=clip_div is not None, L2=l2 != 0.0, DECOUPLED=decoupled != 0.0, SMALL_W=small_w,
        G_BF16=grad.dtype == torch.bfloat16, P_KIND=p_kind, OWN_P=own_p,
    )  # fmt: skip


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))
