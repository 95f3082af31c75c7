"""fp16_update: semantics, purity and errors, for every registered implementation.

The reference implementation is the specification; each faster implementation
declared in ``functional_fp16.update.dispatch.IMPLEMENTATIONS`` runs the same tests
(the ``impl`` fixture: the matrix of ``tests/helpers.py``).
"""

import math
from collections import Counter
from typing import NamedTuple

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._util.tree import NAMESPACE, format_path, tree_leaves
from functional_fp16.update.dispatch import IMPLEMENTATIONS
from tests._bad_inputs import FUZZ, Pair, base_params, good_grads, trained
from tests.helpers import (
    IMPL_NAMES,
    IMPLEMENTATION_MATRIX,
    IMPLEMENTATION_PROPERTIES,
    assert_bitwise_unchanged,
    bit_snapshot,
    no_host_sync,
    random_tree,
    scaled_error,
)
from tests.helpers import (
    bits as bit_pattern,
)

NS = ff.NAMESPACE


def test_the_implementation_matrix_is_the_librarys_declaration():
    """A new ``impl`` value runs every matrix test only once its properties are declared."""
    names = sorted(i.name for i in IMPLEMENTATION_MATRIX)
    undeclared = sorted(set(IMPLEMENTATIONS) - set(IMPLEMENTATION_PROPERTIES))
    assert not undeclared, f"declare {undeclared} in tests/helpers.py's implementation matrix"
    assert names == sorted(IMPLEMENTATIONS) == sorted(IMPLEMENTATION_PROPERTIES), (
        names,
        IMPLEMENTATIONS,
    )
    assert list(IMPL_NAMES) == names and all(
        i.name == key for key, i in IMPLEMENTATION_PROPERTIES.items()
    )
    assert sum(i.default for i in IMPLEMENTATION_MATRIX) == 1
    assert sum(i.specification for i in IMPLEMENTATION_MATRIX) == 1


@pytest.fixture(params=[False, True], ids=["pure", "donated"])
def donate(request):
    return request.param


def leaves(tree):
    return optree.tree_leaves(tree, namespace=NS)


def snapshot(tree):
    return [x.clone() for x in leaves(tree)]


def bits(x):
    x = x.detach().reshape(-1).contiguous()
    return x.view(torch.uint8) if x.dtype != torch.bool else x


def assert_leaves_equal(tree, snap):
    """Bit patterns equal: -0.0 is not +0.0, and NaNs must keep their payload."""
    now = leaves(tree)
    assert len(now) == len(snap)
    for a, b in zip(now, snap):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(bits(a), bits(b))


def fp16_grads(params16, seed, scale=1.0, inject=None):
    """Random FP16 gradients of a scaled loss; ``inject=(leaf_index, value)`` plants inf/NaN."""
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(p.shape, generator=g) * scale).half() for p in leaves(params16)]
    if inject is not None:
        i, value = inject
        out[i] = out[i].clone()
        out[i].view(-1)[0] = value
    return optree.tree_unflatten(optree.tree_structure(params16, namespace=NS), out)


def update(state, grads, impl, donate=False, **kw):
    return ff.fp16_update(state, grads, impl=impl, donate=donate, **kw)


# --------------------------------------------------------------------------
# Differential test against torch.amp.GradScaler + torch.optim.SGD
# --------------------------------------------------------------------------
SGD_CONFIGS = [
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, weight_decay=5e-4),
    dict(momentum=0.0),
]


