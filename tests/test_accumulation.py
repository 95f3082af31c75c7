"""MultiSteps: gradient accumulation against a full-batch step, GradScaler, optax and a model.

The bounds, stated once:

* Micro-batch gradients whose mean is exact (dyadic values on a grid, see
  ``grid_window``): ``k`` micro-batches through ``MultiSteps`` are *bitwise*
  one full-batch ``fp16_update`` of the mean, for every implementation, with
  overflows injected: master, FP16 params, optimiser state, loss scale and its
  counters, skip decisions.
* Against ``torch.optim`` + ``GradScaler`` with accumulation (``scaler.scale(loss
  / k).backward()`` ``k`` times, then ``step``, ``update``, ``zero_grad``):
  decisions, scale, growth tracker and step counts bitwise. For a power-of-two
  ``k`` the accumulated gradients are the same numbers (scaling by powers of
  two commutes with rounding), so SGD's momentum is bitwise and the master
  within one rounding of ``-lr * b`` per applied step (``scaled_error <=
  applied``, as ``tests/test_update.py``); with ``k = 3`` torch divides each
  micro-batch by 3 and we divide the sum, a few ulps of the gradient
  (``scaled_error <= 2``) for the momentum. AdamW adds torch's rounding of its
  decay factor, as in ``tests/test_adam.py``.
* optax's ``MultiSteps`` under ``jax.jit`` (FP32, no loss scaling): counters
  bitwise, master within a few FP32 epsilons of its magnitude (optax keeps a
  running mean, we keep the sum and divide once).
"""

from __future__ import annotations

import math

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves
from tests.helpers import IMPL_NAMES, bits, no_host_sync, scaled_error

N = 257
LR = 0.01
WD = 1e-2
WINDOWS = 8
EPS32 = 2.0**-23


def sgd_momentum():
    return ff.sgd(LR, momentum=0.9)


def adamw():
    return ff.adamw(1e-3, weight_decay=WD)


TXS = {"sgd-momentum": sgd_momentum, "adamw": adamw}


def m0(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1


def same_bits(a, b) -> bool:
    la, lb = tree_leaves(a), tree_leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(la, lb)
    )


def grid_window(seed: int, k: int, scale: float, n: int = N):
    """``k`` FP16 micro-batch gradients (of the loss scaled by ``scale``) whose mean is exact.

    Element j of every gradient is an integer times ``2**e_j``: the full-batch
    value ``M * 2**e`` plus offsets that sum to zero, all below 2048 in
    magnitude (exact in FP16), so the FP32 sum is exact and so is its quotient
    by ``k``. Returns ``(micro, full)``, ``full`` the FP16 mean.
    """
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-10, 3, (n,), generator=g).double()
    mid = torch.randint(-1000, 1001, (n,), generator=g).double()
    offsets = torch.randint(-300, 301, (max(k - 1, 0), n), generator=g).double()
    offsets = torch.cat([offsets, -offsets.sum(0, keepdim=True)])
    unit = 2.0**e * (scale / 2.0**8)
    micro = [((mid + d) * unit).half() for d in offsets]
    full = (mid * unit).half()
    assert torch.equal(sum(x.double() for x in micro) / k, full.double())
    return micro, full


def dynamic_scale():
    return ff.DynamicLossScale(init_scale=2.0**10, growth_interval=2, max_scale=2.0**14)


# --------------------------------------------------------------------------
# k micro-batches == one full-batch step
# --------------------------------------------------------------------------
@pytest.mark.parametrize("make_tx", TXS.values(), ids=TXS.keys())
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_exact_micro_batches_are_bitwise_one_full_batch_step(impl, make_tx, k):
    full = ff.fp16_init({"w": m0()}, make_tx(), dynamic_scale())
    acc = ff.fp16_init({"w": m0()}, ff.MultiSteps(make_tx(), k), dynamic_scale())
    overflow = {2: math.inf, 5: math.nan}  # window -> value planted in one micro-batch
    for w in range(WINDOWS):
        s = float(full.loss_scale.loss_scale)
        assert s == float(acc.loss_scale.loss_scale)
        micro, g_full = grid_window(w, k, s)
        if w in overflow:
            g_full = g_full.clone()
            g_full[w] = overflow[w]
            bad = w % k
            micro[bad] = micro[bad].clone()
            micro[bad][w] = overflow[w]
        full = ff.fp16_update(full, {"w": g_full}, impl=impl)
        for i, g in enumerate(micro):
            acc = ff.fp16_update(acc, {"w": g}, impl=impl)
            if i < k - 1:  # the scale never moves inside a window
                assert float(acc.loss_scale.loss_scale) == s
        assert bool(acc.grads_finite) == bool(full.grads_finite) == (w not in overflow)
        assert same_bits(acc.master, full.master)
        assert same_bits(acc.params, full.params)
        assert same_bits(acc.opt_state.inner_opt_state, full.opt_state)
        assert same_bits(acc.loss_scale, full.loss_scale)
        assert int(acc.step) == k * int(full.step)
        assert int(acc.opt_state.mini_step) == 0
        assert not acc.opt_state.acc_grads["w"].any() and bool(acc.opt_state.acc_finite)
    assert int(acc.opt_state.gradient_step) == WINDOWS - len(overflow)
    assert acc.opt_state.acc_grads["w"].dtype == torch.float32


