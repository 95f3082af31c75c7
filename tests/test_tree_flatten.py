"""The library's flatten is optree's: same leaves (by identity, in order) and same spec.

``tree_flatten`` looks the structure of common trees up instead of asking
``optree`` each call (``_util/tree._known_flatten``); these tests hold the
lookup to ``optree``'s answer on generated trees, on trees that share a key
with different contents, and on the node kinds it must leave to ``optree``.
"""

from __future__ import annotations

import collections
import enum
from typing import NamedTuple

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
