r"""The step-scalars op's Triton kernel (:mod:`.step_scalars` has the math): one launch.

One program over the members (and, for the decision, their leaves): the leaves' flags
and each member's decision, the clip factors, and up to :data:`SLOTS` declared schedules,
read from their programs (a float64 tensor made once per programs and device). Every
schedule takes the float64 operations of its definition in their order, rounded once
to float32, as PyTorch's kernels of the device take them: on CUDA a division by the
schedule's step count is a product with its reciprocal (``div_true_kernel_cuda`` does
that for a divisor given as a Python number), in the interpreter on the CPU a
division; multiply-adds are not contracted (``enable_fp_fusion=False``). A power takes
ATen's special exponents (0, 0.5, 1, 2, 3) as ATen does. On the CPU the kernel runs in
Triton's interpreter (``TRITON_INTERPRET=1``), where a launch is the profiler range
:data:`LAUNCH_LABEL`.
"""

from __future__ import annotations

import struct
from contextlib import nullcontext

import torch

from functional_fp16._fused import triton_stored
from functional_fp16._fused.programs import decode

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - triton ships with torch's builds
    triton = tl = libdevice = None

__all__ = ["available", "run", "SLOTS"]

SLOTS = 4
"""Schedules one launch evaluates; more take one more launch per ``SLOTS``."""

LAUNCH_LABEL = "triton::step_scalars"
"""The profiler range of one launch in the interpreter."""

_PAD = 8  # zeros after the programs: a segment reads its numbers before it knows its kind
_PROGRAMS: dict = {}
_PROGRAMS_KEPT = 1024
_TILE = 2**16  # elements of one program's block: past it the decision is the reference's