@pytest.mark.parametrize(
    "cfg", SGD_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
@pytest.mark.parametrize("interval", [1, 3])
def test_matches_gradscaler_and_torch_sgd(impl, cfg, interval):
    lr, steps = 0.01, 40
    params = random_tree(0)
    ls = ff.DynamicLossScale(
        init_scale=2.0**12, growth_interval=interval, min_scale=2.0**-60, max_scale=math.inf
    )
    state = ff.fp16_init(params, ff.sgd(lr, **cfg), ls)

    # PyTorch's AMP recipe on FP32 copies of the same master weights.
    flat = [m.clone().requires_grad_(True) for m in leaves(state.master)]
    opt = torch.optim.SGD(flat, lr=lr, foreach=False, **cfg)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=interval)
    scaler.scale(torch.ones(()))  # GradScaler creates its scale lazily

    g = torch.Generator().manual_seed(123)
    applied = 0
    worst = 0.0
    for step in range(steps):
        inject = None
        if torch.rand((), generator=g) < 0.25:
            leaf = int(torch.randint(len(flat), (), generator=g))
            inject = (leaf, [math.inf, -math.inf, math.nan][step % 3])
        grads = fp16_grads(
            state.params, seed=step, scale=float(state.loss_scale.loss_scale) * 1e-3, inject=inject
        )

        for p, gr in zip(flat, leaves(grads)):
            p.grad = gr.float()
        scaler.unscale_(opt)
        ours_unscaled = state.loss_scale.unscale(grads)
        for p, u in zip(flat, leaves(ours_unscaled)):
            # Bitwise, NaN positions included (a NaN's payload may differ).
            nan = torch.isnan(p.grad)
            assert torch.equal(nan, torch.isnan(u))
            assert torch.equal(bit_pattern(p.grad)[~nan], bit_pattern(u)[~nan])
        scaler.step(opt)
        found_inf = sum(v.item() for v in scaler._found_inf_per_device(opt).values()) > 0
        scaler.update()

        state = update(state, grads, impl)
        # Overflow comes from the planted values or, at high scales, from the FP16 cast itself.
        expect_finite = all(bool(torch.isfinite(x).all()) for x in leaves(grads))
        assert bool(state.grads_finite) == (not found_inf) == expect_finite
        assert float(state.loss_scale.loss_scale) == scaler.get_scale()
        assert int(state.loss_scale.growth_count) == int(scaler._growth_tracker)
        applied += int(not found_inf)

        for m, p16, p in zip(leaves(state.master), leaves(state.params), flat):
            assert torch.equal(p16, m.half())  # FP16 params are the rounded master
            worst = max(worst, scaled_error(m, p.detach()))
        # Each applied step may differ by one rounding of -lr*b (PyTorch fuses it).
        assert worst <= max(applied, 1), f"step {step}: {worst} eps after {applied} steps"
        if cfg["momentum"] and not cfg.get("weight_decay"):
            trace = next(s for s in state.opt_state if isinstance(s, ff.TraceState))
            for b, p in zip(leaves(trace.trace), flat):
                if "momentum_buffer" in opt.state[p]:
                    assert torch.equal(b, opt.state[p]["momentum_buffer"])
                else:
                    assert not bool(trace.initialized) and not b.any()
    assert 0 < applied < steps


# --------------------------------------------------------------------------
# Skipped steps
# --------------------------------------------------------------------------
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_skipped_step_is_a_bitwise_noop(impl, donate, value):
    params = random_tree(1)
    tx = ff.chain(
        ff.clip_by_global_norm(5.0),
        ff.sgd(ff.cosine_decay_schedule(0.1, 50), momentum=0.9, weight_decay=1e-4),
    )
    state = ff.fp16_init(params, tx)
    for s in range(3):
        state = update(state, fp16_grads(state.params, seed=s, scale=100.0), impl)
    # Signed zeros in the master, working copy and momentum: a select or an
    # arithmetic no-op (x + 0, x * 1 - 0) could turn them into +0.0.
    master = {**state.master, "scalar": torch.tensor(-0.0)}
    params16 = {**state.params, "scalar": torch.tensor(-0.0, dtype=torch.float16)}
    trace = state.opt_state[1][1]
    trace = trace._replace(trace={**trace.trace, "scalar": torch.tensor(-0.0)})
    opt_state = (state.opt_state[0], (*state.opt_state[1][:1], trace, *state.opt_state[1][2:]))
    state = state.replace(master=master, params=params16, opt_state=opt_state)
    keep = snapshot((state.params, state.master, state.opt_state))
    scale = float(state.loss_scale.loss_scale)
    bad = fp16_grads(state.params, seed=9, scale=100.0, inject=(4, value))
    new = update(state, bad, impl, donate=donate)
    assert not bool(new.grads_finite)
    assert_leaves_equal((new.params, new.master, new.opt_state), keep)
    assert torch.signbit(new.master["scalar"]) and torch.signbit(
        new.opt_state[1][1].trace["scalar"]
    )
    assert float(new.loss_scale.loss_scale) == scale / 2
    assert int(new.step) == 4
    # Training continues normally afterwards.
    after = update(new, fp16_grads(new.params, seed=10, scale=100.0), impl)
    assert bool(after.grads_finite)
    assert not torch.equal(after.master["block"].weight, new.master["block"].weight)


def test_first_step_overflow_creates_no_momentum(impl, donate):
    params = random_tree(2)
    state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9, dampening=0.5))
    bad = fp16_grads(state.params, seed=0, inject=(0, math.inf))
    state = update(state, bad, impl, donate=donate)
    trace = state.opt_state[1]
    assert not bool(trace.initialized)
    assert all(not b.any() for b in leaves(trace.trace))
    # The next finite step then starts the buffer from the (unscaled) gradient itself.
    good = fp16_grads(state.params, seed=1)
    expected = state.loss_scale.unscale(good)
    state = update(state, good, impl)
    for b, e in zip(leaves(state.opt_state[1].trace), leaves(expected)):
        assert torch.equal(b, e)


def test_non_finite_loss_skips_the_step(impl):
    state = ff.fp16_init(random_tree(0), ff.sgd(0.1, momentum=0.9))
    keep = snapshot((state.master, state.opt_state))
    grads = fp16_grads(state.params, seed=0)
    new = update(state, grads, impl, loss=torch.tensor(math.nan))
    assert not bool(new.grads_finite)
    assert_leaves_equal((new.master, new.opt_state), keep)
    ok = update(state, grads, impl, loss=torch.tensor(1.0))
    assert bool(ok.grads_finite)


