"""Stuck-scale detection: a clear error instead of training on silently, and no sync per step."""

from __future__ import annotations

import math

import pytest
import torch

import functional_fp16 as ff

INF = math.inf
NAN = math.nan


def make_state(loss_scale=None):
    params = {"w": torch.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": torch.zeros(3)}
    if loss_scale is None:
        loss_scale = ff.DynamicLossScale(init_scale=8.0, min_scale=1.0, growth_interval=1000)
    return ff.fp16_init(params, ff.sgd(0.01, momentum=0.9), loss_scale)


def grads_for(state, value=None):
    g = {k: torch.full_like(v, 0.5) for k, v in state.params.items()}
    if value is not None:
        g["w"] = g["w"].clone()
        g["w"][1, 2] = value
    return g


def run(monitor, state, plan, check_every):
    """Runs ``plan`` (a list of (grad value or None, loss)) and checks every ``check_every``."""
    for i, (value, loss) in enumerate(plan, start=1):
        loss_t = torch.tensor(loss)
        state = ff.fp16_update(state, grads_for(state, value), loss=loss_t)
        monitor.observe(state, loss_t)
        if i % check_every == 0:
            monitor.check()
    return state


def test_overflow_storm_at_min_scale_raises_an_actionable_error():
    state = make_state()
    monitor = ff.StuckScaleMonitor(patience=10)
    monitor.observe(state)  # the initial state: records the scale in force
    # 4 healthy steps, then nothing but overflows. From 8 the scale backs off
    # to 4, 2, 1 (three skipped steps above the floor); the fourth overflow is
    # the first one at the minimum.
    plan = [(None, 1.0)] * 4 + [(INF, 1.0)] * 40
    with pytest.raises(ff.StuckScaleError) as info:
        run(monitor, state, plan, check_every=5)
    err = info.value
    # Stuck steps are updates 8, 9, ...; the 10th of them is update 17, and the
    # first check at or after it is at update 20, which has seen 13 of them.
    assert err.step == 20 and err.run_length == 13
    assert err.last_applied_step == 4 and err.last_finite_loss == 1.0
    assert err.loss_scale == 1.0 and err.nonfinite_losses == 0
    text = str(err)
    for needle in (
        "13 consecutive updates (8 to 20)",
        "minimum (1)",
        "last applied update was step 4, loss 1",
        "learning rate",
        "bfloat16",
        "data",
        "checkpoint saved at or before step 4",
    ):
        assert needle in text, needle


def test_no_error_below_patience_or_above_the_floor():
    state = make_state()
    monitor = ff.StuckScaleMonitor(patience=10)
    monitor.observe(state)
    # Nine overflows at the floor, one good step, nine more: never ten in a row.
    plan = [(INF, 1.0)] * 3 + ([(INF, 1.0)] * 9 + [(None, 1.0)]) * 5
    state = run(monitor, state, plan, check_every=7)
    monitor.check()
    assert float(state.loss_scale.loss_scale) == 1.0
    # Many overflows far above the floor are ordinary backoff, not a stuck run.
    state = make_state(ff.DynamicLossScale(init_scale=2.0**24, min_scale=1.0, growth_interval=1))
    monitor = ff.StuckScaleMonitor(patience=3)
    monitor.observe(state)
    run(monitor, state, [(INF, 1.0), (None, 1.0)] * 30, check_every=4)


def test_a_run_that_ended_before_the_check_is_still_reported():
    state = make_state()
    monitor = ff.StuckScaleMonitor(patience=5)
    monitor.observe(state)
    plan = [(INF, 1.0)] * 3 + [(INF, 1.0)] * 6 + [(None, 1.0)] * 5
    state = run(monitor, state, plan, check_every=100)
    with pytest.raises(ff.StuckScaleError) as info:
        monitor.check()
    assert info.value.run_length == 6 and info.value.step == 9
    monitor.check()  # a new window: the run is over, nothing to report


def test_non_finite_loss_is_stuck_even_with_a_static_scale():
    state = make_state(ff.StaticLossScale(1024.0))
    monitor = ff.StuckScaleMonitor(patience=4)
    monitor.observe(state)
    plan = [(None, 2.0)] * 3 + [(None, NAN), (None, INF), (None, NAN), (None, NAN)]
    with pytest.raises(ff.StuckScaleError) as info:
        run(monitor, state, plan, check_every=1)
    err = info.value
    assert err.run_length == 4 and err.nonfinite_losses == 4 and err.step == 7
    assert err.last_applied_step == 3 and err.last_finite_loss == 2.0
    assert "the loss was inf or NaN in 4 consecutive steps (4 to 7)" in str(err)


def test_overflow_with_a_static_scale_has_nowhere_to_back_off():
    state = make_state(ff.StaticLossScale(1024.0))
    monitor = ff.StuckScaleMonitor(patience=3)
    monitor.observe(state)
    with pytest.raises(ff.StuckScaleError, match="3 consecutive updates"):
        run(monitor, state, [(None, 1.0), (NAN, 1.0), (INF, 1.0), (NAN, 1.0)], check_every=4)


def test_the_update_itself_never_raises():
    state = make_state()
    for _ in range(60):
        state = ff.fp16_update(state, grads_for(state, NAN), loss=torch.tensor(NAN))
    assert int(state.step) == 60 and float(state.loss_scale.loss_scale) == 1.0
    assert not bool(state.grads_finite)


def test_observe_never_reads_a_tensor_on_the_host(monkeypatch):
    state = make_state()
    monitor = ff.StuckScaleMonitor(patience=2)
    states = []
    for i in range(10):  # two good steps, then 8 overflows: 3 backoffs and 5 stuck
        state = ff.fp16_update(state, grads_for(state, INF if i > 1 else None))
        states.append(state)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation in observe()")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, forbidden)
        for s in states:
            monitor.observe(s, torch.tensor(1.0))
    with pytest.raises(ff.StuckScaleError) as info:
        monitor.check()
    assert info.value.run_length == 5 and info.value.last_applied_step == 2


def test_monitor_state_survives_a_checkpoint(tmp_path):
    state = make_state()
    monitor = ff.StuckScaleMonitor(patience=6)
    monitor.observe(state)
    state = run(monitor, state, [(INF, 1.0)] * 6, check_every=100)  # 3 stuck so far
    ff.save_checkpoint(tmp_path / "m.ckpt", {"state": state, "monitor": monitor.state})
    like = {"state": make_state(), "monitor": monitor.state}
    loaded = ff.load_checkpoint(tmp_path / "m.ckpt", like)
    resumed = ff.StuckScaleMonitor(patience=6, state=loaded["monitor"])
    run(resumed, loaded["state"], [(INF, 1.0)] * 2, check_every=100)
    resumed.check()  # 5 in a row: not yet
    with pytest.raises(ff.StuckScaleError, match="6 consecutive updates"):
        run(resumed, loaded["state"], [(INF, 1.0)], check_every=1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"patience": 0}, ValueError, "patience must be >= 1"),
        ({"patience": 2.5}, TypeError, "patience must be an int"),
        ({"patience": True}, TypeError, "patience must be an int"),
        ({"state": {"run": 0}}, TypeError, "state must be a StuckScaleState"),
    ],
)
def test_bad_monitor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ff.StuckScaleMonitor(**kwargs)


