"""The split master (``fp16_init(..., master="split")``): FP16 params plus int16 residuals.

* The codec (``precision.master_split``) against exact rationals: decoding gives back
  the float32 master bitwise wherever ``|m| >= 2^-16`` (every weight whose FP16 cast is
  normal), within ``2^-40`` below; params are the FP16 rounding of the decoded master;
  ``split(join(p, q)) == (p, q)``; signed zeros kept.
* Trajectories: with every weight in FP16's normal range, every optimiser of the
  matrix under every implementation, over steps with overflows, gives params, decoded
  master, optimiser state and counters bitwise the FP32-master run's (on the CPU's
  kernel; on CUDA's default a float32 master's SGD runs PyTorch's fused kernel and a
  split one's the C kernel's arithmetic, held to the C kernel below instead).
* A skipped step leaves params and residuals bitwise; conversions round-trip bitwise;
  bad input is refused by name; checkpoints round-trip and refuse residuals that do not
  fit.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16.precision import master_split
from functional_fp16.precision.master_split import join, residual_unit, split
from tests.helpers import (
    IMPL_NAMES,
    TX_NAMES,
    assert_bitwise_unchanged,
    bit_snapshot,
    bits,
    matrix_grads,
    optimiser_matrix,
)

EXACT_FROM = 2.0**-16
ERROR_BELOW = 2.0**-40


def _f32(pattern: int) -> torch.Tensor:
    return torch.tensor([pattern], dtype=torch.int64).to(torch.int32).view(torch.float32)


# Edges: powers of two (rounding to FP16 carries into the next binade just below them),
# the largest FP16 and the first value that overflows, the smallest normal, subnormals,
# the tie between two subnormals, signed zeros, tiny masters.
EDGES = [
    1.0, 1.0 - 2.0**-24, 1.0 - 2.0**-12, 1.0 - 2.0**-12 - 2.0**-24, 2.0**10 - 2.0**-14,
    65504.0, 65519.99, 65520.0, 2.0**-14, 2.0**-14 - 2.0**-38, 2.0**-14 - 2.0**-25,
    2.0**-15 + 2.0**-25, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-16, 2.0**-16 - 2.0**-40,
    2.0**-17 + 2.0**-41, 1e-30, 1e-45, 0.0, 0.1, 1 / 3,
]  # fmt: skip


def _check(m: torch.Tensor) -> None:
    """The codec's promises for every element of the float32 tensor ``m``."""
    if m.numel() == 0:
        return
    p, q = split(m)
    assert p.dtype == torch.float16 and q.dtype == torch.int16
    back = join(p, q)
    finite = torch.isfinite(p)
    # exact where |m| >= 2^-16 (and the cast is finite), else within 2^-40
    big = (m.abs() >= EXACT_FROM) & finite
    assert torch.equal(bits(back[big]), bits(m[big]))
    for x, y in zip(m[~big & finite].tolist(), back[~big & finite].tolist()):
        assert abs(Fraction(y) - Fraction(x)) <= Fraction(ERROR_BELOW), (x, y)
    # the sign of every zero is kept; an overflowing cast decodes to its infinity
    number = m == m
    assert torch.equal(torch.signbit(back[number]), torch.signbit(m[number]))
    assert torch.equal(torch.isnan(back), ~number)
    assert torch.equal(back[~finite & (m == m)], p[~finite & (m == m)].float())
    # params are the rounding of the decoded master; the residual's range
    assert torch.equal(bits(back.half()), bits(p))
    assert int(q.to(torch.int32).abs().max()) <= 2**14
    # the residual is (decoded - p) / u exactly, as rationals
    for pv, qv, bv, uv in zip(
        p.float().tolist(), q.tolist(), back.tolist(), residual_unit(p).tolist()
    ):
        if math.isfinite(pv):
            assert Fraction(bv) == Fraction(pv) + qv * Fraction(uv)
    # split is the inverse of join on what it makes
    p2, q2 = split(back)
    assert torch.equal(bits(p2), bits(p)) and torch.equal(q2, q)


