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

import pytest
import torch

import functional_fp16 as ff

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


@pytest.mark.parametrize(
    "build",
    [
        lambda: ff.sgd(0.1, 0.9, nesterov=True, dampening=0.0, weight_decay=1e-4),
        lambda: ff.sgd(ff.linear_schedule(0.0, 0.1, 10)),
        lambda: ff.trace(0.0),
        lambda: ff.scale_by_learning_rate(0.1, flip_sign=False),
        lambda: ff.adam(0.0, b1=0.0, b2=0.0, eps=0.0),
        lambda: ff.adamw(1e-3, weight_decay=0.0, mask={"w": True}),
        lambda: ff.masked(ID(), {}),
        lambda: ff.masked(ID(), lambda p: {k: True for k in p}),
        lambda: ff.multi_transform({"a": ID()}, lambda p: {k: "a" for k in p}),
        lambda: ff.apply_if_finite(ID(), 0),
        lambda: ff.MultiSteps(ID(), lambda step: 2),
        lambda: ff.linear_schedule(1.0, 0.0, 0),  # optax: no transition
        lambda: ff.warmup_cosine_decay_schedule(0.0, 0.0, 0, 1),
        lambda: ff.join_schedules([C(1.0)], []),
        lambda: ff.DynamicLossScale(init_scale=1, growth_interval=1, max_scale=INF, hysteresis=2),
        lambda: ff.StaticLossScale(2),
        lambda: ff.get_policy("P = half , c = BF16"),
    ],
)
def test_edge_values_are_accepted(build):
    """The bounds themselves, and every accepted kind of value, still construct."""
    build()
