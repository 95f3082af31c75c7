"""from_torch / to_torch: a job continued either way follows the uninterrupted one.

Both sides of every comparison get the same FP16 gradients of a scaled loss
(fixed per step, one overflow before the switch and one after), so they
unscale to bitwise the same FP32 values (``GradScaler`` and ``fp16_update``
both multiply by fl32(1 / fl64(s))). The bounds, stated once:

* Skip decisions, loss scale and growth tracker: bitwise, every step.
* SGD master: each step both sides compute ``p - lr * b`` from the same
  buffer ``b`` (the same, bitwise, without weight decay; with it, ``b`` sees
  the parameters' difference times ``wd``, negligible). Torch rounds
  ``p + (-lr) * b`` once (a fused multiply-add in its CPU kernel), the
  reference path rounds ``-lr * b`` first: at most one ulp of the larger
  operand per applied step, so ``scaled_error`` <= 1 per applied step. (The
  fused kernel contracts as torch does and matches it bitwise here, but its
  contract is the same bound.)
* Adam: moments bitwise (the same ``lerp`` and ``addcmul``, which the fused
  kernel contracts as torch's CPU kernels do); master within
  ``scaled_error`` 4 (tests/test_adam.py's bound for the split
  learning-rate product).
* AdamW: torch rounds its decay factor ``1 - lr * wd`` to FP32 every step, a
  systematic relative drift of up to ``|fl32(1 - lr*wd) - (1 - lr*wd)|`` per
  step, plus half an ulp of one more rounding per step (tests/test_adam.py):
  ``scaled_error <= steps * (factor_error / eps32 + 0.5)``.
"""

from __future__ import annotations

import math
import pathlib
import re

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves
from tests.helpers import bits, implementations, scaled_error

BEFORE = 10  # torch (or ff) steps before the switch
AFTER = 12  # steps after it
SCALE = 2.0**10
GROWTH_INTERVAL = 3
OVERFLOW_AT = (4, 15)  # one overflow before the switch, one after
EPS32 = 2.0**-23