def test_edges():
    values = torch.tensor(EDGES, dtype=torch.float32)
    _check(torch.cat([values, -values, torch.tensor([float("nan"), float("inf"), -float("inf")])]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_codec_over_float32_patterns(patterns):
    m = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    _check(m[~torch.isnan(m)])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-(2**24), 2**24), min_size=1, max_size=64), st.integers(-45, 16))
def test_codec_near_the_normal_range(ks, e):
    """Masters in and below FP16's normal range: k * 2^(e - 24), every binade from float32's
    subnormals up to FP16's overflow."""
    m = torch.tensor([k * 2.0 ** (e - 24) for k in ks], dtype=torch.float64).to(torch.float32)
    _check(m)


def test_every_pattern_of_a_binade_near_the_edge():
    """Every float32 in [2^-17, 2^-13): the upper subnormals (exact) and the lower (bound)."""
    lo, hi = 0x3A000000 - 2**22, 0x39000000 + 2**23 * 4  # from 2^-17.. to 2^-13
    m = torch.arange(min(lo, hi), max(lo, hi), 97, dtype=torch.int64).to(torch.int32)
    _check(m.view(torch.float32))


def test_mutants_fail():
    """The checks catch a unit without the sign and an encode without the grid."""
    m = torch.tensor([-0.0, 3e-9, 1.5 * 2.0**-24 - 2.0**-47], dtype=torch.float32)
    p, q = split(m)
    unsigned = torch.addcmul(p.float(), q.float(), residual_unit(p).abs())
    assert not torch.equal(torch.signbit(unsigned), torch.signbit(m))
    raw_p = m.half()  # no grid first: the residual of fl16(m), rounded to nearest
    raw_q = ((m - raw_p.float()) / residual_unit(raw_p)).round().to(torch.int16)
    assert not torch.equal(bits(join(raw_p, raw_q).half()), bits(raw_p))


# -- trajectories ------------------------------------------------------------------------


