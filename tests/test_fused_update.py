"""The fused op (``impl="fused"``, the default) under the numerical contract.

Every test here runs twice: with the compiled C kernel and with the op's plain
PyTorch kernel (``generic``, what runs without a C compiler or on other devices).

Bitwise, always: the skip decision, the loss scale and its counters, ``step``,
``grads_finite``, every optimiser-state tensor that is not contracted (the
momentum buffers, the schedule count), and a skipped step being a no-op on
every tensor of the state (compared as bit patterns: -0.0 is not +0.0).

Arithmetic: the kernel contracts the step ``m + f * v`` into one fused
multiply-add where the reference rounds ``f * v`` first. The bound stated and
checked here, element by element, is **one ulp at the scale of the operation**:
``|fused - reference| <= ulp(max(|m|, |m'|, |m' - m|))``. (One ulp of the result
alone bounds no contraction: where ``m`` and ``f * v`` nearly cancel, ``m'`` is
tiny and the reference's own rounding of ``f * v`` is many of its ulps.)
Against ``torch.optim.SGD``, whose foreach kernels contract the same
multiply-adds, the bound is one ulp of the result itself.
"""

import functools
import gc
import io
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import functional_fp16 as ff
from functional_fp16._fused import op_library, steps
from functional_fp16._fused.op_library import grad_stats
from functional_fp16._kernels import cpu as cpu_kernel
from functional_fp16._util.finite import grads_finite
from functional_fp16._util.tree import tree_leaves, tree_map
from functional_fp16.update import dispatch
from tests.helpers import (
    STEPS,
    TX_NAMES,
    assert_within_one_operation_ulp,
    count_c_kernel_calls,
    fresh_json,
    fused_adam_excess,
    matrix_grads,
    optimiser_matrix,
    random_tree,
    ulp,
)
from tests.helpers import assert_states_bitwise_equal as assert_bitwise

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler here")

KERNEL_FOR = op_library.kernel_for  # the real choice, before any test patches it


@pytest.fixture(autouse=True, params=["c", "generic"])
def kernel(request, monkeypatch):
    """Runs each test with the C kernel and with the op's plain PyTorch kernel."""
    if request.param == "generic":
        monkeypatch.setattr(op_library, "kernel_for", lambda device: "generic")
        monkeypatch.setattr(dispatch, "_warned", {"no kernel for cpu", None})
    return request.param


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).view(torch.uint8)


def assert_within_contract(new, ref, old):
    """``new`` (fused) against ``ref`` (reference), both computed from ``old``."""
    assert torch.equal(new.grads_finite, ref.grads_finite)
    assert_bitwise((new.loss_scale, new.step), (ref.loss_scale, ref.step))
    if not bool(ref.grads_finite):
        # a skipped step is a no-op on every tensor of the parameters and optimiser
        assert_bitwise(
            (new.params, new.master, new.opt_state), (old.params, old.master, old.opt_state)
        )
        return
    contracted = op_library.kernel_for(torch.device("cpu")) != "c"
    carried = _carried_error(new, ref) if contracted else None
    by_torch_adam = _torch_adam_leaves(old) if contracted else set()
    for i, (a, r, m) in enumerate(
        zip(tree_leaves(new.master), tree_leaves(ref.master), tree_leaves(old.master))
    ):
        extra = None if carried is None else (r - m).abs() * carried[i]
        if i in by_torch_adam:  # PyTorch's fused Adam steps it: its formula's bound
            extra = fused_adam_excess(r, m) + (0.0 if extra is None else extra)
        assert_within_one_operation_ulp(a, r, m, extra=extra)
    for p, m in zip(tree_leaves(new.params), tree_leaves(new.master)):
        assert torch.equal(bits(p), bits(m.to(p.dtype)))  # the round-to-nearest working copy
    if op_library.kernel_for(torch.device("cpu")) == "c":
        # The C kernel rounds momentum as the reference does: bitwise.
        assert_bitwise(new.opt_state, ref.opt_state)
        return
    # The CUDA default (PyTorch's fused kernels) may contract the momentum's multiply-add,
    # as the contract allows: each FP32 state within one ulp at the scale of its operation
    # (|b|, |b'|, |b' - b|); counts and flags bitwise.
    for a, r, o in zip(
        tree_leaves(new.opt_state), tree_leaves(ref.opt_state), tree_leaves(old.opt_state)
    ):
        if a.dtype == torch.float32:
            assert_within_one_operation_ulp(a, r, o)
        else:
            assert_bitwise(a, r)


