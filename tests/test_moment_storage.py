"""Moments in fewer bytes (``mu_dtype``, ``nu_dtype``, ``accumulator_dtype``).

The codec (``functional_fp16.precision.moment_storage``) is pinned by its error
bound, block by block; the transforms by one step from the same decoded state
against FP32 moments (the arithmetic is the same float32, so the new master is
bitwise the FP32 run's and the new codes are the codes of its moments); the
update by its skip (every byte and block scale unchanged), ``vmap``,
``torch.compile``, checkpoints and the wrappers (masks, labels, ``MultiSteps``,
``inject_hyperparams``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16 import NAMESPACE
from functional_fp16.precision import moment_storage as ms
from tests.helpers import (
    assert_bitwise_unchanged,
    assert_states_bitwise_equal,
    bit_snapshot,
    scaled_error,
)

MU_BOUND = 2.0**-4  # E4M3's three mantissa bits: half an ulp, relative
SUB_BOUND = 2.0**-10  # half of E4M3's subnormal step 2^-9, in units of the block's scale


def _fmt(kind, second=False, block_size=256, **kw):
    return ms.moment_format("x", kind, second=second, block_size=block_size, **kw)


_CODED = ms.BlockCodes(torch.empty(0), torch.empty(0))  # encode into block codes, any shape


def _blocks_of(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block index in the flattened scales: blocks run along each row
    (everything after the first dimension; a vector is one row)."""
    n_rows = x.shape[0] if x.ndim >= 2 else 1
    row = math.prod(x.shape[1:]) if x.ndim >= 2 else x.numel()
    per_row = math.ceil(row / block)
    index = torch.arange(n_rows)[:, None] * per_row + torch.arange(row) // block
    return index.view(x.shape)


# -- a reference codec, written apart from the one under test ------------------------------
# Elementwise by each element's block index (no reshapes into blocks), from the formats'
# definitions: the expected values of the transform tests never come from the code they test.


def _ref_decode(fmt: ms.MomentFormat, stored) -> torch.Tensor:
    if isinstance(stored, ms.BlockCodes):
        index = _blocks_of(stored.codes, fmt.block_size)
        x = stored.codes.view(torch.float8_e4m3fn).float() * stored.scales.reshape(-1)[index]
        return x.square() if fmt.root else x
    if isinstance(stored, ms.ScaledHalf):
        return stored.values.float() * stored.scale
    return stored.float()


_M32 = 0xFFFFFFFF


def _ref_mix(h):
    """The 32-bit finaliser in numpy uint64 (products of two 32-bit numbers fit)."""
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x7FEB352D)) & np.uint64(_M32)
    h = h ^ (h >> np.uint64(15))
    h = (h * np.uint64(0x846CA68B)) & np.uint64(_M32)
    return h ^ (h >> np.uint64(16))


def _ref_salt(count: int, stream: int, leaf: int) -> int:
    fixed = int(_ref_mix(np.uint64((int(_ref_mix(np.uint64(stream))) + leaf * 0x9E3779B1) & _M32)))
    return int(_ref_mix(np.uint64(((count * 0x9E3779B1) + fixed) & _M32)))


def _grid(dtype) -> np.ndarray:
    """Every finite value of ``dtype`` (8 or 16 bits), sorted."""
    n = 256 if dtype == torch.float8_e4m3fn else 65536
    ints = torch.arange(n, dtype=torch.int32).to(torch.uint8 if n == 256 else torch.int16)
    values = ints.view(dtype).double().numpy()
    return np.unique(values[np.isfinite(values)])


def _ref_round(q: torch.Tensor, dtype, salt: int | None, square: bool = False) -> torch.Tensor:
    """``q`` (float32) rounded onto ``dtype``'s grid: to nearest without ``salt``, else its
    magnitude up to the next grid value where the hash of q's bits and the salt gives a u
    under (|q| - lo) / (hi - lo) (with ``square``: u * (lo + hi) under that ratio times
    (|q| + lo), in float32), down otherwise."""
    if salt is None:
        return q.to(dtype)
    grid = _grid(dtype)
    grid = grid[grid >= 0]
    qs = q.detach().numpy().astype(np.float32)
    mag = np.abs(qs)
    i = np.clip(np.searchsorted(grid, mag.astype(np.float64), side="right") - 1, 0, len(grid) - 2)
    lo, hi = grid[i].astype(np.float32), grid[i + 1].astype(np.float32)
    on_grid = lo == mag
    frac = (mag - lo) / (hi - lo)  # exact: hi - lo is a power of two
    bits = qs.view(np.uint32).astype(np.uint64)
    u = (_ref_mix(bits ^ np.uint64(salt)) >> np.uint64(8)).astype(np.float64) * 2.0**-24
    u = u.astype(np.float32)
    if square:
        away = u * (lo + hi) < frac * (mag + lo)
    else:
        away = u < frac
    out = np.copysign(np.where(on_grid | ~away, lo, hi), qs)
    return torch.from_numpy(out.astype(np.float32)).to(dtype)


