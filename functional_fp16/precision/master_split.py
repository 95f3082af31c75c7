r"""The FP32 master as FP16 params plus a 16-bit residual: ``master="split"``.

A float32 master :math:`m` and its FP16 working copy :math:`p = \operatorname{fl}_{16}(m)`
differ by :math:`r = m - p`, which is exact in float32 and small: at most half an FP16
ulp of :math:`p`, and a whole multiple of a power of two that :math:`p`'s exponent
fixes. So :math:`p` and the integer :math:`q = r / u(p)` hold :math:`m` in 4 bytes
instead of 6.

**The unit.** With :math:`e` the biased 5-bit exponent field of :math:`p`'s pattern
(subnormals and zeros have :math:`e = 0`, read as 1),

.. math:: u(p) = \operatorname{sign}(p)\, 2^{\max(e, 1) - 40},

so :math:`u = 2^{E - 25}` for a normal :math:`p = 1.f \cdot 2^E` and :math:`2^{-39}`
below FP16's normal range. The sign makes :math:`q > 0` mean "away from zero" and
keeps the sign of a zero master (:math:`p + 0 \cdot u` is :math:`p`, ``-0.0`` included).

**Encoding** (:func:`split`). Below :math:`2^{-14}` the master is first put on the grid
of :math:`2^{-39}`, the unit there, rounding to nearest (ties to even); above, it is left
as it is:

.. math::
    \tilde m = \begin{cases} \operatorname{rn}(m\,2^{39})\,2^{-39} & |m| < 2^{-14} \\
                              m & \text{otherwise} \end{cases}, \qquad
    p = \operatorname{fl}_{16}(\tilde m), \qquad
    q = \begin{cases} (\tilde m - p) / u(p) & p \text{ finite} \\ 0 & \text{otherwise} \end{cases}

stored as ``int16``. Every step is exact in float32: :math:`\tilde m - p` by Sterbenz's
lemma, the division by a power of two, and :math:`|q| \le 2^{14}` (half an FP16 ulp is
:math:`2^{E-11} = 2^{14} u`).

**Decoding** (:func:`join`): :math:`m = p + q\,u(p)` in float32, exact (the sum is
:math:`\tilde m`, a float32).

**What is exact.** :math:`\operatorname{join}(\operatorname{split}(m)) = \tilde m`. That
is :math:`m` bitwise wherever :math:`|m| \ge 2^{-16}` (every weight whose FP16 cast is a
normal number, and the upper part of the subnormal range, where every float32 is already
on the grid), at signed zeros, and for any :math:`m` on the grid; elsewhere, below
:math:`2^{-16}`, :math:`|\tilde m - m| \le 2^{-40}`. Because :math:`p` is the rounding of
:math:`\tilde m` itself, ``params == fl16(master)`` holds for the decoded master, and
``split(join(p, q)) == (p, q)`` for every pair :func:`split` makes: a skipped step, or a
round trip through a float32 master, leaves params and residuals bitwise as they were.
Where the FP16 cast overflows (:math:`|m| \ge 65520`) the params hold :math:`\pm\infty`,
as they do beside an FP32 master, and the split master decodes to :math:`\pm\infty` (an
FP32 master keeps the finite value); a NaN stays NaN.
"""

from __future__ import annotations

import torch

from functional_fp16._util.dtensors import is_dtensor
from functional_fp16._util.layout import dense_without_overlap

__all__ = ["MASTER_FORMS", "RESIDUAL_DTYPE", "check_master_form", "join", "residual_unit"]
__all__ += ["split", "valid_residuals", "split_leaf", "join_leaf", "holds_residuals"]

MASTER_FORMS = ("float32", "split")
"""The values of ``fp16_init``'s ``master`` argument."""
RESIDUAL_DTYPE = torch.int16
"""The dtype of a split master's residuals (``state.master``'s leaves)."""
PARAM_DTYPE = torch.float16
"""The only working-copy dtype a split master supports."""

_GRID = 2.0**39  # below 2^-14 the master is kept on multiples of 2^-39
_SMALL = 2.0**-14
_BOUND = 2**14  # |q| never exceeds this


def holds_residuals(masters: list) -> bool:
    """Whether a list of master leaves is a split master's: every one an int16 tensor."""
    return bool(masters) and all(
        isinstance(x, torch.Tensor) and x.dtype == RESIDUAL_DTYPE for x in masters
    )


