"""Bad input at the API edges: a specific error naming the leaf or argument, state untouched.

Fixed tables cover each kind of mistake once; hypothesis then fuzzes random
trees with random defects (wrong structure, shape, dtype, device, None or
non-tensor leaves), random hyperparameter values (NaN, inf, negative, wrong
type) and random damage to checkpoint files. Every rejected call must leave
the given state bitwise unchanged. Run with ``-s`` to see the case counts.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._tree import NAMESPACE, format_path, tree_leaves
from functional_fp16.update import _IMPLEMENTATIONS

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FUZZ = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.to(torch.uint8) if t.dtype == torch.bool else t.view(_INT_VIEW[t.element_size()])


def snapshot(tree) -> list[torch.Tensor]:
    return [bits(x).clone() for x in tree_leaves(tree)]


def assert_unchanged(tree, before: list[torch.Tensor]) -> None:
    after = tree_leaves(tree)
    assert len(after) == len(before)
    for x, b in zip(after, before, strict=True):
        assert torch.equal(bits(x), b)


class Pair(NamedTuple):
    kernel: torch.Tensor
    bias: torch.Tensor


def base_params():
    return {
        "scalar": torch.tensor(0.5),
        "pair": Pair(torch.ones(2, 3), torch.zeros(3)),
        "stack": [torch.full((4,), 2.0), (torch.arange(3.0),)],
    }


def trained(params=None, tx=None):
    state = ff.fp16_init(params or base_params(), tx or ff.sgd(0.1, momentum=0.9))
    grads = optree.tree_map(lambda p: torch.full_like(p, 0.25), state.params, namespace=NAMESPACE)
    return ff.fp16_update(state, grads)


def good_grads(state):
    return optree.tree_map(lambda p: torch.full_like(p, 0.5), state.params, namespace=NAMESPACE)


# -- fixed tables ---------------------------------------------------------------------------

M = torch.zeros(2, device="meta")

INIT_CASES = [
    ({}, ValueError, "params is an empty tree"),
    ([], ValueError, "params is an empty tree"),
    ({"a": None, "b": ()}, ValueError, "params is an empty tree"),
    (
        {"w": torch.ones(2), "lr": 0.1},
        TypeError,
        r"params\['lr'\]: expected a floating-point tensor, got float",
    ),
    (
        {"w": torch.ones(2), "n": "x"},
        TypeError,
        r"params\['n'\]: expected a floating-point tensor, got str",
    ),
    (
        {"w": torch.ones(2), "i": torch.ones(2, dtype=torch.int32)},
        TypeError,
        r"params\['i'\]: expected a floating-point",
    ),
    (
        {"w": torch.ones(2), "m": torch.ones(2, dtype=torch.bool)},
        TypeError,
        r"params\['m'\]: expected a floating-point",
    ),
    (
        {"w": torch.ones(2), "c": torch.ones(2, dtype=torch.complex64)},
        TypeError,
        r"params\['c'\]: expected a floating-point",
    ),
    (
        {"w": torch.ones(2), "x": M},
        ValueError,
        r"params\['x'\]: on meta, but params\['w'\] is on cpu",
    ),
    ({"w": torch.tensor([1.0, math.nan])}, ValueError, r"params\['w'\]: contains inf or NaN"),
    (
        {"w": Pair(torch.ones(1), torch.tensor(-math.inf))},
        ValueError,
        r"params\['w'\]\.bias: contains inf or NaN",
    ),
    ({"s": torch.eye(2).to_sparse()}, TypeError, r"params\['s'\]: expected a dense tensor"),
]


@pytest.mark.parametrize("params, error, match", INIT_CASES)
def test_fp16_init_rejects_bad_params(params, error, match):
    with pytest.raises(error, match=match):
        ff.fp16_init(params, ff.sgd(0.1))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"tx": "sgd"}, TypeError, "tx must be a GradientTransformation"),
        (
            {"tx": (lambda p: p, lambda u, s, p: (u, s))},
            TypeError,
            "tx must be a GradientTransformation",
        ),
        ({"loss_scale": 128.0}, TypeError, "loss_scale must be a DynamicLossScale"),
        ({"param_dtype": torch.int8}, TypeError, "param_dtype must be a floating torch.dtype"),
        ({"param_dtype": "float16"}, TypeError, "param_dtype must be a floating torch.dtype"),
    ],
)
def test_fp16_init_rejects_bad_arguments(kwargs, error, match):
    args = {"tx": ff.sgd(0.1), **kwargs}
    with pytest.raises(error, match=match):
        ff.fp16_init(base_params(), args.pop("tx"), **args)


def test_zero_dimensional_and_empty_leaves_are_valid():
    params = {
        "a": torch.tensor(1.0),
        "b": (torch.tensor(-2.0),),
        "none": None,
        "empty": torch.zeros(0),
    }
    state = ff.fp16_init(params, ff.sgd(0.5, momentum=0.9), ff.StaticLossScale(4.0))
    grads = {
        "a": torch.tensor(1.0).half(),
        "b": (torch.tensor(2.0).half(),),
        "none": None,
        "empty": torch.zeros(0).half(),
    }
    scale = float(state.loss_scale.loss_scale)
    grads = optree.tree_map(lambda g: g * scale, grads, namespace=NAMESPACE)
    new = ff.fp16_update(state, grads)
    assert bool(new.grads_finite)
    assert float(new.master["a"]) == 0.5 and float(new.master["b"][0]) == -3.0
    assert new.master["empty"].shape == (0,)


def _with(tree, **changes):
    return {**tree, **changes}


UPDATE_CASES = [
    (
        "missing key",
        lambda g: {k: v for k, v in g.items() if k != "scalar"},
        ValueError,
        r"missing keys \['scalar'\]",
    ),
    (
        "extra key",
        lambda g: _with(g, extra=torch.zeros(1)),
        ValueError,
        r"unexpected keys \['extra'\]",
    ),
    (
        "namedtuple as tuple",
        lambda g: _with(g, pair=tuple(g["pair"])),
        ValueError,
        r"at grads\['pair'\] \(expected a Pair, got a tuple\)",
    ),
    (
        "list as tuple",
        lambda g: _with(g, stack=tuple(g["stack"])),
        ValueError,
        r"at grads\['stack'\] \(expected a list, got a tuple\)",
    ),
    (
        "short list",
        lambda g: _with(g, stack=g["stack"][:1]),
        ValueError,
        r"at grads\['stack'\] \(expected length 2, got 1\)",
    ),
    (
        "shape",
        lambda g: _with(g, pair=Pair(torch.zeros(3, 2).half(), g["pair"].bias)),
        ValueError,
        r"grads\['pair'\]\.kernel: shape \(3, 2\) does not match",
    ),
    (
        "0-d vs 1-d",
        lambda g: _with(g, scalar=torch.zeros(1).half()),
        ValueError,
        r"grads\['scalar'\]: shape \(1,\) does not match params\['scalar'\] shape \(\)",
    ),
    (
        "dtype",
        lambda g: _with(g, scalar=torch.tensor(0.0)),
        TypeError,
        r"grads\['scalar'\]: dtype torch.float32 does not match",
    ),
    (
        "int dtype",
        lambda g: _with(g, scalar=torch.tensor(0, dtype=torch.int16)),
        TypeError,
        r"grads\['scalar'\]: dtype torch.int16",
    ),
    (
        "device",
        lambda g: _with(g, scalar=torch.zeros((), dtype=torch.float16, device="meta")),
        ValueError,
        r"grads\['scalar'\]: device meta does not match",
    ),
    (
        "None leaf",
        lambda g: _with(g, scalar=None),
        TypeError,
        r"grads\['scalar'\]: expected a tensor, got NoneType",
    ),
    (
        "float leaf",
        lambda g: _with(g, scalar=0.5),
        TypeError,
        r"grads\['scalar'\]: expected a tensor, got float",
    ),
    (
        "subtree for leaf",
        lambda g: _with(g, scalar={"x": torch.zeros(())}),
        TypeError,
        r"grads\['scalar'\]: expected a tensor, got dict",
    ),
    (
        "deep None",
        lambda g: _with(g, stack=[g["stack"][0], (None,)]),
        TypeError,
        r"grads\['stack'\]\[1\]\[0\]: expected a tensor",
    ),
    ("not a tree", lambda g: "grads", ValueError, r"different tree structure"),
    ("empty", lambda g: {}, ValueError, r"missing keys"),
]


@pytest.mark.parametrize(
    "name, mutate, error, match", UPDATE_CASES, ids=[c[0] for c in UPDATE_CASES]
)
def test_fp16_update_rejects_bad_grads_and_leaves_state_unchanged(name, mutate, error, match):
    state = trained()
    before = snapshot(state)
    with pytest.raises(error, match=match):
        ff.fp16_update(state, mutate(good_grads(state)))
    assert_unchanged(state, before)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"loss": 1.0}, TypeError, "loss must be a tensor or None"),
        ({"impl": "fastest"}, ValueError, "impl must be 'auto' or one of"),
        ({"agree": 3}, TypeError, "agree must be a callable or None"),
        ({"donate": "yes"}, TypeError, "donate must be a bool"),
    ],
)
def test_fp16_update_rejects_bad_arguments(kwargs, error, match):
    state = trained()
    before = snapshot(state)
    with pytest.raises(error, match=match):
        ff.fp16_update(state, good_grads(state), **kwargs)
    assert_unchanged(state, before)


def test_fp16_update_rejects_a_non_state():
    state = trained()
    with pytest.raises(TypeError, match="state must be an FP16State, got dict"):
        ff.fp16_update({"params": state.params}, good_grads(state))


# -- fuzzing: random trees, random defects -----------------------------------------------------

shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


def _trees():
    def extend(children):
        keys = st.text("abcxyz", min_size=1, max_size=3)
        return st.one_of(
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.tuples(children, children).map(lambda kv: Pair(*kv)),
        )

    return st.recursive(shapes, extend, max_leaves=6).filter(
        lambda t: (
            not isinstance(t, tuple)
            or isinstance(t, Pair)
            or not all(isinstance(x, int) for x in t)
        )
    )


def _materialise(spec, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def build(node):
        if (
            isinstance(node, tuple)
            and not isinstance(node, Pair)
            and all(isinstance(d, int) for d in node)
        ):
            return torch.randn(node, generator=gen)
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, Pair):
            return Pair(build(node.kernel), build(node.bias))
        return type(node)(build(v) for v in node)

    return build(spec)


def _is_shape(node) -> bool:
    return (
        isinstance(node, tuple)
        and not isinstance(node, Pair)
        and all(isinstance(d, int) for d in node)
    )


def replace_at(tree, entries, fn):
    if not entries:
        return fn(tree)
    e, rest = entries[0], entries[1:]
    if isinstance(tree, dict):
        new = dict(tree)
        new[e] = replace_at(tree[e], rest, fn)
        return new
    items = list(tree)
    items[e] = replace_at(tree[e], rest, fn)
    return type(tree)(*items) if isinstance(tree, Pair) else type(tree)(items)


LEAF_DEFECTS = {
    # kind: (make the bad leaf from the good one, error, message after the path)
    "shape": (lambda g: torch.zeros(g.shape + (2,), dtype=g.dtype), ValueError, ": shape "),
    "dtype": (lambda g: g.float(), TypeError, ": dtype torch.float32 does not match"),
    "bf16": (lambda g: g.bfloat16(), TypeError, ": dtype torch.bfloat16 does not match"),
    "int": (lambda g: g.to(torch.int32), TypeError, ": dtype torch.int32 does not match"),
    "device": (
        lambda g: torch.zeros(g.shape, dtype=g.dtype, device="meta"),
        ValueError,
        ": device meta",
    ),
    "none": (lambda g: None, TypeError, ": expected a tensor, got NoneType"),
    "float": (lambda g: 1.5, TypeError, ": expected a tensor, got float"),
    "subtree": (lambda g: [g], TypeError, ": expected a tensor, got list"),
}
NODE_DEFECTS = ("drop", "extra", "retype")


def _node_defect(node, kind: str, last):
    """Breaks the container ``node`` whose child ``last`` is the chosen leaf."""
    if kind == "extra":
        if isinstance(node, dict):
            return {**node, "zz_extra": torch.zeros(1)}
        return (
            list(node) + [torch.zeros(1)]
            if isinstance(node, list)
            else tuple(node) + (torch.zeros(1),)
        )
    if kind == "drop":
        if isinstance(node, dict):
            return {k: v for k, v in node.items() if k != last}
        return (
            [v for i, v in enumerate(node) if i != last]
            if isinstance(node, list)
            else tuple(v for i, v in enumerate(node) if i != last)
        )
    # retype: the same children in another container type
    if isinstance(node, dict):
        return list(node.values())
    if isinstance(node, list):
        return tuple(node)
    return list(node)


def test_fuzz_fp16_update_with_broken_grads():
    seen = Counter()

    @FUZZ
    @given(spec=_trees(), seed=st.integers(0, 2**16), data=st.data())
    def case(spec, seed, data):
        params = _materialise(spec, seed)
        try:
            state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
        except ValueError as err:  # only a tree without any element-bearing leaf
            assert "empty tree" in str(err)
            assert not tree_leaves(params)
            seen["empty tree rejected"] += 1
            return
        state = ff.fp16_update(state, good_grads(state))
        before = snapshot(state)
        accessors = optree.tree_accessors(state.params, namespace=NAMESPACE)
        i = data.draw(st.integers(0, len(accessors) - 1))
        entries = [a.entry for a in accessors[i]]
        path = format_path(accessors[i])
        kind = data.draw(st.sampled_from(sorted(LEAF_DEFECTS) + list(NODE_DEFECTS)))
        grads = good_grads(state)
        if kind in LEAF_DEFECTS:
            make, error, after = LEAF_DEFECTS[kind]
            bad = replace_at(grads, entries, make)
            expected = f"grads{path}{after}"
            if path == "<root>":
                expected = f"grads<root>{after}"
        else:
            bad = replace_at(
                grads, entries[:-1], lambda node: _node_defect(node, kind, entries[-1])
            )
            error = ValueError
            parent = format_path(accessors[i][:-1]) if len(entries) > 1 else ""
            expected = "different tree structure" + (
                f" than params at grads{parent} (" if parent else ""
            )
        with pytest.raises(error) as info:
            ff.fp16_update(state, bad)
        assert expected in str(info.value), (kind, str(info.value))
        assert_unchanged(state, before)
        seen[kind] += 1

    case()
    total = sum(seen.values())
    print(f"\n[fuzz fp16_update] cases={total} by defect={dict(sorted(seen.items()))}")
    assert total >= 350
    assert all(seen[k] > 0 for k in list(LEAF_DEFECTS) + list(NODE_DEFECTS))


# -- fuzzing: hyperparameters ------------------------------------------------------------------

any_value = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-4.0, max_value=4.0),
    st.integers(-3, 2**40),
    st.booleans(),
    st.text(max_size=2),
    st.none(),
    st.just(torch.tensor(1.0)),
)


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


TINY = torch.finfo(torch.float32).tiny


def _fits32(v) -> bool:
    return math.isfinite(v) and math.isfinite(float(torch.tensor(float(v), dtype=torch.float32)))


HYPER = {
    # name: (constructor taking the value, is the value valid)
    "DynamicLossScale.init_scale": (
        lambda v: ff.DynamicLossScale(init_scale=v),
        lambda v: _real(v) and 1.0 <= v <= 2.0**24,
    ),
    "DynamicLossScale.growth_factor": (
        lambda v: ff.DynamicLossScale(growth_factor=v),
        lambda v: _real(v) and 1.0 < v < math.inf,
    ),
    "DynamicLossScale.backoff_factor": (
        lambda v: ff.DynamicLossScale(backoff_factor=v),
        lambda v: _real(v) and 0.0 < v < 1.0,
    ),
    "DynamicLossScale.growth_interval": (
        lambda v: ff.DynamicLossScale(growth_interval=v),
        lambda v: _int(v) and 1 <= v < 2**31,
    ),
    "DynamicLossScale.min_scale": (
        lambda v: ff.DynamicLossScale(min_scale=v),
        lambda v: _real(v) and TINY <= v <= 2.0**16,
    ),
    "DynamicLossScale.max_scale": (
        lambda v: ff.DynamicLossScale(max_scale=v),
        lambda v: _real(v) and v >= 2.0**16,
    ),
    "DynamicLossScale.hysteresis": (
        lambda v: ff.DynamicLossScale(hysteresis=v),
        lambda v: _int(v) and 1 <= v < 2**31,
    ),
    "StaticLossScale.scale": (
        lambda v: ff.StaticLossScale(v),
        lambda v: _real(v) and TINY <= v and _fits32(v),
    ),
    "sgd.learning_rate": (lambda v: ff.sgd(v), lambda v: _real(v) and 0.0 <= v < math.inf),
    "sgd.momentum": (lambda v: ff.sgd(0.1, momentum=v), lambda v: _real(v) and 0.0 <= v < math.inf),
    "sgd.dampening": (
        lambda v: ff.sgd(0.1, momentum=0.9, dampening=v),
        lambda v: _real(v) and 0.0 <= v <= 1.0,
    ),
    "sgd.weight_decay": (
        lambda v: ff.sgd(0.1, weight_decay=v),
        lambda v: _real(v) and 0.0 <= v < math.inf,
    ),
    "trace.decay": (lambda v: ff.trace(v), lambda v: _real(v) and 0.0 <= v < math.inf),
    "clip_by_global_norm.max_norm": (
        lambda v: ff.clip_by_global_norm(v),
        lambda v: _real(v) and 0.0 < v < math.inf,
    ),
    "apply_if_finite.max_consecutive_errors": (
        lambda v: ff.apply_if_finite(ff.sgd(0.1), v),
        lambda v: _int(v) and v >= 0,
    ),
}
# The argument name each error must mention.
NAMES = {
    "sgd.learning_rate": "learning_rate",
    "trace.decay": "momentum",
    "StaticLossScale.scale": "scale",
}


def test_fuzz_hyperparameters():
    seen = Counter()

    @FUZZ
    @given(which=st.sampled_from(sorted(HYPER)), value=any_value)
    def case(which, value):
        build, valid = HYPER[which]
        name = NAMES.get(which, which.split(".")[1])
        if valid(value):
            build(value)
            seen["accepted"] += 1
            return
        with pytest.raises((TypeError, ValueError)) as info:
            build(value)
        assert name in str(info.value), (which, value, str(info.value))
        seen["rejected"] += 1

    case()
    print(f"\n[fuzz hyperparameters] cases={sum(seen.values())} {dict(seen)}")
    assert seen["rejected"] >= 200 and seen["accepted"] >= 40


@pytest.mark.parametrize(
    "build, match",
    [
        (
            lambda: ff.DynamicLossScale(init_scale=4.0, min_scale=8.0),
            r"init_scale \(4.0\) must lie in \[min_scale, max_scale\]",
        ),
        (
            lambda: ff.DynamicLossScale(min_scale=2.0, max_scale=1.0, init_scale=2.0),
            r"min_scale \(2.0\) must be <= max_scale \(1.0\)",
        ),
        (
            lambda: ff.DynamicLossScale(init_scale=1e39, max_scale=math.inf),
            "init_scale .* overflows float32",
        ),
        (lambda: ff.sgd(0.1, nesterov=True), "nesterov momentum requires momentum > 0"),
        (
            lambda: ff.chain(ff.sgd(0.1), "clip"),
            "chain argument 1 must be a GradientTransformation",
        ),
        (lambda: ff.apply_if_finite("sgd", 3), "inner must be a GradientTransformation"),
    ],
)
def test_combinations_of_hyperparameters(build, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build()


# -- fuzzing: damaged checkpoint files and mismatched templates ----------------------------


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "state.ckpt"
    state = trained()
    ff.save_checkpoint(path, {"state": state, "epoch": 4})
    return path.read_bytes(), state


def test_fuzz_truncated_and_tampered_checkpoints(checkpoint_bytes, tmp_path):
    data, state = checkpoint_bytes
    like = {"state": trained(), "epoch": 0}
    seen = Counter()
    path = tmp_path / "bad.ckpt"

    @FUZZ
    @given(
        kind=st.sampled_from(["truncate", "flip", "overwrite"]),
        at=st.integers(0, len(data) - 1),
        mask=st.integers(1, 255),
        length=st.integers(1, 64),
    )
    def case(kind, at, mask, length):
        bad = bytearray(data)
        if kind == "truncate":
            bad = bad[:at]
        elif kind == "flip":
            bad[at] ^= mask
        else:
            bad[at : at + length] = bytes([mask]) * len(bad[at : at + length])
        if bytes(bad) == data:
            return
        path.write_bytes(bytes(bad))
        try:
            out = ff.load_checkpoint(path, like)
        except ff.CheckpointCorruptError as err:
            assert str(path) in str(err)
            seen[f"{kind}: rejected"] += 1
            return
        # Bytes the format never reads (zip padding, timestamps) may change
        # without harm; then the content must be exactly the original.
        assert kind != "truncate"
        assert out["epoch"] == 4
        assert_unchanged(out["state"], snapshot(state))
        seen[f"{kind}: harmless"] += 1

    case()
    total = sum(seen.values())
    print(
        f"\n[fuzz checkpoint files] cases={total} {dict(sorted(seen.items()))} file_bytes={len(data)}"
    )
    assert total >= 350 and seen["truncate: rejected"] > 0 and seen["flip: rejected"] > 0


def test_every_template_leaf_that_does_not_match_is_named(checkpoint_bytes, tmp_path):
    """Exhaustive: each leaf of the template, changed in shape, dtype or kind, in turn."""
    data, _ = checkpoint_bytes
    path = tmp_path / "good.ckpt"
    path.write_bytes(data)
    seen = Counter()
    like = {"state": trained(), "epoch": 0}
    leaves = optree.tree_leaves(like, namespace=NAMESPACE)
    for accessor, leaf in zip(
        optree.tree_accessors(like, namespace=NAMESPACE), leaves, strict=True
    ):
        kinds = (
            ["shape", "dtype", "value type"] if isinstance(leaf, torch.Tensor) else ["value type"]
        )
        for kind in kinds:

            def edit(x, kind=kind):
                if kind == "shape":
                    return torch.zeros(x.shape + (1,), dtype=x.dtype)
                if kind == "dtype":
                    return x.to(torch.float64 if x.dtype != torch.float64 else torch.float32)
                return "not a tensor" if isinstance(x, torch.Tensor) else 0.5

            with pytest.raises(ff.CheckpointMismatchError) as info:
                ff.load_checkpoint(path, _edit_like(like, accessor, edit))
            shown = "".join(_ckpt_entry(a) for a in accessor)
            assert f"checkpoint{shown} does not match like{shown}" in str(info.value), str(
                info.value
            )
            seen[kind] += 1
    print(f"\n[template mismatches] cases={sum(seen.values())} {dict(seen)}")
    assert seen["shape"] == seen["dtype"] == len(leaves) - 1


def _ckpt_entry(entry) -> str:
    if isinstance(entry, optree.GetAttrEntry):
        return f".{entry.name}"
    if isinstance(entry, optree.NamedTupleEntry):
        return f".{entry.field}"
    if isinstance(entry, optree.MappingEntry):
        return f"[{entry.key!r}]"
    return f"[{entry.entry}]"


def _edit_like(tree, accessor, fn):
    """A copy of ``tree`` (FP16States and loss scales included) with one leaf replaced."""
    leaves, spec = optree.tree_flatten(tree, namespace=NAMESPACE)
    target = optree.tree_accessors(tree, namespace=NAMESPACE).index(accessor)
    leaves[target] = fn(leaves[target])
    return optree.tree_unflatten(spec, leaves)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("impl", sorted(_IMPLEMENTATIONS))
def test_an_exception_inside_the_update_leaves_the_state_unchanged(impl, donate):
    def agree(finite):
        raise RuntimeError("peer lost")

    state = trained()
    before = snapshot(state)
    with pytest.raises(RuntimeError, match="peer lost"):
        ff.fp16_update(state, good_grads(state), impl=impl, donate=donate, agree=agree)
    assert_unchanged(state, before)

    inner = ff.sgd(0.1, momentum=0.9)

    def failing_update(updates, opt_state, params=None):
        raise ValueError("transform failed")

    state = trained(tx=ff.GradientTransformation(inner.init, inner.update))
    state = state.replace(tx=ff.GradientTransformation(inner.init, failing_update))
    before = snapshot(state)
    with pytest.raises(ValueError, match="transform failed"):
        ff.fp16_update(state, good_grads(state), impl=impl, donate=donate)
    assert_unchanged(state, before)