def _ref_encode(fmt: ms.MomentFormat, x: torch.Tensor, like, salt: int | None = None):
    """The format's encoding of ``x``; rounded stochastically with ``salt`` (from
    :func:`_ref_salt`)."""
    if isinstance(like, ms.BlockCodes):
        # the correctly rounded root (numpy's, in float64 then rounded: exact for float32)
        base = torch.from_numpy(np.sqrt(x.double().numpy()).astype(np.float32)) if fmt.root else x
        index = _blocks_of(base, fmt.block_size)
        n_rows = base.shape[0] if base.ndim >= 2 else 1
        per_row = index.numel() and int(index.max()) // n_rows + 1
        finite = torch.where(torch.isfinite(base), base.abs(), torch.zeros_like(base))
        peaks = torch.zeros(n_rows * per_row).scatter_reduce(
            0, index.reshape(-1), finite.reshape(-1), "amax"
        )
        scales = peaks / 448.0
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.clamp(base / scales[index], -448.0, 448.0)
        codes = _ref_round(q, torch.float8_e4m3fn, salt, square=fmt.root).view(torch.uint8)
        return ms.BlockCodes(codes, scales.view(like.scales.shape))
    if isinstance(like, ms.ScaledHalf):
        if fmt.scale == "tensor":
            s = 2.0 ** (math.frexp(float(x.max()))[1] - 15)
        else:
            s = fmt.scale
        values = _ref_round(torch.clamp(x / s, -65504.0, 65504.0), torch.float16, salt)
        return ms.ScaledHalf(values, torch.tensor(s, dtype=torch.float32))
    if like.dtype == torch.float32:
        return x.clone()
    return _ref_round(x, like.dtype, salt)


# -- the codec ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 4),
    n=st.integers(1, 1500),
    block_exp=st.integers(0, 9),
    log_scale=st.floats(-30, 30),
    second=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_block_codes_are_within_the_bound_of_their_block(
    rows, n, block_exp, log_scale, second, seed
):
    """|decoded - x| <= max(2^-4 |x|, 2^-10 a) per element (on sqrt(v) for second
    moments), a = the block's max / 448; the scales are exactly that."""
    block = 2**block_exp
    g = torch.Generator().manual_seed(seed)
    shape = (rows, n) if rows else (n,)
    spread = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 3)
    x = (spread * 10 ** (log_scale / 2)).square() if second else spread * 10**log_scale
    fmt = _fmt("int8", second=second, block_size=block)
    stored = ms.encode(fmt, x, _CODED)
    assert isinstance(stored, ms.BlockCodes) and stored.codes.dtype == torch.uint8
    assert stored.scales.shape == (*shape[:-1], math.ceil(n / block))  # blocks along rows
    y = ms.decode(fmt, stored)
    assert y.dtype == torch.float32 and y.shape == x.shape and torch.isfinite(y).all()
    base, got = (x.sqrt(), y.sqrt()) if second else (x, y)
    index = _blocks_of(base, block).reshape(-1)
    peaks = torch.zeros(stored.scales.numel()).scatter_reduce(
        0, index, base.abs().reshape(-1), "amax"
    )
    want = peaks / 448.0
    want = torch.where(want > 0, want, torch.ones_like(want))
    assert torch.equal(stored.scales.reshape(-1), want)
    a = stored.scales.reshape(-1)[index].view(base.shape)
    bound = torch.maximum(base.abs() * MU_BOUND, a * SUB_BOUND) * (1 + 2.0**-20)
    # sqrt of the decoded square may sit one float32 ulp off the decoded root
    slack = base.abs() * 2.0**-22 if second else 0.0
    assert ((got - base).abs() <= bound + slack).all()


def test_a_block_is_coded_from_its_own_elements_only():
    """Changing one block leaves every other block's codes and scale bitwise as they were,
    so blocks inside a rank's shard never depend on another rank's elements."""
    fmt = _fmt("int8", block_size=64)
    x = torch.randn(64 * 5 + 7)
    y = x.clone()
    y[64:128] *= 1e6
    a, b = (ms.encode(fmt, t, _CODED) for t in (x, y))
    keep = torch.ones(x.numel(), dtype=torch.bool)
    keep[64:128] = False
    assert torch.equal(a.codes[keep], b.codes[keep])
    assert torch.equal(a.scales[[0, 2, 3, 4, 5]], b.scales[[0, 2, 3, 4, 5]])
    assert not torch.equal(a.scales[1], b.scales[1])


@pytest.mark.parametrize("value", [0.0, 1e-45, 1e-43, 3e-40, 1e-33, 1e38, -3e38])
def test_zero_tiny_and_huge_blocks_stay_finite(value):
    """The documented bound at the ends of float32's range: an all-zero block, and one whose
    max / 448 rounds to 0, decode to +0.0 exactly; a block whose scale is a normal float32
    (max >= 448 * 2^-126) is within max(2^-4 |x|, 2^-10 a) of each element, the elements
    below its range (x[5]) included; one whose scale is a subnormal within that plus
    448 * 2^-150 (the scale's rounding); none overflows or turns NaN."""
    fmt = _fmt("int8", block_size=16)
    x = torch.full((40,), value)
    x[3] = value / 2
    x[5] = value * 2.0**-20  # below the block's range: 0, or within 2^-10 a
    stored = ms.encode(fmt, x, _CODED)
    y = ms.decode(fmt, stored)
    assert torch.isfinite(y).all()
    scales = torch.full((3,), abs(value)) / 448.0  # in float32
    if not scales.any():  # the scale flushes to 0 (1e-45, 1e-43), or an all-zero block
        assert torch.equal(stored.scales, torch.ones(3))
        assert torch.equal(y.view(torch.int32), torch.zeros(40, dtype=torch.int32))
        return
    assert torch.equal(stored.scales, scales)
    a = stored.scales[_blocks_of(x, 16)]
    bound = torch.maximum(x.abs() * MU_BOUND, a * SUB_BOUND) * (1 + 2.0**-20)
    if abs(value) < 448.0 * 2.0**-126:  # a subnormal scale: rounded to a multiple of 2^-149
        bound = bound + 448.0 * 2.0**-150
    assert ((y - x).abs() <= bound).all(), ((y - x).abs() - bound).max()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("second", [False, True])
