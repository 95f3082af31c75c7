"""The library's flatten is optree's: same leaves (by identity, in order) and same spec.

``tree_flatten`` looks the structure of common trees up instead of asking
``optree`` each call (``_util/tree._known_flatten``); these tests hold the
lookup to ``optree``'s answer on generated trees, on trees that share a key
with different contents, and on the node kinds it must leave to ``optree``:
classes registered in the library's namespace (before or after their first
use, first seen with one tensor in two fields) and dicts under
``optree.dict_insertion_ordered``, down to the update and the leaves it names.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import sys
import threading
import warnings
from typing import NamedTuple

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._util import tree as T


class _Key(str):
    pass


class _Colour(str, enum.Enum):
    RED = "a"


class Pair(NamedTuple):
    a: object
    b: object


def _optree(tree):
    return optree.tree_flatten(tree, namespace=T.NAMESPACE)


def _same(tree) -> None:
    for _ in range(2):  # the first call learns the structure, the second looks it up
        leaves, spec = T.tree_flatten(tree)
        want, want_spec = _optree(tree)
        assert spec == want_spec
        assert len(leaves) == len(want) and all(x is y for x, y in zip(leaves, want))
        assert [x is y for x, y in zip(T.tree_leaves(tree), want)] == [True] * len(want)


def _tensor(draw_id: int) -> torch.Tensor:
    return torch.full((1,), float(draw_id))


keys = st.text(alphabet="abcxyz._0123", min_size=1, max_size=6)
tensors = st.integers(0, 1000).map(_tensor)
flat_dicts = st.dictionaries(keys, tensors, max_size=8)
trees = st.recursive(
    st.one_of(tensors, flat_dicts, st.none()),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.tuples(kids, kids).map(lambda ab: Pair(*ab)),
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_generated_trees_flatten_as_optree_does(tree):
    _same(tree)


def test_a_known_structure_with_other_tensors_gives_those_tensors_in_optree_order():
    first = {"b": torch.zeros(1), "a": torch.ones(1), "c": torch.zeros(2)}
    _same(first)
    second = {"b": torch.ones(3), "a": torch.zeros(3), "c": torch.ones(2)}
    leaves, _ = T.tree_flatten(second)
    assert [x is y for x, y in zip(leaves, [second["a"], second["b"], second["c"]])] == [True] * 3


def test_one_tensor_at_two_places_and_other_key_orders():
    t = torch.zeros(1)
    _same({"wte": t, "lm_head": t, "ln": torch.ones(1)})  # a tie: identity cannot order it
    _same({"z": torch.ones(1), "y": torch.ones(1)})
    _same({"y": torch.ones(1), "z": torch.ones(1)})  # same keys, other insertion order


@pytest.mark.parametrize(
    "tree",
    [
        {2: torch.zeros(1), 1: torch.ones(1)},  # integer keys
        {_Key("a"): torch.zeros(1), "b": torch.ones(1)},  # a str subclass: equal to "a"
        {_Colour.RED: torch.zeros(1), "b": torch.ones(1)},  # a str enum member
        {1: torch.zeros(1), "a": torch.ones(1)},  # keys that do not sort
        {"a": {"b": torch.zeros(1)}},  # a dict inside a dict
        collections.OrderedDict(b=torch.zeros(1), a=torch.ones(1)),
        {"a": torch.nn.Parameter(torch.zeros(1)), "b": 3},  # a non-tensor leaf
        (torch.zeros(1), 2.5, "x"),
        {},
        (),
    ],
)
def test_other_node_kinds_match_optree(tree):
    _same({"a": torch.ones(1), "b": torch.zeros(1)})  # a plain-key tree learnt first
    _same(tree)
    if isinstance(tree, dict):  # the spec rebuilds the same keys, of the same types
        leaves, spec = T.tree_flatten(tree)
        rebuilt = optree.tree_unflatten(spec, leaves)
        assert sorted(map(repr, rebuilt)) == sorted(map(repr, tree))
        assert {type(k) for k in rebuilt} == {type(k) for k in tree}


def test_the_librarys_registered_nodes_flatten_by_their_registration():
    import functional_fp16 as ff

    params = {"w": torch.zeros(2, dtype=torch.float16), "b": torch.zeros(2, dtype=torch.float16)}
    state = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9))
    _same(state)
    _same((state.loss_scale, state.opt_state))


# --- Node kinds optree's registry decides: registered classes, dict_insertion_ordered ---


_OVERRIDES_NAMED_TUPLE = "PyTree type .* is a subclass of `collections.namedtuple`"


def _linear_class(name: str) -> type:
    """A fresh NamedTuple class ``name(w, b)``: one per test, as optree's registrations
    are global."""
    return NamedTuple(name, [("w", object), ("b", object)])


def _register_b_first(cls: type, namespace: str = T.NAMESPACE) -> None:
    """Registers ``cls`` (in the library's namespace unless told) with its own child order:
    ``(b, w)`` for the fields ``(w, b)``."""
    with warnings.catch_warnings():  # optree notes that it overrides the named-tuple default
        warnings.filterwarnings("ignore", _OVERRIDES_NAMED_TUPLE)
        optree.register_pytree_node(
            cls,
            lambda node: ((node.b, node.w), None, ("b", "w")),
            lambda _, children: cls(w=children[1], b=children[0]),
            path_entry_type=optree.GetAttrEntry,
            namespace=namespace,
        )


@contextlib.contextmanager
def _registered_b_first(cls: type):
    _register_b_first(cls)
    try:
        yield cls
    finally:
        optree.unregister_pytree_node(cls, namespace=T.NAMESPACE)


def _agrees(tree) -> None:
    """:func:`_same`, and each leaf sits at the path ``tree_paths`` names for it."""
    _same(tree)
    accessors, want, _ = optree.tree_flatten_with_accessor(tree, namespace=T.NAMESPACE)
    assert T.tree_paths(tree) == [T.format_path(a) for a in accessors]
    assert [a(tree) is x for a, x in zip(accessors, T.tree_leaves(tree))] == [True] * len(want)


def test_a_registered_named_tuple_first_seen_tied_flattens_by_its_registration():
    with _registered_b_first(_linear_class("TiedFirstLinear")) as cls:
        t = torch.zeros(1)
        _agrees(cls(w=t, b=t))  # one tensor in both fields: identity cannot order them
        _agrees(cls(w=torch.zeros(3, 2), b=torch.ones(3)))
        _agrees((cls(w=t, b=torch.ones(2)), None))


def test_a_named_tuple_registered_after_its_first_use_flattens_by_its_registration():
    cls = _linear_class("LateLinear")
    node = cls(w=torch.zeros(3, 2), b=torch.ones(3))
    _agrees(node)  # learnt as a plain named tuple: field order
    _agrees([node, {"x": torch.ones(1)}])
    with _registered_b_first(cls):
        _agrees(node)
        _agrees([node, {"x": torch.ones(1)}])
    _agrees(node)  # unregistered again: field order again
    _agrees([node, {"x": torch.ones(1)}])


def test_a_named_tuple_registered_in_the_global_namespace_flattens_by_its_registration():
    everywhere = _global_namespace()
    cls = _linear_class("GlobalLinear")
    node = cls(w=torch.zeros(3, 2), b=torch.ones(3))
    _agrees(node)
    _register_b_first(cls, everywhere)
    try:
        _agrees(node)
    finally:
        optree.unregister_pytree_node(cls, namespace=everywhere)
    _agrees(node)


@pytest.mark.parametrize("leaf", [torch.Tensor, torch.nn.Parameter])
def test_a_tensor_class_registered_as_a_node_is_left_to_optree(leaf):
    tree = {"a": torch.nn.Parameter(torch.zeros(2)), "b": torch.ones(2)}
    _agrees(tree)
    # optree registers any class, torch.Tensor included: here a node without children
    optree.register_pytree_node(
        leaf, lambda _: ((), None), lambda *_: torch.zeros(1), namespace=T.NAMESPACE
    )
    try:
        _agrees(tree)
    finally:
        optree.unregister_pytree_node(leaf, namespace=T.NAMESPACE)
    _agrees(tree)


@contextlib.contextmanager
def _primed(how: str, cls: type):
    """``cls`` registered b-first, its trees first seen as ``how`` says: ``"tied"``
    (registered, then one tensor in both fields) or ``"late"`` (an update of it
    unregistered, then registered)."""
    if how == "late":
        state = ff.fp16_init(cls(w=torch.randn(3, 2), b=torch.randn(3)), ff.sgd(0.1))
        ff.fp16_update(state, cls(w=torch.ones(3, 2).half(), b=torch.ones(3).half()))
    with _registered_b_first(cls):
        if how == "tied":
            t = torch.randn(3)
            ff.fp16_update(ff.fp16_init(cls(w=t, b=t), ff.sgd(0.1)), cls(w=t.half(), b=t.half()))
        yield cls


@pytest.mark.parametrize("shapes", [((3, 2), (3,)), ((3,), (3,))], ids=["shapes", "same shape"])
@pytest.mark.parametrize("how", ["tied", "late"])
def test_a_registered_named_tuple_updates_each_field_with_its_own_gradient(how, shapes):
    w_shape, b_shape = shapes
    with _primed(how, _linear_class(f"Linear_{how}_{len(w_shape)}")) as cls:
        g = torch.Generator().manual_seed(1)
        w, b = torch.randn(w_shape, generator=g), torch.randn(b_shape, generator=g)
        gw, gb = torch.randn(w_shape, generator=g), torch.randn(b_shape, generator=g) * 100
        tx = ff.sgd(0.5, momentum=0.9)
        state = ff.fp16_init(cls(w=w, b=b), tx)
        assert state.params.w.shape == w_shape and state.params.b.shape == b_shape
        got = ff.fp16_update(state, cls(w=gw.half(), b=gb.half()))
        want = ff.fp16_update(
            ff.fp16_init({"w": w, "b": b}, tx), {"w": gw.half(), "b": gb.half()}
        )  # the same fields as dict keys
        assert torch.equal(got.params.w, want.params["w"])
        assert torch.equal(got.params.b, want.params["b"])
        assert torch.equal(got.master.w, want.master["w"])
        assert ff.nonfinite_leaves(got) == []
        gw[0] = float("inf")
        skipped = ff.fp16_update(state, cls(w=gw.half(), b=gb.half()))
        assert ff.nonfinite_leaves(skipped) == ["w"]


def _global_namespace() -> str:
    """optree's global namespace, a private sentinel (other libraries may use it)."""
    everywhere = vars(optree.registry).get("__GLOBAL_NAMESPACE")
    if everywhere is None:
        pytest.skip("this optree has no global-namespace sentinel")
    return everywhere


@pytest.mark.parametrize("everywhere", [False, True], ids=["namespace", "global"])
def test_dict_insertion_ordered_flattens_dicts_in_insertion_order(everywhere):
    namespace = _global_namespace() if everywhere else T.NAMESPACE
    t = torch.zeros(1)
    tree = {"b": torch.zeros(2), "a": torch.ones(3)}
    nested = (tree, [{"d": torch.ones(1), "c": torch.zeros(1)}], Pair(tree, None))
    _agrees(tree)  # learnt with sorted keys
    _agrees(nested)
    with optree.dict_insertion_ordered(True, namespace=namespace):
        _agrees(tree)
        _agrees(nested)
        _agrees({"y": t, "x": t})  # first seen here, tied
    _agrees({"y": torch.zeros(2), "x": torch.ones(3)})  # the same key, sorted again
    _agrees(tree)


def test_dict_insertion_ordered_updates_each_key_with_its_own_gradient():
    g = torch.Generator().manual_seed(2)
    params = {"b": torch.randn(4, generator=g), "a": torch.randn(4, generator=g)}
    grads = {
        "b": torch.randn(4, generator=g).half(),
        "a": (torch.randn(4, generator=g) * 99).half(),
    }
    tx = ff.adamw(1e-2, weight_decay=0.1)
    want = ff.fp16_update(ff.fp16_init(params, tx), grads)  # learns the trees' keys, sorted
    with optree.dict_insertion_ordered(True, namespace=ff.NAMESPACE):
        got = ff.fp16_update(ff.fp16_init(params, tx), grads)
        _agrees(got.params)
        bad = dict(grads, b=torch.tensor([1, float("inf"), 1, 1]).half())
        assert ff.nonfinite_leaves(ff.fp16_update(ff.fp16_init(params, tx), bad)) == ["b"]
    for key in params:
        assert torch.equal(got.params[key], want.params[key]), key
        assert torch.equal(got.master[key], want.master[key]), key


# Trees with every node kind the lookup meets, registered ones included, and tensors that
# appear at several places (a tie hides an order from the leaf-by-leaf check).
_Registered = _linear_class("HypothesisLinear")
_TIED = [torch.full((1,), -1.0), torch.full((1,), -2.0)]
leaves_or_ties = st.one_of(tensors, st.sampled_from(_TIED))
any_trees = st.recursive(
    st.one_of(leaves_or_ties, st.dictionaries(keys, leaves_or_ties, max_size=5), st.none()),
    lambda kids: st.one_of(
        st.lists(kids, max_size=3),
        st.lists(kids, max_size=3).map(tuple),
        st.tuples(kids, kids).map(lambda ab: Pair(*ab)),
        st.tuples(kids, kids).map(lambda ab: _Registered(*ab)),
        st.dictionaries(keys, kids, max_size=3),
    ),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def registered():
    with _registered_b_first(_Registered):
        yield


@settings(max_examples=200, deadline=None)
@given(tree=any_trees, ordered=st.booleans())
def test_leaves_and_paths_agree_with_optree(registered, tree, ordered):
    """The tree, then the same structure with fresh tensors (no ties), with or without
    ``dict_insertion_ordered``."""
    _agrees(tree)
    fresh = optree.tree_map(torch.clone, tree, namespace=T.NAMESPACE)
    with optree.dict_insertion_ordered(ordered, namespace=T.NAMESPACE):
        _agrees(fresh)
        _agrees(tree)
    _agrees(fresh)


def test_threads_learning_many_structures_at_once_get_optrees_answers(monkeypatch):
    monkeypatch.setattr(T, "_STRUCTURES", {})
    monkeypatch.setattr(T, "_STRUCTURES_KEPT", 4)  # evicting all the time
    interval = sys.getswitchinterval()
    trees = [{f"k{j}": torch.zeros(1) for j in range(n)} for n in range(1, 24)]
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def work(shift: int) -> None:
        try:
            start.wait()
            for i in range(300):
                tree = trees[(i * 7 + shift) % len(trees)]
                leaves, spec = T.tree_flatten(tree)
                want, want_spec = _optree(tree)
                assert spec == want_spec and all(x is y for x, y in zip(leaves, want, strict=True))
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    sys.setswitchinterval(1e-6)  # threads switch every few bytecodes
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert len(T._STRUCTURES) <= 4


# ---------------------------------------------------------------------------
# The walk a torch.compile trace flattens with (``_util/tree._traced_flatten``).
# ---------------------------------------------------------------------------


def _traced_same(tree) -> None:
    """The traced walk gives optree's leaves, rebuilds the tree, and its spec is equal
    for another tree exactly when optree's is."""
    leaves, spec = T._traced_flatten(tree)
    want, want_spec = _optree(tree)
    assert len(leaves) == len(want) and all(x is y for x, y in zip(leaves, want))
    assert spec.num_leaves == len(want)
    rebuilt = T.tree_unflatten(spec, leaves)
    again, again_spec = _optree(rebuilt)
    assert again_spec == want_spec and all(x is y for x, y in zip(again, want))
    if isinstance(tree, dict):  # the keys in their order, of their types
        assert [(k, type(k)) for k in rebuilt] == [(k, type(k)) for k in tree]


@settings(max_examples=150, deadline=None)
@given(trees, trees)
def test_the_traced_walk_flattens_rebuilds_and_compares_as_optree_does(tree, other):
    _traced_same(tree)
    same_structure = _optree(tree)[1] == _optree(other)[1]
    assert (T._traced_flatten(tree)[1] == T._traced_flatten(other)[1]) == same_structure


@pytest.mark.parametrize(
    "tree",
    [
        {2: torch.zeros(1), 1: torch.ones(1)},
        {_Key("a"): torch.zeros(1), "b": torch.ones(1)},
        {_Colour.RED: torch.zeros(1), "b": torch.ones(1)},
        collections.OrderedDict(b=torch.zeros(1), a=torch.ones(1)),
        {"a": torch.nn.Parameter(torch.zeros(1)), "b": 3},
        (torch.zeros(1), 2.5, "x"),
        {"z": {"b": torch.zeros(1), "a": None}, "y": [torch.ones(2)]},
        {},
        (),
    ],
)
def test_the_traced_walk_takes_or_leaves_to_optree_every_other_node_kind(tree):
    _traced_same(tree)


def test_the_traced_walk_flattens_the_librarys_nodes_by_their_registration():
    params = {"w": torch.zeros(2, dtype=torch.float16), "b": torch.zeros(2, dtype=torch.float16)}
    for tx in (ff.sgd(0.1, momentum=0.9), ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(1e-3))):
        state = ff.fp16_init(params, tx)
        _traced_same(state)
        _traced_same((state.loss_scale, state.opt_state))
        leaves, spec = T._traced_flatten(state)
        assert T.tree_unflatten(spec, leaves).tx is tx


def test_the_traced_walk_leaves_a_registered_named_tuple_to_optree():
    class Tied(NamedTuple):
        a: object
        b: object

    tree = {"x": Tied(torch.zeros(1), torch.ones(1))}
    _traced_same(tree)  # the default entry: walked
    with warnings.catch_warnings():  # optree notes that it overrides the named tuple's entry
        warnings.simplefilter("ignore")
        optree.register_pytree_node(
            Tied,
            lambda t: ((t.b, t.a), None, ("b", "a")),  # the fields the other way round
            lambda _, ch: Tied(ch[1], ch[0]),
            namespace=T.NAMESPACE,
        )
    try:
        leaves, spec = T._traced_flatten(tree)
        assert spec.optree_spec is not None
        assert [x is y for x, y in zip(leaves, [tree["x"].b, tree["x"].a])] == [True, True]
        _traced_same(tree)
    finally:
        optree.unregister_pytree_node(Tied, namespace=T.NAMESPACE)


def test_the_traced_walk_leaves_insertion_ordered_dicts_to_optree():
    tree = {"b": torch.zeros(1), "a": torch.ones(1)}
    with optree.dict_insertion_ordered(True, namespace=T.NAMESPACE):
        leaves, spec = T._traced_flatten(tree)
        assert spec.optree_spec is not None and leaves[0] is tree["b"]


def test_the_traced_walk_compares_dicts_by_their_keys_and_rebuilds_their_order():
    a = {"b": torch.zeros(1), "a": {"y": torch.ones(1), "x": None}}
    b = {"a": {"x": None, "y": torch.ones(1)}, "b": torch.zeros(1)}
    assert _optree(a)[1] == _optree(b)[1]
    assert T._traced_flatten(a)[1] == T._traced_flatten(b)[1]
    _traced_same(a)
    _traced_same(b)
    leaves, spec = T._traced_flatten(a)
    rebuilt = T.tree_unflatten(spec, leaves)
    assert list(rebuilt) == ["b", "a"] and list(rebuilt["a"]) == ["y", "x"]