def available(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` (as :func:`.triton_stored.available`)."""
    return triton_stored.available(device)


_SPECIAL = (0.0, 0.5, 1.0, 2.0, 3.0)


def _general_power(form: tuple) -> bool:
    """Whether ``form`` takes a power that is not one of ATen's special exponents
    (Triton's interpreter has no ``pow``: such a program is evaluated by the reference
    there)."""
    kind = form[0]
    if kind == "polynomial":
        return form[3] not in _SPECIAL
    if kind == "cosine":
        return form[4] not in _SPECIAL
    if kind == "exponential":
        return form[3] != 1.0
    if kind == "join":
        return any(map(_general_power, form[1]))
    return kind in ("inv_c1", "sqrt_c2")


def _programs_tensor(programs: list[float], device) -> torch.Tensor:
    """The programs as a float64 tensor on ``device``, made once and kept for the process
    (a CUDA graph that captured it reads it at every replay: nothing kept is freed); keyed
    by the numbers' bits (-0.0 is not 0.0). Past :data:`_PROGRAMS_KEPT` distinct programs
    (schedules made anew call after call) a new one is made afresh each call."""
    key = (struct.pack(f"{len(programs)}d", *programs), str(device))
    found = _PROGRAMS.get(key)
    if found is None:
        padded = [*programs, *[0.0] * _PAD]
        found = torch.tensor(padded, dtype=torch.float64, device=device)
        if len(_PROGRAMS) < _PROGRAMS_KEPT:
            _PROGRAMS[key] = found
    return found


if triton is not None:

    @triton.jit
    def _div(x, d, CUDA: tl.constexpr):
        # ATen's CUDA kernel divides by a number as a product with its reciprocal
        if CUDA:
            return x * (1.0 / d)
        else:
            return x / d

    @triton.jit
    def _general_pow(x, e, CUDA: tl.constexpr):
        if CUDA:
            return libdevice.pow(x, tl.zeros_like(x) + e)
        else:  # never taken: the interpreter has no pow (run() leaves such programs out)
            return x

    @triton.jit
    def _pow(x, e, CUDA: tl.constexpr):
        # torch.pow(x, e) for a float64 x and a number e, ATen's special exponents first
        v = _general_pow(x, e, CUDA)
        v = tl.where(e == 3.0, x * x * x, v)
        v = tl.where(e == 2.0, x * x, v)
        v = tl.where(e == 0.5, tl.sqrt(x), v)
        v = tl.where(e == 1.0, x, v)
        v = tl.where(e == 0.0, tl.zeros_like(x) + 1.0, v)
        return v

    @triton.jit
    def _clamp(x, lo, hi):
        return tl.minimum(tl.maximum(x, lo), hi)

    @triton.jit
    def _segment(prog, pos, t, CUDA: tl.constexpr):
        """One schedule that is not a join, at the float64 steps ``t``: (values, end)."""
        kind = tl.load(prog + pos).to(tl.int32)
        a0 = tl.load(prog + pos + 1)
        a1 = tl.load(prog + pos + 2)
        a2 = tl.load(prog + pos + 3)
        a3 = tl.load(prog + pos + 4)
        a4 = tl.load(prog + pos + 5)
        a5 = tl.load(prog + pos + 6)
        a6 = tl.load(prog + pos + 7)
        zero = tl.zeros_like(t)
        v = zero + a0  # constant
        end = pos + 2
        if kind == 1:  # linear(v0, v1, T, tb)
            u = _clamp(t - a3, 0.0, a2)
            v = a0 + (a1 - a0) * _div(u, a2, CUDA)
            end = pos + 5
        if kind == 2:  # polynomial(v0, v1, power, T, tb)
            u = _clamp(t - a4, 0.0, a3)
            v = (a0 - a1) * _pow(1.0 - _div(u, a3, CUDA), a2, CUDA) + a1
            end = pos + 6
        if kind == 3:  # exponential(v0, T, rate, tb, staircase, has_end, end)
            u = t - a3
            q = _div(u, a1, CUDA)
            q = tl.where(a4 != 0.0, tl.floor(q), q)
            r = tl.where(a2 == 1.0, zero + 1.0, _general_pow(zero + a2, q, CUDA))
            v = tl.where(u <= 0.0, zero + a0, a0 * r)
            v = tl.where(a0 == 0.0, zero, v)
            bounded = tl.where(a2 < 1.0, tl.maximum(v, a6), tl.minimum(v, a6))
            v = tl.where(a5 != 0.0, bounded, v)
            end = pos + 8
        if kind == 4:  # piecewise(v0, n, bounds, values)
            n = a1.to(tl.int32)
            for i in range(n):
                b = tl.load(prog + pos + 3 + i)
                value = tl.load(prog + pos + 3 + n + i)
                v = tl.where(t >= b, zero + value, v)
            end = pos + 3 + 2 * n
        if kind == 5:  # cosine(v0, T, alpha, exponent)
            u = _clamp(t, 0.0, a1)
            c = 0.5 * (1.0 + tl.cos(_div(u * 3.141592653589793, a1, CUDA)))
            v = a0 * ((1.0 - a2) * _pow(c, a3, CUDA) + a2)
            end = pos + 5
        return v, end

    @triton.jit
    def _schedule(prog, pos, step, CUDA: tl.constexpr):
        """The schedule at ``pos`` at the int32 counts ``step``, rounded to float32."""
        kind = tl.load(prog + pos).to(tl.int32)
        v, end = _segment(prog, pos, step.to(tl.float64), CUDA)
        counted = step.to(tl.float32) + 1.0  # kind 7: fl32(fl32(t) + 1), not a schedule
        if (kind == 8) | (kind == 9):  # Adam's corrections at the count after this step
            after = tl.where(step < 2147483647, step + 1, step).to(tl.float64)
            base = tl.zeros_like(after) + tl.load(prog + pos + 1)
            c = 1.0 - _general_pow(base, after, CUDA)
            counted = tl.where(kind == 8, 1.0 / c, tl.sqrt(c)).to(tl.float32)
        if kind == 10:  # the unscale factor of a float32 scale given as its bits
            scale = step.to(tl.float32, bitcast=True).to(tl.float64)
            counted = (1.0 / scale).to(tl.float32)
        if kind == 6:  # join(n, boundaries, n schedules)
            n = tl.load(prog + pos + 1).to(tl.int32)
            at = pos + 1 + n
            v, at = _segment(prog, at, step.to(tl.float64), CUDA)
            for i in range(1, n):
                b = tl.load(prog + pos + 1 + i).to(tl.int32)
                w, at = _segment(prog, at, (step - b).to(tl.float64), CUDA)
                v = tl.where(step >= b, w, v)
        return tl.where(kind >= 7, counted, v.to(tl.float32))

    @triton.jit
    def _lr(prog, start, c_ptr, o_ptr, m, mask, CUDA: tl.constexpr):
        sign = tl.load(prog + start).to(tl.float32)
        step = tl.load(c_ptr + m, mask=mask, other=0)
        tl.store(o_ptr + m, _schedule(prog, start + 1, step, CUDA) * sign, mask=mask)

    @triton.jit
    def step_scalars_kernel(
        members, n_leaves, peak_ptr, inv_ptr, req_ptr, sq_ptr, max_norm, prog,
        leaves_ptr, finite_ptr, skip_ptr, div_ptr, mul_ptr,
        s0, s1, s2, s3, c0, c1, c2, c3, o0, o1, o2, o3,
        PEAK: tl.constexpr, INV: tl.constexpr, REQUIRE: tl.constexpr, CLIP: tl.constexpr,
        NS: tl.constexpr, CUDA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_L: tl.constexpr,
    ):  # fmt: skip
        m = tl.arange(0, BLOCK_M)
        in_m = m < members
        if PEAK:
            ell = tl.arange(0, BLOCK_L)
            where = m[:, None] * n_leaves + ell[None, :]
            mask = in_m[:, None] & (ell[None, :] < n_leaves)
            x = tl.load(peak_ptr + where, mask=mask, other=0.0)
            if INV:
                x = x * tl.load(inv_ptr + m, mask=in_m, other=1.0)[:, None]
            ok = tl.abs(x) < float("inf")  # false for inf and NaN
            tl.store(leaves_ptr + where, ok, mask=mask)
            decided = tl.min(tl.where(mask, ok.to(tl.int32), 1), axis=1) != 0
            if REQUIRE:
                decided = decided & (tl.load(req_ptr + m, mask=in_m, other=0) != 0)
            tl.store(finite_ptr + m, decided, mask=in_m)
            tl.store(skip_ptr + m, tl.where(decided, 0.0, 1.0), mask=in_m)
        if CLIP:
            norm = tl.sqrt(tl.load(sq_ptr + m, mask=in_m, other=0.0)).to(tl.float32)
            inside = norm < max_norm
            one = tl.zeros_like(norm) + 1.0
            tl.store(div_ptr + m, tl.where(inside, one, norm), mask=in_m)
            tl.store(mul_ptr + m, tl.where(inside, one, one * max_norm), mask=in_m)
        if NS > 0:
            _lr(prog, s0, c0, o0, m, in_m, CUDA)
        if NS > 1:
            _lr(prog, s1, c1, o1, m, in_m, CUDA)
        if NS > 2:
            _lr(prog, s2, c2, o2, m, in_m, CUDA)
        if NS > 3:
            _lr(prog, s3, c3, o3, m, in_m, CUDA)


def _block(n: int) -> int:
    return max(2, 1 << max(0, (n - 1).bit_length()))


def run(peak, inv, require, sum_sq, max_norm, counts, programs, members, reference=None):
    """The op's outputs from the Triton kernel: one launch (and one more per
    :data:`SLOTS` schedules past the first ``SLOTS``). In the interpreter a program with
    a power that is not one of ATen's special exponents is evaluated by ``reference``
    (the op's), alone, and so is a decision over more than :data:`_TILE` leaves of all
    members (a large ``vmap`` ensemble: one block would not hold them); without a
    reference the answer is then ``None``."""
    like = next(t for t in (peak, sum_sq, *counts) if t is not None)
    device = like.device
    interpreted = device.type != "cuda"
    n_peak = 0 if peak is None else peak.numel()
    n_leaves = n_peak // members
    leaves = torch.empty(n_peak, dtype=torch.bool, device=device)
    finite = torch.empty(members if peak is not None else 0, dtype=torch.bool, device=device)
    skip = torch.empty(finite.numel(), dtype=torch.float32, device=device)
    clip = members if sum_sq is not None else 0
    div = torch.empty(clip, dtype=torch.float32, device=device)
    mul = torch.empty(clip, dtype=torch.float32, device=device)
    lrs = [torch.empty(members, dtype=torch.float32, device=device) for _ in counts]
    programs = [float(x) for x in programs]
    decoded = decode(programs, len(counts))
    starts = [start for start, _, _ in decoded]
    if peak is not None and _block(members) * _block(n_leaves) > _TILE:
        if reference is None:  # one program's block would not hold the members' leaves
            return None
        return reference(peak, inv, require, sum_sq, max_norm, counts, programs, members)
    ends = [*starts[1:], len(programs)]
    mine = []  # the programs this kernel evaluates; the interpreter has no pow for the rest
    for k, ((start, _, form), end) in enumerate(zip(decoded, ends)):
        if interpreted and _general_power(form):
            if reference is None:
                return None
            one = reference(None, None, None, None, 0.0, [counts[k]], programs[start:end], members)
            lrs[k] = one[5][0]
        else:
            mine.append(k)
    prog = _programs_tensor(programs, device)
    options = {} if interpreted else {"enable_fp_fusion": False}
    for j, first in enumerate(range(0, max(1, len(mine)), SLOTS)):
        ks = mine[first : first + SLOTS]
        part = [(starts[k], counts[k], lrs[k]) for k in ks]
        ns = len(part)
        part += [(0, like, like)] * (SLOTS - ns)  # unused slots: never read
        head = j == 0
        with torch.profiler.record_function(LAUNCH_LABEL) if interpreted else nullcontext():
            step_scalars_kernel[(1,)](
                members, n_leaves, peak if peak is not None else like,
                inv if inv is not None else like, require if require is not None else like,
                sum_sq if sum_sq is not None else like, float(max_norm), prog,
                leaves, finite, skip, div, mul,
                *(s for s, _, _ in part), *(c for _, c, _ in part), *(o for _, _, o in part),
                PEAK=head and peak is not None, INV=inv is not None,
                REQUIRE=require is not None, CLIP=head and sum_sq is not None, NS=ns,
                CUDA=not interpreted, BLOCK_M=_block(members), BLOCK_L=_block(n_leaves),
                **options,
            )  # fmt: skip
    return leaves, finite, skip, div, mul, lrs
