r"""The bookkeeping op's Triton kernel (:mod:`.bookkeeping` has the math): one launch.

One program over the flag's elements (one per member), reading everything from device
memory: the loss scale's state, the four ``ScaleStats`` counters, the step, up to
:data:`SLOTS` counters or flags a launch, and the configuration as a float64 tensor
(made once per configuration and device, then reused). Integer arithmetic wraps as
int32 does; the scale's products are float32 (a power-of-two factor) or a float64
product rounded once to float32, as the reference computes them; comparisons and
selections are exact, so the results are bitwise the C++ kernel's and the reference's.
On the CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``), where a
launch is the profiler range :data:`LAUNCH_LABEL`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from functional_fp16._fused import triton_stored

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's builds
    triton = tl = None

__all__ = ["available", "run", "SLOTS"]

SLOTS = 4
"""Counters or flags one launch advances; a state with more takes one more launch per
``SLOTS`` of them (no library transform has more than two)."""

LAUNCH_LABEL = "triton::bookkeeping"
"""The profiler range of one launch in the interpreter."""

_F32_MAX = (2.0 - 2.0**-23) * 2.0**127
_F32_OVERFLOW = (2.0 - 2.0**-24) * 2.0**127

_CONFIGS: dict = {}


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` (as :func:`.triton_stored.available`)."""
    return triton_stored.available(device)


def _config_tensor(config, device) -> torch.Tensor:
    """The float64 configuration the kernel reads: growth factor, backoff factor, growth
    interval, min scale as float32, the growth cap as float32 (max scale, at most the
    largest float32), hysteresis, whether max scale bounds nothing (an overflowing growth
    keeps the scale), whether each factor is a power of two. Made once per device."""
    key = (tuple(config), str(device))
    if key not in _CONFIGS:
        gf, bf, interval, lo, hi, hyst = config
        f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
        values = [
            gf, bf, interval, f32(lo), f32(min(hi, _F32_MAX)), hyst, float(hi >= _F32_OVERFLOW),
            float(gf > 0 and math.frexp(gf)[0] == 0.5), float(bf > 0 and math.frexp(bf)[0] == 0.5),
        ]  # fmt: skip
        _CONFIGS[key] = torch.tensor(values, dtype=torch.float64, device=device)
    return _CONFIGS[key]


