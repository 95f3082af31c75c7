"""CUDA-only checks: no host synchronisation, CUDA-graph capture, compiled update.

Skipped without a GPU. ``benchmarks/cuda_checks.py`` runs the same checks
(and a speed table) as one script; each check it declares (``CHECKS``) is also
a test here (the names are read without a GPU, so collection needs none).
"""

import math
from pathlib import Path

import pytest
import torch
import torch._dynamo

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import load_module

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCALE = 2.0**12
CUDA_CHECKS = load_module(
    Path(__file__).resolve().parent.parent / "benchmarks" / "cuda_checks.py", "cuda_checks"
)


def _state(tx=None):
    g = torch.Generator().manual_seed(0)
    params = {
        "w": torch.randn(4099, generator=g) * 0.1,
        "m": torch.randn(9, 7, generator=g) * 0.1,
        "s": torch.tensor(0.5),
    }
    params = {k: v.cuda() for k, v in params.items()}
    tx = tx or ff.sgd(0.05, momentum=0.9, weight_decay=1e-4)
    return ff.fp16_init(params, tx, ff.DynamicLossScale(SCALE, growth_interval=2))


def _grads(state, step, bad=False):
    g = torch.Generator().manual_seed(100 + step)
    out = tree_map(
        lambda p: (torch.randn(p.shape, generator=g) * 0.01 * SCALE).to(p.dtype).cuda(),
        state.params,
    )
    if bad:
        out["w"][5] = math.inf
    return out


def _bits_equal(a, b):
    return all(
        torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for x, y in zip(tree_leaves(a), tree_leaves(b))
    )


@pytest.mark.parametrize("donate", [False, True])
def test_update_under_sync_debug_mode_error(impl, donate):
    state = _state()
    grads = [_grads(state, i, bad=(i == 1)) for i in range(3)]
    loss = torch.ones((), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for g in grads:
            state = ff.fp16_update(state, g, impl=impl, donate=donate, loss=loss)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(state.step) == 3


@pytest.mark.parametrize("donate", [False, True])
def test_cuda_graph_replay_equals_eager(impl, donate):
    static = _state()
    static_grads = _grads(static, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = ff.fp16_update(static, static_grads, impl=impl, donate=donate)
        for dst, src in zip(tree_leaves(static), tree_leaves(warm)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ff.fp16_update(static, static_grads, impl=impl, donate=donate)
    eager = tree_map(lambda t: t.clone(), static)
    for i in range(5):
        g = _grads(static, 10 + i, bad=(i == 2))
        for dst, src in zip(tree_leaves(static_grads), tree_leaves(g)):
            dst.copy_(src)
        graph.replay()
        for dst, src in zip(tree_leaves(static), tree_leaves(out)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        eager = ff.fp16_update(eager, g, impl=impl)
        assert _bits_equal(static, eager), i
        assert bool(static.grads_finite) == (i != 2)


@pytest.mark.slow
def test_compiled_update_on_cuda_matches_eager():
    state = _state(ff.sgd(0.05, momentum=0.9, nesterov=True))
    fn = torch.compile(lambda s, g: ff.fp16_update(s, g), fullgraph=True)
    comp, eager = state, state
    for i in range(4):
        g = _grads(state, 20 + i, bad=(i == 1))
        comp = fn(comp, g)
        eager = ff.fp16_update(eager, g, impl="reference")
        for x, y in zip(tree_leaves(comp), tree_leaves(eager)):
            if x.is_floating_point():
                torch.testing.assert_close(x.float(), y.float(), rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(x, y)


def test_the_default_update_is_the_fused_op_on_pytorch_kernels_within_the_contract():
    from functional_fp16.update import dispatch
    from tests.helpers import assert_within_one_operation_ulp

    for tx in [
        ff.sgd(0.05, momentum=0.9),
        ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.05, momentum=0.9, nesterov=True)),
    ]:
        state = _state(tx)
        assert ff.update_path(state) == "fused"
        assert dispatch.route(state).kernel == "generic"  # PyTorch's multi-tensor ops
        for i in range(4):
            g = _grads(state, 30 + i, bad=(i == 1))
            ref = ff.fp16_update(state, g, impl="reference")
            new = ff.fp16_update(state, g)
            assert torch.equal(new.grads_finite, ref.grads_finite)
            assert _bits_equal((new.loss_scale, new.step), (ref.loss_scale, ref.step))
            if bool(ref.grads_finite):
                for k in state.master:
                    assert_within_one_operation_ulp(new.master[k], ref.master[k], state.master[k])
                    assert torch.equal(new.params[k], new.master[k].half())
            else:
                assert _bits_equal((new.master, new.opt_state), (state.master, state.opt_state))
            state = ref


@pytest.mark.slow
@pytest.mark.parametrize("check", list(CUDA_CHECKS.CHECKS))
def test_cuda_checks_script_check_passes(check):
    results = CUDA_CHECKS.run_check(check, torch.device("cuda"))
    torch._dynamo.reset()
    assert results and all(verdict == "PASS" for verdict, _, _ in results), results
