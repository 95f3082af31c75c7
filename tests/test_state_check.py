"""A state whose parts do not belong together is refused before anything is computed.

The cases (``tests/_state_cases.py``) are states assembled by hand the way a
user or a migration might: momentum of another shape, dtype or slot, a
master in FP16 or of another shape or keys, counters and scale of other
dtypes. Each runs against every implementation, plain, under ``MultiSteps``,
under ``vmap`` and sharded over two gloo ranks, in child processes, so a crash (a kernel writing past a
buffer) fails the test instead of ending the run. Every case must be refused
with the right exception type, a message naming the part and the leaf path,
and the given state bitwise untouched.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._util.tree import NAMESPACE, tree_paths
from functional_fp16.update import state_check
from tests._state_cases import CASES, IMPLS, SHARDED_IMPLS, make_state, make_tx, on_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("plain", "multisteps", "vmap", "sharded")
_results: dict[str, dict] = {}
_trained: dict[str, ff.FP16State] = {}


def _child(mode: str) -> tuple[int, str, str]:
    """Runs ``tests._state_cases MODE``; ``sharded`` as two gloo ranks. Returns rank 0's
    exit status (or -1 when the ranks had to be stopped), stdout and stderr."""
    if mode != "sharded":  # the one-process modes share a child
        mode = ",".join(m for m in MODES if m != "sharded")
    command = [sys.executable, "-m", "tests._state_cases", mode]
    if mode != "sharded":
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        return proc.returncode, proc.stdout, proc.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        out, err = procs[0].communicate(timeout=240)  # a hang is a failure, not a wait
        procs[1].communicate(timeout=30)
        return procs[0].returncode, out, err
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        out, err = procs[0].communicate()
        return -1, out, "the ranks hung and were stopped\n" + err


def _run_mode(mode: str) -> dict:
    """``{(mode, impl, case): result}`` from the child process(es) running ``mode``'s cases."""
    key = "sharded" if mode == "sharded" else "one process"
    if key not in _results:
        returncode, stdout, stderr = _child(mode)
        found, running = {}, None
        for line in stdout.splitlines():
            record = json.loads(line)
            if "start" in record:
                running = tuple(record["start"])
            else:
                found[(record["mode"], record["impl"], record["case"])] = record
                running = None
        _results[key] = {
            "found": found,
            "crash": None
            if returncode == 0
            else f"exit status {returncode} while running {running}: {stderr[-2000:]}",
        }
    return _results[key]


# Sharded, the state is checked before the step's first collective, before any
# implementation is chosen: one implementation stands for all there.
_RUNS = [
    pytest.param(mode, impl, case, id=f"{case.name}-{impl}-{mode}")
    for mode in MODES
    for impl in (IMPLS if mode != "sharded" else SHARDED_IMPLS)
    for case in CASES
]


@pytest.mark.parametrize("mode, impl, case", _RUNS)
def test_mismatched_state_is_refused_naming_part_and_path(mode, impl, case):
    run = _run_mode(mode)
    result = run["found"].get((mode, impl, case.name))
    assert result is not None, f"no result for {case.name!r}: {run['crash']}"
    assert result["outcome"] == "refused", f"{case.name!r} was computed silently"
    assert result["type"] == case.error.__name__, result
    for word in case.words:
        assert word in result["message"], (word, result["message"])
    assert result["untouched"], f"{case.name!r}: the given state changed"
    assert run["crash"] is None, run["crash"]


