"""``torch.compile(fullgraph=True)`` of the update and of a whole training step.

The model is tiny so that compiling stays cheap. Graph breaks make
``fullgraph=True`` raise; recompilation is made an error with
``torch._dynamo.config.error_on_recompile`` and also counted. Each
implementation's compiled step is held to its own path: the dispatcher's route
for it, and its own operators (``traced_as`` in ``tests/helpers.py``) in the
traced graph, none of another implementation's.
"""

import math

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map
from tests.helpers import IMPLEMENTATION_MATRIX, implementation

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "l1": {"w": torch.randn(16, 8, generator=g) * 0.3, "b": torch.zeros(16)},
        "l2": {"w": torch.randn(4, 16, generator=g) * 0.3, "b": torch.zeros(4)},
        "scalar": torch.tensor(0.5),
    }


def _loss_fn(params, x, y):
    p = tree_map(lambda t: t.float(), params)  # FP16 parameters, FP32 compute (CPU)
    h = F.relu(x @ p["l1"]["w"].T + p["l1"]["b"])
    logits = (h @ p["l2"]["w"].T + p["l2"]["b"]) * p["scalar"]
    return F.cross_entropy(logits, y)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def _make_step(impl, donate):
    def train_step(state, x, y):
        def scaled(p):
            loss = _loss_fn(p, x, y)
            return state.loss_scale.scale(loss), loss.detach()

        grads, (_, loss) = torch.func.grad_and_value(scaled, has_aux=True)(state.params)
        return ff.fp16_update(state, grads, loss=loss, impl=impl, donate=donate), loss

    return train_step


def _clone(state):
    return tree_map(lambda t: t.clone(), state)


def _close(a, b, tight=False):
    for x, y in zip(tree_leaves(a), tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        if not x.is_floating_point():
            assert torch.equal(x, y)
        elif tight and x.dtype == torch.float32:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)
        elif tight:
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)
        else:
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("donate", [False, True])
def test_train_step_compiles_without_breaks_or_recompiles(impl, donate):
    tx = ff.sgd(0.1, momentum=0.9, weight_decay=1e-4)
    state0 = ff.fp16_init(_params(), tx, ff.DynamicLossScale(2.0**15, growth_interval=2))
    # a fusable SGD chain: each implementation's first route
    assert ff.update_path(state0, impl) == implementation(impl).routes[0]
    step = _make_step(impl, donate)
    backend = CompileCounterWithBackend("inductor")  # keeps the traced graphs
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager_state, comp_state = _clone(state0), _clone(state0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(5):
            x, y = _batch(i)
            if i == 2:  # an overflowing step: the flag is data, not a guard
                x = x.clone()
                x[0, 0] = math.inf
            eager_state, _ = step(eager_state, x, y)
            comp_state, _ = compiled(comp_state, x, y)
            eager_state, comp_state = _clone(eager_state), _clone(comp_state)
            _close(comp_state, eager_state)
    assert bool(comp_state.step == 5)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    _assert_traced_as(backend.graphs, impl)


def _assert_traced_as(graphs, impl):
    """The traced graphs hold ``impl``'s own operators and no other implementation's."""
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    for other in IMPLEMENTATION_MATRIX:
        if other.traced_as is not None:
            found = sorted(op for op in ops if other.traced_as in op)
            assert bool(found) == (other.name == impl), (impl, other.name, found)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize(
    "tx",
    [
        ff.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
        ff.sgd(ff.linear_schedule(0.1, 0.0, 10), momentum=0.8, dampening=0.5),
        ff.chain(ff.clip_by_global_norm(0.1), ff.sgd(0.1, momentum=0.9)),
    ],
    ids=["nesterov_wd", "schedule_dampening", "clip"],
)
def test_compiled_update_matches_eager(tx, donate):
    # Inductor may round a fused multiply-add differently from the eager
    # kernels (``torch.add(alpha=...)`` is an FMA in eager CPU code), so the
    # compiled update agrees to a few ulp; skip decisions and counters exactly.
    state = ff.fp16_init(_params(), tx, ff.DynamicLossScale(2.0**10))
    assert ff.update_path(state, "foreach") in implementation("foreach").routes
    backend = CompileCounterWithBackend("inductor")
    update = torch.compile(
        lambda s, g: ff.fp16_update(s, g, impl="foreach", donate=donate),
        fullgraph=True,
        backend=backend,
    )
    eager = _clone(state)
    comp = _clone(state)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(4):
            gen = torch.Generator().manual_seed(i)
            grads = tree_map(
                lambda p: (torch.randn(p.shape, generator=gen) * 100).to(p.dtype), state.params
            )
            if i == 1:
                grads["l1"]["w"][0, 0] = math.nan
            eager = _clone(ff.fp16_update(eager, grads, impl="reference"))
            comp = _clone(update(comp, grads))
            _close(comp, eager, tight=True)
            assert bool(comp.grads_finite) == (i != 1)
    assert counters["stats"]["unique_graphs"] == 1
    _assert_traced_as(backend.graphs, "foreach")


_FIRST_USE = """
import torch
import functional_fp16 as ff
state = ff.fp16_init({"w": torch.randn(8).half()}, ff.adamw(1e-3, weight_decay=0.1))
fn = torch.compile(ff.fp16_update, fullgraph=True)
new = fn(state, {"w": torch.ones(8, dtype=torch.float16)})
ref = ff.fp16_update(state, {"w": torch.ones(8, dtype=torch.float16)})
assert torch.equal(new.master["w"], ref.master["w"]), (new.master, ref.master)
print("ok")
"""


def test_a_compiled_update_may_be_the_first_use_in_a_process():
    """The first update of a process compiled (the kernels not yet loaded): the trace
    asks nothing that would load them (a fresh interpreter, Adam's step)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _FIRST_USE], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("tx", [ff.sgd(0.05, momentum=0.9), ff.adamw(1e-3, weight_decay=0.1)])
def test_a_compiled_update_recompiles_for_other_shapes(tx):
    """A second state of other shapes recompiles the update with dynamic shapes (Dynamo's
    automatic dynamic): the state checks trace their symbolic strides (a sort of them
    failed), and each state's update equals its eager one."""
    fn = torch.compile(ff.fp16_update, fullgraph=True)
    for n in (8, 12, 20):
        state = ff.fp16_init({"w": torch.randn(3, n).half(), "b": torch.randn(n).half()}, tx)
        grads = tree_map(lambda p: torch.full_like(p, 0.5), state.params)
        new, ref = fn(state, grads), ff.fp16_update(state, grads)
        assert torch.equal(new.master["w"], ref.master["w"])
        assert torch.equal(new.loss_scale.loss_scale, ref.loss_scale.loss_scale)