# --------------------------------------------------------------------------
# torch.optim + GradScaler with accumulation
# --------------------------------------------------------------------------
def random_window(seed: int, k: int, scale: float, inject=None):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(N, generator=g) * scale * 1e-3 * (1 + i)).half() for i in range(k)]
    if inject is not None:
        i, value = inject
        out[i][seed % N] = value
    return out


TORCH_OPTS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, foreach=False),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=WD, foreach=False),
}


@pytest.mark.parametrize("name", TXS.keys())
@pytest.mark.parametrize("k", [2, 3, 4])
def test_follows_gradscaler_with_accumulation(name, k):
    windows = 16
    init = m0(1)
    ls = ff.DynamicLossScale(init_scale=2.0**12, growth_interval=3, max_scale=math.inf)
    state = ff.fp16_init({"w": init.clone()}, ff.MultiSteps(TXS[name](), k), ls)
    param = torch.nn.Parameter(init.clone())
    opt = TORCH_OPTS[name]([param])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    rng = torch.Generator().manual_seed(7)
    applied = 0
    for w in range(windows):
        s = scaler.get_scale()
        inject = None
        if torch.rand((), generator=rng) < 0.25:
            inject = (int(torch.randint(k, (), generator=rng)), [math.inf, math.nan][w % 2])
        micro = random_window(w, k, s, inject)
        for g in micro:
            # The GradScaler loop: a loss whose gradient is the unscaled g, divided by k.
            unscaled = g.float() * ff.unscale_factor(torch.tensor(s))
            loss = (param * unscaled).sum() / k
            scaler.scale(loss).backward()
            state = ff.fp16_update(state, {"w": g})
        scaler.step(opt)
        found_inf = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
        scaler.update()
        opt.zero_grad(set_to_none=True)
        applied += not found_inf

        assert bool(state.grads_finite) == (not found_inf) == (inject is None)
        assert float(state.loss_scale.loss_scale) == scaler.get_scale()
        assert int(state.loss_scale.growth_count) == int(scaler._growth_tracker)
        assert int(state.opt_state.gradient_step) == applied
        assert int(state.step) == k * (w + 1)
    assert 0 < applied < windows
    inner = state.opt_state.inner_opt_state
    master = state.master["w"]
    if name == "sgd-momentum":
        trace = inner[1]
        buf = opt.state[param]["momentum_buffer"]
        if k & (k - 1) == 0:  # the same sums: momentum bitwise
            assert torch.equal(bits(trace.trace["w"]), bits(buf))
        else:
            assert scaled_error(trace.trace["w"], buf) <= 2.0
        assert scaled_error(master, param.detach()) <= applied
    else:
        assert int(inner[0].count) == applied == int(opt.state[param]["step"])
        factor_error = abs(float(torch.tensor(1.0 - 1e-3 * WD)) - (1.0 - 1e-3 * WD))
        bound = applied * (factor_error / EPS32 + 0.5)
        assert scaled_error(master, param.detach()) <= bound