def check_master_form(master: object, param_dtype: torch.dtype) -> str:
    """Refuses a ``master=`` that is not one of :data:`MASTER_FORMS`, or ``"split"``
    with a ``param_dtype`` other than float16 (a ``ValueError`` naming the argument)."""
    if master not in MASTER_FORMS:
        raise ValueError(f"master must be one of {MASTER_FORMS}, got {master!r}")
    if master == "split" and param_dtype != PARAM_DTYPE:
        raise ValueError(
            f"master='split' needs param_dtype=torch.float16 (got {param_dtype}): the residual "
            "holds the FP32 master exactly only beside FP16 params"
        )
    return master


def residual_unit(params: torch.Tensor) -> torch.Tensor:
    r"""The float32 unit :math:`u(p) = \operatorname{sign}(p)\,2^{\max(e, 1) - 40}` of each
    FP16 param's residual (:math:`e`: the biased exponent field of its pattern)."""
    h = params.view(torch.int16).to(torch.int32)
    exponent = torch.clamp((h >> 10) & 31, min=1)
    bits = (exponent + 87) << 23  # 2^(e - 40): a biased float32 exponent e + 87
    bits = torch.where(h < 0, bits | -(2**31), bits)
    return bits.view(torch.float32)


_PIECE = 1 << 20
"""Elements :func:`split` and :func:`join` work on at a time: their float32 temporaries
are a few pieces, whatever the tensor's size."""


def _pieces(*tensors: torch.Tensor):
    """Matching flat pieces of equally laid out dense tensors, in memory order (the
    tensors themselves where they are small or not dense)."""
    n, strides = tensors[0].numel(), tensors[0].stride()
    if n <= _PIECE or not all(dense_without_overlap(t) and t.stride() == strides for t in tensors):
        yield tensors
        return
    flats = [t.as_strided((n,), (1,)) for t in tensors]
    for start in range(0, n, _PIECE):
        yield tuple(f[start : start + _PIECE] for f in flats)


def split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(params, residual)`` of a float32 master (see the module docstring):

    .. math:: p = \operatorname{fl}_{16}(\tilde m), \quad q = (\tilde m - p) / u(p)

    Returns the FP16 params and the ``int16`` residuals, laid out like ``master``. A
    large master is split a piece at a time (its float32 temporaries stay small).
    """
    if master.dtype != torch.float32:
        raise TypeError(f"split takes a float32 master, got {master.dtype}")
    params = torch.empty_like(master, dtype=PARAM_DTYPE)
    residual = torch.empty_like(master, dtype=RESIDUAL_DTYPE)
    for m, p_out, q_out in _pieces(master, params, residual):
        on_grid = torch.where(m.abs() < _SMALL, torch.round(m * _GRID) / _GRID, m)
        p = on_grid.to(PARAM_DTYPE)
        wide = p.to(torch.float32)
        q = (on_grid - wide) / residual_unit(p)
        p_out.copy_(p)
        q_out.copy_(torch.where(torch.isfinite(wide), q, 0.0))
    return params, residual


def join(params: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    r"""The float32 master :math:`p + q\,u(p)` of FP16 params and their ``int16``
    residuals (laid out like the params; a piece at a time)."""
    if params.dtype != PARAM_DTYPE or residual.dtype != RESIDUAL_DTYPE:
        raise TypeError(
            f"join takes float16 params and int16 residuals, got {params.dtype} and "
            f"{residual.dtype}"
        )
    master = torch.empty_like(params, dtype=torch.float32)
    for p, q, m_out in _pieces(params, residual, master):
        torch.addcmul(p.to(torch.float32), q.to(torch.float32), residual_unit(p), out=m_out)
    return master


def valid_residuals(params: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    r"""Whether each residual is one :func:`split` can make beside its param (0-d bool):
    :math:`|q| \le 2^{14}`, :math:`q = 0` where :math:`p` is inf or NaN, and the decoded
    master rounds back to :math:`p`."""
    q = residual.to(torch.int32)
    finite = torch.isfinite(params)
    ok = (q.abs() <= _BOUND) & (finite | (q == 0))
    back = join(params, residual).to(PARAM_DTYPE)
    same = back.view(torch.int16) == params.view(torch.int16)
    return (ok & (same | ~finite)).all()


def _placed_like(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor placed like ``like`` (a plain ``like``: ``local`` itself)."""
    if not is_dtensor(like):
        return local
    return type(like).from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def split_leaf(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split` of one leaf; a DTensor's on its local shard, params and residuals
    placed like it."""
    local = master.to_local() if is_dtensor(master) else master
    params, residual = split(local)
    return _placed_like(master, params), _placed_like(master, residual)


def join_leaf(params: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """:func:`join` of one leaf; DTensors on their local shards, the master placed like
    the params."""
    if is_dtensor(params):
        return _placed_like(params, join(params.to_local(), residual.to_local()))
    return join(params, residual)