def _torch_adam_leaves(state) -> set[int]:
    """The master leaves the plain kernel steps with PyTorch's fused Adam/AdamW: those of
    a float32-moment Adam group (``adam._fused``)."""
    fp = steps.fused_plan(state)
    if fp is None:
        return set()
    return {
        i for g in fp.groups if g.fusable.name == "adam" and not g.plan.stored for i in g.leaves
    }


def _carried_error(new, ref):
    r"""Per master leaf, the relative error of the optimiser's FP32 state leaves that step it
    (the largest over the state's blocks laid out like the master), or ``None``.

    The CUDA default runs PyTorch's fused kernels, which may contract the momentum's
    multiply-add as well as the master's (both within the contract's one ulp at their own
    scale). The master's step :math:`\eta b'` then carries the momentum's rounding: the
    bound on the master is one ulp at its operation's scale plus
    :math:`|m_{ref} - m| \cdot |b' - b'_{ref}| / |b'_{ref}|`, the momentum's own error
    carried by the step (and the momentum is held to its one ulp separately)."""
    n = len(tree_leaves(ref.master))
    a = [x for x in tree_leaves(new.opt_state) if x.dtype == torch.float32]
    r = [x for x in tree_leaves(ref.opt_state) if x.dtype == torch.float32]
    shapes = [x.shape for x in tree_leaves(ref.master)]
    if not r or len(r) % n or any(x.shape != shapes[i % n] for i, x in enumerate(r)):
        return None
    out = [torch.zeros(s) for s in shapes]
    for i, (x, y) in enumerate(zip(a, r)):
        rel = ((x - y).abs() / y.abs()).nan_to_num(nan=0.0, posinf=0.0)
        out[i % n] = torch.maximum(out[i % n], rel)
    return out


def clone(state):
    return tree_map(lambda x: x.clone(), state)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("name", TX_NAMES)
def test_every_chain_within_contract_of_the_reference(name, donate):
    tx = optimiser_matrix()[name]
    state = ff.fp16_init(random_tree(3, scale=0.5), tx)
    for step in range(STEPS):
        bad = [None, math.inf, None, math.nan, None, -math.inf][step]
        grads = matrix_grads(state, step, 0, bad=bad)
        old = clone(state)
        ref = ff.fp16_update(old, grads, impl="reference")
        state = ff.fp16_update(state, grads, impl="fused", donate=donate)
        assert_within_contract(state, ref, old)
        state = clone(state) if donate else state


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("loss_scale", ["dynamic", "static", "none"])
def test_dtypes_and_loss_scales_within_contract(param_dtype, loss_scale):
    make = {
        "dynamic": lambda: ff.DynamicLossScale(2.0**8, growth_interval=2),
        "static": lambda: ff.StaticLossScale(2.0**6),
        "none": ff.NoOpLossScale,
    }[loss_scale]
    state = ff.fp16_init(
        random_tree(4), ff.sgd(0.05, momentum=0.9), make(), param_dtype=param_dtype
    )
    for step in range(STEPS):
        grads = matrix_grads(state, step, 1, scale=64.0, bad=math.inf if step == 2 else None)
        old = clone(state)
        ref = ff.fp16_update(old, grads, impl="reference")
        state = ff.fp16_update(state, grads, impl="fused")
        assert_within_contract(state, ref, old)
    if param_dtype == torch.float32:  # the working copy is the master itself
        assert all(p is m for p, m in zip(tree_leaves(state.params), tree_leaves(state.master)))


TORCH_CONFIGS = [
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
    dict(momentum=0.9, weight_decay=1e-3),
    dict(),
]