# --------------------------------------------------------------------------
# optax's MultiSteps under jax.jit (FP32, no loss scaling)
# --------------------------------------------------------------------------
def test_matches_optax_multisteps_under_jit():
    np = pytest.importorskip("numpy")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    optax = pytest.importorskip("optax")

    lr, momentum = 0.05, 0.9
    init = m0(2)
    every_k = lambda step: 2 + step % 2  # windows of 2, 3, 2, 3, ... micro-batches
    ours = ff.fp16_init(
        {"w": init},
        ff.MultiSteps(ff.sgd(lr, momentum=momentum), every_k),
        ff.NoOpLossScale(),
        param_dtype=torch.float32,
    )
    alone = ff.MultiSteps(ff.sgd(lr, momentum=momentum), every_k)
    a_params = {"w": init.clone()}
    a_state = alone.init(a_params)

    tx = optax.MultiSteps(optax.sgd(lr, momentum=momentum), every_k_schedule=every_k)
    j_params = {"w": jnp.asarray(init.numpy())}
    j_state = tx.init(j_params)

    @jax.jit
    def j_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    g = torch.Generator().manual_seed(3)
    for _ in range(15):
        grad = torch.randn(N, generator=g)
        ours = ff.fp16_update(ours, {"w": grad})
        updates, a_state = alone.update({"w": grad}, a_state, a_params)
        a_params = ff.apply_updates(a_params, updates)
        j_params, j_state = j_step(j_params, j_state, {"w": jnp.asarray(grad.numpy())})
        theirs = torch.from_numpy(np.asarray(j_params["w"]).copy())
        for st_ in (ours.opt_state, a_state):
            assert int(st_.mini_step) == int(j_state.mini_step)
            assert int(st_.gradient_step) == int(j_state.gradient_step)
        assert scaled_error(ours.master["w"], theirs) <= 4.0
        assert scaled_error(a_params["w"], theirs) <= 4.0
        # Our accumulator holds the sum, optax's the running mean.
        n = int(j_state.mini_step)
        if n:
            mean = torch.from_numpy(np.asarray(j_state.acc_grads["w"]).copy())
            assert scaled_error(ours.opt_state.acc_grads["w"] / n, mean) <= 4.0
    assert int(ours.opt_state.gradient_step) == 6


# --------------------------------------------------------------------------
# Random overflow patterns against a pure-Python model
# --------------------------------------------------------------------------
UNIT = 2.0**-4  # every micro-batch's unscaled gradient: UNIT at its own position


class WindowScaleModel:
    """The documented rule: the scale moves once per window, by the window's finite flag."""

    def __init__(self, log2_scale: int, interval: int, lo: float, hi: float):
        self.scale, self.count = 2.0**log2_scale, 0
        self.interval, self.lo, self.hi = interval, lo, hi

    def close_window(self, finite: bool) -> None:
        if finite:
            self.count += 1
            if self.count >= self.interval:
                self.scale, self.count = min(self.scale * 2.0, self.hi), 0
        else:
            self.scale, self.count = max(self.scale / 2.0, self.lo), 0


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 5),
    windows=st.integers(1, 5),
    impl=st.sampled_from(IMPL_NAMES),
    use_grad_mean=st.booleans(),
    as_schedule=st.booleans(),
    interval=st.integers(1, 3),
    log2_scale=st.integers(0, 16),
    data=st.data(),
)
def test_random_overflows_skip_whole_windows_and_count_every_micro_batch_once(
    k, windows, impl, use_grad_mean, as_schedule, interval, log2_scale, data
):
    n = k * windows
    bad = data.draw(
        st.lists(
            st.one_of(st.none(), st.sampled_from([math.inf, -math.inf, math.nan])),
            min_size=n,
            max_size=n,
        ),
        label="overflow per micro-batch",
    )
    every_k = (lambda step: torch.full_like(step, k)) if as_schedule else k
    tx = ff.MultiSteps(ff.sgd(1.0), every_k, use_grad_mean=use_grad_mean)
    ls = ff.DynamicLossScale(2.0**log2_scale, growth_interval=interval, max_scale=2.0**16)
    state = ff.fp16_init({"w": torch.zeros(n), "b": torch.zeros(2)}, tx, ls)
    model = WindowScaleModel(log2_scale, interval, 1.0, 2.0**16)
    share = torch.tensor(UNIT) / k if use_grad_mean else torch.tensor(UNIT)
    expected = torch.zeros(n)  # the master: -share at each micro-batch of an applied window
    applied = 0
    for j in range(n):
        i = j % k
        if i == 0:
            at_start, window_ok = state, True
        s = float(state.loss_scale.loss_scale)
        assert s == model.scale  # one scale for the whole window
        w = torch.zeros(n, dtype=torch.float16)
        w[j] = s * UNIT
        b = torch.zeros(2, dtype=torch.float16)
        if bad[j] is not None:
            (w if j % 2 else b)[j % 2] = bad[j]
        window_ok = window_ok and bad[j] is None
        state = ff.fp16_update(state, {"w": w, "b": b}, impl=impl)

        ms = state.opt_state
        assert int(state.step) == j + 1
        assert int(ms.mini_step) == (i + 1) % k
        assert bool(state.grads_finite) == window_ok
        if i < k - 1:
            assert same_bits(state.loss_scale, at_start.loss_scale)
            assert same_bits(state.master, at_start.master)
            assert bool(ms.acc_finite) == window_ok
            if window_ok:  # the accumulator says exactly which micro-batches it holds
                held = torch.zeros(n)
                held[j - i : j + 1] = UNIT
                assert same_bits(ms.acc_grads, {"w": held, "b": torch.zeros(2)})
            continue
        # The window closed.
        model.close_window(window_ok)
        if window_ok:
            applied += 1
            expected[j - i : j + 1] = -share
        else:  # skipped as a whole: the state is the one the window started with
            assert same_bits(state.master, at_start.master)
            assert same_bits(state.params, at_start.params)
            assert same_bits(ms, at_start.opt_state)
        assert same_bits(state.master, {"w": expected, "b": torch.zeros(2)})
        assert same_bits(ms.acc_grads, {"w": torch.zeros(n), "b": torch.zeros(2)})
        assert bool(ms.acc_finite)
        assert int(ms.gradient_step) == applied
        assert float(state.loss_scale.loss_scale) == model.scale
        assert int(state.loss_scale.growth_count) == model.count