if triton is not None:

    @triton.jit
    def _times(s, f, pow2):
        # fl32(s * f): in float32 for a power-of-two factor, else the float64 product
        # rounded once to float32
        wide = (s.to(tl.float64) * f).to(tl.float32)
        return tl.where(pow2, s * f.to(tl.float32), wide)

    @triton.jit
    def _advance(c_ptr, co_ptr, offs, mask, f, KIND: tl.constexpr):
        if KIND == 1:  # an int32 count: +1 on an applied step, saturating
            c = tl.load(c_ptr + offs, mask=mask)
            tl.store(co_ptr + offs, tl.where(f & (c < 2147483647), c + 1, c), mask=mask)
        if KIND == 2:  # a bool flag: set on an applied step
            c = tl.load(c_ptr + offs, mask=mask)
            tl.store(co_ptr + offs, c | f, mask=mask)

    @triton.jit
    def bookkeeping_kernel(
        n, fin_ptr, cfg_ptr, s_ptr, gc_ptr, hc_ptr, so_ptr, gco_ptr, hco_ptr, inv_ptr,
        st0, st1, st2, st3, sto0, sto1, sto2, sto3, step_ptr, stepo_ptr,
        c0, c1, c2, c3, co0, co1, co2, co3,
        DYNAMIC: tl.constexpr, STATS: tl.constexpr,
        K0: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr, K3: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        f = tl.load(fin_ptr + offs, mask=mask, other=0) != 0
        if STATS:
            s = tl.load(s_ptr + offs, mask=mask, other=1.0)
            s_new = s
            if DYNAMIC:
                gf = tl.load(cfg_ptr + 0)
                bf = tl.load(cfg_ptr + 1)
                interval = tl.load(cfg_ptr + 2)
                floor = tl.load(cfg_ptr + 3).to(tl.float32)
                cap = tl.load(cfg_ptr + 4).to(tl.float32)
                hyst = tl.load(cfg_ptr + 5).to(tl.int32)
                unbounded = tl.load(cfg_ptr + 6) != 0
                gf_pow2 = tl.load(cfg_ptr + 7) != 0
                bf_pow2 = tl.load(cfg_ptr + 8) != 0
                gc = tl.load(gc_ptr + offs, mask=mask, other=0)
                hc = tl.load(hc_ptr + offs, mask=mask, other=0)
                count = gc + 1
                grow = count.to(tl.float64) >= interval
                grown = _times(s, gf, gf_pow2)
                finite_grown = tl.abs(grown) < float("inf")
                grown = tl.where(
                    unbounded, tl.where(finite_grown, grown, s), tl.minimum(grown, cap)
                )
                hyst_over = tl.maximum(hc - 1, 0)
                backed = tl.maximum(_times(s, bf, bf_pow2), floor)
                s_new = tl.where(f, tl.where(grow, grown, s), tl.where(hyst_over <= 0, backed, s))
                tl.store(gco_ptr + offs, tl.where(f, tl.where(grow, 0, count), 0), mask=mask)
                tl.store(
                    hco_ptr + offs, tl.where(f, tl.where(grow, hyst, hc), hyst_over), mask=mask
                )
            tl.store(so_ptr + offs, s_new, mask=mask)
            tl.store(inv_ptr + offs, (1.0 / s_new.to(tl.float64)).to(tl.float32), mask=mask)
            one = tl.full((BLOCK,), 1, tl.int32)
            zero = tl.full((BLOCK,), 0, tl.int32)
            tl.store(
                sto0 + offs, tl.load(st0 + offs, mask=mask) + tl.where(f, zero, one), mask=mask
            )
            tl.store(
                sto1 + offs,
                tl.load(st1 + offs, mask=mask) + tl.where(s_new > s, one, zero),
                mask=mask,
            )
            tl.store(
                sto2 + offs,
                tl.load(st2 + offs, mask=mask) + tl.where(s_new < s, one, zero),
                mask=mask,
            )
            tl.store(sto3 + offs, tl.where(f, tl.load(st3 + offs, mask=mask) + 1, zero), mask=mask)
            tl.store(stepo_ptr + offs, tl.load(step_ptr + offs, mask=mask) + 1, mask=mask)
        _advance(c0, co0, offs, mask, f, K0)
        _advance(c1, co1, offs, mask, f, K1)
        _advance(c2, co2, offs, mask, f, K2)
        _advance(c3, co3, offs, mask, f, K3)


def run(finite, scale, stats, step, counters, config, kind):
    """The op's outputs from the Triton kernel: one launch (and one more per
    :data:`SLOTS` counters past the first ``SLOTS``)."""
    device = finite.device
    interpreted = device.type != "cuda"
    if interpreted:
        triton_stored._exact_fma()
    fresh = torch.empty_like
    scale_out = [fresh(t) for t in scale]
    stats_out = [fresh(t) for t in stats]
    step_out = fresh(step)
    inv = fresh(scale[0])
    counters_out = [fresh(t) for t in counters]
    n = finite.numel()
    block = max(16, 1 << max(0, (n - 1).bit_length()))
    cfg = _config_tensor(config, device)
    dynamic = kind == 0
    s, so = scale[0], scale_out[0]
    gc, hc = (scale[1], scale[2]) if dynamic else (s, s)
    gco, hco = (scale_out[1], scale_out[2]) if dynamic else (so, so)
    options = {} if interpreted else {"enable_fp_fusion": False}
    firsts = range(0, max(1, len(counters)), SLOTS)
    for j, first in enumerate(firsts):
        part = list(zip(counters[first : first + SLOTS], counters_out[first : first + SLOTS]))
        kinds = [2 if c.dtype == torch.bool else 1 for c, _ in part] + [0] * (SLOTS - len(part))
        part += [(finite, finite)] * (SLOTS - len(part))  # unused slots: never read
        with torch.profiler.record_function(LAUNCH_LABEL) if interpreted else nullcontext():
            bookkeeping_kernel[(1,)](
                n, finite, cfg, s, gc, hc, so, gco, hco, inv, *stats, *stats_out, step, step_out,
                *(c for c, _ in part), *(o for _, o in part),
                DYNAMIC=dynamic, STATS=j == 0, K0=kinds[0], K1=kinds[1], K2=kinds[2],
                K3=kinds[3], BLOCK=block, **options,
            )  # fmt: skip
    return scale_out, stats_out, step_out, inv, counters_out
