r"""How an optimiser's moments are stored: FP32, BF16, FP16 or 8-bit block codes.

An optimiser step decodes each stored moment to float32, updates it in float32
and encodes the result, all inside the step; only the encoded form is state.
A :class:`MomentFormat` is static configuration (a transform closes over it and
declares it in its ``spec``), so the fused kernels can tell FP32 moments from
the others without reading a tensor.

=============  ======================================  ====================================
format         stored per parameter element            decode (to float32)
=============  ======================================  ====================================
``float32``    the value                               itself
``bfloat16``   :math:`\operatorname{rn}_{bf16}(x)`     exact widening
``float16``    :math:`\operatorname{rn}_{16}(x / s)`,  :math:`q \cdot s`
               ``s`` a power of two per tensor
               (second moments; see below)
``"e4m3"``     one byte per element, one float32       :math:`\operatorname{e4m3}(q) \cdot a`
               scale per block of ``block_size``       (first moments),
               elements (default 256)                  :math:`(\operatorname{e4m3}(q)\cdot a)^2`
                                                       (second moments)
=============  ======================================  ====================================

:math:`\operatorname{rn}` above is rounding to nearest. Adam's, AdamW's and Lion's
moments are rounded *stochastically* by default (``moment_rounding="stochastic"``;
:func:`encode_all` with the optimiser's step count), onto the same grids, so that a
moving average whose change per step is under half a code step still follows it in
expectation (:mod:`functional_fp16.precision.stochastic_rounding`); SGD's trace,
which keeps no step count, is rounded to nearest.

**FP16 second moments** carry a scale: :math:`v \approx g^2` leaves FP16's
range (:math:`g = 10^{-4}` gives :math:`10^{-8}`, below its smallest normal
:math:`6.1\cdot 10^{-5}`). With ``scale="tensor"`` each step picks
:math:`s = 2^{e - 15}` for :math:`\max v \in [2^{e-1}, 2^e)`, so the largest
element lands in :math:`[2^{14}, 2^{15})` and dividing by :math:`s` is exact;
a float ``scale`` fixes :math:`s` (a power of two) instead. A fixed scale
*saturates*: an element past :math:`65504\,s` (FP16's largest finite value
times the scale; an infinity included) is stored as :math:`65504\,s`, so the
moment stays finite and the step needs no host check, but such elements are
under-estimated (choose :math:`s \ge \max v / 65504`, or ``"tensor"``); an
element under :math:`2^{-25} s` flushes to 0. First moments in
FP16 are stored as they are (no scale), like optax's ``mu_dtype``.

**8-bit block codes** (``"e4m3"``; ``"int8"``, its former name, is an alias): each row of the tensor (everything after its
first dimension; a vector is one row) is cut into blocks of ``block_size``
consecutive elements (a row's last block may be shorter), so the scales have
the shape ``(shape[0], blocks per row)``. A block stores
its absolute maximum :math:`A` as :math:`a = A / 448` in float32 (1 where that
is 0) and each element as the byte of :math:`\operatorname{rn}_{e4m3}(x / a)`
(clamped to :math:`\pm 448`), the FP8 E4M3
format (one sign bit, four exponent bits, three mantissa bits, largest finite
value 448). It is a dynamic code: the exponent bits give every block a range of
:math:`448 / 2^{-9} \approx 2^{18}` between its largest and smallest non-zero
value, and the three mantissa bits a relative rounding error of at most
:math:`2^{-4}`. A first moment (signed) is coded as it is; a second moment
(non-negative, with twice the dynamic range) is coded through its square root,
:math:`r = \sqrt v` (correctly rounded), so the code spans :math:`2^{36}` of :math:`v` and decoding
squares it. Together: :math:`|\hat x - x| \le \max(2^{-4}|x|, 2^{-10} a)` per
element (on :math:`r` for second moments) while :math:`a` is a normal float32
(:math:`A \ge 448 \cdot 2^{-126} \approx 5.3\cdot 10^{-36}`); below that the
scale is a float32 subnormal, rounded to a multiple of :math:`2^{-149}`, and the
bound gains :math:`448 \cdot 2^{-150}` absolute; where :math:`A / 448` rounds
to 0 the block decodes to zeros. A non-finite element does not enter its
block's scale (:math:`A` is the largest *finite* magnitude): a NaN is coded as
E4M3's NaN, an infinity saturates to :math:`\pm 448 a`, and the block's other
elements keep their codes (``fp16_update`` never encodes one: it skips such
steps). A tensor with no rows (an empty local shard, FSDP2's on a rank past a
short first dimension) has empty codes and scales of shape
``(0, blocks per row)``. Blocks never straddle rows, so a parameter sharded by rows (FSDP2's
``Shard(0)``) has its blocks inside each rank's shard, and its scales are a
DTensor sharded the same way (DCP reshards both by rows). Only matrices (two
or more dimensions) whose rows hold at least ``min_row`` elements (64) are
coded; vectors (norm weights, biases) and narrower matrices keep FP32 moments:
their bytes are negligible, their statistics the least regular, and a rule
that looks at the row length alone gives one answer for a whole tensor and for
every rank's shard of it (torchao keeps tensors under 4096 elements in FP32,
by their size).

The codes are kept as ``uint8`` (bit patterns of ``torch.float8_e4m3fn``), so
every serialiser and collective handles them as plain bytes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from functional_fp16._util import validate
from functional_fp16._util.tree import tree_flatten, tree_paths, tree_unflatten
from functional_fp16.precision.stochastic_rounding import random_bits, round_stochastic, salt

__all__ = [
    "MomentFormat",
    "BlockCodes",
    "ScaledHalf",
    "FLOAT32",
    "moment_format",
    "zeros_like_moment",
    "zeros_like_moments",
    "decode",
    "encode",
    "decode_all",
    "encode_all",
    "is_stored_moment",
]

_E4M3 = torch.float8_e4m3fn
_E4M3_MAX = 448.0
_F16_MAX = 65504.0
_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    "e4m3": "e4m3",
    "int8": "e4m3",  # the former name of the same format
}
DEFAULT_BLOCK = 256
MIN_ROW = 64


class MomentFormat(NamedTuple):
    """Static description of how one optimiser moment is stored."""

    kind: str  # "float32", "bfloat16", "float16" or "e4m3"
    root: bool  # e4m3: code the square root (second moments)
    scale: str | float | None  # float16 second moments: "tensor" or a fixed power of two
    block_size: int  # e4m3: elements per block
    min_row: int  # e4m3: matrices with shorter rows (and vectors) stay float32
    rounding: str = "nearest"  # "nearest", or "stochastic" (with the optimiser's step count)


FLOAT32 = MomentFormat("float32", False, None, DEFAULT_BLOCK, MIN_ROW)
"""The default: float32 moments, as ``torch.optim`` keeps them."""


class BlockCodes(NamedTuple):
    """An 8-bit block-coded moment (see the module docstring)."""

    codes: torch.Tensor  # uint8, shaped like the parameter: E4M3 bit patterns
    # float32, scales_shape(shape, block_size): (shape[0], ceil(row / block_size)), row the
    # elements after the first dimension ((ceil(numel / block_size),) for a vector):
    # each block's largest finite magnitude / 448 (1 where that is 0)
    scales: torch.Tensor


class ScaledHalf(NamedTuple):
    """A float16 moment with its per-tensor power-of-two scale."""

    values: torch.Tensor  # float16, shaped like the parameter: the moment / scale
    scale: torch.Tensor  # 0-d float32, a power of two


def moment_format(
    name: str,
    dtype: Any,
    *,
    second: bool,
    scale: Any = None,
    scale_name: str = "scale",
    block_size: int = DEFAULT_BLOCK,
    rounding: str = "nearest",
) -> MomentFormat:
    """Checks a transform's ``*_dtype`` argument and returns its :class:`MomentFormat`.

    Args:
      name: the argument's name, for errors (``"nu_dtype"``).
      dtype: ``None`` or ``torch.float32`` (float32), ``torch.bfloat16``,
        ``torch.float16`` or ``"e4m3"`` (8-bit block codes; ``"int8"`` is an alias).
      second: whether the moment is a second moment (non-negative, squared
        gradients): only those take a ``scale`` and are coded through their root.
      scale: for a float16 second moment, ``"tensor"`` or a power of two; required
        there, refused elsewhere.
      scale_name: the scale argument's name, for errors.
      block_size: for ``"e4m3"``, a positive power of two.
      rounding: ``"nearest"`` or ``"stochastic"`` (see
        :mod:`functional_fp16.precision.stochastic_rounding`); float32 moments
        are never rounded.

    Raises:
      ValueError or TypeError naming the argument.
    """
    if dtype is None:
        dtype = torch.float32
    try:
        kind = _NAMES.get(dtype)
    except TypeError:  # unhashable
        kind = None
    if kind is None:
        raise ValueError(
            f"{name} must be torch.float32, torch.bfloat16, torch.float16 or 'e4m3' (alias "
            f"'int8'), got {dtype!r}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two, got {block_size}")
    if kind == "float16" and second:
        if scale is None:
            raise ValueError(
                f"{name}=torch.float16 needs {scale_name}: squared gradients leave float16's "
                f"range, so the moment is stored divided by a power of two; pass "
                f"{scale_name}='tensor' (one chosen per tensor each step) or a fixed power of two"
            )
        if scale != "tensor":
            value = validate.real(scale_name, scale, positive=True)
            if math.frexp(value)[0] != 0.5:
                raise ValueError(f"{scale_name} must be 'tensor' or a power of two, got {scale!r}")
            scale = value
    elif scale is not None:
        raise ValueError(f"{scale_name} applies to {name}=torch.float16 only, got {scale!r}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"moment_rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if kind == "float32":
        return FLOAT32
    return MomentFormat(kind, second and kind == "e4m3", scale, block_size, MIN_ROW, rounding)


def is_stored_moment(x: Any) -> bool:
    """Whether ``x`` is a tensor or one of the coded forms."""
    return isinstance(x, (torch.Tensor, BlockCodes, ScaledHalf))


def _coded(fmt: MomentFormat, like: torch.Tensor) -> bool:
    return fmt.kind == "e4m3" and like.ndim >= 2 and math.prod(like.shape[1:]) >= fmt.min_row


def zeros_like_moment(fmt: MomentFormat, p: torch.Tensor) -> Any:
    """A zero moment for a parameter ``p`` in format ``fmt``.

    Raises:
      NotImplementedError: a scaled or block-coded format for a DTensor parameter
        (its scales would have to follow each rank's shard).
    """
    if fmt.kind == "float32":
        return torch.zeros_like(p, dtype=torch.float32)
    if fmt.kind == "bfloat16":
        return torch.zeros_like(p, dtype=torch.bfloat16)
    if fmt.kind == "float16" and fmt.scale is None:
        return torch.zeros_like(p, dtype=torch.float16)
    if fmt.kind == "float16":
        if _is_dtensor(p):
            raise NotImplementedError(
                "float16 moments with a per-tensor scale are not supported for DTensor "
                "parameters (each rank would choose its own scale); use torch.bfloat16 or 'e4m3'"
            )
        values = torch.zeros_like(p, dtype=torch.float16)
        return ScaledHalf(values, torch.ones((), dtype=torch.float32, device=p.device))
    if not _coded(fmt, p):
        return torch.zeros_like(p, dtype=torch.float32)
    codes = torch.zeros_like(p, dtype=torch.uint8)
    if not _is_dtensor(p):
        return BlockCodes(codes, torch.ones(scales_shape(p.shape, fmt.block_size), device=p.device))
    return BlockCodes(codes, _dtensor_scales(p, fmt.block_size))


def zeros_like_moments(fmt: MomentFormat, params: Any) -> Any:
    """:func:`zeros_like_moment` of every leaf of ``params``, with its tree structure; a
    refused leaf is named by its path (``params['blocks.0.mlp.fc.weight']: ...``)."""
    leaves, spec = tree_flatten(params)
    out = []
    for i, p in enumerate(leaves):
        try:
            out.append(zeros_like_moment(fmt, p))
        except NotImplementedError as err:
            raise NotImplementedError(f"params{tree_paths(params)[i]}: {err}") from None
    return tree_unflatten(spec, out)


def scales_shape(shape: torch.Size | tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """The shape of the block scales of a tensor of ``shape``: ``(shape[0], blocks per row)``
    where a row is everything after the first dimension, ``(blocks,)`` for a vector."""
    if len(shape) >= 2:
        return (shape[0], -(-math.prod(shape[1:]) // block_size))
    return (-(-math.prod(shape) // block_size),)


def _is_dtensor(p: Any) -> bool:
    return type(p) is not torch.Tensor and hasattr(p, "placements")


def _dtensor_scales(p: Any, block_size: int) -> Any:
    """Block scales of a DTensor parameter: a DTensor laid out as the parameter, each rank
    holding the scales of the blocks of its own rows (blocks never straddle shards)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not all(
        isinstance(x, Replicate) or (isinstance(x, Shard) and x.dim == 0) for x in p.placements
    ):
        raise NotImplementedError(
            f"'e4m3' moments of a DTensor parameter need it sharded by rows (Shard(0), as "
            f"FSDP2 shards) or replicated, got shape {tuple(p.shape)} with placements "
            f"{tuple(p.placements)}: its blocks would straddle the shards"
        )
    local = p.to_local()
    ones = torch.ones(scales_shape(local.shape, block_size), device=local.device)
    shape = scales_shape(p.shape, block_size)
    return DTensor.from_local(
        ones, p.device_mesh, p.placements, run_check=False, shape=shape, stride=(shape[1], 1)
    )


def decode(fmt: MomentFormat, stored: Any) -> torch.Tensor:
    """The float32 value of a moment stored in format ``fmt`` (a new tensor unless it
    is float32 already)."""
    if isinstance(stored, BlockCodes):
        return _decode_blocks(stored, fmt.block_size, fmt.root)
    if isinstance(stored, ScaledHalf):
        return stored.values.float() * stored.scale
    return stored.float()


def decode_all(fmt: MomentFormat, stored: list[Any]) -> list[Any]:
    """:func:`decode` of each moment; ``stored`` itself for float32 (no call per leaf)."""
    return stored if fmt is FLOAT32 else [decode(fmt, m) for m in stored]


def encode_all(
    fmt: MomentFormat,
    xs: list[torch.Tensor],
    likes: list[Any],
    count: torch.Tensor | None = None,
    stream: int = 0,
) -> list[Any]:
    """:func:`encode` of each moment in the form of ``likes``; ``xs`` itself for float32.

    Where ``fmt.rounding`` is ``"stochastic"``, ``count`` (the optimiser's applied-step
    count) salts the rounding: leaf ``i`` with the salt of ``(count, stream, i)``
    (:mod:`.stochastic_rounding`)."""
    if fmt is FLOAT32:
        return xs
    if count is None or fmt.rounding != "stochastic":
        return [encode(fmt, x, like) for x, like in zip(xs, likes)]
    return [
        encode(fmt, x, like, salt(count, stream, i)) for i, (x, like) in enumerate(zip(xs, likes))
    ]


def encode(fmt: MomentFormat, x: torch.Tensor, like: Any, salt_: torch.Tensor | None = None) -> Any:
    """``x`` (float32) stored in format ``fmt``, in the form of ``like`` (the old moment):
    rounded to nearest, or stochastically with ``salt_`` (see :func:`encode_all`)."""
    if isinstance(like, BlockCodes):
        return _encode_blocks(x, fmt.block_size, fmt.root, salt_)
    if isinstance(like, ScaledHalf):
        return _encode_scaled(fmt, x, salt_)
    if salt_ is None or like.dtype == torch.float32:
        return x.to(like.dtype)
    bits, emin = _GRIDS[like.dtype]
    return round_stochastic(x, bits, emin, random_bits(x, salt_)).to(like.dtype)


_GRIDS = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}  # mantissa bits, min exponent