def test_grads_that_overflow_when_unscaled_are_skipped(impl):
    """A scale below one can turn finite FP16 grads into FP32 inf: that is an overflow too."""
    params = {"w": torch.zeros(4)}
    ls = ff.StaticLossScale(1e-36)
    state = ff.fp16_init(params, ff.sgd(0.1), ls)
    grads = {"w": torch.full((4,), 60000.0, dtype=torch.float16)}
    new = update(state, grads, impl)
    assert not bool(new.grads_finite)
    assert torch.equal(new.master["w"], state.master["w"])


# --------------------------------------------------------------------------
# Precision semantics
# --------------------------------------------------------------------------
def test_clipping_and_weight_decay_see_unscaled_fp32(impl):
    n = 64
    params = {"w": torch.linspace(-1, 1, n)}
    scale = 2.0**16
    tx = ff.chain(
        ff.add_decayed_weights(0.5), ff.clip_by_global_norm(0.1), ff.scale_by_learning_rate(1.0)
    )
    state = ff.fp16_init(params, tx, ff.StaticLossScale(scale))
    # Scaled FP16 grads of 1000: squaring them in FP16 would overflow (> 65504).
    grads = {"w": torch.full((n,), 1000.0, dtype=torch.float16)}
    new = update(state, grads, impl)
    assert bool(new.grads_finite)
    m = state.master["w"].double()
    g = torch.full((n,), 1000.0, dtype=torch.float64) / scale + 0.5 * m
    g = g * min(1.0, 0.1 / float(g.norm()))
    expected = (m - g).float()
    torch.testing.assert_close(new.master["w"], expected, rtol=2e-6, atol=2e-7)
    assert float((new.master["w"] - state.master["w"]).double().norm()) == pytest.approx(
        0.1, rel=1e-5
    )


def test_params_are_round_to_nearest_of_master(impl):
    params = {"w": torch.tensor([1.0, 1.0 + 2**-11, 1.0 + 3 * 2**-12, 65519.0, 70000.0, 1e-8])}
    with pytest.warns(UserWarning, match=r"params\['w'\]: values up to 70000 overflow"):
        state = ff.fp16_init(params, ff.sgd(0.0))
    assert torch.equal(state.master["w"], params["w"])
    assert torch.equal(state.params["w"], params["w"].half())
    state = update(state, {"w": torch.zeros(6, dtype=torch.float16)}, impl)
    assert torch.equal(state.params["w"], state.master["w"].to(torch.float16))


# --------------------------------------------------------------------------
# Purity and host synchronisation
# --------------------------------------------------------------------------
def test_inputs_are_never_modified(impl):
    state = ff.fp16_init(random_tree(3), ff.sgd(0.05, momentum=0.9, nesterov=True))
    for s in range(6):
        inject = (2, math.inf) if s == 3 else None
        grads = fp16_grads(state.params, seed=s, scale=10.0, inject=inject)
        before = snapshot((state, grads))
        new = update(state, grads, impl)
        assert_leaves_equal((state, grads), before)
        state = new


@pytest.mark.parametrize(
    "tx",
    [
        ff.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
        ff.chain(
            ff.clip_by_global_norm(1.0),
            ff.sgd(ff.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10), momentum=0.9, dampening=0.1),
        ),
        ff.apply_if_finite(ff.sgd(0.1, momentum=0.9), 3),
    ],
    ids=["sgd", "clip+schedule", "apply_if_finite"],
)
def test_update_never_synchronises_with_the_host(impl, donate, tx):
    ls = ff.DynamicLossScale(growth_interval=2, hysteresis=2)
    state = ff.fp16_init(random_tree(4), tx, ls)
    grads = [
        fp16_grads(state.params, seed=s, inject=(1, math.nan) if s == 1 else None) for s in range(4)
    ]
    with no_host_sync():
        for g in grads:
            state = update(state, g, impl, donate=donate, loss=torch.tensor(0.5))
    assert int(state.step) == 4


# --------------------------------------------------------------------------
# State container
# --------------------------------------------------------------------------
def test_init_copies_and_casts():
    params = random_tree(5, dtype=torch.float32)
    state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
    for p, m, h in zip(leaves(params), leaves(state.master), leaves(state.params)):
        assert m.dtype == torch.float32 and h.dtype == torch.float16
        assert torch.equal(m, p) and m.data_ptr() != p.data_ptr()
        assert torch.equal(h, p.half())
    assert isinstance(state.loss_scale, ff.DynamicLossScale)
    assert state.step.dtype == torch.int32 and int(state.step) == 0
    assert state.grads_finite.dtype == torch.bool and bool(state.grads_finite)
    # FP16 or BF16 inputs give an exact FP32 master.
    p16 = {"w": torch.randn(5).half()}
    s16 = ff.fp16_init(p16, ff.sgd(0.1))
    assert torch.equal(s16.master["w"], p16["w"].float())
    sbf = ff.fp16_init(p16, ff.sgd(0.1), param_dtype=torch.bfloat16)
    assert isinstance(sbf.loss_scale, ff.NoOpLossScale) and sbf.params["w"].dtype == torch.bfloat16