@pytest.mark.parametrize("cfg", TORCH_CONFIGS, ids=str)
def test_one_step_within_one_ulp_of_torch_sgd_and_long_runs_within_four(cfg):
    torch.manual_seed(0)
    n, lr, scale = 100_003, 0.05, 1024.0
    m0 = torch.randn(n) * 0.05
    state = ff.fp16_init({"w": m0}, ff.sgd(lr, **cfg), ff.StaticLossScale(scale))
    param = torch.nn.Parameter(m0.clone())
    # What a user runs beside this kernel: on the CPU torch's multi-tensor SGD (the C kernel
    # rounds as it does), on CUDA SGD(fused=True), the kernel the CUDA default calls.
    fused = op_library.kernel_for(torch.device("cpu")) == "generic"
    opt = torch.optim.SGD(
        [param], lr=lr, **({"fused": True} if fused else {"foreach": True}), **cfg
    )
    inv = ff.unscale_factor(torch.tensor(scale))
    for step in range(30):
        g16 = (torch.randn(n) * scale * 0.1).half()
        param.grad = g16.float() * inv
        state = ff.fp16_update(state, {"w": g16})
        opt.step()
        ours, theirs = state.master["w"], param.detach()
        if step == 0:  # one step from the same state: 1 ulp of the result
            assert bool(((ours - theirs).abs() <= ulp(theirs)).all())
        # a long run: a few ulps of the result
        assert bool(((ours - theirs).abs() <= 4 * ulp(theirs)).all()), step
        if cfg.get("momentum"):
            buf = opt.state[param]["momentum_buffer"]
            assert bool(((state.opt_state[1].trace["w"] - buf).abs() <= 4 * ulp(buf)).all())


def test_the_readme_and_example_optimisers_take_the_fused_path():
    params = random_tree(0)
    quick = ff.fp16_init(params, ff.sgd(1e-3, momentum=0.9))
    clipped = ff.fp16_init(
        params, ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(1e-3, momentum=0.9))
    )
    assert ff.update_path(quick) == ff.update_path(clipped) == "fused"
    assert ff.update_path(quick, impl="foreach") == "foreach-sgd"
    assert ff.update_path(clipped, impl="foreach") == "foreach"
    assert ff.update_path(quick, impl="reference") == "reference"
    with pytest.raises(ValueError, match="impl"):
        ff.update_path(quick, impl="fast")


