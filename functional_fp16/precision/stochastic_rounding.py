r"""Stochastic rounding from a counter-based hash, for moments stored in fewer bits.

A moving average :math:`m \leftarrow \beta m + (1 - \beta) g` stored by rounding
to nearest loses every change smaller than half its code step: with
:math:`\beta_2 = 0.999` a second moment moves by about 0.1 % a step, under half
a bfloat16 step (0.4 %) and far under half an 8-bit code step (3 to 6 %), so it
stops following its average. Rounded stochastically, a value whose magnitude lies
between two neighbours :math:`l \le |x| < h` of the format's grid is stored with
magnitude

.. math:: |\hat x| = \begin{cases} h & u < (|x| - l) / (h - l) \\ l & \text{otherwise}\end{cases},
    \qquad \mathbb E[\hat x] = x,

so the stored moment follows its average in expectation, however small the
step. (Through a square root, as second moments are coded, the probability is
taken on the squares, :math:`(x^2 - l^2) / (h^2 - l^2)`, so that the decoded
:math:`\hat x^2` is the unbiased one.)

The uniform :math:`u \in [0, 1)` (24 bits) comes from a hash of the value's own float32
bits and a *salt* made of the optimiser's applied-step count, the leaf's
position in its tree and which moment it is:

.. math:: u = \lfloor \operatorname{mix}(\operatorname{bits}(x) \oplus \text{salt}) / 2^8 \rfloor / 2^{24},
    \qquad \text{salt} = \operatorname{mix}(t \cdot \phi + \operatorname{mix}(\text{stream}, \text{leaf}))

(``mix`` is a 32-bit integer finaliser, :func:`mix32`). No element index enters
it: an element's rounding depends on its value, the step, the leaf and the
moment alone, so a tree sharded by FSDP2 or tensor parallelism rounds every
element exactly as one process does, a run resumed from a checkpoint rounds as
the uninterrupted run, and each member of a ``vmap`` rounds as it would alone.
The count changes at every applied step, so an element that holds the same
value step after step is rounded afresh each time.

The test is on the magnitude, so that a value and its negation round alike;
:func:`round_stochastic` spells it out in the operations that every kernel
repeats bit for bit (integers where the spacing is above the value's own last
bit, two float32 products where a square is rounded).
"""

from __future__ import annotations

import torch

__all__ = ["mix32", "salt", "salt_base", "salt_table", "random_bits", "round_stochastic"]

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1  # 2^32 / phi, odd


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``(h * c) mod 2^32`` for int64 ``h`` in ``[0, 2^32)``, without an int64 overflow:
    the 16-bit halves of ``h`` multiply apart (each product under 2^49)."""
    low = (h & 0xFFFF) * c
    high = ((h >> 16) * (c & 0xFFFF)) << 16
    return (low + high) & _M32


def mix32(h):
    r"""A 32-bit integer finaliser (xor-shift-multiply, two rounds): every input bit moves
    about half of the output bits. ``h``: an int in :math:`[0, 2^{32})`, or an int64 tensor
    of such values (computed elementwise, exactly, on any device)."""
    if isinstance(h, int):
        h ^= h >> 16
        h = (h * 0x7FEB352D) & _M32
        h ^= h >> 15
        h = (h * 0x846CA68B) & _M32
        return h ^ (h >> 16)
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def salt(count: torch.Tensor, stream: int, leaf: int) -> torch.Tensor:
    """The salt of one leaf's moment at one step: an int64 0-d tensor in ``[0, 2^32)``.

    Args:
      count: the optimiser's applied-step count (a 0-d integer tensor; batched
        under ``vmap``).
      stream: which moment (0 for a first moment, 1 for a second).
      leaf: the leaf's position in its tree.
    """
    t = count.to(torch.int64) & _M32
    return mix32((_mul32(t, _GOLDEN) + salt_base(stream, leaf)) & _M32)


_FIXED: dict = {}


def salt_table(count: torch.Tensor, leaves: list[int]) -> torch.Tensor:
    """:func:`salt` for both moments (stream 0 and 1) of every leaf in ``leaves``, as one
    ``(2, len(leaves))`` int64 tensor: ``salt_table(t, ids)[s, i] == salt(t, s, ids[i])``.
    One chain of integer ops whatever the number of leaves; the salts' fixed parts are
    made once per list of leaves and device."""
    key = (tuple(leaves), count.device)
    if key not in _FIXED:
        fixed = [[salt_base(stream, leaf) for leaf in leaves] for stream in (0, 1)]
        _FIXED[key] = torch.tensor(fixed, dtype=torch.int64, device=count.device)
    t = count.to(torch.int64) & _M32
    return mix32((_mul32(t, _GOLDEN) + _FIXED[key]) & _M32)


def salt_base(stream: int, leaf: int) -> int:
    r"""The part of a salt that does not change with the step, :math:`\operatorname{mix}
    (\operatorname{mix}(\text{stream}) + \text{leaf} \cdot \phi)`, an int in ``[0, 2^32)``:
    ``salt(t, stream, leaf) == mix32((t * phi + salt_base(stream, leaf)) mod 2^32)`` (the
    form a kernel that reads the count on the device computes)."""
    return mix32((mix32(stream & _M32) + leaf * _GOLDEN) & _M32)


def random_bits(x: torch.Tensor, salt_: torch.Tensor) -> torch.Tensor:
    """32 random bits per element of the float32 tensor ``x``: ``mix32(bits(x) ^ salt_)``,
    an int64 tensor in ``[0, 2^32)`` (see the module docstring)."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    return mix32(bits ^ salt_)


