"""Mismatched states: states whose parts do not belong together, run in a child process.

Each case builds a state by hand as a user might (``state.replace``, a
migration written for another layout, a cast) and gives it to an update.
Run as ``python -m tests._state_cases MODE[,MODE...]``: for every
implementation and case it prints one JSON line saying whether the update refused it, with
what, and whether the given state was left bitwise untouched. A case that crashes the process
ends the output early; the parent test (``tests/test_state_check.py``)
reports the case that was running.

MODE is ``plain`` (``fp16_update``), ``multisteps`` (a ``MultiSteps``
optimiser, the cases applied to its inner state), ``vmap`` (two stacked
members under ``torch.func.vmap``, each member mutated alike) or
``sharded`` (``sharded_update`` of a ZeRO-1 state on every rank of a gloo
group started by the parent like ``torchrun``; rank 0 prints).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import NAMESPACE, tree_leaves, tree_map
from tests.helpers import IMPL_NAMES, implementations


class Case(NamedTuple):
    name: str
    mutate: Callable[[ff.FP16State], ff.FP16State]
    error: type  # TypeError or ValueError
    words: tuple[str, ...]  # what the message must name: the part and the leaf path


def params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(32, generator=g),
        "b": torch.randn(64, generator=g),
        "m": torch.randn(4, 8, generator=g),
    }


def _map_first(obj: Any, kind: type, fn: Callable[[Any], Any]) -> tuple[Any, bool]:
    """``obj`` with its first (depth-first) node of type ``kind`` replaced by ``fn(node)``."""
    if isinstance(obj, kind):
        return fn(obj), True
    if isinstance(obj, tuple):
        parts, done = [], False
        for x in obj:
            if not done:
                x, done = _map_first(x, kind, fn)
            parts.append(x)
        return (type(obj)(*parts) if hasattr(obj, "_fields") else tuple(parts)), done
    return obj, False


def on_trace(state: ff.FP16State, fn) -> ff.FP16State:
    opt, done = _map_first(state.opt_state, ff.TraceState, fn)
    assert done, "no TraceState in the optimiser state"
    return state.replace(opt_state=opt)


def on_chain(state: ff.FP16State, fn) -> ff.FP16State:
    """Applies ``fn`` to the SGD chain's state (the inner state under ``MultiSteps``)."""
    opt = state.opt_state
    if isinstance(opt, ff.MultiStepsState):
        return state.replace(opt_state=opt._replace(inner_opt_state=fn(opt.inner_opt_state)))
    return state.replace(opt_state=fn(opt))


def swap_trace_to_front(chain_state: tuple) -> tuple:
    """A migration written for a layout with momentum first: the momentum planted at index 0."""
    parts = list(chain_state)
    i = next(k for k, x in enumerate(parts) if isinstance(x, ff.TraceState))
    parts[0], parts[i] = parts[i], parts[0]
    return tuple(parts)


def scheduled_chain_state(state: ff.FP16State) -> tuple:
    """The chain state ``sgd(linear_schedule(...))`` makes, for the same master."""
    tx = ff.sgd(ff.linear_schedule(0.1, 0.0, 10), momentum=0.9)
    return tx.init(state.master)


def on_scale(state: ff.FP16State, **tensors) -> ff.FP16State:
    """The loss scale with tensor leaves replaced by hand (bypassing ``replace``'s checks)."""
    ls = state.loss_scale
    leaves, spec = optree.tree_flatten(ls, namespace=NAMESPACE)
    names = type(ls).TENSOR_FIELDS
    new = [tensors[n](x) if n in tensors else x for n, x in zip(names, leaves)]
    return state.replace(loss_scale=optree.tree_unflatten(spec, new))