def test_a_non_finite_element_leaves_the_rest_of_its_block_coded(bad, second):
    """An inf or NaN (``tx.update`` called directly; ``fp16_update`` skips such steps) does
    not enter its block's scale: the block's other elements decode within the bound of
    their values, a NaN decodes as NaN and an infinity saturates at the block's
    largest code (448 a), and the other blocks do not change."""
    fmt = _fmt("int8", second=second, block_size=64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 192, generator=g)
    x = x.square() if second else x
    if second and bad < 0:
        bad = float("inf")  # a second moment is non-negative
    y = x.clone()
    y[1, 70] = bad
    stored = ms.encode(fmt, y, _CODED)
    out = ms.decode(fmt, stored)
    clean = ms.encode(fmt, x, _CODED)
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[1, 70] = False
    base, got = (x.sqrt(), out.sqrt()) if second else (x, out)
    a = stored.scales.reshape(-1)[_blocks_of(x, 64)]
    bound = torch.maximum(base.abs() * MU_BOUND, a * SUB_BOUND) * (1 + 2.0**-20)
    slack = base.abs() * 2.0**-22 if second else 0.0
    assert ((got - base).abs() <= bound + slack)[keep].all()
    assert torch.equal(stored.codes[keep], clean.codes[keep])
    assert torch.equal(stored.scales, clean.scales)  # the scales of the finite elements
    if math.isnan(bad):
        assert math.isnan(float(out[1, 70]))
    else:
        top = a[1, 70] * 448.0  # float32
        assert torch.equal(out[1, 70], top.square() if second else top.copysign(torch.tensor(bad)))


def test_scaled_float16_second_moment_keeps_tiny_values():
    """v ~ 1e-12 underflows float16 alone; the per-tensor power of two keeps 11 bits."""
    fmt = ms.moment_format("nu_dtype", torch.float16, second=True, scale="tensor")
    v = torch.rand(1000) * 1e-12 + 1e-13
    stored = ms.encode(fmt, v, ms.zeros_like_moment(fmt, v))
    exponent = math.frexp(float(stored.scale))
    assert exponent[0] == 0.5  # a power of two
    assert 2.0**14 <= float(stored.values.float().max()) < 2.0**15
    assert ((ms.decode(fmt, stored) - v).abs() <= v * 2.0**-11 + float(stored.scale) * 2**-24).all()
    fixed = ms.moment_format("nu_dtype", torch.float16, second=True, scale=2.0**-40)
    again = ms.encode(fixed, v, ms.zeros_like_moment(fixed, v))
    assert float(again.scale) == 2.0**-40
    # v / 2^-40 lies in [0.1, 1.2]: float16 normals, 11 significant bits
    assert torch.equal(again.values, (v * 2.0**40).half())
    assert ((ms.decode(fixed, again) - v).abs() <= v * 2.0**-11).all()


def test_a_fixed_scale_saturates_instead_of_overflowing():
    """nu_scale=2^-30 with gradients of 1: v / s ~ 10^6 passes float16's 65504. The stored
    value saturates at 65504 s (finite), so the following updates stay non-zero, with
    the sign of the FP32-moment run's (1) and the size the saturated moment gives,
    computed here in float64: the moment is under-estimated, never lost."""
    fixed = ms.moment_format("nu_dtype", torch.float16, second=True, scale=2.0**-30)
    v = torch.tensor([1e-3, 1.0, float("inf"), 1e-5])
    stored = ms.encode(fixed, v, ms.zeros_like_moment(fixed, v))
    assert torch.isfinite(stored.values).all()
    want = torch.tensor([65504.0, 65504.0, 65504.0, 1e-5 * 2.0**30]).half()
    assert torch.equal(stored.values, want)
    coded = ff.scale_by_adam(nu_dtype=torch.float16, nu_scale=2.0**-30)
    plain = ff.scale_by_adam()
    params = {"w": torch.zeros(3, 5)}
    a, b = coded.init(params), plain.init(params)
    v = 0.0  # the stored second moment, float64
    for t in range(1, 6):
        grads = {"w": torch.ones(3, 5)}
        (ua, a), (ub, b) = coded.update(grads, a, params), plain.update(grads, b, params)
        v = 0.999 * v + 0.001  # g = 1; m_t / (1 - b1^t) = 1
        want = 1.0 / (math.sqrt(v / (1 - 0.999**t)) + 1e-8)
        v = min(v, 65504.0 * 2.0**-30)  # saturates from the first step on
        assert torch.isfinite(a.nu["w"].values).all() and ((ub["w"] - 1).abs() <= 2.0**-20).all()
        assert ((ua["w"] - want).abs() <= want * 2.0**-18).all(), (t, ua["w"][0, 0], want)
    assert float(ua["w"][0, 0]) > 1.5  # the under-estimated moment shows


def test_vectors_and_narrow_matrices_stay_float32_and_zeros_decode_to_zero():
    fmt = ms.moment_format("mu_dtype", "int8", second=False)
    for plain in (torch.zeros(100_000), torch.zeros(4096, 63)):  # a vector; rows under 64
        kept = ms.zeros_like_moment(fmt, plain)
        assert type(kept) is torch.Tensor and kept.dtype == torch.float32
    big = ms.zeros_like_moment(fmt, torch.zeros(64, 64))
    assert isinstance(big, ms.BlockCodes) and big.codes.shape == (64, 64)
    assert torch.equal(ms.decode(fmt, big), torch.zeros(64, 64))
    for kind, dtype in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)):
        f = ms.moment_format("mu_dtype", kind, second=False)
        assert ms.zeros_like_moment(f, torch.zeros(3)).dtype == dtype
    assert ms.moment_format("mu_dtype", torch.float32, second=False) is ms.FLOAT32