def _encode_scaled(fmt: MomentFormat, x: torch.Tensor, salt_=None) -> ScaledHalf:
    if fmt.scale == "tensor":
        # max v in [2^(e-1), 2^e): s = 2^(e-15) puts it in [2^14, 2^15), inside float16.
        exponent = torch.frexp(x.amax())[1]
        scale = torch.ldexp(torch.ones((), dtype=torch.float32, device=x.device), exponent - 15)
        q = x / scale
    else:
        # A fixed scale saturates at float16's largest finite value (no host check, no inf).
        scale = torch.full((), fmt.scale, dtype=torch.float32, device=x.device)
        q = torch.clamp(x / scale, -_F16_MAX, _F16_MAX)
    if salt_ is not None:
        q = torch.clamp(round_stochastic(q, 10, -14, random_bits(q, salt_)), -_F16_MAX, _F16_MAX)
    return ScaledHalf(q.to(torch.float16), scale)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(shape[0], rest)`` (a vector as one row): the rows blocks lie in.

    Sizes are spelt out, never ``-1``, which a tensor of no elements (no rows)
    cannot resolve.
    """
    if x.ndim >= 2:
        return x.reshape(x.shape[0], math.prod(x.shape[1:]))
    return x.reshape(1, x.numel())


def _split(rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as its whole blocks ``(rows, blocks, block_size)`` and each row's shorter rest.

    Views where the row length is a multiple of the block size, never a padded
    copy (Inductor miscompiled a padded copy decoded and encoded in one graph,
    in torch 2.14).
    """
    length = rows.shape[1]
    n = length // block_size
    whole = n * block_size
    if whole == length:
        return rows.view(rows.shape[0], n, block_size), rows[:, length:]
    return rows[:, :whole].reshape(rows.shape[0], n, block_size), rows[:, whole:]