CASES = [
    Case(
        "momentum of another shape",
        lambda s: on_trace(s, lambda t: t._replace(trace={**t.trace, "w": t.trace["w"][None]})),
        ValueError,
        ("state.opt_state", "trace['w']", "shape (1, "),
    ),
    Case(
        "momentum in FP16",
        lambda s: on_trace(s, lambda t: t._replace(trace=tree_map(torch.Tensor.half, t.trace))),
        TypeError,
        ("state.opt_state", ".trace[", "float16"),
    ),
    Case(
        "momentum in the wrong slot",
        lambda s: on_chain(s, swap_trace_to_front),
        ValueError,
        ("state.opt_state", "TraceState"),
    ),
    Case(
        "scheduled sgd's state under a constant-lr sgd",
        lambda s: on_chain(s, lambda _: scheduled_chain_state(s)),
        ValueError,
        ("state.opt_state", "ScaleByScheduleState"),
    ),
    Case(
        "master in FP16",
        lambda s: s.replace(master=tree_map(torch.Tensor.half, s.master)),
        TypeError,
        ("state.master[", "float16"),
    ),
    Case(
        "master of another shape",
        lambda s: s.replace(master={**s.master, "b": s.master["b"][None]}),
        ValueError,
        ("state.master['b']", "shape (1, "),
    ),
    Case(
        "TraceState.initialized as int64",
        lambda s: on_trace(s, lambda t: t._replace(initialized=t.initialized.long())),
        TypeError,
        ("state.opt_state", ".initialized", "int64"),
    ),
    Case(
        "loss-scale counter as int64",
        lambda s: on_scale(s, growth_count=torch.Tensor.long),
        TypeError,
        ("state.loss_scale.growth_count", "int64"),
    ),
    Case(
        "loss-scale counter as float32",
        lambda s: on_scale(s, hysteresis_count=torch.Tensor.float),
        TypeError,
        ("state.loss_scale.hysteresis_count", "float32"),
    ),
    Case(
        "loss scale as float64",
        lambda s: on_scale(s, loss_scale=torch.Tensor.double),
        TypeError,
        ("state.loss_scale.loss_scale", "float64"),
    ),
    Case(
        "step as int64",
        lambda s: s.replace(step=s.step.long()),
        TypeError,
        ("state.step", "int64"),
    ),
    Case(
        "master keyed like another model",
        lambda s: s.replace(master={"x" if k == "w" else k: v for k, v in s.master.items()}),
        ValueError,
        ("state.master", "'x'", "'w'"),
    ),
    Case(
        "master with an extra key",
        lambda s: s.replace(master={**s.master, "extra": torch.zeros(3)}),
        ValueError,
        ("state.master", "'extra'"),
    ),
    Case(
        "momentum on another device",
        lambda s: on_trace(
            s, lambda t: t._replace(trace={**t.trace, "w": t.trace["w"].to("meta")})
        ),
        ValueError,
        ("state.opt_state", "trace['w']", "meta"),
    ),
]


def make_tx(mode: str) -> ff.GradientTransformation:
    tx = ff.sgd(0.1, momentum=0.9)
    return ff.MultiSteps(tx, 2) if mode == "multisteps" else tx


def make_state(tx: ff.GradientTransformation) -> ff.FP16State:
    state = ff.fp16_init(params(), tx)
    grads = tree_map(lambda p: torch.full_like(p, 0.25), state.params)
    return ff.fp16_update(state, grads)  # momentum buffers and counters that are not zeros


def bits(state: ff.FP16State) -> list[torch.Tensor]:
    """Every tensor of the state as raw bytes (-0.0 and +0.0 differ)."""
    return [
        x.detach().cpu().contiguous().view(-1).view(torch.uint8).clone()
        if x.device.type != "meta"
        else torch.tensor(list(x.shape))
        for x in tree_leaves(state)
    ]


IMPLS = IMPL_NAMES  # the implementation matrix (tests/helpers.py)
# Sharded, the state is checked before any implementation is chosen: the default stands for all.
SHARDED_IMPLS = tuple(implementations(lambda i: i.default))


def run(modes: str) -> None:
    """Runs every case of each mode in ``modes`` (comma-separated)."""
    for mode in modes.split(","):
        run_mode(mode)


def run_mode(mode: str) -> None:
    if mode == "sharded":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        try:
            for impl in SHARDED_IMPLS:
                for case in CASES:
                    run_case(impl, mode, case, quiet=dist.get_rank() != 0)
        finally:
            dist.destroy_process_group()
        return
    for impl in IMPLS:
        for case in CASES:
            run_case(impl, mode, case)


def run_case(impl: str, mode: str, case: Case, quiet: bool = False) -> None:
    tx = make_tx(mode)
    if not quiet:
        print(json.dumps({"start": [mode, impl, case.name]}), flush=True)
    if mode == "sharded":
        from functional_fp16.distributed import shard_state, sharded_update

        state = case.mutate(shard_state(make_state(tx)))

        def update(s, g):
            return sharded_update(s, g, impl=impl)

    elif mode == "vmap":
        members = [case.mutate(make_state(tx)) for _ in range(2)]
        state = ff.tree_stack(members)
        update = torch.func.vmap(lambda s, g: ff.fp16_update(s, g, impl=impl))
    else:
        state = case.mutate(make_state(tx))

        def update(s, g):
            return ff.fp16_update(s, g, impl=impl)

    grads = tree_map(lambda p: torch.full_like(p, 0.5), state.params)
    before = bits(state)
    result: dict[str, Any] = {"mode": mode, "impl": impl, "case": case.name}
    try:
        update(state, grads)
        result["outcome"] = "accepted"
    except Exception as err:  # recorded for the parent test
        result.update(outcome="refused", type=type(err).__name__, message=str(err))
    after = bits(state)
    result["untouched"] = len(before) == len(after) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(before, after)
    )
    if not quiet:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    run(sys.argv[1])
