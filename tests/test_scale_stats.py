"""The loss-scale counters (``state.scale_stats``, ``ff.loss_scale_stats``).

Their rules are checked against a plain-Python model that reads only what a
user sees: each step's loss scale before and after, and whether it was
applied. Every implementation must give the same counters bit for bit, under
``vmap`` per member and under ``torch.compile``; checkpoints (single-file and
DCP) carry them, and files written before they existed load with zeros.
"""

import math
import warnings
from pathlib import Path

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from tests.helpers import assert_states_bitwise_equal

NS = ff.NAMESPACE
DATA = Path(__file__).parent / "data"
IMPLS = [("reference", False), ("foreach", False), ("fused", False), ("fused", True)]


def model(history):
    """The counters from ``(scale before, scale after, applied)`` per optimiser step."""
    skips = growths = backoffs = since = 0
    for before, after, applied in history:
        skips += not applied
        growths += after > before
        backoffs += after < before
        since = since + 1 if applied else 0
    return {"skips": skips, "growths": growths, "backoffs": backoffs, "since_skip": since}


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _grads(bad: bool, step: int):
    g = torch.Generator().manual_seed(100 + step)
    out = {k: (torch.randn(v.shape, generator=g) * 4).half() for k, v in _params().items()}
    if bad:
        out["w"][1, 2] = math.inf if step % 2 else math.nan
    return out


def _run(pattern, impl, donate, tx=None, every=1):
    tx = tx or ff.adamw(1e-3, weight_decay=0.1)
    if every > 1:
        tx = ff.MultiSteps(tx, every)
    scale = ff.DynamicLossScale(2.0**3, growth_interval=2, hysteresis=2)
    state = ff.fp16_init(_params(), tx, scale)
    history, states = [], []
    for i, bad in enumerate(pattern):
        before = float(state.loss_scale.loss_scale)
        new = ff.fp16_update(state, _grads(bad, i), impl=impl, donate=donate)
        closed = every == 1 or int(new.opt_state.mini_step) == 0
        if closed:
            history.append((before, float(new.loss_scale.loss_scale), bool(new.grads_finite)))
        state = optree.tree_map(torch.clone, new, namespace=NS) if donate else new
        states.append(state)
    return states, history


@settings(max_examples=12, deadline=None, database=None)
@given(pattern=st.lists(st.booleans(), min_size=1, max_size=14))
def test_counters_follow_the_rules_and_agree_bitwise_across_implementations(pattern):
    ref, history = _run(pattern, "reference", False)
    assert ff.loss_scale_stats(ref[-1]) == model(history)
    for impl, donate in IMPLS[1:]:
        got, _ = _run(pattern, impl, donate)
        for a, b in zip(ref, got):
            assert_states_bitwise_equal(a.scale_stats, b.scale_stats)


def test_multisteps_counts_windows_not_micro_batches():
    pattern = [False, True, False, False, True, True, False, False]  # windows of two
    states, history = _run(pattern, "reference", False, every=2)
    assert len(history) == 4
    assert ff.loss_scale_stats(states[-1]) == model(history)
    assert ff.loss_scale_stats(states[-1])["skips"] == 2  # windows 1 and 3 overflowed
    for impl, donate in IMPLS[1:]:
        got, _ = _run(pattern, impl, donate, every=2)
        assert_states_bitwise_equal(got[-1].scale_stats, states[-1].scale_stats)


def test_counters_under_vmap_and_compile():
    patterns = [[False, True, False, False], [True, True, False, False], [False] * 4]
    alone = [_run(p, "fused", False)[0][-1] for p in patterns]
    members = [ff.fp16_init(_params(), ff.adamw(1e-3)) for _ in patterns]
    tx = members[0].tx
    scale = ff.DynamicLossScale(2.0**3, growth_interval=2, hysteresis=2)
    stacked = ff.tree_stack([ff.fp16_init(_params(), tx, scale) for _ in patterns])
    vm = torch.func.vmap(ff.fp16_update)
    for i in range(4):
        grads = ff.tree_stack([_grads(p[i], i) for p in patterns])
        stacked = vm(stacked, grads)
    per_member = ff.loss_scale_stats(stacked)
    for k, one in enumerate(alone):
        assert {n: v[k] for n, v in per_member.items()} == ff.loss_scale_stats(one)

    torch._dynamo.reset()
    step = torch.compile(ff.fp16_update, fullgraph=True)
    state = eager = ff.fp16_init(_params(), ff.adamw(1e-3), scale)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i, bad in enumerate([False, True, False, False, True]):
            state = step(state, _grads(bad, i))
            eager = ff.fp16_update(eager, _grads(bad, i))
            assert_states_bitwise_equal(state.scale_stats, eager.scale_stats)
    torch._dynamo.reset()


