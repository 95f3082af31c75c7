"""Which leaves overflowed: ``state.leaf_finite`` and ``ff.nonfinite_leaves``.

On a step where some leaves' gradients hold an inf or NaN, every
implementation (the tree-map reference, the multi-tensor path, the fused op
on its C and its plain PyTorch kernel, pure and donated) records exactly
those leaves, bit for bit alike; under ``vmap`` each member its own, under
``torch.compile`` the same without a recompile; ``MultiSteps`` keeps a
window's; checkpoints carry the flags and older files load them as all
finite. The expected paths are written out here, not derived from the
library's own path formatting. (Sharded and DTensor states: ``test_dtensor``
and ``test_sharding`` check that every rank names a leaf whose inf sat in one
rank's shard.)
"""

import math
import warnings
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16._fused import op_library
from functional_fp16._kernels import cpu as c_kernel
from tests.helpers import assert_states_bitwise_equal, optimiser_matrix

NS = ff.NAMESPACE
DATA = Path(__file__).parent / "data"

# The tree's leaves in flattening order (dict keys sorted), as dotted paths.
NAMES = [
    "h.0.ln.w",
    "h.0.mlp.c_fc.bias",
    "h.0.mlp.c_fc.weight",
    "h.1.ln.w",
    "h.1.mlp.c_fc.bias",
    "h.1.mlp.c_fc.weight",
    "none",
    "wte",
]
SHAPES = [(4,), (6,), (6, 4), (4,), (6,), (6, 4), (0,), (9, 4)]
FILLED = [i for i, s in enumerate(SHAPES) if math.prod(s)]  # "none" is empty
A, B = NAMES.index("h.1.mlp.c_fc.weight"), NAMES.index("wte")

# (impl, donate, kernel of the fused op; None for the others): "c" is the C++ op library,
# "c-ctypes" the same C kernel called through ctypes (where the C++ ops cannot be built; its
# pure SGD step speculates), "generic" the plain PyTorch kernel (CUDA's default).
RUNS = [
    ("reference", False, None),
    ("foreach", False, None),
    ("foreach", True, None),
    ("fused", False, "c"),
    ("fused", True, "c"),
    ("fused", False, "c-ctypes"),
    ("fused", True, "c-ctypes"),
    ("fused", False, "generic"),
    ("fused", True, "generic"),
]
# Every way the fused update decides: the C speculative SGD step, the C++ ops' own
# decision (Adam, Lion), one grad_stats call before the op (clipping, several groups),
# and optimisers the fused op does not take.
TXS = ["momentum", "adam", "lion", "recipe", "labels_sgd_adam", "apply_if_finite", "sgd"]
TXS += ["rmsprop_momentum_schedule"]


def _params():
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(s, generator=g) for s in SHAPES]
    return optree.tree_unflatten(_spec(), leaves)


def _spec():
    tree = {
        "h": [{"ln": {"w": 0}, "mlp": {"c_fc": {"bias": 0, "weight": 0}}} for _ in range(2)],
        "none": 0,
        "wte": 0,
    }
    return optree.tree_structure(tree, namespace=NS)


def _grads(seed: int, bad: dict[int, float]):
    """FP16 gradients; ``bad`` maps a leaf index to the value one of its elements gets."""
    g = torch.Generator().manual_seed(seed)
    leaves = [(torch.randn(s, generator=g) * 8).half() for s in SHAPES]
    for i, value in bad.items():
        flat = leaves[i].view(-1)
        flat[(seed * 7 + i) % flat.numel()] = value
    return optree.tree_unflatten(_spec(), leaves)


def _scale(kind: str):
    return {
        "dynamic": ff.DynamicLossScale(2.0**8, growth_interval=2),
        "static": ff.StaticLossScale(4.0),
        "noop": ff.NoOpLossScale(),
    }[kind]


def _clone(tree):
    return optree.tree_map(torch.clone, tree, namespace=NS)


def _update(state, grads, impl, donate, kernel, **kw):
    """One ``fp16_update`` of copies of ``state`` and ``grads`` (a donated update writes them)."""
    with kernel_of(kernel):
        return ff.fp16_update(_clone(state), _clone(grads), impl=impl, donate=donate, **kw)