def test_state_flattens_to_tensors_and_rebuilds_with_its_tx():
    tx = ff.sgd(0.1, momentum=0.9)
    state = ff.fp16_init(random_tree(0), tx, ff.DynamicLossScale(growth_interval=5))
    flat, spec = optree.tree_flatten(state, namespace=NS)
    assert all(isinstance(x, torch.Tensor) for x in flat)
    back = optree.tree_unflatten(spec, flat)
    assert isinstance(back, ff.FP16State) and back.tx is tx
    assert back.loss_scale.config() == state.loss_scale.config()
    paths = [p for p in optree.tree_paths(state, namespace=NS)]
    assert ("master", "block", "weight") in paths or ("master", "block", 0) in paths


@pytest.mark.parametrize(
    "make_grads, error, match",
    [
        (lambda p: {k: v for k, v in p.items() if k != "scalar"}, ValueError, "tree structure"),
        (
            lambda p: {**p, "scalar": p["scalar"].reshape(1)},
            ValueError,
            r"grads\['scalar'\]: shape \(1,\)",
        ),
        (
            lambda p: {**p, "vecs": (p["vecs"][0].float(),) + p["vecs"][1:]},
            TypeError,
            r"grads\['vecs'\]\[0\]: dtype torch.float32",
        ),
        (
            lambda p: {**p, "block": p["block"]._replace(bias=p["block"].bias.to("meta"))},
            ValueError,
            r"grads\['block'\]\.bias: device meta",
        ),
        (lambda p: {**p, "scalar": 1.0}, TypeError, r"grads\['scalar'\]: expected a tensor"),
        (
            lambda p: {**p, "block": p["block"]._replace(weight=p["block"].weight.to_sparse())},
            TypeError,
            r"grads\['block'\]\.weight: layout torch.sparse_coo",
        ),
        (lambda p: [p], ValueError, "tree structure"),
    ],
    ids=["structure", "shape", "dtype", "device", "not-a-tensor", "sparse", "wrapped"],
)
def test_bad_grads_are_named_and_state_is_untouched(impl, make_grads, error, match):
    state = ff.fp16_init(random_tree(0), ff.sgd(0.1, momentum=0.9))
    state = update(state, fp16_grads(state.params, seed=0), impl)
    keep = snapshot(state)
    grads = make_grads(fp16_grads(state.params, seed=1))
    with pytest.raises(error, match=match):
        update(state, grads, impl)
    assert_leaves_equal(state, keep)


def test_bad_update_arguments():
    state = ff.fp16_init({"w": torch.zeros(2)}, ff.sgd(0.1))
    grads = {"w": torch.zeros(2, dtype=torch.float16)}
    with pytest.raises(TypeError, match="state must be an FP16State"):
        ff.fp16_update({"w": torch.zeros(2)}, grads)
    with pytest.raises(ValueError, match="impl must be"):
        ff.fp16_update(state, grads, impl="nope")
    with pytest.raises(TypeError, match="loss must be a tensor"):
        ff.fp16_update(state, grads, loss=1.0)


@pytest.mark.parametrize(
    "params, error, match",
    [
        ({}, ValueError, "empty"),
        (
            {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.int64)},
            TypeError,
            r"params\['b'\]: expected a floating-point tensor",
        ),
        ({"a": torch.zeros(2), "b": [1.0]}, TypeError, r"params\['b'\]\[0\]"),
        (
            {"a": torch.zeros(2), "b": torch.zeros(2, device="meta")},
            ValueError,
            r"params\['b'\]: on meta",
        ),
    ],
    ids=["empty", "int", "float", "two-devices"],
)
def test_bad_params_are_named(params, error, match):
    with pytest.raises(error, match=match):
        ff.fp16_init(params, ff.sgd(0.1))


def test_bad_init_arguments():
    with pytest.raises(TypeError, match="tx must be a GradientTransformation"):
        ff.fp16_init({"w": torch.zeros(2)}, lambda g: g)
    with pytest.raises(TypeError, match="loss_scale must be"):
        ff.fp16_init({"w": torch.zeros(2)}, ff.sgd(0.1), loss_scale=2.0**16)
    with pytest.raises(TypeError, match="param_dtype"):
        ff.fp16_init({"w": torch.zeros(2)}, ff.sgd(0.1), param_dtype=torch.int8)


# --------------------------------------------------------------------------
# Edges found in review: aliasing state, autograd history, the agree hook
# --------------------------------------------------------------------------
class _Prev(NamedTuple):
    prev: dict


def _remember_params() -> ff.GradientTransformation:
    """A transform whose state is the params it was called with, kept without a copy."""

    def init(params):
        return _Prev(prev={k: v.clone() for k, v in params.items()})

    def update(updates, state, params=None):
        return updates, _Prev(prev=params)

    return ff.GradientTransformation(init, update)