def test_checkpoints_carry_the_counters(tmp_path):
    states, history = _run([False, True, False], "fused", False)
    state = states[-1]
    ff.save_checkpoint(tmp_path / "s.ckpt", state)
    back = ff.load_checkpoint(tmp_path / "s.ckpt", like=state)
    assert ff.loss_scale_stats(back) == model(history) == ff.loss_scale_stats(state)
    ffd.save_dcp_state(state, tmp_path / "dcp")
    again = ffd.load_dcp_state(
        ff.fp16_init(_params(), state.tx, state.loss_scale), tmp_path / "dcp"
    )
    assert_states_bitwise_equal(again, state)


def _before_scale_stats():
    """The state ``tests/data/state_before_scale_stats.ckpt`` holds, rebuilt (the code that
    wrote it: five reference steps of AdamW, the third overflowing)."""
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}
    scale = ff.DynamicLossScale(2.0**4, growth_interval=2)
    state = ff.fp16_init(params, ff.adamw(1e-3, weight_decay=0.1), scale)
    for i in range(5):
        grads = {k: (torch.randn(v.shape, generator=g) * 8).half() for k, v in params.items()}
        if i == 2:
            grads["w"][0, 0] = float("inf")
        state = ff.fp16_update(state, grads, impl="reference")
    return state


def test_a_checkpoint_from_before_the_counters_loads_them_as_zeros(tmp_path):
    want = _before_scale_stats()
    with pytest.warns(UserWarning, match="before FP16State.scale_stats.*start at zero"):
        got = ff.load_checkpoint(DATA / "state_before_scale_stats.ckpt", like=want)
    assert ff.loss_scale_stats(got) == dict.fromkeys(ff.loss_scale_stats(want), 0)
    assert ff.loss_scale_stats(want)["skips"] == 1  # the template's own are not taken
    old = [getattr(got, f) for f in ff.FP16State.FIELDS if f != "scale_stats"]
    new = [getattr(want, f) for f in ff.FP16State.FIELDS if f != "scale_stats"]
    assert_states_bitwise_equal(old, new)
    # A DCP directory written without them loads the same way.
    import torch.distributed.checkpoint as dcp

    from functional_fp16.distributed.dcp_state import one_process_is_intended, state_to_dcp

    saved = state_to_dcp(want)
    del saved["scale_stats"]
    with one_process_is_intended():
        dcp.save(saved, checkpoint_id=tmp_path / "old_dcp", no_dist=True)
    with pytest.warns(UserWarning, match="before FP16State.scale_stats"):
        again = ffd.load_dcp_state(
            ff.fp16_init(_params(), want.tx, want.loss_scale), tmp_path / "old_dcp"
        )
    assert ff.loss_scale_stats(again) == dict.fromkeys(ff.loss_scale_stats(want), 0)
    assert_states_bitwise_equal(again.master, want.master)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="state must be an FP16State"):
        ff.loss_scale_stats({"scale_stats": 1})
    state = ff.fp16_init(_params(), ff.sgd(0.1))
    bad = state.replace(scale_stats=ff.precision.scale_stats.ScaleStats(*[torch.zeros(())] * 4))
    with pytest.raises(TypeError, match=r"state.scale_stats.skips: dtype torch.float32"):
        ff.fp16_update(bad, _grads(False, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ff.loss_scale_stats(state) == dict.fromkeys(
            ("skips", "growths", "backoffs", "since_skip"), 0
        )