def round_stochastic(
    x: torch.Tensor, mantissa_bits: int, min_exponent: int, r: torch.Tensor, *, square=False
) -> torch.Tensor:
    r"""``x`` (float32) rounded to the grid of a binary format with ``mantissa_bits``
    stored mantissa bits and smallest normal exponent ``min_exponent`` (below it, the
    format's subnormal spacing), its magnitude away from zero with probability
    :math:`p = (|x| - l)/s` and towards zero otherwise, where :math:`l \le |x| < l + s`
    are the grid's neighbours of :math:`|x|` (``square``: :math:`p = \frac{|x|^2 -
    l^2}{(l + s)^2 - l^2}`, so that the square is the unbiased one).

    ``r``: the random bits (:func:`random_bits`), int64 in ``[0, 2^32)``. With
    :math:`u = \lfloor r / 2^8 \rfloor / 2^{24}`, the value goes away from zero where

    .. math:: u \cdot s < |x| - l \qquad\text{or, with square,}\qquad
        u \cdot (2 l + s) < f \cdot (|x| + l), \quad f = (|x| - l) / s

    (float32 operations in this order; :math:`u s`, :math:`|x| - l`, :math:`2l + s` and
    :math:`f` are exact, and no square is formed, so nothing underflows). Where
    :math:`|x| \ge s` the first is the integer test :math:`\lfloor r / 2^{32-d}
    \rfloor < |x|`'s :math:`d` dropped bits, with :math:`d` the bits of :math:`|x|`'s
    float32 pattern below the spacing: adding :math:`2^d - 1 - \lfloor r / 2^{32-d}
    \rfloor` to the pattern and clearing those bits rounds it (the kernels' form).

    The result is float32 and lies on the format's grid (so converting it is exact),
    except where it rounds past the format's largest value (clamp first). Values on
    the grid, zeros (with their sign), infinities and NaNs are returned as they are.
    bfloat16: ``(7, -126)``; float16: ``(10, -14)``; E4M3: ``(3, -6)``.
    """
    mag = x.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    biased = mag >> 23
    t = torch.clamp(biased - 127, min=min_exponent) - mantissa_bits  # the spacing is 2^t
    d = t - (torch.clamp(biased, min=1) - 150)  # bits of the pattern below 2^t
    tiny = d > 23  # |x| < 2^t: its neighbours are 0 and 2^t
    dn = torch.clamp(d, max=23)
    low = mag & ((1 << dn) - 1)
    l_bits = torch.where(tiny, torch.zeros_like(mag), mag - low)
    lower = l_bits.to(torch.int32).view(torch.float32)
    s = _power_of_two(t)
    xa = mag.to(torch.int32).view(torch.float32)
    u = (r >> 8).to(torch.float32) * 2.0**-24
    if square:
        away = u * (lower + lower + s) < ((xa - lower) / s) * (xa + lower)
    else:
        away = torch.where(tiny, u * s < xa, (r >> (32 - dn)) < low)
    out = torch.copysign(torch.where(away, lower + s, lower), x)
    return torch.where(biased == 255, x, out)


def _power_of_two(t: torch.Tensor) -> torch.Tensor:
    """``2^t`` as float32 for int64 ``t`` in ``[-149, 127]``, built from its bit pattern
    (a normal's exponent field, or a subnormal's one set bit)."""
    normal = (torch.clamp(t, min=-126) + 127) << 23
    subnormal = 1 << torch.clamp(t + 149, 0, 22)
    bits = torch.where(t >= -126, normal, subnormal)
    return bits.to(torch.int32).view(torch.float32)