EMPTY_SHAPES = [(0, 256), (0, 768), (0, 300), (0, 197, 768)]  # local shards with no rows


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("second", [False, True])
def test_a_tensor_with_no_rows_is_coded_as_empty(shape, second):
    """An empty local shard (FSDP2 gives one to a rank past a short first dimension: a
    ViT's (1, 197, 768) position embedding at 2 ranks) is coded: empty codes, scales
    (0, blocks per row), decoding to an empty float32 tensor of its shape."""
    fmt = _fmt("int8", second=second)
    p = torch.zeros(shape)
    zero = ms.zeros_like_moment(fmt, p)
    per_row = math.ceil(math.prod(shape[1:]) / 256)
    assert isinstance(zero, ms.BlockCodes) and zero.codes.shape == shape
    assert zero.scales.shape == ms.scales_shape(shape, 256) == (0, per_row)
    stored = ms.encode(fmt, p, zero)
    assert stored.codes.shape == shape and stored.scales.shape == (0, per_row)
    for x in (ms.decode(fmt, zero), ms.decode(fmt, stored)):
        assert x.dtype == torch.float32 and x.shape == shape


def _empty_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "pos": torch.zeros(0, 197, 768),  # a rank's shard of a (1, 197, 768) embedding
        "qkv": torch.zeros(0, 256),  # of a (3, width, width) weight at 4 ranks, flattened
        "w": torch.randn(8, 256, generator=g) * 0.1,
    }


def test_a_state_with_empty_shards_updates_saves_and_maps(tmp_path):
    """fp16_update, state_nbytes, a checkpoint, vmap and torch.compile of a state whose
    params hold empty leaves with int8 moments (Adam's and Lion's)."""
    tx = ff.adamw(1e-3, mu_dtype="int8", nu_dtype="int8")
    state = ff.fp16_init(_empty_params(), tx, ff.DynamicLossScale(2.0**10))
    for k in ("pos", "qkv"):
        assert isinstance(state.opt_state[0].mu[k], ms.BlockCodes), k
    grads = {k: torch.ones(p.shape, dtype=torch.float16) for k, p in state.params.items()}
    nxt = ff.fp16_update(state, grads)
    assert bool(nxt.grads_finite) and int(nxt.step) == 1
    assert not torch.equal(nxt.master["w"], state.master["w"])
    for k, blocks in (("pos", 591), ("qkv", 1)):
        assert nxt.master[k].shape == state.master[k].shape
        assert nxt.opt_state[0].nu[k].scales.shape == (0, blocks)
    n = ff.state_nbytes(nxt)
    assert n.opt_state == 2 * (8 * 256 + 4 * 8) + 4  # the empty leaves hold no bytes
    ff.save_checkpoint(tmp_path / "s.ckpt", nxt)  # the load checks the scales' shapes
    assert_states_bitwise_equal(ff.load_checkpoint(tmp_path / "s.ckpt", state), nxt)
    members = [ff.fp16_init(_empty_params(s), tx, ff.DynamicLossScale(2.0**10)) for s in range(2)]
    many = [_grads(m, 4 + i) for i, m in enumerate(members)]
    out = torch.func.vmap(ff.fp16_update)(ff.tree_stack(members), ff.tree_stack(many))
    for i, (m, g) in enumerate(zip(members, many)):
        assert_states_bitwise_equal(ff.tree_unstack(out)[i], ff.fp16_update(m, g))
    torch._dynamo.reset()
    lion = ff.fp16_init(_empty_params(), ff.lion(1e-4, mu_dtype="int8"))
    g = _grads(lion, 5)
    compiled = torch.compile(ff.fp16_update, fullgraph=True)(lion, g)
    assert_states_bitwise_equal(compiled, ff.fp16_update(lion, g))


# -- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: ff.adamw(1e-3, mu_dtype=torch.int16), ValueError, "mu_dtype"),
        (lambda: ff.adamw(1e-3, nu_dtype="int4"), ValueError, "nu_dtype"),
        (lambda: ff.adam(1e-3, nu_dtype=torch.float16), ValueError, "nu_scale"),
        (lambda: ff.adam(1e-3, nu_dtype=torch.bfloat16, nu_scale="tensor"), ValueError, "nu_scale"),
        (lambda: ff.adam(1e-3, nu_dtype=torch.float16, nu_scale=3.0), ValueError, "power of two"),
        (lambda: ff.adamw(1e-3, mu_dtype="int8", block_size=96), ValueError, "block_size"),
        (lambda: ff.adamw(1e-3, mu_dtype="int8", block_size=0), ValueError, "block_size"),
        (lambda: ff.lion(1e-4, mu_dtype="int8", block_size=True), TypeError, "block_size"),
        (lambda: ff.lion(1e-4, mu_dtype=[torch.float16]), ValueError, "mu_dtype"),
        (lambda: ff.sgd(0.1, accumulator_dtype="int8"), ValueError, "accumulator_dtype"),
        (lambda: ff.sgd(0.1, momentum=0.9, accumulator_dtype="fp8"), ValueError, "accumulator"),
    ],
)
def test_bad_moment_settings_raise_at_construction(make, error, words):
    with pytest.raises(error, match=words):
        make()


# -- the transforms, inside fp16_update ---------------------------------------------------


def _recipe(**moments):
    """The transformer recipe: clip + AdamW (warmup-cosine, decay on matrices)."""
    schedule = ff.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 20, 1e-4)
    matrices = lambda t: {k: v.ndim >= 2 for k, v in t.items()}
    adamw = ff.adamw(schedule, b2=0.95, weight_decay=0.1, mask=matrices, **moments)
    return ff.chain(ff.clip_by_global_norm(1.0), adamw)