def _params(seed=0):
    """Weights in FP16's normal range, away from zero for every step of the tests."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        x = 0.5 + 0.5 * torch.rand(*shape, generator=g)
        return torch.where(torch.rand(*shape, generator=g) < 0.5, -x, x)

    return {"w": w(24, 40), "v": w(40), "c": w(3, 5, 7)}


STEPS = 40


def _run(tx, impl, master, steps=STEPS, donate=False):
    state = ff.fp16_init(_params(), tx, master=master)
    for k in range(steps):
        bad = float("inf") if k % 9 == 4 else (float("nan") if k % 13 == 7 else None)
        state = ff.fp16_update(state, matrix_grads(state, k, 3, bad=bad), impl=impl, donate=donate)
    return state


def _same_run(split_state, wide_state):
    assert ff.master_form(split_state) == "split" and ff.master_form(wide_state) == "float32"
    for a, b in zip(
        ff._util.tree.tree_leaves(ff.master_weights(split_state)),
        ff._util.tree.tree_leaves(wide_state.master),
    ):
        assert torch.equal(bits(a), bits(b))
    for a, b in zip(
        ff._util.tree.tree_leaves(
            (split_state.params, split_state.opt_state, split_state.loss_scale)
        ),
        ff._util.tree.tree_leaves((wide_state.params, wide_state.opt_state, wide_state.loss_scale)),
    ):
        assert torch.equal(bits(a), bits(b))
    assert ff.loss_scale_stats(split_state) == ff.loss_scale_stats(wide_state)
    assert bool(split_state.step == wide_state.step)


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize("name", TX_NAMES)
def test_trajectory_equals_the_float32_master(name, impl):
    tx = optimiser_matrix()[name]
    wide = _run(tx, impl, "float32")
    assert int(ff.loss_scale_stats(wide)["skips"]) > 0  # overflows happened
    _same_run(_run(optimiser_matrix()[name], impl, "split"), wide)


STORED = {
    "adamw_e4m3": lambda: ff.adamw(1e-3, weight_decay=0.1, mu_dtype="e4m3", nu_dtype="e4m3"),
    "adam_bf16_clip": lambda: ff.chain(
        ff.clip_by_global_norm(1.0), ff.adam(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
    ),
    "lion_e4m3": lambda: ff.lion(1e-4, mu_dtype="e4m3"),
    "sgd_e4m3": lambda: ff.sgd(0.05, momentum=0.9, accumulator_dtype="e4m3"),
}


@pytest.mark.parametrize("name", sorted(STORED))
def test_trajectory_with_stored_moments(name):
    _same_run(_run(STORED[name](), "auto", "split"), _run(STORED[name](), "auto", "float32"))


@pytest.mark.parametrize("impl", IMPL_NAMES)
def test_donated_equals_pure(impl):
    tx = optimiser_matrix()["recipe"]
    pure = _run(tx, impl, "split", steps=8)
    donated = _run(optimiser_matrix()["recipe"], impl, "split", steps=8, donate=True)
    for a, b in zip(ff._util.tree.tree_leaves(pure), ff._util.tree.tree_leaves(donated)):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("impl", IMPL_NAMES)
@pytest.mark.parametrize("name", ["momentum", "recipe", "lion"])
def test_a_skipped_step_is_a_no_op(name, impl):
    state = ff.fp16_init(_params(), optimiser_matrix()[name], master="split")
    state = ff.fp16_update(state, matrix_grads(state, 0, 1), impl=impl)
    before = bit_snapshot((state.params, state.master, state.opt_state))
    new = ff.fp16_update(state, matrix_grads(state, 1, 1, bad=float("inf")), impl=impl)
    assert not bool(new.grads_finite)
    assert_bitwise_unchanged((new.params, new.master, new.opt_state), before)
    assert_bitwise_unchanged((state.params, state.master, state.opt_state), before)


# -- the API -----------------------------------------------------------------------------


def test_bytes_and_master_weights():
    params = _params()
    wide = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
    narrow = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9), master="split")
    n = sum(p.numel() for p in params.values())
    assert ff.state_nbytes(wide).master == 4 * n and ff.state_nbytes(narrow).master == 2 * n
    assert ff.state_nbytes(narrow).params == 2 * n
    assert all(q.dtype == torch.int16 for q in narrow.master.values())
    for k in params:
        assert torch.equal(bits(ff.master_weights(narrow)[k]), bits(params[k]))
        assert torch.equal(bits(narrow.params[k]), bits(wide.params[k]))
    assert ff.master_weights(wide) is wide.master


def test_convert_round_trip():
    wide = _run(optimiser_matrix()["recipe"], "auto", "float32", steps=5)
    narrow = ff.convert_master(wide, "split")
    assert ff.master_form(narrow) == "split"
    back = ff.convert_master(narrow, "float32")
    for a, b in zip(back.master.values(), wide.master.values()):
        assert torch.equal(bits(a), bits(b))
    again = ff.convert_master(back, "split")
    for a, b in zip(
        ff._util.tree.tree_leaves((again.params, again.master)),
        ff._util.tree.tree_leaves((narrow.params, narrow.master)),
    ):
        assert torch.equal(bits(a), bits(b))
    assert ff.convert_master(narrow, "split") is narrow
    # the converted state trains on as the float32 one does
    g = matrix_grads(wide, 9, 2)
    _same_run(ff.fp16_update(narrow, g), ff.fp16_update(wide, g))


def test_bad_input():
    params = _params()
    tx = ff.sgd(0.1)
    with pytest.raises(ValueError, match="master must be one of"):
        ff.fp16_init(params, tx, master="fp32")
    with pytest.raises(ValueError, match="param_dtype=torch.float16"):
        ff.fp16_init(params, tx, master="split", param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="copy_master=False"):
        ff.fp16_init(params, tx, master="split", copy_master=False)
    state = ff.fp16_init(params, tx, master="split")
    g = matrix_grads(state, 0, 0)
    wrong_shape = state.replace(master={**state.master, "v": torch.zeros(41, dtype=torch.int16)})
    with pytest.raises(ValueError, match=r"state.master\['v'\]: shape"):
        ff.fp16_update(wrong_shape, g)
    mixed = state.replace(master={**state.master, "v": torch.zeros(40, dtype=torch.int32)})
    with pytest.raises(TypeError, match=r"state.master\['v'\]: dtype torch.int32"):
        ff.fp16_update(mixed, g)
    bf16 = state.replace(params={k: v.bfloat16() for k, v in state.params.items()})
    with pytest.raises(TypeError, match=r"state.params\['c'\]: dtype torch.bfloat16; a split"):
        ff.fp16_update(bf16, g)
    with pytest.raises(ValueError, match="master must be one of"):
        ff.convert_master(state, "half")
    with pytest.raises(ValueError, match="needs float16 params"):
        ff.convert_master(ff.fp16_init(params, tx, param_dtype=torch.bfloat16), "split")


def test_checkpoint_round_trip_and_corrupt_residuals(tmp_path):
    state = _run(optimiser_matrix()["recipe"], "auto", "split", steps=4)
    ff.save_checkpoint(tmp_path / "s.pt", state)
    back = ff.load_checkpoint(
        tmp_path / "s.pt", like=ff.fp16_init(_params(), state.tx, master="split")
    )
    for a, b in zip(ff._util.tree.tree_leaves(back), ff._util.tree.tree_leaves(state)):
        assert torch.equal(bits(a), bits(b))
    bad_master = dict(state.master)
    bad_master["w"] = bad_master["w"].clone()
    bad_master["w"][3, 4] = 2**14 + 1  # out of range
    ff.save_checkpoint(tmp_path / "bad.pt", state.replace(master=bad_master))
    with pytest.raises(ff.CheckpointCorruptError, match=r"state.master\['w'\]: residuals"):
        ff.load_checkpoint(tmp_path / "bad.pt", like=back)
    off = dict(state.master)
    off["v"] = off["v"].clone()
    odd = int(torch.nonzero(bits(state.params["v"]) & 1)[0])
    off["v"][odd] = 2**14  # half an ulp away from an odd param: decodes to a tie, rounds away
    ff.save_checkpoint(tmp_path / "off.pt", state.replace(master=off))
    with pytest.raises(ff.CheckpointCorruptError, match=r"state.master\['v'\]"):
        ff.load_checkpoint(tmp_path / "off.pt", like=back)


def test_valid_residuals_catches_each_rule():
    p = torch.tensor([1.0, float("inf"), 2.0**-20], dtype=torch.float16)
    q = torch.zeros(3, dtype=torch.int16)
    assert bool(master_split.valid_residuals(p, q))
    assert not bool(master_split.valid_residuals(p, torch.tensor([0, 1, 0], dtype=torch.int16)))
    assert not bool(
        master_split.valid_residuals(p, torch.tensor([2**14 + 1, 0, 0], dtype=torch.int16))
    )


# -- transforms of the update ------------------------------------------------------------


def test_vmap_members_step_as_alone():
    tx = optimiser_matrix()["recipe"]
    states = [ff.fp16_init(_params(seed), tx, master="split") for seed in range(3)]
    grads = [
        matrix_grads(s, 0, k, bad=float("inf") if k == 1 else None) for k, s in enumerate(states)
    ]
    batched = torch.func.vmap(ff.fp16_update)(ff.tree_stack(states), ff.tree_stack(grads))
    for k, member in enumerate(ff.tree_unstack(batched)):
        alone = ff.fp16_update(states[k], grads[k])
        for a, b in zip(ff._util.tree.tree_leaves(member), ff._util.tree.tree_leaves(alone)):
            assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("name", ["recipe"])
def test_compiled_equals_eager(name):
    eager = ff.fp16_init(_params(), optimiser_matrix()[name], master="split")
    compiled = eager
    step = torch.compile(ff.fp16_update, fullgraph=True)
    for k in range(3):
        g = matrix_grads(eager, k, 5, bad=float("inf") if k == 1 else None)
        eager, compiled = ff.fp16_update(eager, g), step(compiled, g)
    for a, b in zip(ff._util.tree.tree_leaves(compiled), ff._util.tree.tree_leaves(eager)):
        assert torch.equal(bits(a), bits(b))


@pytest.mark.parametrize(
    "make",
    [
        lambda: ff.MultiSteps(ff.adamw(1e-3, weight_decay=0.1), every_k_schedule=2),
        lambda: ff.inject_hyperparams(ff.adamw)(learning_rate=1e-3, weight_decay=0.1),
        lambda: ff.inject_hyperparams(ff.sgd)(learning_rate=0.05, momentum=0.9),
    ],
    ids=["multisteps", "inject_adamw", "inject_sgd"],
)
def test_wrapped_optimisers_equal_the_float32_master(make):
    _same_run(_run(make(), "auto", "split", steps=10), _run(make(), "auto", "float32", steps=10))


def _tiny_params():
    """Weights at every scale the codec treats apart: normal, the upper subnormals (exact),
    below 2^-16 (on the grid), FP16's subnormal ties, signed zeros; some cross zero."""
    g = torch.Generator().manual_seed(7)
    scales = torch.tensor([1.0, 2.0**-13, 2.0**-15, 2.0**-17, 2.0**-22, 2.0**-26, 2.0**-30])
    w = torch.randn(7, 150, generator=g) * scales[:, None]
    w[0, :4] = torch.tensor([0.0, -0.0, 1.5 * 2.0**-24, -2.5 * 2.0**-24])
    # "e": 15 elements, all in the kernels' last, partial vector (and the scalar remainder
    # of join_master and split_master), values of every kind
    e = torch.tensor([0.3, -0.0, 0.0, 2.0**-20, -3 * 2.0**-25, 1e-30, 65504.0, -700.0, 2.0**-14,
                      -(2.0**-14) + 2.0**-30, 1.5 * 2.0**-24, 7e-6, -2e-7, 1.0, -1.0])  # fmt: skip
    return {"w": w, "v": torch.randn(37, generator=g) * 2.0**-18, "e": e}