def test_donation_keeps_state_that_aliases_the_old_master(impl, donate):
    tx = ff.chain(_remember_params(), ff.sgd(0.5))
    state = ff.fp16_init({"w": torch.ones(3)}, tx, ff.NoOpLossScale())
    new = update(state, {"w": torch.ones(3, dtype=torch.float16)}, impl, donate=donate)
    assert torch.equal(new.master["w"], torch.full((3,), 0.5))
    # The transform saw the master before the step: 1.0, whatever the memory reuse.
    assert torch.equal(new.opt_state[0].prev["w"], torch.ones(3))


def test_grads_with_autograd_history_are_taken_as_values(impl, donate):
    state = ff.fp16_init(random_tree(0), ff.sgd(0.1, momentum=0.9))
    plain = fp16_grads(state.params, seed=3)
    tracked = optree.tree_map(lambda g: g.float().requires_grad_() * 1.0, plain, namespace=NS)
    tracked = optree.tree_map(lambda g: g.half(), tracked, namespace=NS)
    assert all(g.requires_grad for g in leaves(tracked))
    expected = update(state, plain, impl)
    new = update(state, tracked, impl, donate=donate)
    for a, b in zip(leaves(new), leaves(expected)):
        assert not a.requires_grad
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "agree",
    [
        lambda f: f.to(torch.uint8),
        lambda f: f.reshape(1),
        lambda f: True,
    ],
    ids=["uint8", "shape-1", "python-bool"],
)
def test_agree_must_return_a_flag_and_leaves_the_state_untouched(impl, donate, agree):
    state = ff.fp16_init(random_tree(0), ff.sgd(0.1, momentum=0.9))
    state = update(state, fp16_grads(state.params, seed=0), impl)
    keep = snapshot(state)
    with pytest.raises(TypeError, match="agree must return a 0-d bool tensor"):
        update(state, fp16_grads(state.params, seed=1), impl, donate=donate, agree=agree)
    assert_leaves_equal(state, keep)


def _bits(tree):
    return [x.view(torch.int32) if x.dtype == torch.float32 else x for x in leaves(tree)]


@pytest.mark.parametrize(
    "tx",
    [
        ff.sgd(0.1, weight_decay=0.5),
        ff.sgd(0.1, momentum=0.9, weight_decay=0.5),
        ff.sgd(0.1, momentum=0.5, nesterov=True, weight_decay=0.5),
    ],
    ids=["wd", "wd+momentum", "wd+nesterov"],
)
def test_exact_cancellations_keep_the_reference_signed_zeros(impl, tx):
    """u + wd*m == 0 exactly (and -0.0 masters): every implementation keeps the same bits."""
    master = torch.tensor([-0.0, -0.0, 0.0, 2.0, -2.0, 1.0])
    grads = {"w": torch.tensor([0.0, -0.0, -0.0, -1.0, 1.0, 0.25], dtype=torch.float16)}
    ref = ff.fp16_init({"w": master}, tx, ff.NoOpLossScale())
    ours = ref
    for _ in range(3):
        ref = update(ref, grads, "reference")
        ours = update(ours, grads, impl)
        for a, b in zip(_bits(ours), _bits(ref)):
            assert torch.equal(a, b)


# --------------------------------------------------------------------------
# Bad input (moved from test_bad_inputs.py): a specific error naming the leaf
# or argument, and the given state bitwise unchanged. Fixed tables cover each
# kind of mistake once; hypothesis then fuzzes random trees with random defects.
# --------------------------------------------------------------------------
M = torch.zeros(2, device="meta")

INIT_CASES = [
    ({}, ValueError, "params is an empty tree"),
    ([], ValueError, "params is an empty tree"),
    ({"a": None, "b": ()}, ValueError, "params is an empty tree"),
    (
        {"w": torch.ones(2), "lr": 0.1},
        TypeError,
        r"params\['lr'\]: expected a floating-point tensor, got float",
    ),
    (
        {"w": torch.ones(2), "n": "x"},
        TypeError,
        r"params\['n'\]: expected a floating-point tensor, got str",
    ),
    (
        {"w": torch.ones(2), "i": torch.ones(2, dtype=torch.int32)},
        TypeError,
        r"params\['i'\]: expected a floating-point",
    ),
    (
        {"w": torch.ones(2), "m": torch.ones(2, dtype=torch.bool)},
        TypeError,
        r"params\['m'\]: expected a floating-point",
    ),
    (
        {"w": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)},
        TypeError,
        r"params\['c'\]: expected a floating-point",
    ),
    (
        {"w": torch.ones(2), "x": M},
        ValueError,
        r"params\['x'\]: on meta, but params\['w'\] is on cpu",
    ),
    ({"w": torch.tensor([1.0, math.nan])}, ValueError, r"params\['w'\]: contains inf or NaN"),
    (
        {"w": Pair(torch.ones(1), torch.tensor(-math.inf))},
        ValueError,
        r"params\['w'\]\.bias: contains inf or NaN",
    ),
    ({"s": torch.eye(2).to_sparse()}, TypeError, r"params\['s'\]: expected a dense tensor"),
]