SETTINGS = {
    "adamw_int8": lambda: ff.adamw(1e-3, weight_decay=0.1, mu_dtype="int8", nu_dtype="int8"),
    "adamw_bf16": lambda: ff.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
    "adam_fp16": lambda: ff.adam(
        1e-3, mu_dtype=torch.float16, nu_dtype=torch.float16, nu_scale="tensor"
    ),
    "recipe_int8": lambda: _recipe(mu_dtype="int8", nu_dtype="int8", block_size=128),
    "lion_int8": lambda: ff.lion(1e-4, weight_decay=0.1, mu_dtype="int8"),
    "sgd_int8": lambda: ff.sgd(0.05, momentum=0.9, accumulator_dtype="int8"),
    "sgd_bf16": lambda: ff.sgd(0.05, momentum=0.9, nesterov=True, accumulator_dtype=torch.bfloat16),
    "adamw_int8_stochastic": lambda: ff.adamw(
        1e-3, weight_decay=0.1, mu_dtype="int8", nu_dtype="int8", moment_rounding="stochastic"
    ),
    "lion_bf16_stochastic": lambda: ff.lion(
        1e-4, mu_dtype=torch.bfloat16, moment_rounding="stochastic"
    ),
}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(96, 64, generator=g) * 0.1,  # 6144 elements: coded
        "v": torch.randn(41, 300, generator=g) * 0.1,  # coded: rows of one block and a rest
        "b": torch.randn(64, generator=g) * 0.1,  # a vector: stays FP32
    }


def _updates(seed, like):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g) * 1e-2 for k, p in like.items()}


def _is_stored(x) -> bool:
    return isinstance(x, (ms.BlockCodes, ms.ScaledHalf))


def _map(fn, tree, *rest):
    return optree.tree_map(fn, tree, *rest, is_leaf=_is_stored, namespace=NAMESPACE)


# The stream each moment field rounds with where its format rounds stochastically (Adam's
# and Lion's, which count their steps).
STREAMS = {"mu": 0, "nu": 1}