def test_a_state_seen_before_is_not_checked_again():
    """The template is built once per configuration; later calls look the signature up."""
    built = []
    original = state_check._template

    def counting(*args, **kwargs):
        built.append(1)
        return original(*args, **kwargs)

    state = make_state(make_tx("plain"))
    state_check._good.clear()
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    try:
        state_check._template = counting
        for _ in range(3):  # rebuilt by hand each time, so not carrying a signature
            state = ff.fp16_update(state.replace(), grads)
        assert len(built) == 1
        state_check._good.clear()  # forgotten: only the signature a state carries can help
        for _ in range(3):  # states the update returned carry theirs
            state = ff.fp16_update(state, grads)
        assert len(built) == 1
        bad = on_trace(state, lambda t: t._replace(trace={**t.trace, "w": t.trace["w"].half()}))
        for _ in range(2):  # a refused signature is never remembered
            with pytest.raises(TypeError, match=r"state\.opt_state\[1\]\.trace\['w'\]"):
                ff.fp16_update(bad, grads)
        assert len(built) == 3
    finally:
        state_check._template = original


def test_states_alike_share_one_signature_object():
    """Two states of one layout get the very signature first checked, so the caches
    keyed by it find their entries by identity, not by comparing every leaf's metadata."""
    state_check._good.clear()
    tx = make_tx("plain")
    first = state_check.check_state(make_state(tx))
    again = state_check.check_state(make_state(tx))
    assert again == first and again is first


def test_a_transform_whose_init_needs_values_is_checked_on_real_tensors():
    """``tx.init`` that reads values cannot run on meta tensors; the check builds real ones."""

    def init(params):
        scale = float(sum(p.abs().sum() for p in params.values()))  # reads values
        return {k: torch.full_like(p, scale) for k, p in params.items()}

    def update(updates, state, params=None):
        return {k: -0.1 * u for k, u in updates.items()}, state

    tx = ff.GradientTransformation(init, update)
    state = ff.fp16_init({"a": torch.ones(3), "b": torch.ones(2, 2)}, tx)
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    assert ff.fp16_update(state, grads).step == 1
    bad = state.replace(opt_state={**state.opt_state, "a": state.opt_state["a"][:2]})
    with pytest.raises(ValueError, match=r"state\.opt_state\['a'\]: shape \(2,\), expected \(3,\)"):
        ff.fp16_update(bad, grads)


def test_compiled_update_refuses_a_mismatched_state():
    """Under ``torch.compile`` the check runs while tracing: the same refusal reaches the caller."""
    state = make_state(make_tx("plain"))
    bad = on_trace(state, lambda t: t._replace(trace={**t.trace, "b": t.trace["b"].half()}))
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    torch._dynamo.reset()
    with pytest.raises(
        TypeError, match=r"state\.opt_state\[1\]\.trace\['b'\]: dtype torch\.float16"
    ):
        torch.compile(ff.fp16_update)(bad, grads)
    torch._dynamo.reset()


_MUTATIONS = {
    "float16": lambda x, other: x.half(),
    "float64": lambda x, other: x.double(),
    "int32": lambda x, other: x.int(),
    "bool": lambda x, other: x.bool(),
    "extra dim": lambda x, other: x[None],
    "flattened": lambda x, other: x.reshape(-1),
    "meta": lambda x, other: x.to("meta"),
    "another leaf": lambda x, other: other,
    "a number": lambda x, other: 1.0,
}


@settings(max_examples=80, deadline=None, database=None)
@given(data=st.data())
def test_any_leaf_changed_by_hand_is_refused_or_fits(data):
    """Fuzz: one leaf of a trained state changed; refused naming its path, or it still fits."""
    mode = data.draw(st.sampled_from(["plain", "multisteps"]), label="mode")
    if mode not in _trained:
        _trained[mode] = make_state(make_tx(mode))
    state = _trained[mode]
    leaves, spec = optree.tree_flatten(state, namespace=NAMESPACE)
    paths = tree_paths(state)
    # params are the reference the rest is checked against (their own checks: test_update.py)
    n_params = len(optree.tree_leaves(state.params, namespace=NAMESPACE))
    i = data.draw(st.integers(n_params, len(leaves) - 1), label="leaf")
    j = data.draw(st.integers(0, len(leaves) - 1), label="other")
    how = data.draw(st.sampled_from(sorted(_MUTATIONS)), label="mutation")
    new = _MUTATIONS[how](leaves[i], leaves[j])
    fits = isinstance(new, torch.Tensor) and (new.shape, new.dtype, new.device) == (
        leaves[i].shape,
        leaves[i].dtype,
        leaves[i].device,
    )
    mutated = optree.tree_unflatten(spec, [new if k == i else x for k, x in enumerate(leaves)])
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    if fits:
        assert ff.fp16_update(mutated, grads).step == state.step + 1
        return
    with pytest.raises((TypeError, ValueError)) as info:
        ff.fp16_update(mutated, grads)
    message = str(info.value)
    assert message.startswith("state" + paths[i]), (paths[i], how, message)