@pytest.mark.parametrize("params, error, match", INIT_CASES)
def test_fp16_init_rejects_bad_params(params, error, match):
    with pytest.raises(error, match=match):
        ff.fp16_init(params, ff.sgd(0.1))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tx": "sgd"}, TypeError, "tx must be a GradientTransformation"),
        (
            {"tx": (lambda p: p, lambda u, s, p: (u, s))},
            TypeError,
            "tx must be a GradientTransformation",
        ),
        ({"loss_scale": 128.0}, TypeError, "loss_scale must be a DynamicLossScale"),
        ({"param_dtype": torch.int8}, TypeError, "param_dtype must be a floating torch.dtype"),
        ({"param_dtype": "float16"}, TypeError, "param_dtype must be a floating torch.dtype"),
    ],
)
def test_fp16_init_rejects_bad_arguments(kwargs, error, match):
    args = {"tx": ff.sgd(0.1), **kwargs}
    with pytest.raises(error, match=match):
        ff.fp16_init(base_params(), args.pop("tx"), **args)


def test_zero_dimensional_and_empty_leaves_are_valid():
    params = {
        "a": torch.tensor(1.0),
        "b": (torch.tensor(-2.0),),
        "none": None,
        "empty": torch.zeros(0),
    }
    state = ff.fp16_init(params, ff.sgd(0.5, momentum=0.9), ff.StaticLossScale(4.0))
    grads = {
        "a": torch.tensor(1.0).half(),
        "b": (torch.tensor(2.0).half(),),
        "none": None,
        "empty": torch.zeros(0).half(),
    }
    scale = float(state.loss_scale.loss_scale)
    grads = optree.tree_map(lambda g: g * scale, grads, namespace=NAMESPACE)
    new = ff.fp16_update(state, grads)
    assert bool(new.grads_finite)
    assert float(new.master["a"]) == 0.5 and float(new.master["b"][0]) == -3.0
    assert new.master["empty"].shape == (0,)


def _with(tree, **changes):
    return {**tree, **changes}


UPDATE_CASES = [
    (
        "missing key",
        lambda g: {k: v for k, v in g.items() if k != "scalar"},
        ValueError,
        r"missing keys \['scalar'\]",
    ),
    (
        "extra key",
        lambda g: _with(g, extra=torch.zeros(1)),
        ValueError,
        r"unexpected keys \['extra'\]",
    ),
    (
        "namedtuple as tuple",
        lambda g: _with(g, pair=tuple(g["pair"])),
        ValueError,
        r"at grads\['pair'\] \(expected a Pair, got a tuple\)",
    ),
    (
        "list as tuple",
        lambda g: _with(g, stack=tuple(g["stack"])),
        ValueError,
        r"at grads\['stack'\] \(expected a list, got a tuple\)",
    ),
    (
        "short list",
        lambda g: _with(g, stack=g["stack"][:1]),
        ValueError,
        r"at grads\['stack'\] \(expected length 2, got 1\)",
    ),
    (
        "shape",
        lambda g: _with(g, pair=Pair(torch.zeros(3, 2).half(), g["pair"].bias)),
        ValueError,
        r"grads\['pair'\]\.kernel: shape \(3, 2\) does not match",
    ),
    (
        "0-d vs 1-d",
        lambda g: _with(g, scalar=torch.zeros(1).half()),
        ValueError,
        r"grads\['scalar'\]: shape \(1,\) does not match params\['scalar'\] shape \(\)",
    ),
    (
        "dtype",
        lambda g: _with(g, scalar=torch.tensor(0.0)),
        TypeError,
        r"grads\['scalar'\]: dtype torch.float32 does not match",
    ),
    (
        "int dtype",
        lambda g: _with(g, scalar=torch.tensor(0, dtype=torch.int16)),
        TypeError,
        r"grads\['scalar'\]: dtype torch.int16",
    ),
    (
        "device",
        lambda g: _with(g, scalar=torch.zeros((), dtype=torch.float16, device="meta")),
        ValueError,
        r"grads\['scalar'\]: device meta does not match",
    ),
    (
        "None leaf",
        lambda g: _with(g, scalar=None),
        TypeError,
        r"grads\['scalar'\]: expected a tensor, got NoneType",
    ),
    (
        "float leaf",
        lambda g: _with(g, scalar=0.5),
        TypeError,
        r"grads\['scalar'\]: expected a tensor, got float",
    ),
    (
        "subtree for leaf",
        lambda g: _with(g, scalar={"x": torch.zeros(())}),
        TypeError,
        r"grads\['scalar'\]: expected a tensor, got dict",
    ),
    (
        "deep None",
        lambda g: _with(g, stack=[g["stack"][0], (None,)]),
        TypeError,
        r"grads\['stack'\]\[1\]\[0\]: expected a tensor",
    ),
    ("not a tree", lambda g: "grads", ValueError, r"different tree structure"),
    ("empty", lambda g: {}, ValueError, r"missing keys"),
]