def test_bad_observe_arguments():
    monitor = ff.StuckScaleMonitor()
    with pytest.raises(TypeError, match="state must be an FP16State"):
        monitor.observe({"w": torch.zeros(1)})
    with pytest.raises(TypeError, match="loss must be a tensor or None"):
        monitor.observe(make_state(), 1.0)
    assert monitor.state is None


def test_the_cifar10_example_stops_with_the_stuck_scale_error(tmp_path, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    examples = Path(__file__).resolve().parent.parent / "examples"
    if str(examples) not in sys.path:
        sys.path.insert(0, str(examples))
    spec = importlib.util.spec_from_file_location(
        "cifar10_functional", examples / "cifar10_functional.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # A learning rate of 1e4 blows the loss up after the first step; from an
    # initial scale of 4 the scale reaches its minimum of 1 after two backoffs.
    argv = [
        "--dataset",
        "fake",
        "--fake-train-size",
        "160",
        "--fake-test-size",
        "20",
        "--batch-size",
        "16",
        "--eval-batch-size",
        "20",
        "--device",
        "cpu",
        "--no-progress",
        "--no-plot",
        "--workers",
        "0",
        "--epochs",
        "1",
        "--no-tune-malloc",
        "--lr",
        "1e4",
        "--init-scale",
        "4",
        "--stuck-patience",
        "3",
        "--log-every",
        "2",
        "--out-dir",
        str(tmp_path),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(SystemExit, match="error: Training is stuck") as info:
            example.main(argv)
    finally:
        torch.set_num_threads(threads)
    assert "The last applied update was step 1" in str(info.value)
    assert not list(tmp_path.glob("checkpoint_epoch_*.pt"))  # stopped within the first epoch


def test_a_first_step_that_backs_off_onto_the_floor_is_not_called_stuck():
    """The first observed step may have used a larger scale than the one it left behind."""
    state = ff.fp16_init(
        {"w": torch.ones(2)}, ff.sgd(0.1), ff.DynamicLossScale(init_scale=2.0, min_scale=1.0)
    )
    monitor = ff.StuckScaleMonitor(patience=1)
    bad = {"w": torch.tensor([float("inf"), 0.0], dtype=torch.float16)}
    state = ff.fp16_update(state, bad)  # used 2, now at the floor 1
    monitor.observe(state)
    monitor.check()
    state = ff.fp16_update(state, bad)  # used the floor: stuck
    monitor.observe(state)
    with pytest.raises(ff.StuckScaleError):
        monitor.check()


def test_the_pure_pair_counts_from_the_first_update_and_never_mutates():
    state = make_state(ff.DynamicLossScale(init_scale=1.0, min_scale=1.0))  # at the floor
    tracker = ff.stuck_scale_init(state)
    assert int(tracker.run) == 0 and float(tracker.scale) == 1.0
    history = [tracker]
    for value in (INF, INF, None, INF):  # the very first update is already stuck
        state = ff.fp16_update(state, grads_for(state, value), loss=torch.tensor(1.0))
        before = [t.clone() for t in tracker]
        new = ff.stuck_scale_observe(tracker, state, torch.tensor(1.0))
        same = [
            torch.equal(a.reshape(1).view(torch.uint8), b.reshape(1).view(torch.uint8))
            for a, b in zip(tracker, before)
        ]  # bitwise: the loss starts as NaN
        assert all(same)  # pure
        tracker = new
        history.append(tracker)
    assert [int(t.run) for t in history] == [0, 1, 2, 0, 1]
    assert int(tracker.worst) == 2 and int(tracker.last_applied_step) == 3
    with pytest.raises(ff.StuckScaleError, match="2 consecutive updates \\(1 to 2\\)"):
        ff.stuck_scale_check(tracker, patience=2)
    fresh = ff.stuck_scale_check(tracker, patience=3)  # below patience: a new window
    assert int(fresh.worst) == int(fresh.run) == 1
    with pytest.raises(TypeError, match="tracker must be a StuckScaleState"):
        ff.stuck_scale_observe({"run": 0}, state)
    with pytest.raises(ValueError, match="patience must be >= 1"):
        ff.stuck_scale_check(tracker, patience=0)
