"""Bad hyperparameters fail at construction, naming the argument.

Every exported transform, schedule, loss scale and policy constructor is
given a value of the wrong type or out of range; it must raise ``TypeError``
or ``ValueError`` when it is built, before any ``init`` or ``update``, with a
message that names the argument. optax checks few of these (it accepts a
negative learning rate or ``b1=1``); torch.optim rejects most of them, and so
do we (``docs/migration.md``, "Coming from optax and jmp").

The random-value fuzzing of single hyperparameters lives beside each module's
tests (``test_sgd.py``, ``test_loss_scale.py``, ...); this table is the
fixed list of cases, one per kind of mistake.
"""

import math

import optree
import pytest
import torch

import functional_fp16 as ff
from tests.helpers import bits, scaled_error

NAN, INF = math.nan, math.inf
ID = ff.identity
C = ff.constant_schedule

# (id, constructor, exception type, fragment of the message)
CASES = [
    # sgd and its parts
    ("sgd lr < 0", lambda: ff.sgd(-0.1), ValueError, "learning_rate must be finite and >= 0"),
    ("sgd lr nan", lambda: ff.sgd(NAN), ValueError, "learning_rate must be finite"),
    ("sgd lr inf", lambda: ff.sgd(INF), ValueError, "learning_rate must be finite"),
    ("sgd lr str", lambda: ff.sgd("0.1"), TypeError, "learning_rate must be a real number"),
    (
        "sgd lr tensor",
        lambda: ff.sgd(torch.tensor([0.1])),
        TypeError,
        "learning_rate must be a real",
    ),
    ("sgd lr bool", lambda: ff.sgd(True), TypeError, "learning_rate must be a real number"),
    ("sgd momentum < 0", lambda: ff.sgd(0.1, -0.9), ValueError, "momentum must be finite and >= 0"),
    ("sgd momentum nan", lambda: ff.sgd(0.1, NAN), ValueError, "momentum must be finite"),
    (
        "sgd dampening > 1",
        lambda: ff.sgd(0.1, 0.9, dampening=2.0),
        ValueError,
        "dampening must be <= 1",
    ),
    (
        "sgd dampening < 0",
        lambda: ff.sgd(0.1, 0.9, dampening=-1.0),
        ValueError,
        "dampening must be",
    ),
    (
        "sgd dampening str with nesterov",
        lambda: ff.sgd(0.1, 0.9, nesterov=True, dampening="0"),
        TypeError,
        "dampening must be a real number",
    ),
    ("sgd weight_decay < 0", lambda: ff.sgd(0.1, weight_decay=-1e-4), ValueError, "weight_decay"),
    (
        "sgd nesterov str",
        lambda: ff.sgd(0.1, 0.9, nesterov="yes"),
        TypeError,
        "nesterov must be a bool",
    ),
    (
        "sgd nesterov int",
        lambda: ff.sgd(0.1, 0.9, nesterov=1),
        TypeError,
        "nesterov must be a bool",
    ),
    (
        "sgd nesterov without momentum",
        lambda: ff.sgd(0.1, nesterov=True),
        ValueError,
        "nesterov momentum requires momentum > 0",
    ),
    ("trace decay < 0", lambda: ff.trace(-0.5), ValueError, "momentum must be finite and >= 0"),
    (
        "trace nesterov str",
        lambda: ff.trace(0.5, nesterov="x"),
        TypeError,
        "nesterov must be a bool",
    ),
    (
        "scale_by_learning_rate lr < 0",
        lambda: ff.scale_by_learning_rate(-1.0),
        ValueError,
        "learning_rate must be finite and >= 0",
    ),
    (
        "scale_by_learning_rate flip_sign str",
        lambda: ff.scale_by_learning_rate(1.0, flip_sign="no"),
        TypeError,
        "flip_sign must be a bool",
    ),
    ("add_decayed_weights < 0", lambda: ff.add_decayed_weights(-1.0), ValueError, "weight_decay"),
    (
        "add_decayed_weights mask int",
        lambda: ff.add_decayed_weights(1.0, mask=3),
        TypeError,
        "mask: expected a Python bool",
    ),
    (
        "add_decayed_weights mask leaf int",
        lambda: ff.add_decayed_weights(1.0, mask={"w": 1}),
        TypeError,
        "mask['w']: expected a Python bool",
    ),
    (
        "add_decayed_weights mask tensor",
        lambda: ff.add_decayed_weights(1.0, mask={"w": torch.tensor(True)}),
        TypeError,
        "mask['w']: expected a Python bool",
    ),
    # adam
    ("adam lr < 0", lambda: ff.adam(-1e-3), ValueError, "learning_rate must be finite and >= 0"),
    ("adam lr str", lambda: ff.adam("1e-3"), TypeError, "learning_rate must be a real number"),
    ("adam b1 = 1", lambda: ff.adam(1e-3, b1=1.0), ValueError, "b1 must be in [0, 1), got 1.0"),
    ("adam b1 < 0", lambda: ff.adam(1e-3, b1=-0.1), ValueError, "b1 must be finite and >= 0"),
    ("adam b2 > 1", lambda: ff.adam(1e-3, b2=1.5), ValueError, "b2 must be in [0, 1), got 1.5"),
    ("adam b2 nan", lambda: ff.adam(1e-3, b2=NAN), ValueError, "b2 must be finite"),
    ("adam b2 str", lambda: ff.adam(1e-3, b2="0.9"), TypeError, "b2 must be a real number"),
    ("adam eps < 0", lambda: ff.adam(1e-3, eps=-1e-8), ValueError, "eps must be finite and >= 0"),
    ("adam eps inf", lambda: ff.adam(1e-3, eps=INF), ValueError, "eps must be finite"),
    ("adam eps_root < 0", lambda: ff.adam(1e-3, eps_root=-1.0), ValueError, "eps_root must be"),
    ("adamw lr < 0", lambda: ff.adamw(-1e-3), ValueError, "learning_rate must be finite"),
    (
        "adamw weight_decay < 0",
        lambda: ff.adamw(1e-3, weight_decay=-1.0),
        ValueError,
        "weight_decay",
    ),
    ("adamw mask int", lambda: ff.adamw(1e-3, mask=5), TypeError, "mask: expected a Python bool"),
    ("scale_by_adam b1 = 1", lambda: ff.scale_by_adam(b1=1.0), ValueError, "b1 must be in [0, 1)"),
    # clipping
    (
        "clip_by_global_norm 0",
        lambda: ff.clip_by_global_norm(0.0),
        ValueError,
        "max_norm must be finite and > 0",
    ),
    ("clip_by_global_norm nan", lambda: ff.clip_by_global_norm(NAN), ValueError, "max_norm"),
    (
        "clip_by_global_norm str",
        lambda: ff.clip_by_global_norm("1"),
        TypeError,
        "max_norm must be a real",
    ),
    # masking and combining
    (
        "masked inner",
        lambda: ff.masked(3, {"w": True}),
        TypeError,
        "inner must be a GradientTransformation",
    ),
    ("masked mask None", lambda: ff.masked(ID(), None), TypeError, "mask must be a tree of bools"),
    ("masked mask int", lambda: ff.masked(ID(), 3), TypeError, "mask: expected a Python bool"),
    (
        "masked mask leaf str",
        lambda: ff.masked(ID(), ["yes"]),
        TypeError,
        "mask[0]: expected a Python bool",
    ),
    (
        "multi_transform transforms list",
        lambda: ff.multi_transform([ID()], {"w": 0}),
        TypeError,
        "transforms must be a mapping",
    ),
    (
        "multi_transform transform int",
        lambda: ff.multi_transform({"a": 3}, {"w": "a"}),
        TypeError,
        "transforms['a'] must be a GradientTransformation",
    ),
    (
        "multi_transform unknown label",
        lambda: ff.multi_transform({"a": ID()}, {"w": "b"}),
        ValueError,
        "param_labels['w']: label 'b' has no transform",
    ),
    (
        "multi_transform labels None",
        lambda: ff.multi_transform({"a": ID()}, None),
        TypeError,
        "param_labels must be a tree of labels",
    ),
    (
        "multi_transform unhashable label",
        lambda: ff.multi_transform({"a": ID()}, {"w": bytearray(b"a")}),
        TypeError,
        "param_labels['w']: a label must be hashable, got bytearray",
    ),
    (
        "chain argument",
        lambda: ff.chain(ID(), 3),
        TypeError,
        "chain argument 1 must be a GradientTransformation",
    ),
    # conditionality and accumulation
    (
        "apply_if_finite inner",
        lambda: ff.apply_if_finite(3, 1),
        TypeError,
        "inner must be a GradientTransformation",
    ),
    (
        "apply_if_finite errors < 0",
        lambda: ff.apply_if_finite(ID(), -1),
        ValueError,
        "max_consecutive_errors must be >= 0",
    ),
    (
        "apply_if_finite errors float",
        lambda: ff.apply_if_finite(ID(), 1.5),
        TypeError,
        "max_consecutive_errors must be an int, got float",
    ),
    (
        "MultiSteps opt",
        lambda: ff.MultiSteps(3, 2),
        TypeError,
        "opt must be a GradientTransformation",
    ),
    (
        "MultiSteps k = 0",
        lambda: ff.MultiSteps(ID(), 0),
        ValueError,
        "every_k_schedule must be >= 1",
    ),
    (
        "MultiSteps k float",
        lambda: ff.MultiSteps(ID(), 2.0),
        TypeError,
        "every_k_schedule must be an int",
    ),
    (
        "MultiSteps k > int32",
        lambda: ff.MultiSteps(ID(), 2**31),
        ValueError,
        "every_k_schedule must fit in int32",
    ),
    (
        "MultiSteps use_grad_mean int",
        lambda: ff.MultiSteps(ID(), 2, use_grad_mean=1),
        TypeError,
        "use_grad_mean must be a bool",
    ),
    # schedules
    ("constant_schedule < 0", lambda: C(-1.0), ValueError, "value must be finite and >= 0"),
    ("constant_schedule nan", lambda: C(NAN), ValueError, "value must be finite"),
    (
        "linear_schedule init nan",
        lambda: ff.linear_schedule(NAN, 0.0, 10),
        ValueError,
        "init_value",
    ),
    ("linear_schedule end < 0", lambda: ff.linear_schedule(1.0, -1.0, 10), ValueError, "end_value"),
    (
        "linear_schedule steps float",
        lambda: ff.linear_schedule(1.0, 0.0, 10.5),
        TypeError,
        "transition_steps must be an int",
    ),
    (
        "linear_schedule begin < 0",
        lambda: ff.linear_schedule(1.0, 0.0, 10, -1),
        ValueError,
        "transition_begin must be >= 0",
    ),
    (
        "cosine_decay steps 0",
        lambda: ff.cosine_decay_schedule(1.0, 0),
        ValueError,
        "decay_steps must be >= 1",
    ),
    (
        "cosine_decay steps float",
        lambda: ff.cosine_decay_schedule(1.0, 10.0),
        TypeError,
        "decay_steps must be an int",
    ),
    (
        "cosine_decay alpha > 1",
        lambda: ff.cosine_decay_schedule(1.0, 10, alpha=2.0),
        ValueError,
        "alpha must be in [0, 1]",
    ),
    (
        "cosine_decay exponent 0",
        lambda: ff.cosine_decay_schedule(1.0, 10, exponent=0.0),
        ValueError,
        "exponent must be finite and > 0",
    ),
    (
        "cosine_decay exponent < 0",
        lambda: ff.cosine_decay_schedule(1.0, 10, exponent=-1.0),
        ValueError,
        "exponent must be finite and > 0",
    ),
    ("cosine_decay init < 0", lambda: ff.cosine_decay_schedule(-1.0, 10), ValueError, "init_value"),
    (
        "join_schedules numbers",
        lambda: ff.join_schedules([1.0, 2.0], [5]),
        TypeError,
        "schedules[0] must be a schedule",
    ),
    (
        "join_schedules not a sequence",
        lambda: ff.join_schedules(3, []),
        TypeError,
        "join_schedules takes a sequence",
    ),
    (
        "join_schedules boundary float",
        lambda: ff.join_schedules([C(1.0), C(2.0)], [5.0]),
        TypeError,
        "boundaries[0] must be an int",
    ),
    (
        "join_schedules boundary count",
        lambda: ff.join_schedules([C(1.0), C(2.0)], [5, 6]),
        ValueError,
        "len(boundaries) == len(schedules) - 1",
    ),
    (
        "join_schedules decreasing",
        lambda: ff.join_schedules([C(1.0)] * 3, [6, 5]),
        ValueError,
        "boundaries must be strictly increasing",
    ),
    (
        "warmup_cosine init nan without warmup",
        lambda: ff.warmup_cosine_decay_schedule(NAN, 1.0, 0, 100),
        ValueError,
        "init_value must be finite",
    ),
    (
        "warmup_cosine peak < 0",
        lambda: ff.warmup_cosine_decay_schedule(0.0, -1.0, 10, 100),
        ValueError,
        "peak_value",
    ),
    (
        "warmup_cosine warmup < 0",
        lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, -1, 100),
        ValueError,
        "warmup_steps must be >= 0",
    ),
    (
        "warmup_cosine decay float",
        lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100.0),
        TypeError,
        "decay_steps must be an int",
    ),
    (
        "warmup_cosine decay <= warmup",
        lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 10, 10),
        ValueError,
        "decay_steps (10) must exceed warmup_steps (10)",
    ),
    (
        "warmup_cosine end > peak",
        lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100, 2.0),
        ValueError,
        "end_value (2.0) must not exceed peak_value",
    ),
    (
        "warmup_cosine exponent 0",
        lambda: ff.warmup_cosine_decay_schedule(0.0, 1.0, 10, 100, exponent=0.0),
        ValueError,
        "exponent must be finite and > 0",
    ),
    # loss scales
    (
        "DynamicLossScale init 0",
        lambda: ff.DynamicLossScale(init_scale=0.0),
        ValueError,
        "init_scale must be finite and > 0",
    ),
    (
        "DynamicLossScale init < 0",
        lambda: ff.DynamicLossScale(init_scale=-1.0),
        ValueError,
        "init_scale must be finite and > 0",
    ),
    (
        "DynamicLossScale init inf",
        lambda: ff.DynamicLossScale(init_scale=INF, max_scale=INF),
        ValueError,
        "init_scale must be finite",
    ),
    (
        "DynamicLossScale init tensor",
        lambda: ff.DynamicLossScale(init_scale=torch.tensor(2.0)),
        TypeError,
        "init_scale must be a real number",
    ),
    (
        "DynamicLossScale init below min",
        lambda: ff.DynamicLossScale(init_scale=0.5),
        ValueError,
        "init_scale (0.5) must lie in [min_scale, max_scale]",
    ),
    (
        "DynamicLossScale period 0",
        lambda: ff.DynamicLossScale(growth_interval=0),
        ValueError,
        "growth_interval must be >= 1",
    ),
    (
        "DynamicLossScale period float",
        lambda: ff.DynamicLossScale(growth_interval=5.0),
        TypeError,
        "growth_interval must be an int",
    ),
    (
        "DynamicLossScale period > int32",
        lambda: ff.DynamicLossScale(growth_interval=2**31),
        ValueError,
        "growth_interval must fit in int32",
    ),
    (
        "DynamicLossScale factor 1",
        lambda: ff.DynamicLossScale(growth_factor=1.0),
        ValueError,
        "growth_factor must be > 1",
    ),
    (
        "DynamicLossScale factor < 1",
        lambda: ff.DynamicLossScale(growth_factor=0.5),
        ValueError,
        "growth_factor must be > 1",
    ),
    (
        "DynamicLossScale factor inf",
        lambda: ff.DynamicLossScale(growth_factor=INF),
        ValueError,
        "growth_factor must be finite",
    ),
    (
        "DynamicLossScale backoff 1",
        lambda: ff.DynamicLossScale(backoff_factor=1.0),
        ValueError,
        "backoff_factor must be in (0, 1)",
    ),
    (
        "DynamicLossScale backoff 0",
        lambda: ff.DynamicLossScale(backoff_factor=0.0),
        ValueError,
        "backoff_factor must be finite and > 0",
    ),
    (
        "DynamicLossScale min 0",
        lambda: ff.DynamicLossScale(min_scale=0.0),
        ValueError,
        "min_scale must be finite and > 0",
    ),
    (
        "DynamicLossScale min subnormal",
        lambda: ff.DynamicLossScale(min_scale=1e-40, init_scale=1.0),
        ValueError,
        "min_scale (1e-40) must be >=",
    ),
    (
        "DynamicLossScale max nan",
        lambda: ff.DynamicLossScale(max_scale=NAN),
        ValueError,
        "max_scale must be a number > 0 or inf, got nan",
    ),
    (
        "DynamicLossScale max < min",
        lambda: ff.DynamicLossScale(min_scale=4.0, max_scale=2.0, init_scale=3.0),
        ValueError,
        "min_scale (4.0) must be <= max_scale (2.0)",
    ),
    (
        "DynamicLossScale max str",
        lambda: ff.DynamicLossScale(max_scale="inf"),
        TypeError,
        "max_scale must be a real number",
    ),
    (
        "DynamicLossScale hysteresis 0",
        lambda: ff.DynamicLossScale(hysteresis=0),
        ValueError,
        "hysteresis must be >= 1",
    ),
    (
        "StaticLossScale 0",
        lambda: ff.StaticLossScale(0.0),
        ValueError,
        "scale must be finite and > 0",
    ),
    ("StaticLossScale nan", lambda: ff.StaticLossScale(NAN), ValueError, "scale must be finite"),
    (
        "StaticLossScale overflow",
        lambda: ff.StaticLossScale(1e39),
        ValueError,
        "scale (1e+39) overflows float32",
    ),
    (
        "StaticLossScale str",
        lambda: ff.StaticLossScale("2"),
        TypeError,
        "scale must be a real number",
    ),
    # policies
    (
        "Policy int dtype",
        lambda: ff.Policy(torch.int32, torch.float32, torch.float32),
        TypeError,
        "param_dtype must be a floating-point torch.dtype",
    ),
    (
        "Policy None",
        lambda: ff.Policy(torch.float16, None, torch.float32),
        TypeError,
        "compute_dtype must be a floating-point",
    ),
    (
        "Policy bad name",
        lambda: ff.Policy("f16", "f16", "f8"),
        ValueError,
        "unknown dtype name 'f8'",
    ),
    (
        "get_policy not a str",
        lambda: ff.get_policy(torch.float16),
        TypeError,
        "policy must be a str",
    ),
    ("get_policy unknown key", lambda: ff.get_policy("p=f16,x=f32"), ValueError, "unknown key 'x'"),
    (
        "get_policy unknown dtype",
        lambda: ff.get_policy("c=int8"),
        ValueError,
        "c: unknown dtype name 'int8'",
    ),
    (
        "get_policy repeated key",
        lambda: ff.get_policy("p=f16,params=f32"),
        ValueError,
        "param_dtype is given more than once",
    ),
]