def kernel_of(kernel: str | None) -> ExitStack:
    """Within the block, the fused op runs ``kernel`` (see :data:`RUNS`)."""
    stack = ExitStack()
    if kernel == "generic":
        stack.enter_context(mock.patch.object(op_library, "kernel_for", lambda d: "generic"))
    if kernel == "c-ctypes":
        stack.enter_context(mock.patch.object(c_kernel, "ops_available", lambda: False))
    return stack


@settings(max_examples=60, deadline=None, database=None)
@given(
    bad=st.dictionaries(
        st.sampled_from(FILLED), st.sampled_from([math.inf, -math.inf, math.nan]), max_size=4
    ),
    tx=st.sampled_from(TXS),
    scale=st.sampled_from(["dynamic", "static", "noop"]),
    seed=st.integers(0, 50),
)
def test_exactly_the_overflowing_leaves_are_named_by_every_implementation(bad, tx, scale, seed):
    state = ff.fp16_init(_params(), optimiser_matrix()[tx], _scale(scale))
    grads = _grads(seed, bad)
    want = [NAMES[i] for i in sorted(bad)]
    ref = _update(state, grads, "reference", False, None)
    assert ff.nonfinite_leaves(ref) == want
    assert bool(ref.grads_finite) == (not bad)
    for impl, donate, kernel in RUNS[1:]:
        got = _update(state, grads, impl, donate, kernel)
        assert_states_bitwise_equal(got.leaf_finite, ref.leaf_finite)
        assert_states_bitwise_equal(got.grads_finite, ref.grads_finite)


@pytest.mark.parametrize("tx", TXS)
@pytest.mark.parametrize("impl,donate,kernel", RUNS)
def test_a_and_b_then_a_clean_step_then_a_skip_for_the_loss(tx, impl, donate, kernel):
    state = ff.fp16_init(_params(), optimiser_matrix()[tx])
    state = _update(state, _grads(1, {A: math.inf, B: math.nan}), impl, donate, kernel)
    assert ff.nonfinite_leaves(state) == ["h.1.mlp.c_fc.weight", "wte"]
    assert state.leaf_finite.tolist() == [i not in (A, B) for i in range(len(NAMES))]
    state = _update(state, _grads(2, {}), impl, donate, kernel)
    assert bool(state.grads_finite) and ff.nonfinite_leaves(state) == []
    # Skipped for a non-finite loss alone: no leaf overflowed.
    state = _update(state, _grads(3, {}), impl, donate, kernel, loss=torch.tensor(math.nan))
    assert not bool(state.grads_finite) and ff.nonfinite_leaves(state) == []


@pytest.mark.parametrize("tx", ["recipe", "momentum", "adam", "lion"])
@pytest.mark.parametrize(
    "impl,donate,kernel",
    [("fused", False, "c"), ("fused", True, "c"), ("fused", False, "c-ctypes")]
    + [("fused", False, "generic"), ("foreach", False, None), ("reference", False, None)],
)
def test_each_member_of_a_vmapped_update_names_its_own_leaves(tx, impl, donate, kernel):
    bads = [{A: math.inf, B: math.nan}, {}, {B: -math.inf}]
    tx = optimiser_matrix()[tx]
    alone = [
        ff.fp16_update(ff.fp16_init(_params(), tx), _grads(k, bad), impl=impl)
        for k, bad in enumerate(bads)
    ]
    stacked = ff.tree_stack([ff.fp16_init(_params(), tx) for _ in bads])
    grads = ff.tree_stack([_grads(k, bad) for k, bad in enumerate(bads)])
    with kernel_of(kernel):
        out = torch.func.vmap(lambda s, g: ff.fp16_update(s, g, impl=impl, donate=donate))(
            stacked, grads
        )
    assert ff.nonfinite_leaves(out) == [["h.1.mlp.c_fc.weight", "wte"], [], ["wte"]]
    for k, one in enumerate(alone):
        assert ff.nonfinite_leaves(one) == ff.nonfinite_leaves(out)[k]
        assert_states_bitwise_equal(out.leaf_finite[k], one.leaf_finite)