# (coded transform, FP32 twin, the state's moment fields and their formats' spec fields)
TRANSFORMS = {
    "adam_int8": (
        lambda: ff.scale_by_adam(mu_dtype="int8", nu_dtype="int8", block_size=128),
        lambda: ff.scale_by_adam(),
        {"mu": "mu_format", "nu": "nu_format"},
    ),
    "adam_bf16_fp16": (
        lambda: ff.scale_by_adam(
            b2=0.95, mu_dtype=torch.bfloat16, nu_dtype=torch.float16, nu_scale="tensor"
        ),
        lambda: ff.scale_by_adam(b2=0.95),
        {"mu": "mu_format", "nu": "nu_format"},
    ),
    "lion_int8": (
        lambda: ff.scale_by_lion(mu_dtype="int8"),
        lambda: ff.scale_by_lion(),
        {"mu": "mu_format"},
    ),
    "adam_int8_stochastic": (
        lambda: ff.scale_by_adam(
            mu_dtype="int8", nu_dtype="int8", block_size=128, moment_rounding="stochastic"
        ),
        lambda: ff.scale_by_adam(),
        {"mu": "mu_format", "nu": "nu_format"},
    ),
    "adam_bf16_fp16_stochastic": (
        lambda: ff.scale_by_adam(
            b2=0.95,
            mu_dtype=torch.bfloat16,
            nu_dtype=torch.float16,
            nu_scale="tensor",
            moment_rounding="stochastic",
        ),
        lambda: ff.scale_by_adam(b2=0.95),
        {"mu": "mu_format", "nu": "nu_format"},
    ),
    "lion_int8_stochastic": (
        lambda: ff.scale_by_lion(mu_dtype="int8", moment_rounding="stochastic"),
        lambda: ff.scale_by_lion(),
        {"mu": "mu_format"},
    ),
    "trace_int8": (
        lambda: ff.trace(0.9, accumulator_dtype="int8"),
        lambda: ff.trace(0.9),
        {"trace": "accumulator_format"},
    ),
    "trace_fp16_nesterov": (
        lambda: ff.trace(0.9, nesterov=True, accumulator_dtype=torch.float16),
        lambda: ff.trace(0.9, nesterov=True),
        {"trace": "accumulator_format"},
    ),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_a_step_from_decoded_moments_is_the_fp32_step_then_coded(name):
    """From moments equal to the decoded ones, the FP32 transform's updates are bitwise the
    coded transform's, and its new moments coded are bitwise the coded transform's:
    storage changes the bytes kept between steps, never the float32 arithmetic. Decoded
    and coded by the reference codec (``_ref_decode``, ``_ref_encode``), so a codec that
    decodes or encodes wrongly in both directions alike is not its own witness; moments
    rounded stochastically (``moment_rounding="stochastic"``) by the reference's own hash
    (numpy), neighbours (every value of the format, enumerated) and probabilities."""
    make, make_fp32, fields = TRANSFORMS[name]
    coded, plain = make(), make_fp32()
    params = _params()
    state = coded.init(params)
    formats = {f: getattr(coded.spec, sf) for f, sf in fields.items()}
    assert all(fmt.kind != "float32" for fmt in formats.values())
    for seed in range(2):  # two steps: non-zero moments, the trace initialised
        _, state = coded.update(_updates(seed, params), state, params)
    twin = state._replace(
        **{
            f: _map(functools.partial(_ref_decode, fmt), getattr(state, f))
            for f, fmt in formats.items()
        }
    )
    grads = _updates(7, params)
    u_coded, new_coded = coded.update(grads, state, params)
    u_plain, new_plain = plain.update(grads, twin, params)
    assert_states_bitwise_equal(u_coded, u_plain)
    count = int(new_coded.count) if "count" in new_coded._fields else None
    for field, spec_field in fields.items():
        fmt = getattr(coded.spec, spec_field)
        stream = STREAMS.get(field) if fmt.rounding == "stochastic" else None
        leaves = optree.tree_leaves(
            getattr(new_plain, field), is_leaf=_is_stored, namespace=NAMESPACE
        )
        likes = optree.tree_leaves(getattr(state, field), is_leaf=_is_stored, namespace=NAMESPACE)
        recoded = [
            _ref_encode(fmt, x, like, None if stream is None else _ref_salt(count, stream, i))
            for i, (x, like) in enumerate(zip(leaves, likes))
        ]
        got = optree.tree_leaves(getattr(new_coded, field), is_leaf=_is_stored, namespace=NAMESPACE)
        assert_states_bitwise_equal(got, recoded)
    stored = optree.tree_leaves(state, namespace=NAMESPACE)
    assert any(x.dtype in (torch.uint8, torch.bfloat16, torch.float16) for x in stored)


def _state(make, seed=0, tx=None):
    params = {k: v.clone() for k, v in _params(seed).items()}
    return ff.fp16_init(params, tx or make(), ff.DynamicLossScale(2.0**10))


def _grads(state, seed, bad=None):
    g = torch.Generator().manual_seed(seed)
    s = float(state.loss_scale.loss_scale)
    out = {
        k: (torch.randn(p.shape, generator=g) * 1e-2 * s).half() for k, p in state.params.items()
    }
    if bad is not None:
        out["v"][17, 3] = bad
    return out


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_skipped_step_leaves_every_byte_and_block_scale(name):
    state = _state(SETTINGS[name])
    for seed in range(2):
        state = ff.fp16_update(state, _grads(state, seed))
    kinds = {x.dtype for x in optree.tree_leaves(state.opt_state, namespace=NAMESPACE)}
    assert kinds & {torch.uint8, torch.bfloat16, torch.float16}, kinds
    before = bit_snapshot((state.master, state.params, state.opt_state))
    for bad in (float("inf"), float("nan")):
        skipped = ff.fp16_update(state, _grads(state, 5, bad=bad))
        assert not bool(skipped.grads_finite)
        assert_bitwise_unchanged((skipped.master, skipped.params, skipped.opt_state), before)
    assert_bitwise_unchanged((state.master, state.params, state.opt_state), before)


def _loss(master, target):
    return sum(((master[k] - target[k]) ** 2).sum() for k in master)


@pytest.mark.parametrize(
    "name, slack, moment_slack",
    [("adamw_int8", 0.05, 0.3), ("adamw_bf16", 0.02, 0.02), ("adam_fp16", 0.02, 0.005),
     ("lion_int8", 0.05, 0.15), ("sgd_int8", 0.05, 0.15), ("sgd_bf16", 0.02, 0.01),
     ("recipe_int8", 0.05, 0.25)],
)  # fmt: skip
def test_training_with_stored_moments_tracks_fp32_moments(name, slack, moment_slack):
    """Fitting a quadratic from noisy gradients for 60 steps: the loss with stored
    moments ends within ``slack`` (relative) of the loss with FP32 moments, and both fall;
    every stored moment, decoded, is within ``moment_slack`` (relative, in norm) of the
    FP32 run's (about twice the difference measured on these seeds: the runs part by
    their rounding, and a moment decoded as zero is 1 away). The loss alone does not
    see a lost momentum: Lion's sign of the gradient alone fits this quadratic as well."""
    target = {k: v * 0 + 0.05 for k, v in _params(1).items()}
    finals, moments = [], []
    for make in (SETTINGS[name], _FP32[name]):
        state = _state(make)
        start = float(_loss(state.master, target))
        g = torch.Generator().manual_seed(3)
        for _ in range(60):
            s = state.loss_scale.loss_scale
            grads = {
                k: ((2 * (m - target[k]) + torch.randn(m.shape, generator=g) * 0.05) * s).half()
                for k, m in state.master.items()
            }
            state = ff.fp16_update(state, grads)
        finals.append(float(_loss(state.master, target)))
        moments.append(_decoded_moments(state))
        assert finals[-1] < start
    coded, plain = finals
    assert abs(coded - plain) <= slack * plain, (coded, plain)
    assert len(moments[0]) == len(moments[1]) > 0
    for i, (a, b) in enumerate(zip(*moments)):
        assert float((a - b).norm()) <= moment_slack * float(b.norm()), (i, a, b)


_FIELDS = {
    ff.ScaleByAdamState: {"mu": "mu_format", "nu": "nu_format"},
    ff.ScaleByLionState: {"mu": "mu_format"},
    ff.TraceState: {"trace": "accumulator_format"},
}


def _moment_specs(spec):
    """The specs of the moment-holding transforms in ``spec``, in chain order."""
    if hasattr(spec, "parts"):
        for part in spec.parts:
            yield from _moment_specs(part)
    elif hasattr(spec, "mu_format") or hasattr(spec, "accumulator_format"):
        yield spec


def _decoded_moments(state) -> list[torch.Tensor]:
    """Every moment of ``state`` as float32, decoded by the reference codec."""
    found = optree.tree_leaves(
        state.opt_state, is_leaf=lambda x: isinstance(x, tuple(_FIELDS)), namespace=NAMESPACE
    )
    states = [x for x in found if isinstance(x, tuple(_FIELDS))]
    out = []
    for held, spec in zip(states, _moment_specs(state.tx.spec), strict=True):
        for field, spec_field in _FIELDS[type(held)].items():
            fmt = getattr(spec, spec_field)
            is_stored = lambda x: isinstance(x, (ms.BlockCodes, ms.ScaledHalf))
            leaves = optree.tree_leaves(
                getattr(held, field), is_leaf=is_stored, namespace=NAMESPACE
            )
            out += [_ref_decode(fmt, x) for x in leaves]
    return out


_FP32 = {
    "adamw_int8": lambda: ff.adamw(1e-3, weight_decay=0.1),
    "adamw_bf16": lambda: ff.adamw(1e-3),
    "adam_fp16": lambda: ff.adam(1e-3),
    "recipe_int8": _recipe,
    "lion_int8": lambda: ff.lion(1e-4, weight_decay=0.1),
    "sgd_int8": lambda: ff.sgd(0.05, momentum=0.9),
    "sgd_bf16": lambda: ff.sgd(0.05, momentum=0.9, nesterov=True),
    "adamw_int8_stochastic": lambda: ff.adamw(1e-3, weight_decay=0.1),
    "lion_bf16_stochastic": lambda: ff.lion(1e-4),
}


_AS_WRITTEN = {
    "adam_fp16": "a per-tensor scale needs the whole new moment before it codes any element",
}


def test_update_path_names_the_route_stored_moments_take():
    """Adam's and Lion's stored moments and SGD's stored trace (BF16, FP16 without a
    scale, block codes) take the fused step;
    the formats in ``_AS_WRITTEN`` run as written; update_path says which."""
    for name, make in SETTINGS.items():
        expected = "foreach" if name in _AS_WRITTEN else "fused"
        assert ff.update_path(_state(make)) == expected, name
        assert ff.update_path(_state(_FP32[name])) == "fused", name


@pytest.mark.parametrize("name", ["adamw_int8", "sgd_int8", "adam_fp16", "adamw_int8_stochastic"])
def test_checkpoint_round_trip_is_bitwise(tmp_path, name):
    state = _state(SETTINGS[name])
    for seed in range(2):
        state = ff.fp16_update(state, _grads(state, seed))
    ff.save_checkpoint(tmp_path / "s.ckpt", state)
    loaded = ff.load_checkpoint(tmp_path / "s.ckpt", _state(SETTINGS[name], seed=1))
    assert_states_bitwise_equal(loaded, state)
    nxt = ff.fp16_update(loaded, _grads(state, 9))
    assert_states_bitwise_equal(nxt, ff.fp16_update(state, _grads(state, 9)))


@pytest.mark.parametrize(
    "codes, scales",
    [
        (torch.zeros(8, 300, dtype=torch.uint8), torch.ones(8, 4)),  # 4 blocks: no power of 2
        (torch.zeros(8, 300, dtype=torch.uint8), torch.ones(4, 2)),  # other rows
        (torch.zeros(8, 300, dtype=torch.uint8), torch.ones(16)),  # not per row
        (torch.zeros(8, 300, dtype=torch.uint8), torch.ones(8, 2, dtype=torch.float64)),
        (torch.zeros(8, 300), torch.ones(8, 2)),  # codes of float32
        (torch.zeros(300, dtype=torch.uint8), torch.ones(0)),
    ],
)
def test_a_checkpoint_whose_block_scales_do_not_fit_is_corrupt(tmp_path, codes, scales):
    good = {"m": ms.BlockCodes(torch.zeros(8, 300, dtype=torch.uint8), torch.ones(8, 2))}
    ff.save_checkpoint(tmp_path / "good.ckpt", good)
    assert torch.equal(
        ff.load_checkpoint(tmp_path / "good.ckpt", good)["m"].scales, torch.ones(8, 2)
    )
    ff.save_checkpoint(tmp_path / "bad.ckpt", {"m": ms.BlockCodes(codes, scales)})
    for like in (None, good):
        with pytest.raises(ff.CheckpointCorruptError, match=r"\['m'\]: block"):
            ff.load_checkpoint(tmp_path / "bad.ckpt", like)


@pytest.mark.parametrize(
    "name", ["adamw_int8", "sgd_int8", "adamw_int8_stochastic", "lion_bf16_stochastic"]
)
def test_vmap_steps_each_member_as_alone(name):
    tx = SETTINGS[name]()
    members = [_state(None, seed=s, tx=tx) for s in range(2)]
    grads = [_grads(m, 4 + i) for i, m in enumerate(members)]
    stacked = ff.tree_stack(members)
    out = torch.func.vmap(ff.fp16_update)(stacked, ff.tree_stack(grads))
    for i, (m, g) in enumerate(zip(members, grads)):
        assert_states_bitwise_equal(ff.tree_unstack(out)[i], ff.fp16_update(m, g))


@pytest.mark.parametrize("name, exact", [("recipe_int8", False)])
def test_compiles_as_one_graph(name, exact):
    """``torch.compile(fullgraph=True)`` takes the update whole. Every leaf of the state is
    compared with eager's: decisions, loss scale, counts and flags bitwise; the master
    within one float32 ulp of the step; the float32 leaves (block scales, vector moments)
    within 4 float32 eps of their magnitude and the codes within one code step (2^-3),
    the bound of a chain that Inductor compiles (the recipe's stored moments now go
    through the fused op, opaque to Inductor). Adam's, Lion's and SGD's stored steps in
    one graph, bitwise: ``tests/test_fused_stored_moments.py``."""
    torch._dynamo.reset()
    state = _state(SETTINGS[name])
    state = ff.fp16_update(state, _grads(state, 0))
    grads = _grads(state, 1)
    eager = ff.fp16_update(state, grads)
    compiled = torch.compile(ff.fp16_update, fullgraph=True)(state, grads)
    for field in ("loss_scale", "step", "grads_finite", "scale_stats", "leaf_finite"):
        assert_states_bitwise_equal(getattr(compiled, field), getattr(eager, field))
    for k in state.master:
        step = (eager.master[k] - state.master[k]).abs()
        assert ((compiled.master[k] - eager.master[k]).abs() <= step * 2.0**-20 +
                eager.master[k].abs() * 2.0**-23).all()  # fmt: skip
    a_leaves = optree.tree_leaves(compiled.opt_state, namespace=NAMESPACE)
    b_leaves = optree.tree_leaves(eager.opt_state, namespace=NAMESPACE)
    assert len(a_leaves) == len(b_leaves)
    assert {x.dtype for x in b_leaves} & {torch.int32, torch.bool}  # counts or flags
    assert any(x.dtype in (torch.uint8, torch.bfloat16) for x in b_leaves)
    for a, b in zip(a_leaves, b_leaves):
        assert type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
        if exact or not b.is_floating_point() and b.dtype != torch.uint8:
            assert_states_bitwise_equal(a, b)
        elif b.dtype == torch.uint8:  # codes of values within float32 rounding of each other
            x, y = (t.view(torch.float8_e4m3fn).float() for t in (a, b))
            assert ((x - y).abs() <= y.abs() * 2.0**-3).all()
        else:
            assert b.dtype == torch.float32 and scaled_error(a, b) <= 4, scaled_error(a, b)


WRAPPED = {
    "masked": lambda: ff.masked(
        ff.adamw(1e-3, mu_dtype="int8", nu_dtype="int8"), lambda t: {k: k != "b" for k in t}
    ),
    "labels": lambda: ff.multi_transform(
        {
            "matrix": ff.sgd(0.05, momentum=0.9, accumulator_dtype="int8"),
            # formats vectors use ("int8" would leave them FP32)
            "vector": ff.adam(
                1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.float16, nu_scale="tensor"
            ),
        },
        lambda t: {k: "matrix" if v.ndim >= 2 else "vector" for k, v in t.items()},
    ),
    "multisteps": lambda: ff.MultiSteps(
        ff.adamw(1e-3, mu_dtype="int8", nu_dtype="int8"), every_k_schedule=2
    ),
    "inject": lambda: ff.inject_hyperparams(
        ff.adamw, static_args=("b1", "b2", "eps", "weight_decay", "mu_dtype", "nu_dtype")
    )(1e-3, mu_dtype="int8", nu_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(WRAPPED))
def test_wrappers_carry_stored_moments(name):
    """Masks, labels, MultiSteps and inject_hyperparams keep the stored form; a skip is a
    bitwise no-op on all of it. Under labels the vector's Adam keeps its own formats
    (bfloat16 first moment, scaled float16 second moment), written."""
    state = _state(WRAPPED[name])
    for seed in range(4):
        state = ff.fp16_update(state, _grads(state, seed))
    moments = _moments(state.opt_state)
    codes = [x for x in moments if x.dtype == torch.uint8]
    assert codes and any(bool(c.ne(0).any()) for c in codes)  # moments were written
    if name == "labels":
        found = optree.tree_leaves(
            state.opt_state,
            is_leaf=lambda x: isinstance(x, ff.ScaleByAdamState),
            namespace=NAMESPACE,
        )
        (adam,) = [x for x in found if isinstance(x, ff.ScaleByAdamState)]
        mu, nu = adam.mu["b"], adam.nu["b"]
        assert type(mu) is torch.Tensor and mu.dtype == torch.bfloat16 and bool(mu.ne(0).all())
        assert isinstance(nu, ms.ScaledHalf) and nu.values.dtype == torch.float16
        assert 2.0**14 <= float(nu.values.float().max()) < 2.0**15  # a per-tensor scale
    before = bit_snapshot((state.master, moments))
    skipped = ff.fp16_update(state, _grads(state, 7, bad=float("inf")))
    assert_bitwise_unchanged((skipped.master, _moments(skipped.opt_state)), before)


_MOMENT_STATES = (ff.ScaleByAdamState, ff.ScaleByLionState, ff.TraceState)


def _moments(opt_state) -> list[torch.Tensor]:
    """The tensors of every moment-holding state inside ``opt_state`` (codes, scales,
    plain moments, counts), in order."""
    found = optree.tree_leaves(
        opt_state, is_leaf=lambda x: isinstance(x, _MOMENT_STATES), namespace=NAMESPACE
    )
    states = [x for x in found if isinstance(x, _MOMENT_STATES)]
    assert states
    return optree.tree_leaves(states, namespace=NAMESPACE)


def test_state_nbytes_counts_each_part():
    params = {"w": torch.zeros(128, 64), "b": torch.zeros(64)}  # 8192 + 64 elements
    fp32 = ff.fp16_init(params, ff.adamw(1e-3))
    coded = ff.fp16_init(params, ff.adamw(1e-3, mu_dtype="int8", nu_dtype="int8"))
    half = ff.fp16_init(params, ff.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16))
    n = 8192 + 64
    a, b, c = (ff.state_nbytes(s) for s in (fp32, coded, half))
    assert (a.params, a.master) == (2 * n, 4 * n) == (b.params, b.master)
    assert a.opt_state == 8 * n + 4  # two FP32 moments and the int32 count
    # w: a byte per element and a scale per block: 128 rows of 64, one block each
    # (blocks lie along rows), twice; b: FP32 (a vector)
    assert b.opt_state == 2 * (8192 + 4 * 128) + 2 * 4 * 64 + 4
    assert c.opt_state == 4 * n + 4
    assert a.total == a.params + a.master + a.opt_state + a.other
    assert a.other == sum(x.numel() * x.element_size() for x in optree.tree_leaves(
        (fp32.loss_scale, fp32.step, fp32.grads_finite, fp32.scale_stats, fp32.leaf_finite),
        namespace=NAMESPACE,
    ))  # fmt: skip
    with pytest.raises(TypeError, match="FP16State"):
        ff.state_nbytes(params)


def test_fp32_moments_are_unchanged_by_default():
    """The default state is the FP32 layout older checkpoints hold."""
    state = _state(lambda: ff.adamw(1e-3))
    assert all(
        x.dtype == torch.float32
        for x in optree.tree_leaves(state.opt_state, namespace=NAMESPACE)
        if x.ndim
    )
    assert state.tx.spec.parts[0].mu_format is ms.FLOAT32