@pytest.mark.parametrize(
    "build, error, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_hyperparameter_is_rejected_at_construction(build, error, fragment):
    with pytest.raises(error) as info:
        build()
    assert fragment in str(info.value), str(info.value)


def test_case_ids_are_unique():
    ids = [c[0] for c in CASES]
    assert len(ids) == len(set(ids))


# -- the edge values, and what each does to an update -------------------------------------


def _tree(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}


def _same(a, b) -> bool:
    """Same structure, dtypes, shapes and bit patterns (so -0.0 != 0.0 and NaN == NaN)."""
    ns = ff.NAMESPACE
    la, lb = optree.tree_leaves(a, namespace=ns), optree.tree_leaves(b, namespace=ns)
    return optree.tree_structure(a, namespace=ns) == optree.tree_structure(b, namespace=ns) and all(
        x.dtype == y.dtype and torch.equal(bits(x), bits(y)) for x, y in zip(la, lb)
    )


def _steps(tx, grads_seq, params):
    """The updates of ``tx`` over ``grads_seq`` from ``params`` (not applied), and its state."""
    state, out = tx.init(params), []
    for grads in grads_seq:
        u, state = tx.update(grads, state, params)
        out.append(u)
    return out, state


def _check_sgd_nesterov_undampened(tx):
    """Against ``torch.optim.SGD`` with the same values: the momentum buffer bitwise (with
    dampening 0 it is PyTorch's operations), the parameters within 4 eps at the tensor's
    scale (PyTorch fuses ``p - lr * d`` into one rounding)."""
    params, grads_seq = _tree(0), [_tree(s) for s in (1, 2, 3)]
    p, state = dict(params), tx.init(params)
    flat = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.SGD(
        flat.values(), lr=0.1, momentum=0.9, nesterov=True, dampening=0.0, weight_decay=1e-4,
        foreach=False,
    )  # fmt: skip
    for grads in grads_seq:
        u, state = tx.update(grads, state, p)
        p = ff.apply_updates(p, u)
        for k, x in flat.items():
            x.grad = grads[k].clone()
        opt.step()
    trace = next(s for s in state if isinstance(s, ff.TraceState)).trace
    for k, x in flat.items():
        assert torch.equal(bits(trace[k]), bits(opt.state[x]["momentum_buffer"])), k
        assert scaled_error(p[k], x.detach()) <= 4, k


def _check_schedule_from_zero(tx):
    """linear 0 -> 0.1 over 10 steps: the first update is lr 0 (nothing moves), the second
    ``-0.01 g``."""
    params, (g1, g2) = _tree(0), [_tree(1), _tree(2)]
    (u1, u2), _ = _steps(tx, [g1, g2], params)
    for k in params:
        assert not u1[k].any(), k
        assert torch.equal(ff.apply_updates(params, u1)[k], params[k]), k
        lr = torch.tensor(0.01, dtype=torch.float64).float()  # the schedule's value, rounded once
        assert torch.equal(u2[k], g2[k] * -lr), k


def _check_trace_without_decay(tx):
    """Momentum 0: the updates pass through as they are (a -0.0 too), the buffer untouched."""
    params = _tree(0)
    g1, g2 = _tree(1), _tree(2)
    g2["w"][0, 0] = -0.0
    (u1, u2), state = _steps(tx, [g1, g2], params)
    assert _same(u1, g1) and _same(u2, g2)
    assert not state.initialized and all(not b.any() for b in state.trace.values())


def _check_unflipped_learning_rate(tx):
    """``flip_sign=False``: ``+0.1 g`` (the same sign as the gradient)."""
    params, g = _tree(0), _tree(1)
    (u,), _ = _steps(tx, [g], params)
    for k in params:
        assert torch.equal(u[k], g[k] * 0.1), k
        assert torch.equal(torch.sign(u[k]), torch.sign(g[k])), k


def _check_adam_all_zero(tx):
    """Learning rate 0: the master unchanged bitwise, in ``fp16_update`` too; b1 = 0 and
    b2 = 0: the moments are this step's gradient and its square, bitwise; and the same
    edge values with a learning rate of 1 (eps = 0, bias corrections 1 - 0^t = 1) step each
    element by exactly ``-sign(g)``, as ``torch.optim.Adam`` does."""
    params, g = _tree(0), _tree(1)
    (u,), state = _steps(tx, [g], params)
    moments = next(s for s in state if isinstance(s, ff.ScaleByAdamState))
    for k in params:
        assert not u[k].any(), k
        assert torch.equal(bits(moments.mu[k]), bits(g[k])), k
        assert torch.equal(bits(moments.nu[k]), bits(g[k] * g[k])), k
    half = {k: v.half() for k, v in params.items()}
    fp16 = ff.fp16_init(half, tx, ff.StaticLossScale(1))
    stepped = ff.fp16_update(fp16, {k: v.half() for k, v in g.items()})
    assert bool(stepped.grads_finite)
    assert _same(stepped.master, fp16.master) and _same(stepped.params, fp16.params)
    (u1,), _ = _steps(ff.adam(1.0, b1=0.0, b2=0.0, eps=0.0), [g], params)
    flat = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.Adam(flat.values(), lr=1.0, betas=(0.0, 0.0), eps=0.0, foreach=False)
    for k, x in flat.items():
        x.grad = g[k].clone()
    opt.step()
    for k in params:
        assert (g[k] != 0).all()  # eps = 0: a zero gradient would give 0 / 0
        assert torch.equal(u1[k], -torch.sign(g[k])), k
        assert torch.equal(flat[k].detach(), params[k] - torch.sign(g[k])), k


def _check_adamw_without_decay(tx):
    """Weight decay 0 (masked in): exactly Adam's updates, the parameters not read."""
    params, grads_seq = {"w": _tree(0)["w"]}, [{"w": _tree(s)["w"]} for s in (1, 2)]
    ours, _ = _steps(tx, grads_seq, params)
    plain, _ = _steps(ff.adam(1e-3), grads_seq, params)
    assert all(_same(a, b) for a, b in zip(ours, plain))
    moved, _ = _steps(tx, grads_seq, {"w": params["w"] * 1e6})  # other params, same updates
    assert all(_same(a, b) for a, b in zip(ours, moved))


def _check_empty_mask(tx):
    """An empty mask fits the empty tree: nothing in, nothing out."""
    state = tx.init({})
    u, new = tx.update({}, state, {})
    assert u == {} and isinstance(new, ff.MaskedState)


def _check_callable_mask(tx):
    """A mask function, every leaf masked in: the inner ``-0.5 u`` on every leaf."""
    params, g = _tree(0), _tree(1)
    (u,), _ = _steps(tx, [g], params)
    assert _same(u, {k: v * -0.5 for k, v in g.items()})


def _check_one_label(tx):
    """One label for every leaf: the inner ``-0.5 u`` on every leaf."""
    _check_callable_mask(tx)


def _check_give_up_at_once(tx):
    """``max_consecutive_errors=0``: the first non-finite update is already let through,
    counted; a finite one resets the count."""
    params, g = _tree(0), _tree(1)
    g["w"][1, 2] = math.inf
    state = tx.init(params)
    u, state = tx.update(g, state, params)
    assert _same(u, g)
    assert int(state.notfinite_count) == 1 and int(state.total_notfinite) == 1
    assert not bool(state.last_finite)
    u, state = tx.update(_tree(2), state, params)
    assert _same(u, _tree(2)) and int(state.notfinite_count) == 0
    assert int(state.total_notfinite) == 1
    held = ff.apply_if_finite(ff.identity(), 1)  # one more tolerated: the same update zeroed
    zeroed, _ = held.update(g, held.init(params), params)
    assert all(not x.any() for x in zeroed.values())


def _check_scheduled_window(tx):
    """A window size from a function (2): the first call emits zeros, the second the mean
    of the two gradients, accumulated in float32."""
    params, g1, g2 = _tree(0), _tree(1), _tree(2)
    (u1, u2), state = _steps(tx, [g1, g2], params)
    for k in params:
        assert torch.equal(bits(u1[k]), bits(torch.zeros_like(g1[k]))), k
        assert torch.equal(u2[k], (g1[k] + g2[k]) / 2), k
    assert int(state.gradient_step) == 1 and int(state.mini_step) == 0


def _values(schedule, steps=range(4)):
    return [schedule(torch.tensor(t, dtype=torch.int32)) for t in steps]


def _check_no_transition(schedule):
    """``transition_steps=0``: the initial value at every step (optax's rule)."""
    got = _values(schedule, [0, 1, 5, 1000])
    assert all(v.dtype == torch.float32 and float(v) == 1.0 for v in got), got


def _check_all_zero_cosine(schedule):
    """Zero everywhere (peak 0, no warmup, one decay step), so an SGD step moves nothing."""
    got = _values(schedule, [0, 1, 2, 100])
    assert all(v.dtype == torch.float32 and float(v) == 0.0 for v in got), got
    params, g = _tree(0), _tree(1)
    (u,), _ = _steps(ff.sgd(schedule), [g], params)
    assert all(not x.any() for x in u.values())


def _check_one_schedule_joined(schedule):
    """No boundaries: the one schedule's value at every step."""
    got = _values(schedule, [0, 1, 7, 10**6])
    assert all(float(v) == 1.0 for v in got), got


def _check_hysteresis_without_ceiling(scale):
    """``growth_interval=1``: every finite step doubles the scale; ``max_scale=inf``: no
    ceiling, but the scale never becomes inf (2^127 stays); ``hysteresis=2``: the first
    overflow keeps the scale, the second halves it (``min_scale`` 1 is the floor)."""
    s = scale.adjust(torch.tensor(True))
    assert float(s.loss_scale) == 2.0 and int(s.growth_count) == 0
    s = s.adjust(torch.tensor(False))
    assert float(s.loss_scale) == 2.0 and int(s.hysteresis_count) == 1
    s = s.adjust(torch.tensor(False))
    assert float(s.loss_scale) == 1.0 and int(s.hysteresis_count) == 0
    for _ in range(130):
        s = s.adjust(torch.tensor(True))
    assert float(s.loss_scale) == 2.0**127
    # one update: a finite step applied with the scale 1, which then doubles
    params, g = _tree(0), _tree(1)
    state = ff.fp16_init({k: v.half() for k, v in params.items()}, ff.sgd(1.0), scale)
    half_g = {k: v.half() for k, v in g.items()}
    new = ff.fp16_update(state, half_g)
    assert float(new.loss_scale.loss_scale) == 2.0
    for k in params:
        assert torch.equal(new.master[k], state.master[k] - half_g[k].float()), k


def _check_static_int_scale(scale):
    """An int 2: a float32 scale of 2 that scales the loss by 2, unscales the gradients by
    it (SGD(1) moves the master by exactly ``-g / 2``), and stays 2 after an overflow."""
    assert scale.loss_scale.dtype == torch.float32 and float(scale.loss_scale) == 2.0
    assert float(scale.scale(torch.tensor(3.0))) == 6.0
    params, g = _tree(0), _tree(1)
    state = ff.fp16_init({k: v.half() for k, v in params.items()}, ff.sgd(1.0), scale)
    half_g = {k: v.half() for k, v in g.items()}
    new = ff.fp16_update(state, half_g)
    for k in params:
        assert torch.equal(new.master[k], state.master[k] - half_g[k].float() / 2), k
    half_g["w"][0, 0] = math.inf
    skipped = ff.fp16_update(new, half_g)
    assert not bool(skipped.grads_finite) and float(skipped.loss_scale.loss_scale) == 2.0
    assert _same(skipped.master, new.master)


def _check_spaced_mixed_case_policy(policy):
    """``P = half , c = BF16``: FP16 params, BF16 compute and (by default) output."""
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        torch.float16, torch.bfloat16, torch.bfloat16,
    )  # fmt: skip
    x = _tree(0)
    assert _same(policy.cast_to_param(x), {k: v.half() for k, v in x.items()})
    assert _same(policy.cast_to_compute(x), {k: v.bfloat16() for k, v in x.items()})
    assert _same(policy.cast_to_output(x), {k: v.bfloat16() for k, v in x.items()})