@pytest.mark.parametrize("tx,donate", [("recipe", False), ("momentum", True)])
def test_compiled_updates_name_the_same_leaves_without_recompiling(tx, donate):
    torch._dynamo.reset()
    step = torch.compile(lambda s, g: ff.fp16_update(s, g, donate=donate), fullgraph=True)
    state = eager = ff.fp16_init(_params(), optimiser_matrix()[tx])
    state = _clone(state)  # (a donated update writes into it)
    pattern = [{A: math.inf, B: math.nan}, {}, {B: math.inf}, {A: math.nan}, {}]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, bad in enumerate(pattern):
            state = step(state, _grads(i, bad))
            eager = ff.fp16_update(eager, _grads(i, bad))
            assert ff.nonfinite_leaves(state) == [NAMES[j] for j in sorted(bad)]
            assert_states_bitwise_equal(state.leaf_finite, eager.leaf_finite)
    torch._dynamo.reset()


@pytest.mark.parametrize("impl,donate,kernel", RUNS)
def test_multisteps_names_the_windows_leaves_until_it_closes(impl, donate, kernel):
    state = ff.fp16_init(_params(), ff.MultiSteps(optimiser_matrix()["recipe"], 3))
    expected = [
        ({A: math.inf}, ["h.1.mlp.c_fc.weight"]),
        ({B: math.nan}, ["h.1.mlp.c_fc.weight", "wte"]),
        ({}, ["h.1.mlp.c_fc.weight", "wte"]),  # the window closes, skipped
        ({}, []),  # a new window starts afresh
        ({}, []),
        ({}, []),  # applied
    ]
    for i, (bad, names) in enumerate(expected):
        state = _update(state, _grads(i, bad), impl, donate, kernel)
        assert ff.nonfinite_leaves(state) == names, i
    assert bool(state.grads_finite) and int(state.opt_state.gradient_step) == 1


def test_multisteps_names_a_leaf_whose_mean_overflows_though_each_micro_batch_was_finite():
    # Unscaled by 2^113, an FP16 gradient of 19200 is 2.0e38: finite in FP32, but the
    # sum of two is not, and neither is their mean.
    scale = ff.StaticLossScale(2.0**-113)
    for impl, donate, kernel in RUNS:
        state = ff.fp16_init(_params(), ff.MultiSteps(ff.adamw(1e-3), 2), scale)
        grads = optree.tree_map(torch.zeros_like, _grads(0, {}), namespace=NS)
        optree.tree_leaves(grads, namespace=NS)[B].view(-1)[3] = 19200.0
        state = _update(state, grads, impl, donate, kernel)
        assert ff.nonfinite_leaves(state) == [], (impl, kernel)  # each micro-batch is finite
        state = _update(state, grads, impl, donate, kernel)
        assert not bool(state.grads_finite)
        assert ff.nonfinite_leaves(state) == ["wte"], (impl, donate, kernel)


def test_checkpoints_carry_the_flags(tmp_path):
    state = ff.fp16_init(_params(), optimiser_matrix()["recipe"])
    state = ff.fp16_update(state, _grads(0, {A: math.inf}))
    ff.save_checkpoint(tmp_path / "s.ckpt", state)
    back = ff.load_checkpoint(tmp_path / "s.ckpt", like=ff.fp16_init(_params(), state.tx))
    assert ff.nonfinite_leaves(back) == ["h.1.mlp.c_fc.weight"]
    ffd.save_dcp_state(state, tmp_path / "dcp")
    again = ffd.load_dcp_state(ff.fp16_init(_params(), state.tx), tmp_path / "dcp")
    assert_states_bitwise_equal(again, state)


def test_a_checkpoint_from_before_the_flags_loads_them_as_all_finite(tmp_path):
    from tests.test_scale_stats import _before_scale_stats

    want = _before_scale_stats()  # what the files were written from, by the code of then
    like = want.replace(leaf_finite=torch.zeros_like(want.leaf_finite))  # not taken from like
    # Written with the loss-scale counters but before the flags (the previous release) ...
    with pytest.warns(UserWarning, match=r"before FP16State.leaf_finite; the leaves' finite"):
        got = ff.load_checkpoint(DATA / "state_before_leaf_finite.ckpt", like=like)
    assert got.leaf_finite.tolist() == [True, True] and ff.nonfinite_leaves(got) == []
    assert ff.loss_scale_stats(got) == ff.loss_scale_stats(want)  # read from the file
    assert ff.loss_scale_stats(want)["skips"] == 1
    rest = [f for f in ff.FP16State.FIELDS if f != "leaf_finite"]
    assert_states_bitwise_equal([getattr(got, f) for f in rest], [getattr(want, f) for f in rest])
    # ... and before both.
    with pytest.warns(UserWarning, match=r"before .*FP16State.leaf_finite.*start as all finite"):
        got = ff.load_checkpoint(DATA / "state_before_scale_stats.ckpt", like=like)
    assert got.leaf_finite.tolist() == [True, True] and ff.nonfinite_leaves(got) == []
    # A DCP directory written without them loads the same way.
    import torch.distributed.checkpoint as dcp

    from functional_fp16.distributed.dcp_state import one_process_is_intended, state_to_dcp

    saved = state_to_dcp(got)
    del saved["leaf_finite"]
    with one_process_is_intended():
        dcp.save(saved, checkpoint_id=tmp_path / "old_dcp", no_dist=True)
    with pytest.warns(UserWarning, match=r"before FP16State.leaf_finite; the leaves'"):
        again = ffd.load_dcp_state(like, tmp_path / "old_dcp")
    assert again.leaf_finite.tolist() == [True, True]
    assert_states_bitwise_equal(again.master, got.master)