# --------------------------------------------------------------------------
# Semantics around the edges
# --------------------------------------------------------------------------
def test_a_non_finite_loss_in_one_micro_batch_skips_the_window():
    state = ff.fp16_init({"w": m0()}, ff.MultiSteps(sgd_momentum(), 3), dynamic_scale())
    start = state
    micro, _ = grid_window(0, 3, float(state.loss_scale.loss_scale))
    for i, g in enumerate(micro):
        loss = torch.tensor(math.nan if i == 1 else 0.5)
        state = ff.fp16_update(state, {"w": g}, loss=loss)
        assert bool(state.grads_finite) == (i == 0)
    assert same_bits((state.master, state.opt_state), (start.master, start.opt_state))
    assert float(state.loss_scale.loss_scale) == float(start.loss_scale.loss_scale) / 2


def test_the_window_size_follows_the_schedule_of_applied_windows():
    sizes = torch.tensor([1, 3, 2, 4], dtype=torch.int32)
    schedule = lambda step: torch.take(sizes, torch.clamp(step, max=3).long())
    state = ff.fp16_init({"w": m0()}, ff.MultiSteps(ff.sgd(LR), schedule), dynamic_scale())
    closed = []
    for j in range(12):
        g = torch.randn(N).half()
        if j == 1:  # the first 3-window overflows: it is repeated, with the same size
            g[0] = math.inf
        state = ff.fp16_update(state, {"w": g})
        if int(state.opt_state.mini_step) == 0:
            closed.append((j + 1, bool(state.grads_finite)))
    assert [end for end, _ in closed] == [1, 4, 7, 9]  # the 4-window is still open
    assert [ok for _, ok in closed] == [True, False, True, True]


def test_donated_updates_equal_pure_ones(impl):
    pure = ff.fp16_init({"w": m0()}, ff.MultiSteps(sgd_momentum(), 2), dynamic_scale())
    donated = ff.fp16_init({"w": m0()}, ff.MultiSteps(sgd_momentum(), 2), dynamic_scale())
    for w in range(4):
        for g in random_window(w, 2, 2.0**10, inject=(1, math.inf) if w == 2 else None):
            pure = ff.fp16_update(pure, {"w": g}, impl=impl)
            donated = ff.fp16_update(donated, {"w": g.clone()}, impl=impl, donate=True)
            assert same_bits(pure, donated)


def test_a_donated_accumulator_that_shares_memory_is_refused(impl):
    """A donated update sums into the accumulator in place: two of its leaves over one
    tensor would be summed twice, so the state is refused, naming them, and untouched."""
    params = {"a": m0(0, 8), "b": m0(1, 8)}
    state = ff.fp16_init(params, ff.MultiSteps(sgd_momentum(), 2), dynamic_scale())
    shared = torch.zeros(8)
    ms = state.opt_state
    state = state.replace(opt_state=ms._replace(acc_grads={"a": shared, "b": shared}))
    grads = {k: (torch.ones(8) * 64).half() for k in params}
    with pytest.raises(ValueError, match=r"acc_grads.*share memory"):
        ff.fp16_update(state, grads, impl=impl, donate=True)
    assert bool((shared == 0).all())
    ff.fp16_update(state, grads, impl=impl)  # pure: nothing is written in place