def _sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root (torch's vectorised CPU ``sqrt`` is one ulp off
    for about 1 value in 160; through float64 it rounds correctly, as CUDA's does)."""
    return x.sqrt() if x.device.type == "cuda" else x.double().sqrt().float()


def _encode_blocks(x: torch.Tensor, block_size: int, root: bool, salt_=None) -> BlockCodes:
    y = _sqrt_rn(x) if root else x
    full, rest = _split(_rows(y), block_size)
    # The largest finite magnitude: an inf or NaN leaves its block's scale (and so the
    # other elements' codes) as the finite elements make it.
    peaks = _finite_abs(full).amax(dim=2)
    if rest.shape[1]:
        peaks = torch.cat([peaks, _finite_abs(rest).amax(dim=1, keepdim=True)], dim=1)
    scales = peaks / _E4M3_MAX
    # An all-zero block (or one so small that its scale flushes to zero) gets scale 1,
    # so that 0 / scale is 0, never NaN; the clamp keeps a quotient that rounding (or a
    # subnormal scale) pushed past 448 from becoming E4M3's NaN, and saturates an
    # infinity; a NaN stays NaN.
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    n_full = full.shape[1]
    quotient = (full / scales[:, :n_full, None]).reshape(full.shape[0], n_full * block_size)
    if rest.shape[1]:
        quotient = torch.cat([quotient, rest / scales[:, n_full:]], dim=1)
    quotient = torch.clamp(quotient, -_E4M3_MAX, _E4M3_MAX)
    if salt_ is not None:  # on E4M3's grid (3 mantissa bits, subnormal below 2^-6)
        r = random_bits(quotient, salt_)
        quotient = round_stochastic(quotient, 3, -6, r, square=root)
    codes = quotient.to(_E4M3).view(torch.uint8)
    return BlockCodes(codes.view(x.shape), scales.view(scales_shape(x.shape, block_size)))


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` with every inf and NaN as 0."""
    return torch.nan_to_num(x.abs(), nan=0.0, posinf=0.0)


def _decode_blocks(stored: BlockCodes, block_size: int, root: bool) -> torch.Tensor:
    codes, scales = stored
    full, rest = _split(_rows(codes).view(_E4M3), block_size)
    rows = scales.view(full.shape[0], scales.shape[-1])
    n_full = full.shape[1]
    flat = (full.float() * rows[:, :n_full, None]).reshape(full.shape[0], n_full * block_size)
    if rest.shape[1]:
        flat = torch.cat([flat, rest.float() * rows[:, n_full:]], dim=1)
    out = flat.view(codes.shape)
    return out.square() if root else out