@pytest.mark.parametrize(
    "name, mutate, error, match", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES]
)
def test_fp16_update_rejects_bad_grads_and_leaves_state_unchanged(name, mutate, error, match):
    state = trained()
    before = bit_snapshot(state)
    with pytest.raises(error, match=match):
        ff.fp16_update(state, mutate(good_grads(state)))
    assert_bitwise_unchanged(state, before)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"loss": 1.0}, TypeError, "loss must be a tensor or None"),
        ({"impl": "fastest"}, ValueError, "impl must be 'auto' or one of"),
        ({"agree": 3}, TypeError, "agree must be a callable or None"),
        ({"donate": "yes"}, TypeError, "donate must be a bool"),
    ],
)
def test_fp16_update_rejects_bad_arguments(kwargs, error, match):
    state = trained()
    before = bit_snapshot(state)
    with pytest.raises(error, match=match):
        ff.fp16_update(state, good_grads(state), **kwargs)
    assert_bitwise_unchanged(state, before)


def test_fp16_update_rejects_a_non_state():
    state = trained()
    with pytest.raises(TypeError, match="state must be an FP16State, got dict"):
        ff.fp16_update({"params": state.params}, good_grads(state))


# Fuzzing: random trees with random defects (wrong structure, shape, dtype,
# device, None or non-tensor leaves). Run with ``-s`` to see the case counts.

shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


def _is_shape(node) -> bool:
    return (
        isinstance(node, tuple)
        and not isinstance(node, Pair)
        and all(isinstance(d, int) for d in node)
    )


def _trees():
    def extend(children):
        keys = st.text("abcxyz", min_size=1, max_size=3)
        return st.one_of(
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.tuples(children, children).map(lambda kv: Pair(*kv)),
        )

    # The root must be a container: a bare shape is a single tensor, not a tree.
    return st.recursive(shapes, extend, max_leaves=6).filter(lambda t: not _is_shape(t))


def _materialise(spec, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def build(node):
        if _is_shape(node):
            return torch.randn(node, generator=gen)
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, Pair):
            return Pair(build(node.kernel), build(node.bias))
        return type(node)(build(v) for v in node)

    return build(spec)


def replace_at(tree, entries, fn):
    if not entries:
        return fn(tree)
    e, rest = entries[0], entries[1:]
    if isinstance(tree, dict):
        new = dict(tree)
        new[e] = replace_at(tree[e], rest, fn)
        return new
    items = list(tree)
    items[e] = replace_at(tree[e], rest, fn)
    return type(tree)(*items) if isinstance(tree, Pair) else type(tree)(items)


LEAF_DEFECTS = {
    # kind: (make the bad leaf from the good one, error, message after the path)
    "shape": (lambda g: torch.zeros(g.shape + (2,), dtype=g.dtype), ValueError, ": shape "),
    "dtype": (lambda g: g.float(), TypeError, ": dtype torch.float32 does not match"),
    "bf16": (lambda g: g.bfloat16(), TypeError, ": dtype torch.bfloat16 does not match"),
    "int": (lambda g: g.to(torch.int32), TypeError, ": dtype torch.int32 does not match"),
    "device": (
        lambda g: torch.zeros(g.shape, dtype=g.dtype, device="meta"),
        ValueError,
        ": device meta",
    ),
    "none": (lambda g: None, TypeError, ": expected a tensor, got NoneType"),
    "float": (lambda g: 1.5, TypeError, ": expected a tensor, got float"),
    "subtree": (lambda g: [g], TypeError, ": expected a tensor, got list"),
}
NODE_DEFECTS = ("drop", "extra", "retype")


def _node_defect(node, kind: str, last):
    """Breaks the container ``node`` whose child ``last`` is the chosen leaf."""
    if kind == "extra":
        if isinstance(node, dict):
            return {**node, "zz_extra": torch.zeros(1)}
        return (
            list(node) + [torch.zeros(1)]
            if isinstance(node, list)
            else tuple(node) + (torch.zeros(1),)
        )
    if kind == "drop":
        if isinstance(node, dict):
            return {k: v for k, v in node.items() if k != last}
        return (
            [v for i, v in enumerate(node) if i != last]
            if isinstance(node, list)
            else tuple(v for i, v in enumerate(node) if i != last)
        )
    # retype: the same children in another container type
    if isinstance(node, dict):
        return list(node.values())
    if isinstance(node, list):
        return tuple(node)
    return list(node)