def test_never_synchronises_with_the_host(impl):
    state = ff.fp16_init({"w": m0()}, ff.MultiSteps(adamw(), 3), dynamic_scale())
    grads = random_window(0, 3, 2.0**10, inject=(1, math.nan)) + random_window(1, 3, 2.0**9)
    with no_host_sync():
        for g in grads:
            state = ff.fp16_update(state, {"w": g}, impl=impl, loss=torch.tensor(0.5))
    assert int(state.step) == 6 and int(state.opt_state.gradient_step) == 1


def test_update_path_names_the_inner_step():
    state = ff.fp16_init({"w": m0()}, ff.MultiSteps(sgd_momentum(), 2))
    assert ff.update_path(state) == ff.update_path(ff.fp16_init({"w": m0()}, sgd_momentum()))
    alone = ff.update_path(ff.fp16_init({"w": m0()}, adamw()))
    assert ff.update_path(ff.fp16_init({"w": m0()}, ff.MultiSteps(adamw(), 2))) == alone
    assert ff.update_path(state, "reference") == "reference"


def test_checkpoint_mid_window_resumes_bitwise(tmp_path):
    def fresh():
        return ff.fp16_init({"w": m0()}, ff.MultiSteps(adamw(), 3), dynamic_scale())

    grads = [g for w in range(3) for g in random_window(w, 3, 2.0**10)]
    state = fresh()
    for g in grads[:4]:  # one window applied, one micro-batch into the next
        state = ff.fp16_update(state, {"w": g})
    assert int(state.opt_state.mini_step) == 1 and state.opt_state.acc_grads["w"].any()
    ff.save_checkpoint(tmp_path / "acc.ckpt", state)
    resumed = ff.load_checkpoint(tmp_path / "acc.ckpt", fresh())
    assert isinstance(resumed.opt_state, ff.MultiStepsState)
    assert same_bits(resumed, state)
    for g in grads[4:]:
        state = ff.fp16_update(state, {"w": g})
        resumed = ff.fp16_update(resumed, {"w": g})
    assert same_bits(resumed, state)


def test_the_transform_alone_keeps_shapes_dtypes_and_an_fp32_accumulator():
    tx = ff.MultiSteps(ff.sgd(0.5), 2)
    params = {"a": torch.randn(3, 4).half(), "b": (torch.randn(5).half(),)}
    updates = {"a": torch.randn(3, 4).half(), "b": (torch.randn(5).half(),)}
    kept = [x.clone() for x in tree_leaves((params, updates))]
    state0 = tx.init(params)
    out, state = tx.update(updates, state0, params)
    assert same_bits(tree_leaves((params, updates)), kept)  # inputs untouched
    assert same_bits(state0, tx.init(params))  # the old state too

    def layout(tree):
        return optree.tree_structure(tree, namespace=ff.NAMESPACE), [
            (x.shape, x.dtype) for x in tree_leaves(tree)
        ]

    assert layout(out) == layout(updates) and layout(state) == layout(state0)
    assert not any(x.any() for x in tree_leaves(out))  # zeros until the window closes
    assert all(a.dtype == torch.float32 for a in tree_leaves(state.acc_grads))
    out, state = tx.update(updates, state, params)
    want = optree.tree_map(lambda u: u * -0.5, updates)  # sgd(0.5) of the mean (2u) / 2
    assert same_bits(out, want) and int(state.gradient_step) == 1