def make_model(seed: int = 0) -> torch.nn.Module:
    """Two linear layers; ``named_parameters`` order (0.weight, 0.bias, ...) is not sorted order."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def fp16_grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """FP16 gradients of a scaled loss for ``step``, fixed per step; an inf at OVERFLOW_AT."""
    g = torch.Generator().manual_seed(1000 + step)
    grads = {
        name: (torch.randn(p.shape, generator=g) * 40.0).half()
        for name, p in model.named_parameters()
    }
    if step in OVERFLOW_AT:
        grads["2.bias"][1] = math.inf
    return grads


def scaler_for() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=GROWTH_INTERVAL)
    scaler.scale(torch.ones(()))  # GradScaler creates its scale tensor lazily
    return scaler


def torch_step(model, optimizer, scaler, grads) -> tuple[bool, float, int]:
    """One GradScaler step on FP16-valued gradients: (skipped, scale, growth tracker)."""
    scaler.scale(torch.ones(()))  # a real job scales its loss (and so creates the scale tensor)
    for name, p in model.named_parameters():
        p.grad = grads[name].float()
    before = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    sd = scaler.state_dict()
    return sd["scale"] < before, sd["scale"], sd["_growth_tracker"]


def ff_step(state, grads, impl="auto"):
    state = ff.fp16_update(state, grads, impl=impl)
    ls = state.loss_scale
    return state, (not bool(state.grads_finite), float(ls.loss_scale), int(ls.growth_count))


class Snapshot:
    """Everything of a torch job that from_torch must not touch: bit patterns and metadata."""

    def __init__(self, optimizer, scaler=None):
        self.meta, self.tensors = [], []
        for g, group in enumerate(optimizer.param_groups):
            self.meta.append({k: v for k, v in group.items() if k != "params"})
            for i, p in enumerate(group["params"]):
                self.tensors.append(bits(p))
                for key, value in optimizer.state.get(p, {}).items():
                    self.meta.append((g, i, key, value.dtype, value.device, value.stride()))
                    self.tensors.append(bits(value))
        self.meta.append(len(optimizer.state))
        if scaler is not None:
            self.meta.append(scaler.state_dict())
            for name in ("_scale", "_growth_tracker"):
                t = getattr(scaler, name, None)
                self.meta.append((name, t is None))
                self.tensors += [] if t is None else [bits(t)]

    def __eq__(self, other):
        return (
            self.meta == other.meta
            and len(self.tensors) == len(other.tensors)
            and all(torch.equal(a, b) for a, b in zip(self.tensors, other.tensors))
        )


def snapshot(optimizer, scaler=None) -> Snapshot:
    return Snapshot(optimizer, scaler)


def state_bits(state):
    return [bits(x) for x in tree_leaves(state)]


def assert_same_bits(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


SGD_CONFIGS = [
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    dict(lr=0.05, momentum=0.9, dampening=0.25),
    dict(lr=0.05),
]


def torch_then(make_optimizer, impl="auto"):
    """A torch job for BEFORE steps, from_torch, then both continued AFTER steps side by side."""
    model = make_model()
    optimizer = make_optimizer(model)
    scaler = scaler_for()
    for step in range(BEFORE):
        torch_step(model, optimizer, scaler, fp16_grads(model, step))
    before = snapshot(optimizer, scaler)
    state = ff.from_torch(dict(model.named_parameters()), optimizer, scaler)
    assert snapshot(optimizer, scaler) == before  # from_torch reads, never writes
    assert int(state.step) == 0 and state.params["0.weight"].dtype == torch.float16
    for name, p in model.named_parameters():
        assert torch.equal(bits(state.master[name]), bits(p))
        assert torch.equal(state.params[name], p.detach().half())
    applied = 0
    for step in range(BEFORE, BEFORE + AFTER):
        grads = fp16_grads(model, step)
        taken = state_bits(state)
        theirs = torch_step(model, optimizer, scaler, grads)
        assert_same_bits(state_bits(state), taken)  # no tensor shared with the torch job
        state, ours = ff_step(state, grads, impl)
        assert ours == theirs, f"step {step}: (skipped, scale, tracker) {ours} != {theirs}"
        applied += not ours[0]
    assert applied == AFTER - 1
    return model, optimizer, state, applied


# the specification and the default implementation
SPEC_AND_DEFAULT = implementations(lambda i: i.specification or i.default)


@pytest.mark.parametrize("impl", SPEC_AND_DEFAULT)
@pytest.mark.parametrize(
    "config", SGD_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items())
)
def test_sgd_job_continued_by_fp16_update_follows_torch(config, impl):
    model, optimizer, state, applied = torch_then(
        lambda m: torch.optim.SGD(m.parameters(), **config), impl
    )
    for name, p in model.named_parameters():
        assert scaled_error(state.master[name], p.detach()) <= applied, name
        if config.get("momentum"):
            buf = optimizer.state[p]["momentum_buffer"]
            assert scaled_error(state.opt_state[1].trace[name], buf) <= applied, name


def test_sgd_with_several_groups_of_one_setting():
    def make(m):
        weights = [p for n, p in m.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in m.named_parameters() if n.endswith("bias")]
        return torch.optim.SGD([{"params": biases}, {"params": weights}], lr=0.05, momentum=0.9)

    model, _, state, applied = torch_then(make)
    for name, p in model.named_parameters():
        assert scaled_error(state.master[name], p.detach()) <= applied, name


ADAM_CASES = {
    "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
    "Adam-L2": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=1e-2),
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=1e-2),
}


@pytest.mark.parametrize("impl", SPEC_AND_DEFAULT)
@pytest.mark.parametrize("kind", list(ADAM_CASES))
def test_adam_job_continued_by_fp16_update_follows_torch(kind, impl):
    model, optimizer, state, applied = torch_then(ADAM_CASES[kind], impl)
    inner = state.opt_state[1][0] if kind == "Adam-L2" else state.opt_state[0]
    assert isinstance(inner, ff.ScaleByAdamState)
    factor_error = abs(float(torch.tensor(1.0 - 1e-3 * 1e-2)) - (1.0 - 1e-3 * 1e-2))
    for name, p in model.named_parameters():
        theirs = optimizer.state[p]
        assert int(inner.count) == int(theirs["step"]) == BEFORE - 1 + applied
        if kind == "AdamW":
            bound = applied * (factor_error / EPS32 + 0.5)
        else:
            bound = 4.0
        assert scaled_error(state.master[name], p.detach()) <= bound, name
        if kind == "Adam-L2":  # the decayed gradient depends on the parameters
            assert scaled_error(inner.mu[name], theirs["exp_avg"]) <= 4.0
        else:
            assert torch.equal(bits(inner.mu[name]), bits(theirs["exp_avg"]))
            assert torch.equal(bits(inner.nu[name]), bits(theirs["exp_avg_sq"]))


def ff_then(tx, make_optimizer, by_identity):
    """An ff job for BEFORE steps, to_torch into a fresh torch job, then both continued."""
    model = make_model(seed=1)
    ls = ff.DynamicLossScale(init_scale=SCALE, growth_interval=GROWTH_INTERVAL)
    state = ff.fp16_init(dict(model.named_parameters()), tx, ls)
    for step in range(BEFORE):
        state, _ = ff_step(state, fp16_grads(model, step))
    other = make_model(seed=2)  # other values: to_torch must overwrite them
    optimizer = make_optimizer(other)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=GROWTH_INTERVAL)
    kept = state_bits(state)
    params = dict(other.named_parameters()) if by_identity else None
    ff.to_torch(state, optimizer, scaler, params=params)
    assert_same_bits(state_bits(state), kept)
    assert scaler.state_dict()["scale"] == float(state.loss_scale.loss_scale)
    for name, p in other.named_parameters():
        assert torch.equal(bits(p), bits(state.master[name]))
    applied = 0
    for step in range(BEFORE, BEFORE + AFTER):
        grads = fp16_grads(other, step)
        theirs = torch_step(other, optimizer, scaler, grads)
        state, ours = ff_step(state, grads)
        assert ours == theirs, f"step {step}: (skipped, scale, tracker) {ours} != {theirs}"
        applied += not ours[0]
    return other, optimizer, state, applied


@pytest.mark.parametrize("by_identity", [False, True], ids=["by-order", "by-identity"])
def test_fp16_job_continued_by_torch_sgd_follows_fp16_update(by_identity):
    tx = ff.sgd(0.05, 0.9, nesterov=True, weight_decay=1e-3)
    model, optimizer, state, applied = ff_then(
        tx,
        lambda m: torch.optim.SGD(
            m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
        ),
        by_identity,
    )
    for name, p in model.named_parameters():
        assert scaled_error(state.master[name], p.detach()) <= applied, name


@pytest.mark.parametrize("kind", list(ADAM_CASES))
def test_fp16_job_continued_by_torch_adam_follows_fp16_update(kind):
    tx = {
        "Adam": ff.adam(1e-3),
        "Adam-L2": ff.chain(ff.add_decayed_weights(1e-2), ff.adam(1e-3)),
        "AdamW": ff.adamw(1e-3, weight_decay=1e-2),
    }[kind]
    model, optimizer, state, applied = ff_then(tx, ADAM_CASES[kind], by_identity=False)
    factor_error = abs(float(torch.tensor(1.0 - 1e-3 * 1e-2)) - (1.0 - 1e-3 * 1e-2))
    bound = applied * (factor_error / EPS32 + 0.5) if kind == "AdamW" else 4.0
    for name, p in model.named_parameters():
        assert scaled_error(state.master[name], p.detach()) <= bound, name
        assert optimizer.state[p]["step"].dtype == torch.float32
        assert optimizer.state[p]["step"].device.type == "cpu"


def test_a_state_with_no_step_yet_writes_no_optimizer_state():
    model = make_model()
    state = ff.fp16_init(dict(model.named_parameters()), ff.adamw(1e-3, weight_decay=1e-2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    ff.to_torch(state, optimizer, scaler)
    assert len(optimizer.state) == 0 and scaler.get_scale() == 2.0**16


ROUND_TRIP_JOBS = {  # name: (optimizer, torch steps taken, scaler)
    "SGD, no step, lazy scaler": (lambda m: torch.optim.SGD(m.parameters(), 0.1, 0.9), 0, "lazy"),
    "SGD after steps": (
        lambda m: torch.optim.SGD(m.parameters(), 0.1, 0.9, weight_decay=1e-3),
        6,
        "on",
    ),
    "SGD no momentum": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 6, "on"),
    "SGD, no scaler": (lambda m: torch.optim.SGD(m.parameters(), 0.1, 0.5), 0, None),
    "Adam, no step": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), 0, "on"),
    "Adam, disabled scaler": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), 0, "off"),
    "AdamW after steps": (ADAM_CASES["AdamW"], 6, "on"),
    "Adam-L2 after steps": (ADAM_CASES["Adam-L2"], 6, "on"),
}


@pytest.mark.parametrize("job", list(ROUND_TRIP_JOBS))
def test_round_trip_leaves_the_torch_job_bitwise_as_it_was(job):
    make, steps, kind = ROUND_TRIP_JOBS[job]
    model = make_model()
    optimizer = make(model)
    scaler = {
        "lazy": torch.amp.GradScaler("cpu", init_scale=SCALE),  # no scale tensor yet
        "on": scaler_for(),
        "off": torch.amp.GradScaler("cpu", enabled=False),
        None: None,
    }[kind]
    for step in range(steps):  # step 4 overflows
        torch_step(model, optimizer, scaler, fp16_grads(model, step))
    before = snapshot(optimizer, scaler)
    state = ff.from_torch(dict(model.named_parameters()), optimizer, scaler)
    assert snapshot(optimizer, scaler) == before
    ff.to_torch(state, optimizer, scaler)
    assert snapshot(optimizer, scaler) == before


def test_from_torch_without_a_scaler_takes_a_loss_scale_or_none():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.named_parameters())
    assert isinstance(ff.from_torch(params, optimizer).loss_scale, ff.NoOpLossScale)
    state = ff.from_torch(params, optimizer, loss_scale=ff.StaticLossScale(128.0))
    assert float(state.loss_scale.loss_scale) == 128.0
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert isinstance(ff.from_torch(params, optimizer, disabled).loss_scale, ff.NoOpLossScale)


def test_the_tx_from_torch_builds_is_the_library_s_own():
    model = make_model()
    params = dict(model.named_parameters())
    sgd = ff.from_torch(params, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert ff.update_path(sgd) in ("fused", "foreach-sgd")
    assert sgd.tx.spec == ff.sgd(0.1, 0.9).spec
    adamw = ff.from_torch(params, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99)))
    assert adamw.tx.spec == ff.adamw(1e-3, 0.8, 0.99, weight_decay=1e-2).spec


# -- bad inputs: a clear error naming what is wrong, and nothing modified -------


def refuses(call, optimizer, scaler, error, match):
    before = snapshot(optimizer, scaler)
    with pytest.raises(error, match=match):
        call()
    assert snapshot(optimizer, scaler) == before


def test_from_torch_refuses_what_an_fp16_state_cannot_hold():
    model = make_model()
    params = dict(model.named_parameters())
    scaler = scaler_for()
    cases = [
        (
            torch.optim.Adam(model.parameters(), amsgrad=True),
            ValueError,
            r"param_groups\[0\]\['amsgrad'\] is True",
        ),
        (torch.optim.RMSprop(model.parameters()), TypeError, r"optimizer must be .*RMSprop"),
        (
            torch.optim.SGD(model.parameters(), lr=0.1, maximize=True),
            ValueError,
            r"param_groups\[0\]\['maximize'\]",
        ),
    ]
    for optimizer, error, match in cases:
        refuses(lambda: ff.from_torch(params, optimizer, scaler), optimizer, scaler, error, match)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-3
    )
    refuses(
        lambda: ff.from_torch(params, groups, scaler),
        groups,
        scaler,
        ValueError,
        r"param_groups\[1\]\['weight_decay'\] is 0.0 but param_groups\[0\]\['weight_decay'\] is 0.01.*mask",
    )


def test_from_torch_refuses_params_that_are_not_the_optimizer_s():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = scaler_for()
    params = dict(model.named_parameters())
    missing = {k: v for k, v in params.items() if k != "0.bias"}
    refuses(
        lambda: ff.from_torch(missing, optimizer, scaler),
        optimizer,
        scaler,
        ValueError,
        r"optimizer.param_groups\[0\]\['params'\]\[1\] .* is not in params",
    )
    extra = {**params, "extra": torch.nn.Parameter(torch.zeros(3))}
    refuses(
        lambda: ff.from_torch(extra, optimizer, scaler),
        optimizer,
        scaler,
        ValueError,
        r"params\['extra'\] .* is not one of the optimizer's parameters",
    )
    copies = {k: v.detach().clone() for k, v in params.items()}
    refuses(
        lambda: ff.from_torch(copies, optimizer, scaler), optimizer, scaler, ValueError, "identity"
    )
    twice = {**params, "again": params["0.weight"]}
    refuses(
        lambda: ff.from_torch(twice, optimizer, scaler),
        optimizer,
        scaler,
        ValueError,
        r"params\['again'\] is the same tensor as params\['0.weight'\]",
    )
    refuses(
        lambda: ff.from_torch(params, optimizer, scaler, loss_scale=ff.NoOpLossScale()),
        optimizer,
        scaler,
        ValueError,
        "not both",
    )
    half = torch.nn.Linear(2, 2).half()
    half_opt = torch.optim.SGD(half.parameters(), lr=0.1)
    refuses(
        lambda: ff.from_torch(dict(half.named_parameters()), half_opt),
        half_opt,
        None,
        TypeError,
        r"params\['(weight|bias)'\]: expected a float32",
    )


def test_from_torch_refuses_momentum_on_some_leaves_only():
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model[0].weight.grad = torch.ones_like(model[0].weight)  # the only one with a gradient
    optimizer.step()
    refuses(
        lambda: ff.from_torch(dict(model.named_parameters()), optimizer),
        optimizer,
        None,
        ValueError,
        r"params\['0.weight'\] has a momentum buffer but params\['0.bias'\] has none",
    )


def test_to_torch_refuses_a_state_that_does_not_match():
    model = make_model()
    params = dict(model.named_parameters())
    ls = ff.DynamicLossScale(init_scale=SCALE, growth_interval=GROWTH_INTERVAL)
    state = ff.fp16_init(params, ff.sgd(0.05, 0.9), ls)
    scaler = scaler_for()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cases = [
        (
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            scaler,
            r"lr=0.05 but optimizer.param_groups\[0\]\['lr'\] is 0.1",
        ),
        (torch.optim.AdamW(model.parameters(), lr=0.05), scaler, "follows torch.optim.SGD's rule"),
        (
            sgd,
            torch.amp.GradScaler("cpu", growth_interval=7),
            r"growth_interval is 3 but the scaler's growth_interval is 7",
        ),
        (sgd, None, "scaler is None"),
        (sgd, torch.amp.GradScaler("cpu", enabled=False), "scaler is disabled"),
    ]
    for optimizer, sc, match in cases:
        refuses(lambda: ff.to_torch(state, optimizer, sc), optimizer, sc, ValueError, match)
    clipped = state.replace(tx=ff.chain(ff.clip_by_global_norm(1.0), ff.sgd(0.05, 0.9)))
    refuses(
        lambda: ff.to_torch(clipped, sgd, scaler),
        sgd,
        scaler,
        ValueError,
        "not one of the optimisers",
    )
    rmsprop = torch.optim.RMSprop(model.parameters())
    refuses(
        lambda: ff.to_torch(state, rmsprop, scaler),
        rmsprop,
        scaler,
        TypeError,
        "RMSprop",
    )
    # Matched by position, a parameter whose shape differs names both sides.
    reordered = torch.optim.SGD(
        [model[2].weight, model[0].weight, model[0].bias, model[2].bias], lr=0.05, momentum=0.9
    )
    refuses(
        lambda: ff.to_torch(state, reordered, scaler),
        reordered,
        scaler,
        ValueError,
        r"param_groups\[0\]\['params'\]\[0\] has shape \(3, 8\) but state.master\['0.weight'\].*pass params=",
    )
    others = {k: torch.nn.Parameter(v.detach().clone()) for k, v in params.items()}
    refuses(
        lambda: ff.to_torch(state, sgd, scaler, params=others), sgd, scaler, ValueError, "identity"
    )
    no_state = state_bits(state)
    ff.to_torch(state, sgd, scaler, params=params)  # and the right one is accepted
    assert_same_bits(state_bits(state), no_state)


def test_to_torch_checks_names_where_the_optimizer_has_them():
    model = make_model()
    state = ff.fp16_init(dict(model.named_parameters()), ff.sgd(0.05), ff.NoOpLossScale())
    named = torch.optim.SGD(model.named_parameters(), lr=0.05)
    ff.to_torch(state, named)
    renamed = {"a." + k: v for k, v in state.master.items()}
    wrong = state.replace(master=renamed, params={"a." + k: v for k, v in state.params.items()})
    wrong = wrong.replace(opt_state=wrong.tx.init(wrong.master))
    refuses(lambda: ff.to_torch(wrong, named), named, None, ValueError, r"named '0.weight'")


# -- the documentation's example runs as written -------------------------------


def test_migration_doc_example_runs():
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "migration.md").read_text()
    section = text.split("## Continuing a running job", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under '## Continuing a running job'"
    namespace: dict = {}
    exec(compile(match.group(1), "migration-example", "exec"), namespace)
    assert int(namespace["state"].step) > 0