@pytest.mark.parametrize("kernel", ["c", "cuda-default"])
@pytest.mark.parametrize(
    "name", ["momentum", "sgd", "recipe", "lion", "rmsprop_momentum_schedule", "adamw_e4m3"]
)
def test_the_kernels_split_like_the_codec(name, kernel, monkeypatch):
    """The fused step on a split master equals the fused step on its float32 master,
    split by the codec (``convert_master``), bitwise, for masters at every scale: the
    kernels' own join and split are the codec's."""
    if kernel == "cuda-default" and name in ("momentum", "recipe"):
        # There a float32 master's SGD and Adam are PyTorch's fused kernels and a split
        # one's the C kernel's arithmetic (Triton): within their bounds, compared below
        # with the C kernel.
        pytest.skip("see test_cuda_defaults_split_step_is_the_c_kernels")
    monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", kernel)
    tx = STORED[name]() if name in STORED else optimiser_matrix()[name]
    narrow = ff.fp16_init(_tiny_params(), tx, master="split")
    for k in range(4):
        wide = ff.convert_master(narrow, "float32")
        g = matrix_grads(narrow, k, 11, scale=2.0**-4, bad=float("inf") if k == 2 else None)
        for donate in (False, True):
            stepped = ff.fp16_update(narrow if not donate else _copy(narrow), g, donate=donate)
            expected = ff.convert_master(ff.fp16_update(wide, g), "split")
            assert ff.update_path(narrow) == "fused"
            for a, b in zip(
                ff._util.tree.tree_leaves(stepped), ff._util.tree.tree_leaves(expected)
            ):
                assert torch.equal(bits(a), bits(b))
        narrow = stepped