def test_without_a_compiler_it_warns_once_and_runs_the_plain_kernel(monkeypatch, kernel):
    state = ff.fp16_init(random_tree(0), ff.sgd(0.1, momentum=0.9))
    grads = matrix_grads(state, 0, 0)
    monkeypatch.setattr(op_library, "kernel_for", KERNEL_FOR)  # this test chooses for itself
    assert dispatch.route(state).kernel == "c"
    with_c = ff.fp16_update(state, grads)
    monkeypatch.setattr(cpu_kernel, "_loaded", True)
    monkeypatch.setattr(cpu_kernel, "_lib", None)
    monkeypatch.setattr(cpu_kernel, "_reason", "no C compiler found (test)")
    monkeypatch.setattr(dispatch, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        new = ff.fp16_update(state, grads)
    assert ff.update_path(state) == "fused"
    assert dispatch.route(state).kernel == "generic"
    assert_bitwise(new, with_c)  # on the CPU the plain kernel is bitwise the C one
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ff.fp16_update(state, grads)  # said once, not every step


def test_pure_outputs_never_alias_live_tensors_and_dropped_ones_are_reused():
    tx = ff.sgd(0.1, momentum=0.9)
    # FP32 buffers of 400 KB, which the pool (the plain kernel's) or the block cache (the C
    # kernel's) serves, reusing a dropped buffer of the same size: a size no other test uses,
    # so that buffers other tests dropped cannot serve these updates before s1's own.
    s0 = ff.fp16_init({"w": torch.randn(100_007), "b": torch.randn(10)}, tx)
    keep = clone(s0)
    grads = matrix_grads(s0, 0, 0)
    s1 = ff.fp16_update(s0, grads)
    s2 = ff.fp16_update(s1, grads)
    live = {x.untyped_storage().data_ptr() for x in tree_leaves((s0, s1))}
    assert not live & {x.untyped_storage().data_ptr() for x in tree_leaves(s2.master)}
    assert_bitwise(s0, keep)  # inputs are never written
    view = s1.master["w"][:10]  # a view keeps its storage alive
    keep_view = view.clone()
    old_ptrs = {x.untyped_storage().data_ptr() for x in tree_leaves(s1)}
    del s1
    gc.collect()
    s3 = ff.fp16_update(s2, grads)
    s4 = ff.fp16_update(s3, grads)
    now = {x.untyped_storage().data_ptr() for x in tree_leaves((s3, s4))}
    assert view.untyped_storage().data_ptr() not in now
    assert now & (old_ptrs - {view.untyped_storage().data_ptr()})  # the rest is reused
    assert torch.equal(view, keep_view)  # and the view's values were never overwritten


OWNED_OUTPUT_TXS = {
    "momentum": ff.sgd(0.05, momentum=0.9),
    "recipe": optimiser_matrix()["recipe"],
    "lion": ff.lion(1e-3, weight_decay=0.1),
    "rmsprop": ff.rmsprop(1e-3, momentum=0.9),
    "adam_bf16_first_moment": ff.adamw(1e-3, mu_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("master", ["float32", "split"])
@pytest.mark.parametrize("name", list(OWNED_OUTPUT_TXS))
def test_every_pure_output_owns_exactly_its_bytes(name, master):
    """Each tensor of a pure update's new state has a storage of its own holding exactly
    its bytes at offset 0, as a tensor made by ``torch.empty`` has, and an empty one none:
    a checkpoint stores each without a copy, ``torch.save`` takes them all, and no output
    overlaps another (the C kernel carves a state part's small leaves from one block)."""
    # the empty leaf last: where a part held two states, another state's leaf followed it
    params = {**random_tree(), "zz_empty": torch.zeros(0, 4)}
    state = ff.fp16_init(params, OWNED_OUTPUT_TXS[name], master=master)
    new = ff.fp16_update(state, matrix_grads(state, 0, 0))
    outputs = tree_leaves((new.params, new.master, new.opt_state))
    spans = []
    for x in outputs:
        assert x.storage_offset() == 0
        assert x.untyped_storage().nbytes() == x.numel() * x.element_size()
        if not x.numel():
            assert x.untyped_storage().data_ptr() == 0  # no memory, as torch.empty(0)
            continue
        spans.append((x.data_ptr(), x.data_ptr() + x.untyped_storage().nbytes()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    torch.save(outputs, io.BytesIO())  # refuses storages at one address with two dtypes


C_OUTPUTS = pytest.mark.usefixtures("c_kernel_only")


@pytest.fixture
def c_kernel_only(kernel):
    if kernel != "c":
        pytest.skip("the plain kernel's outputs come from the Python pool (tests/test_memory.py)")


def _addresses(tree, min_numel=100, below=None) -> set[int]:
    """The data addresses of ``tree``'s leaves served by the ops' block cache (the 0-d
    counters come from the system allocator, which reuses addresses at random); with
    ``below``, of those under that many bytes only."""
    leaves = [x for x in tree_leaves(tree) if x.numel() >= min_numel]
    return {x.data_ptr() for x in leaves if below is None or x.nbytes < below}


def _kept_state_case():
    """Three small leaves, carved from their part's block, and one large, with a block of
    its own (fp32 master and momentum and fp16 params all over 256 KiB); sizes no other
    test uses, so the block cache's free blocks of these sizes are this test's."""
    params = {"w": torch.randn(200_003), **{f"b{i}": torch.randn(1_003 + i) for i in range(3)}}
    s0 = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
    grads = matrix_grads(s0, 0, 0)
    s1 = ff.fp16_update(s0, grads)
    return s1, ff.fp16_update(s1, grads), grads


@C_OUTPUTS
def test_a_kept_part_keeps_its_own_memory_only():
    """Holding a dropped state's params (a user's copy for an average or a comparison)
    keeps their memory alive and intact, and only theirs: the same state's master and
    momentum are reused by the next updates."""
    s1, s2, grads = _kept_state_case()
    kept = s1.params
    values = tree_map(torch.clone, kept)
    others = _addresses((s1.master, s1.opt_state), below=256 * 1024)  # the carved leaves
    del s1
    gc.collect()
    s3 = ff.fp16_update(s2, grads)
    s4 = ff.fp16_update(s3, grads)
    now = _addresses((s3, s4))
    assert not now & _addresses(kept)
    assert now & others
    assert_bitwise(kept, values)


@C_OUTPUTS
def test_a_kept_small_leaf_does_not_keep_the_large_ones():
    """A small leaf kept alive keeps its part's block of small leaves, never a large
    leaf's memory: the large leaves of the same part are reused by the next updates."""
    s1, s2, grads = _kept_state_case()
    kept = s1.params["b0"]
    value = kept.clone()
    large = _addresses(s1.params["w"])
    del s1
    gc.collect()
    s3 = ff.fp16_update(s2, grads)
    s4 = ff.fp16_update(s3, grads)
    assert large & _addresses((s3, s4))
    assert not _addresses(kept, 1) & _addresses((s3, s4), 1)
    assert torch.equal(kept.view(torch.int16), value.view(torch.int16))


_LONG_AGO = """
import gc, json, torch
import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves

def grads_of(state):
    return {k: torch.full_like(v, 0.01) for k, v in state.params.items()}

big = {f"w{i}": torch.randn(1_000_003 + i) for i in range(2)}
b0 = ff.fp16_init(big, ff.sgd(0.1, momentum=0.9))
b1 = ff.fp16_update(b0, grads_of(b0))
b2 = ff.fp16_update(b1, grads_of(b0))
del b0, b1, b2  # two states of the cache's blocks: twice the call, all it keeps
gc.collect()
small = {"w": torch.randn(200_011), **{f"b{i}": torch.randn(1_013 + i) for i in range(3)}}
s0 = ff.fp16_init(small, ff.sgd(0.1, momentum=0.9))
s1 = ff.fp16_update(s0, grads_of(s0))
s2 = ff.fp16_update(s1, grads_of(s0))
large = [x for x in tree_leaves(s1) if x.nbytes >= 256 * 1024]  # blocks of their own
dropped, sizes = {x.data_ptr() for x in large}, [x.nbytes for x in large]
del s1, large
gc.collect()
# Had those blocks gone back to malloc, these requests of their sizes would take them.
decoys = [torch.empty(n, dtype=torch.uint8) for n in sizes]
s3 = ff.fp16_update(s2, grads_of(s0))
print(json.dumps({
    "path": ff.update_path(s0),
    "dropped": len(dropped),
    "reused": len(dropped & {x.data_ptr() for x in tree_leaves(s3)}),
    "decoyed": len(dropped & {x.data_ptr() for x in decoys}),
}))
"""


@C_OUTPUTS
def test_blocks_of_a_state_dropped_long_ago_make_room_for_the_current_ones():
    """The block cache keeps at most twice its largest call's bytes free; once a larger
    tree's dropped states fill that, the next tree's dropped blocks still take the
    oldest ones' place, and its next update reuses them. In a fresh interpreter: the
    cache is the process's, and earlier tests leave it in any state."""
    got = fresh_json(_LONG_AGO, env={"FUNCTIONAL_FP16_CPU_KERNEL": "c"})
    assert got == {"path": "fused", "dropped": 3, "reused": 3, "decoyed": 0}, got


def test_channels_last_and_strided_gradients():
    params = {"conv": torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last)}
    state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
    assert ff.update_path(state) == "fused"
    g = (torch.randn(8, 3, 3, 3) * 100).half()  # contiguous, unlike the master
    ref = ff.fp16_update(state, {"conv": g}, impl="reference")
    new = ff.fp16_update(state, {"conv": g})
    assert_within_contract(new, ref, state)
    assert new.master["conv"].is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 40_000])
@pytest.mark.parametrize("value", [None, math.inf, -math.inf, math.nan, 6e4, -3e38])
def test_kernel_finite_decision_matches_grads_finite(dtype, n, value):
    g = torch.randn(n).to(dtype)
    if value is not None:
        g[n // 2] = value
    for inv in (torch.tensor(1.0), torch.tensor(2.0**-10), torch.tensor(2.0**100), None):
        one = None if inv is None else inv.reshape(1)
        peak, _ = grad_stats([g, torch.ones(3, dtype=dtype)], one, 1, 1, False)
        mine = torch.isfinite(peak if inv is None else peak * inv)[0]
        assert bool(mine) == bool(grads_finite([g], inv))


def test_kernel_sum_of_squares_matches_global_norm():
    g = [(torch.randn(n) * 300).half() for n in (1, 17, 70_001)]
    inv = torch.tensor(2.0**-8)
    _, sq = grad_stats(g, inv.reshape(1), 1, 1, True)
    expected = ff.global_norm([x.float() * inv for x in g])
    assert torch.equal(sq[0].sqrt().float(), expected)


@functools.cache
def _compiled_update():
    """``fp16_update`` compiled once for both kernels of this module: under
    ``torch.compile`` the route leaves the kernel unchosen and the traced op picks
    its kernel (``op_library.kernel_for``, which the ``kernel`` fixture patches)
    each time it runs, so the graph is the same for both and each test still runs
    it with its own kernel. Compiling it twice cost about 10 s."""
    backend = CompileCounterWithBackend("inductor")  # keeps the traced graph
    return torch.compile(ff.fp16_update, fullgraph=True, backend=backend), backend


def test_the_compiled_update_still_matches_eager_fused(kernel, monkeypatch):
    state = ff.fp16_init(random_tree(0), ff.sgd(0.1, momentum=0.9))
    grads = matrix_grads(state, 0, 0)
    assert ff.update_path(state) == "fused"
    calls = count_c_kernel_calls(monkeypatch, [])
    compiled, backend = _compiled_update()
    new = compiled(state, grads)
    assert backend.graphs  # traced (by this test or the other kernel's)
    # the compiled update is the fused op, and the op ran this test's kernel when it ran
    ops = {str(n.target) for g in backend.graphs for n in g.graph.nodes}
    assert "functional_fp16.sgd_step.default" in ops, sorted(ops)
    assert calls.count("sgd_update") == (kernel == "c"), calls
    ref = ff.fp16_update(state, grads, impl="reference")
    assert_within_contract(new, ref, state)


def test_leaves_without_a_state_layout_are_refused_by_the_plan_not_the_kernel():
    state = ff.fp16_init(random_tree(0), ff.sgd(0.1, momentum=0.9))
    bad = state.replace(master=tree_map(lambda m: m.double(), state.master))
    assert steps.fused_plan(bad) is None
    assert steps.fused_plan(state) is not None


TENSOR_HYPERPARAMETERS = {
    "sgd_momentum_0": lambda: ff.sgd(0.05, momentum=torch.tensor(0.0)),
    "sgd_decay_0": lambda: ff.sgd(0.05, momentum=0.9, weight_decay=torch.tensor(0.0)),
    "adamw_decay_0": lambda: ff.adamw(1e-3, weight_decay=torch.tensor(0.0)),
    "lion_decay_0": lambda: ff.lion(1e-3, weight_decay=torch.tensor(0.0)),
    "rmsprop_trace_0": lambda: ff.chain(
        ff.scale_by_rms(), ff.scale_by_learning_rate(1e-2), ff.trace(torch.tensor(0.0))
    ),
}


@pytest.mark.parametrize("name", sorted(TENSOR_HYPERPARAMETERS))
def test_hyperparameters_given_as_tensors_run_as_written(name):
    """A tensor hyperparameter's value is never read on the host, so a transform keeps its
    general form for it (a trace of momentum ``tensor(0.)`` still starts and turns -0.0
    into +0.0): the update runs the chain as written, bitwise the reference, never a fused
    plan that would drop the part as it drops a float 0."""
    from functional_fp16._fused.steps import why_not_fused

    make = TENSOR_HYPERPARAMETERS[name]
    ours, ref = (ff.fp16_init(random_tree(1), make()) for _ in range(2))
    assert why_not_fused(ours) == "a hyperparameter given as a tensor"
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = tree_map(lambda p: (torch.randn(p.shape, generator=g) * 100).half(), ours.params)
        tree_leaves(grads)[2].zero_()  # zero gradients: where -0.0 and +0.0 part
        ours = ff.fp16_update(ours, grads)
        ref = ff.fp16_update(ref, grads, impl="reference")
        assert_bitwise(ours, ref)