@pytest.mark.parametrize("param_dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_every_update_keeps_the_signature_it_carries_forward(param_dtype):
    """A state ``fp16_update`` returns is not checked again: it carries its input's
    signature. That is sound only if every implementation keeps every leaf's
    structure, shape, strides, dtype and device; this holds them to it, for every
    optimiser of the matrix, plain and under MultiSteps, pure and donated, with a
    channels-last leaf, a skipped step, and a float32 working copy that is its master."""
    from tests.helpers import matrix_grads, optimiser_matrix, random_tree

    tree = random_tree(0)
    tree["conv"] = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    for name, tx in optimiser_matrix().items():
        for outer in (tx, ff.MultiSteps(tx, 2)):
            for impl in IMPLS:
                for donate in (False, True):
                    state = ff.fp16_init(tree, outer, param_dtype=param_dtype)
                    before = state_check._signature(state)
                    for bad in (None, float("inf")):
                        grads = matrix_grads(state, 0, 0, bad=bad)
                        state = ff.fp16_update(state, grads, impl=impl, donate=donate)
                        where = (name, impl, donate, bad)
                        assert state._checked == before, where
                        assert state_check._signature(state) == before, where


def test_a_state_made_by_hand_is_checked_again_and_states_are_immutable():
    state = make_state(make_tx("plain"))
    assert state._checked is not None  # made by fp16_update
    with pytest.raises(AttributeError, match="immutable"):
        state.master = {}
    rebuilt = optree.tree_unflatten(*reversed(optree.tree_flatten(state, namespace=NAMESPACE)))
    changed = state.replace(step=state.step.long())
    assert rebuilt._checked is None and changed._checked is None
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    with pytest.raises(TypeError, match=r"state\.step: dtype torch\.int64"):
        ff.fp16_update(changed, grads)


def test_a_donated_state_whose_leaves_share_memory_is_refused(impl):
    state = ff.fp16_init({"w": torch.randn(6), "b": torch.randn(6)}, ff.sgd(0.1, momentum=0.9))
    grads = {k: torch.ones_like(v) for k, v in state.params.items()}
    state = ff.fp16_update(state, grads)
    shared = on_trace(state, lambda t: t._replace(trace={**t.trace, "w": state.master["w"]}))
    with pytest.raises(ValueError, match="share memory"):
        ff.fp16_update(shared, grads, impl=impl, donate=True)
    # Pure, the same state computes: nothing is written in place.
    assert ff.fp16_update(shared, grads, impl=impl).step == 2


def test_a_state_tensor_with_overlapping_elements_is_refused():
    state = ff.fp16_init({"w": torch.randn(4, 4)}, ff.sgd(0.1, momentum=0.9))
    grads = {"w": torch.ones(4, 4, dtype=torch.float16)}
    expanded = state.replace(master={"w": torch.randn(4, 1).expand(4, 4)})
    with pytest.raises(ValueError, match=r"state\.master\['w'\]: strides \(1, 0\)"):
        ff.fp16_update(expanded, grads, donate=True)
    transposed = state.replace(master={"w": state.master["w"].t().contiguous().t()})
    assert ff.fp16_update(transposed, grads).step == 1  # dense in another order: fine