PAST_FP16 = {
    # each pushes masters at +-65519.99 outward by more than 65520 - 65519.99 in one step
    "momentum": lambda: ff.sgd(0.05, momentum=0.9),  # then inf, held
    "wd": lambda: ff.sgd(0.05, momentum=0.9, weight_decay=1e-2),  # inf, then NaN
    "adam": lambda: ff.adam(1.0),
    "l2_adam": lambda: ff.chain(ff.add_decayed_weights(1e-2), ff.adam(1.0)),  # NaN
    "lion": lambda: ff.lion(1.0, weight_decay=0.0),
    "rmsprop": lambda: ff.rmsprop(1.0, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(PAST_FP16))
def test_masters_past_fp16s_range_split_like_the_codec(name):
    """Masters stepped past 65520 (params inf, residuals 0) and on to NaN: the C kernel's
    split of them is the codec's, bitwise, pure and donated; 40 elements, so whole
    vectors and a last, partial one."""
    m = torch.tensor([65519.99, -65519.99] * 20)
    narrow = ff.fp16_init({"o": m}, PAST_FP16[name](), ff.DynamicLossScale(1.0), master="split")
    g = {"o": (-torch.sign(m) * 60000.0).to(torch.float16)}
    for _ in range(3):
        wide = ff.convert_master(narrow, "float32")
        expected = ff.convert_master(ff.fp16_update(wide, g), "split")
        for donate in (False, True):
            stepped = ff.fp16_update(narrow if not donate else _copy(narrow), g, donate=donate)
            assert ff.update_path(narrow) == "fused"
            for a, b in zip(
                ff._util.tree.tree_leaves(stepped), ff._util.tree.tree_leaves(expected)
            ):
                assert torch.equal(bits(a), bits(b))
        narrow = stepped
    p = narrow.params["o"]
    assert torch.isinf(p).any() or torch.isnan(p).any()
    assert not narrow.master["o"][~torch.isfinite(p)].any()  # residual 0 past the range


@pytest.mark.parametrize("name", ["momentum", "nesterov", "dampening", "wd", "clip", "recipe"])
def test_cuda_defaults_split_step_is_the_c_kernels(name, monkeypatch):
    """SGD with momentum and the AdamW recipe on a split master, CUDA's default (the
    stored-state step: Triton where it runs, else leaf by leaf) against the C kernel, every
    byte, step after step."""
    state = ff.fp16_init(_tiny_params(), optimiser_matrix()[name], master="split")
    for k in range(4):
        g = matrix_grads(state, k, 13, scale=2.0**-4, bad=float("nan") if k == 2 else None)
        monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", "c")
        want = ff.fp16_update(state, g)
        monkeypatch.setenv("FUNCTIONAL_FP16_CPU_KERNEL", "cuda-default")
        got = ff.fp16_update(state, g)
        for a, b in zip(ff._util.tree.tree_leaves(got), ff._util.tree.tree_leaves(want)):
            assert torch.equal(bits(a), bits(b))
        state = want


def _copy(state):
    return ff._util.tree.tree_map(torch.clone, state)


def test_large_masters_split_a_piece_at_a_time_alike():
    """Past ``_PIECE`` elements split and join go a piece at a time in memory order:
    equal to the whole-tensor result, for a row-major and a transposed master."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(1100, 1000, generator=g) * torch.logspace(-12, 2, 1000)  # every scale
    assert big.numel() > master_split._PIECE
    for m in (big, big.t()):
        p, q = split(m)
        assert p.stride() == m.stride() and q.stride() == m.stride()
        rows = [split(m[i : i + 1].clone()) for i in range(0, m.shape[0], 97)]
        for k, (pr, qr) in zip(range(0, m.shape[0], 97), rows):
            assert torch.equal(bits(p[k : k + 1]), bits(pr)) and torch.equal(q[k : k + 1], qr)
        back = join(p, q)
        big_enough = m.abs() >= EXACT_FROM
        assert back.stride() == m.stride()
        assert torch.equal(bits(back[big_enough]), bits(m[big_enough]))
        assert torch.equal(bits(back), bits(join(p.contiguous(), q.contiguous()).view_as(back)))


def test_dcp_round_trip_and_corrupt_residuals(tmp_path):
    """``save_dcp_state``/``load_dcp_state`` (one process): a split state back bitwise;
    residuals that do not fit their params refused by name."""
    from functional_fp16 import distributed as ffd

    state = _run(optimiser_matrix()["recipe"], "auto", "split", steps=3)
    ffd.save_dcp_state(state, tmp_path / "ok")
    like = ff.fp16_init(_params(), state.tx, master="split")
    back = ffd.load_dcp_state(like, tmp_path / "ok")
    for a, b in zip(ff._util.tree.tree_leaves(back), ff._util.tree.tree_leaves(state)):
        assert torch.equal(bits(a), bits(b))
    bad = dict(state.master)
    bad["c"] = bad["c"].clone()
    bad["c"][0, 0, 0] = -(2**15)
    ffd.save_dcp_state(state.replace(master=bad), tmp_path / "bad")
    with pytest.raises(ff.CheckpointCorruptError, match=r"state.master\['c'\]: residuals"):
        ffd.load_dcp_state(like, tmp_path / "bad")