def test_bad_input_is_refused_by_name():
    with pytest.raises(TypeError, match="state must be an FP16State"):
        ff.nonfinite_leaves({"leaf_finite": torch.ones(8, dtype=torch.bool)})
    state = ff.fp16_init(_params(), ff.sgd(0.1))
    for bad in (torch.ones(8), torch.ones(7, dtype=torch.bool), None):
        broken = state.replace(leaf_finite=bad) if bad is not None else state.replace()
        if bad is None:
            object.__setattr__(broken, "leaf_finite", [True] * 8)  # not a tensor at all
        with pytest.raises(TypeError, match=r"state.leaf_finite must be a bool tensor of shape"):
            ff.nonfinite_leaves(broken)
    # The update refuses such a state before it computes anything.
    grads = _grads(0, {})
    before = _clone(state)
    with pytest.raises(ValueError, match=r"state.leaf_finite: shape \(7,\), expected \(8,\)"):
        ff.fp16_update(state.replace(leaf_finite=torch.ones(7, dtype=torch.bool)), grads)
    with pytest.raises(TypeError, match=r"state.leaf_finite: dtype torch.float32"):
        ff.fp16_update(state.replace(leaf_finite=torch.ones(8)), grads)
    assert_states_bitwise_equal(state, before)
    # A fresh state, and one built by hand, have no overflowed leaf yet.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ff.nonfinite_leaves(state) == []
        fields = {f: getattr(state, f) for f in ff.FP16State.FIELDS[:6]}
        assert ff.nonfinite_leaves(ff.FP16State(**fields, tx=state.tx)) == []


def test_the_fused_ops_return_the_leaves_flags_where_they_decide():
    """The op's second output: per leaf where it decided itself, empty where it was told."""
    g = [torch.ones(5).half(), torch.full((3,), math.inf).half(), torch.ones(0).half()]
    m = [torch.zeros(5), torch.zeros(3), torch.zeros(0)]
    args = dict(grads=g, master=m, trace=[], params=[x.half() for x in m])
    args.update(separate=[True] * 3, inv=torch.ones(1), clip_div=None, clip_mul=None)
    args.update(lr=torch.full((1,), -0.1), require=None, started=None, weight_decay=0.0)
    args.update(momentum=0.0, dampening=0.0, nesterov=False, members=1)
    from functional_fp16._fused.sgd import SGD_OPS

    for kernel in ("c", "generic"):
        with mock.patch.object(op_library, "kernel_for", lambda d, k=kernel: k):
            *_, finite, leaves = SGD_OPS.call(False, dict(args, apply=None))
            assert finite.tolist() == [False] and leaves.tolist() == [True, False, True]
            *_, finite, leaves = SGD_OPS.call(False, dict(args, apply=torch.ones(1, dtype=bool)))
            assert finite.tolist() == [True] and leaves.numel() == 0


def test_leaf_paths_are_the_dotted_keys_in_flattening_order():
    assert ff.leaf_paths(_params()) == NAMES
    assert ff.leaf_paths({"transformer.h.0.attn.c_attn.weight": torch.ones(1)}) == [
        "transformer.h.0.attn.c_attn.weight"  # a flat dict's key as it is
    ]
    assert ff.leaf_paths([torch.ones(1), (torch.ones(1), {"b": torch.ones(1)})]) == [
        "0",
        "1.0",
        "1.1.b",
    ]