def test_fuzz_fp16_update_with_broken_grads():
    seen = Counter()

    @FUZZ
    @given(spec=_trees(), seed=st.integers(0, 2**16), data=st.data())
    def case(spec, seed, data):
        params = _materialise(spec, seed)
        try:
            state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
        except ValueError as err:  # only a tree without any element-bearing leaf
            assert "empty tree" in str(err)
            assert not tree_leaves(params)
            seen["empty tree rejected"] += 1
            return
        state = ff.fp16_update(state, good_grads(state))
        before = bit_snapshot(state)
        accessors = optree.tree_accessors(state.params, namespace=NAMESPACE)
        i = data.draw(st.integers(0, len(accessors) - 1))
        entries = [a.entry for a in accessors[i]]
        path = format_path(accessors[i])
        kind = data.draw(st.sampled_from(sorted(LEAF_DEFECTS) + list(NODE_DEFECTS)))
        grads = good_grads(state)
        if kind in LEAF_DEFECTS:
            make, error, after = LEAF_DEFECTS[kind]
            bad = replace_at(grads, entries, make)
            expected = f"grads{path}{after}"
            if path == "<root>":
                expected = f"grads<root>{after}"
        else:
            bad = replace_at(
                grads, entries[:-1], lambda node: _node_defect(node, kind, entries[-1])
            )
            error = ValueError
            parent = format_path(accessors[i][:-1]) if len(entries) > 1 else ""
            expected = "different tree structure" + (
                f" than params at grads{parent} (" if parent else ""
            )
        with pytest.raises(error) as info:
            ff.fp16_update(state, bad)
        assert expected in str(info.value), (kind, str(info.value))
        assert_bitwise_unchanged(state, before)
        seen[kind] += 1

    case()
    total = sum(seen.values())
    print(f"\n[fuzz fp16_update] cases={total} by defect={dict(sorted(seen.items()))}")
    assert total >= 350
    assert all(seen[k] > 0 for k in list(LEAF_DEFECTS) + list(NODE_DEFECTS))


def test_an_exception_inside_the_update_leaves_the_state_unchanged(impl, donate):
    def agree(finite):
        raise RuntimeError("peer lost")

    state = trained()
    before = bit_snapshot(state)
    with pytest.raises(RuntimeError, match="peer lost"):
        ff.fp16_update(state, good_grads(state), impl=impl, donate=donate, agree=agree)
    assert_bitwise_unchanged(state, before)

    inner = ff.sgd(0.1, momentum=0.9)

    def failing_update(updates, opt_state, params=None):
        raise ValueError("transform failed")

    state = trained(tx=ff.GradientTransformation(inner.init, inner.update))
    state = state.replace(tx=ff.GradientTransformation(inner.init, failing_update))
    before = bit_snapshot(state)
    with pytest.raises(ValueError, match="transform failed"):
        ff.fp16_update(state, good_grads(state), impl=impl, donate=donate)
    assert_bitwise_unchanged(state, before)


def test_update_path_names_the_implementation_that_runs(monkeypatch):
    """``update_path`` and ``fp16_update`` ask the same dispatcher: for every optimiser of
    the matrix, with each ``impl``, a plain and a MultiSteps state, the code that runs is
    the code ``update_path`` names."""
    from functional_fp16._fused import steps as fused_steps
    from functional_fp16.update import dispatch, foreach
    from tests.helpers import matrix_grads, optimiser_matrix

    ran = []
    real_fused, real_foreach, real_reference = (
        fused_steps.fused_update,
        foreach.foreach_update,
        dispatch.reference_update,
    )
    monkeypatch.setattr(
        dispatch, "fused_update", lambda *a, **k: ran.append("fused") or real_fused(*a, **k)
    )

    def foreach_spy(state, *a):
        ran.append("foreach-sgd" if foreach.sgd_sequence(state) is not None else "foreach")
        return real_foreach(state, *a)

    monkeypatch.setattr(dispatch, "foreach_update", foreach_spy)
    monkeypatch.setattr(
        dispatch, "reference_update", lambda *a: ran.append("reference") or real_reference(*a)
    )
    for name, tx in optimiser_matrix().items():
        for outer in (tx, ff.MultiSteps(tx, 2)):
            state = ff.fp16_init(random_tree(0), outer)
            grads = matrix_grads(state, 0, 0)
            for impl in ("auto", *IMPL_NAMES):
                ran.clear()
                ff.fp16_update(state, grads, impl=impl)
                assert ran == [ff.update_path(state, impl)], (name, impl, ran)


def test_copy_master_false_takes_fp32_params_as_the_master_and_refuses_others():
    w = torch.randn(3, 4)
    state = ff.fp16_init({"w": w}, ff.sgd(0.1), param_dtype=torch.float32, copy_master=False)
    assert state.master["w"].data_ptr() == w.data_ptr() and state.params["w"] is state.master["w"]
    g = {"w": torch.ones(3, 4)}
    before = w.clone()
    ff.fp16_update(state, g)  # pure: the shared tensor is not written
    assert torch.equal(w, before)
    ff.fp16_update(state, g, donate=True)  # donated: written in place
    assert torch.equal(w, before - 0.1)
    copied = ff.fp16_init({"w": w}, ff.sgd(0.1), param_dtype=torch.float32)
    assert copied.master["w"].data_ptr() != w.data_ptr()  # the default copies
    with pytest.raises(TypeError, match=r"params\['h'\]: dtype torch.float16; copy_master=False"):
        ff.fp16_init({"h": w.half()}, ff.sgd(0.1), copy_master=False)
    with pytest.raises(TypeError, match="copy_master must be a bool"):
        ff.fp16_init({"w": w}, ff.sgd(0.1), copy_master=1)