HALF = lambda: ff.scale_by_learning_rate(0.5)  # noqa: E731 - an inner transform that shows

# (id, constructor, what the value must do)
EDGE_CASES = [
    (
        "sgd nesterov dampening 0",
        lambda: ff.sgd(0.1, 0.9, nesterov=True, dampening=0.0, weight_decay=1e-4),
        _check_sgd_nesterov_undampened,
    ),
    (
        "sgd schedule from 0",
        lambda: ff.sgd(ff.linear_schedule(0.0, 0.1, 10)),
        _check_schedule_from_zero,
    ),
    ("trace 0", lambda: ff.trace(0.0), _check_trace_without_decay),
    (
        "lr not flipped",
        lambda: ff.scale_by_learning_rate(0.1, flip_sign=False),
        _check_unflipped_learning_rate,
    ),
    ("adam all 0", lambda: ff.adam(0.0, b1=0.0, b2=0.0, eps=0.0), _check_adam_all_zero),
    (
        "adamw wd 0",
        lambda: ff.adamw(1e-3, weight_decay=0.0, mask={"w": True}),
        _check_adamw_without_decay,
    ),
    ("masked empty", lambda: ff.masked(ID(), {}), _check_empty_mask),
    ("masked fn", lambda: ff.masked(HALF(), lambda p: {k: True for k in p}), _check_callable_mask),
    (
        "multi_transform one label",
        lambda: ff.multi_transform({"a": HALF()}, lambda p: {k: "a" for k in p}),
        _check_one_label,
    ),
    ("apply_if_finite 0", lambda: ff.apply_if_finite(ID(), 0), _check_give_up_at_once),
    ("MultiSteps fn", lambda: ff.MultiSteps(ID(), lambda step: 2), _check_scheduled_window),
    ("linear 0 steps", lambda: ff.linear_schedule(1.0, 0.0, 0), _check_no_transition),
    (
        "warmup cosine all 0",
        lambda: ff.warmup_cosine_decay_schedule(0.0, 0.0, 0, 1),
        _check_all_zero_cosine,
    ),
    ("join one", lambda: ff.join_schedules([C(1.0)], []), _check_one_schedule_joined),
    (
        "dynamic scale bounds",
        lambda: ff.DynamicLossScale(init_scale=1, growth_interval=1, max_scale=INF, hysteresis=2),
        _check_hysteresis_without_ceiling,
    ),
    ("static int", lambda: ff.StaticLossScale(2), _check_static_int_scale),
    (
        "policy spaces",
        lambda: ff.get_policy("P = half , c = BF16"),
        _check_spaced_mixed_case_policy,
    ),
]


@pytest.mark.parametrize(
    "build, check", [c[1:] for c in EDGE_CASES], ids=[c[0] for c in EDGE_CASES]
)
def test_edge_values_are_accepted(build, check):
    """The bounds themselves, and every accepted kind of value, still construct, and do
    what they say to an update (against torch.optim or the formula by hand; where the
    value is a mask or labels, the inner transform is ``-0.5 u`` so that its effect shows)."""
    check(build())


def test_edge_case_ids_are_unique():
    ids = [c[0] for c in EDGE_CASES]
    assert len(ids) == len(set(ids))
