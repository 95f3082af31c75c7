"""The multi-tensor path (``impl="foreach"``) against the reference implementation.

The fast path performs the reference's floating-point operations in the same
order, so on the CPU every leaf of every state must be bitwise equal, step
after step, for every transform chain, with and without donation, through
overflows and skipped steps.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16 import allocator
from functional_fp16._util import finite as fast_update
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import (
    IMPL_NAMES,
    SIZES,
    STEPS,
    TX_NAMES,
    assert_states_bitwise_equal,
    implementations,
    matrix_grads,
    optimiser_matrix,
    random_tree,
)


def _bits(x):
    return x.reshape(-1).view(torch.uint8)


def _run(tx, impl, donate, seed=0, bad_steps=(), scale=2.0**10, loss_scale=None, dtype=None):
    params = random_tree(seed, scale=0.5)
    kwargs = {} if dtype is None else {"param_dtype": dtype}
    state = ff.fp16_init(params, tx, loss_scale, **kwargs)
    states = []
    for step in range(STEPS):
        bad = math.inf if step in bad_steps else None
        if step in bad_steps and step % 2:
            bad = math.nan
        grads = matrix_grads(state, step, seed, scale=scale, bad=bad)
        state = ff.fp16_update(state, grads, impl=impl, donate=donate)
        # Snapshot: a donated state is overwritten by the next step.
        states.append(tree_map(lambda x: x.clone(), state))
    return states


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("name", TX_NAMES)
def test_bitwise_equal_to_reference(name, donate):
    tx = optimiser_matrix()[name]
    ref = _run(tx, "reference", False, bad_steps=(0, 3))
    fast = _run(tx, "foreach", donate, bad_steps=(0, 3))
    for r, f in zip(ref, fast):
        assert_states_bitwise_equal(r, f)
    assert not bool(ref[0].grads_finite) and bool(ref[1].grads_finite)


@pytest.mark.parametrize(
    "loss_scale",
    [
        lambda: ff.DynamicLossScale(2.0**10, growth_interval=2),
        lambda: ff.StaticLossScale(3.0),
        lambda: ff.NoOpLossScale(),
    ],
    ids=["dynamic", "static", "noop"],
)
@pytest.mark.parametrize("donate", [False, True])
def test_bitwise_equal_for_every_loss_scale(loss_scale, donate):
    tx = ff.sgd(0.05, momentum=0.9, weight_decay=1e-3)
    ref = _run(tx, "reference", False, bad_steps=(2,), loss_scale=loss_scale())
    fast = _run(tx, "foreach", donate, bad_steps=(2,), loss_scale=loss_scale())
    for r, f in zip(ref, fast):
        assert_states_bitwise_equal(r, f)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("donate", [False, True])
def test_bitwise_equal_for_other_param_dtypes(dtype, donate):
    tx = ff.sgd(0.05, momentum=0.9)
    ref = _run(tx, "reference", False, bad_steps=(1,), dtype=dtype, scale=1.0)
    fast = _run(tx, "foreach", donate, bad_steps=(1,), dtype=dtype, scale=1.0)
    for r, f in zip(ref, fast):
        assert_states_bitwise_equal(r, f)


@given(
    seed=st.integers(0, 2**16),
    name=st.sampled_from(TX_NAMES),
    bad=st.sets(st.integers(0, STEPS - 1), max_size=3),
    scale=st.sampled_from([1.0, 2.0**10, 2.0**15]),
    donate=st.booleans(),
)
def test_bitwise_equal_random(seed, name, bad, scale, donate):
    tx = optimiser_matrix()[name]
    ref = _run(tx, "reference", False, seed=seed, bad_steps=bad, scale=scale)
    fast = _run(tx, "foreach", donate, seed=seed, bad_steps=bad, scale=scale)
    for r, f in zip(ref, fast):
        assert_states_bitwise_equal(r, f)


@pytest.mark.parametrize("name", TX_NAMES)
def test_pure_mode_modifies_no_input(name):
    tx = optimiser_matrix()[name]
    state = ff.fp16_init(random_tree(3), tx)
    state = ff.fp16_update(state, matrix_grads(state, 0, 3), impl="foreach")
    grads = matrix_grads(state, 1, 3)
    before = [x.clone() for x in tree_leaves((state, grads))]
    versions = [x._version for x in tree_leaves((state, grads))]
    new = ff.fp16_update(state, grads, impl="foreach")
    after = tree_leaves((state, grads))
    for b, a in zip(before, after):
        assert torch.equal(_bits(b), _bits(a))
    assert versions == [x._version for x in after]
    # And no output aliases an input tensor's memory (except 0-d state passed through).
    inputs = {x.data_ptr() for x in after if x.numel() > 1}
    for x in tree_leaves(new.master) + tree_leaves(new.params):
        if x.numel() > 1:
            assert x.data_ptr() not in inputs


def test_donation_writes_into_the_old_buffers():
    state = ff.fp16_init(random_tree(1), ff.sgd(0.05, momentum=0.9))
    state = ff.fp16_update(state, matrix_grads(state, 0, 1), impl="foreach")
    old_ptrs = [x.data_ptr() for x in tree_leaves((state.master, state.params, state.opt_state))]
    new = ff.fp16_update(state, matrix_grads(state, 1, 1), impl="foreach", donate=True)
    new_ptrs = [x.data_ptr() for x in tree_leaves((new.master, new.params, new.opt_state))]
    sizes = [x.numel() for x in tree_leaves((new.master, new.params, new.opt_state))]
    # master, FP16 params and momentum buffers are reused (0-d flags may be new).
    reused = [o == n for o, n, s in zip(old_ptrs, new_ptrs, sizes) if s > 1]
    assert reused and all(reused)


def test_donated_skip_leaves_the_buffers_bitwise_unchanged():
    state = ff.fp16_init(random_tree(2), ff.sgd(0.05, momentum=0.9, weight_decay=0.1))
    state = ff.fp16_update(state, matrix_grads(state, 0, 2), impl="foreach")
    snapshot = [x.clone() for x in tree_leaves((state.master, state.params, state.opt_state))]
    new = ff.fp16_update(
        state, matrix_grads(state, 1, 2, bad=math.nan), impl="foreach", donate=True
    )
    assert not bool(new.grads_finite)
    for s, x in zip(snapshot, tree_leaves((new.master, new.params, new.opt_state))):
        assert torch.equal(_bits(s), _bits(x))


def test_negative_zero_survives_a_skipped_step():
    params = {"w": torch.tensor([-0.0, 0.0, 1.0, -2.0])}
    for impl in IMPL_NAMES:
        for donate in (False, True):
            state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
            grads = {"w": torch.tensor([-0.0, math.inf, 0.0, 1.0], dtype=torch.float16)}
            new = ff.fp16_update(state, grads, impl=impl, donate=donate)
            assert torch.signbit(new.master["w"][0]) and torch.signbit(new.params["w"][0])


# -- grads_finite ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("value", [None, math.inf, -math.inf, math.nan])
def test_grads_finite_matches_isfinite(dtype, n, value):
    g = [torch.randn(n).to(dtype), torch.randn(()).to(dtype), torch.empty(0, dtype=dtype)]
    if value is not None:
        g[0][n // 2] = value
    inv = torch.tensor(1 / 1024.0)
    expected = all(bool(torch.isfinite(x.float() * inv).all()) for x in g)
    assert bool(fast_update.grads_finite(g, inv)) == expected
    assert bool(fast_update.grads_finite(g, None)) == (value is None)


def test_grads_finite_does_not_overflow_like_a_sum():
    # Finite FP32/BF16 values whose sum overflows are still finite.
    for dtype in (torch.float32, torch.bfloat16):
        g = [torch.full((8,), 3e38).to(dtype)]
        assert bool(fast_update.grads_finite(g, torch.tensor(1.0)))


def test_grads_finite_sees_overflow_caused_by_unscaling():
    inv = ff.unscale_factor(torch.tensor(2.0**-120))  # a tiny scale: inv = 2**120
    g = [torch.tensor([2.0**10, 1.0], dtype=torch.float16)]
    assert not bool(torch.isfinite(g[0].float() * inv).all())
    assert not bool(fast_update.grads_finite(g, inv))
    assert bool(fast_update.grads_finite([torch.tensor([1.0], dtype=torch.float16)], inv))


def test_grads_finite_of_nothing_is_true():
    assert bool(fast_update.grads_finite([], None))
    assert bool(fast_update.grads_finite([torch.empty(0)], torch.tensor(2.0)))


# -- states the kernels cannot take ------------------------------------------


def _error_of(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the type and text are what is compared
        return type(err), str(err)
    raise AssertionError("expected an error")


@pytest.mark.parametrize("impl", implementations(lambda i: not i.specification))
def test_an_unexpected_state_gets_exactly_the_reference_error(impl):
    # A state whose structure does not fit the declared chain is not fed to a
    # specialised kernel; the generic path then reports the mismatch exactly
    # as the reference does: same type, same message.
    tx = ff.sgd(0.1, momentum=0.9)
    state = ff.fp16_init(random_tree(0), tx)
    grads = matrix_grads(state, 0, 0)
    for bad_opt in [
        (ff.EmptyState(),),
        (
            ff.EmptyState(),
            ff.TraceState(trace={"x": torch.zeros(3)}, initialized=torch.tensor(False)),
            ff.EmptyState(),
        ),
    ]:
        bad = state.replace(opt_state=bad_opt)
        expected = _error_of(lambda: ff.fp16_update(bad, grads, impl="reference"))
        assert _error_of(lambda: ff.fp16_update(bad, grads, impl=impl)) == expected


_TUNE_MALLOC_PROBE = """
import ctypes, ctypes.util, torch
from functional_fp16 import allocator
from functional_fp16._util import finite as fast_update

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallinfo2.restype = MallInfo2

def mmapped(nbytes=64 << 20):
    # glibc's own account: is a live 64 MiB tensor a separate mmap (unmapped,
    # and page-faulted anew, on every free and reallocation) or heap memory?
    t = torch.empty(nbytes // 4)
    return libc.mallinfo2().hblkhd >= nbytes

before = mmapped()
ok = allocator.tune_malloc(1 << 28)
print(ok, before, mmapped())
"""


def test_tune_malloc_is_an_explicit_opt_in():
    import platform
    import subprocess
    import sys

    with pytest.raises(ValueError):
        allocator.tune_malloc(0)
    with pytest.raises(TypeError):
        allocator.tune_malloc(1.5)
    # Applied in a child process, so that this run's allocator stays as it was.
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt and mallinfo2 are glibc's")
    out = subprocess.run(
        [sys.executable, "-c", _TUNE_MALLOC_PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    # Before: glibc serves the block with its own mmap; after: from the heap,
    # where freed blocks are reused instead of being unmapped and faulted in again.
    assert out == ["True", "True", "False"], out