# --------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((ff.sgd(0.1), 0), {}, ValueError, "every_k_schedule must be >= 1"),
        ((ff.sgd(0.1), -3), {}, ValueError, "every_k_schedule must be >= 1"),
        ((ff.sgd(0.1), 2**31), {}, ValueError, "every_k_schedule must fit in int32"),
        ((ff.sgd(0.1), 2.0), {}, TypeError, "every_k_schedule must be an int >= 1 or a function"),
        ((ff.sgd(0.1), True), {}, TypeError, "every_k_schedule must be an int >= 1 or a function"),
        ((ff.sgd(0.1), "4"), {}, TypeError, "every_k_schedule must be an int >= 1 or a function"),
        ((ff.sgd(0.1), None), {}, TypeError, "every_k_schedule must be an int >= 1 or a function"),
        (("sgd", 2), {}, TypeError, "opt must be a GradientTransformation"),
        ((ff.sgd(0.1), 2), {"use_grad_mean": 1}, TypeError, "use_grad_mean must be a bool"),
    ],
)
def test_bad_configuration_is_named(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        ff.MultiSteps(*args, **kwargs)


def _state(tx):
    return ff.fp16_init({"w": m0(), "b": {"c": torch.zeros(3)}}, tx, dynamic_scale())


def _grads(state):
    return optree.tree_map(lambda p: torch.ones_like(p), state.params)


@pytest.mark.parametrize(
    "make_grads, error, match",
    [
        (lambda g: {"w": g["w"]}, ValueError, r"grads has a different tree structure"),
        (lambda g: {**g, "b": {"d": g["b"]["c"]}}, ValueError, r"grads\['b'\].*missing keys"),
        (lambda g: {**g, "w": g["w"][:5]}, ValueError, r"grads\['w'\]: shape \(5,\)"),
        (lambda g: {**g, "w": g["w"].float()}, TypeError, r"grads\['w'\]: dtype torch.float32"),
    ],
)
def test_bad_grads_are_named_and_the_state_is_untouched(make_grads, error, match):
    state = _state(ff.MultiSteps(sgd_momentum(), 3))
    state = ff.fp16_update(state, _grads(state))  # one micro-batch into the window
    keep = [x.clone() for x in tree_leaves(state)]
    with pytest.raises(error, match=match):
        ff.fp16_update(state, make_grads(_grads(state)))
    assert same_bits(tree_leaves(state), keep)


def test_bad_updates_to_the_transform_alone_are_named():
    tx = ff.MultiSteps(ff.sgd(0.1), 2)
    params = {"w": torch.zeros(4), "b": {"c": torch.zeros(3)}}
    state = tx.init(params)
    keep = [x.clone() for x in tree_leaves(state)]
    with pytest.raises(ValueError, match=r"updates\['b'\].*missing keys"):
        tx.update({"w": torch.ones(4), "b": {"x": torch.ones(3)}}, state, params)
    with pytest.raises(ValueError, match=r"updates\['w'\]: shape \(2,\).*acc_grads\['w'\]"):
        tx.update({"w": torch.ones(2), "b": {"c": torch.ones(3)}}, state, params)
    with pytest.raises(TypeError, match="must be a MultiStepsState"):
        tx.update(params, ff.sgd(0.1).init(params), params)
    assert same_bits(tree_leaves(state), keep)


@pytest.mark.parametrize(
    "schedule, error, match",
    [
        (lambda step: 0, ValueError, r"every_k_schedule\(gradient_step\) must be >= 1"),
        (lambda step: 2.5, TypeError, r"every_k_schedule\(gradient_step\) must return an int"),
        (lambda step: step > 0, TypeError, r"must return an int or a 0-d real tensor"),
        (lambda step: torch.ones(2), TypeError, r"must return an int or a 0-d real tensor"),
    ],
)
def test_bad_schedule_values_are_named_and_the_state_is_untouched(schedule, error, match):
    state = _state(ff.MultiSteps(ff.sgd(0.1), schedule))
    keep = [x.clone() for x in tree_leaves(state)]
    with pytest.raises(error, match=match):
        ff.fp16_update(state, _grads(state))
    assert same_bits(tree_leaves(state), keep)


@pytest.mark.parametrize(
    "make_tx, match",
    [
        (lambda: ff.chain(ff.clip_by_global_norm(1.0), ff.MultiSteps(ff.sgd(0.1), 2)), "outermost"),
        (lambda: ff.MultiSteps(ff.MultiSteps(ff.sgd(0.1), 2), 2), "MultiSteps inside MultiSteps"),
    ],
)
def test_a_nested_multisteps_is_refused_by_fp16_update(make_tx, match):
    state = _state(make_tx())
    keep = [x.clone() for x in tree_leaves(state)]
    with pytest.raises(ValueError, match=match):
        ff.fp16_update(state, _grads(state))
    assert same_bits(tree_leaves(state), keep)


def test_a_state_of_another_optimiser_is_refused():
    state = _state(ff.sgd(0.1)).replace(tx=ff.MultiSteps(ff.sgd(0.1), 2))
    with pytest.raises(
        ValueError, match=r"state\.opt_state: expected a MultiStepsState, got a tuple"
    ):
        ff.fp16_update(state, _grads(state))
