"""Shared pieces of the bad-input tests: bitwise state snapshots, a small trained state, fuzzing.

Bad input at the API edges must get a specific error naming the leaf or
argument, and leave the given state bitwise unchanged. The tests live next to
the module they test (``test_update.py``, ``test_loss_scale.py``,
``test_sgd.py``, ``test_clipping.py``, ``test_conditionality.py``,
``test_checkpoint.py``); this module holds what several of them use. Kept out
of ``tests/helpers.py`` because it needs hypothesis, which the benchmark
scripts that import ``tests.helpers`` do not.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._util.tree import NAMESPACE

FUZZ = settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)


class Pair(NamedTuple):
    kernel: torch.Tensor
    bias: torch.Tensor


def base_params():
    """A dict holding a 0-d leaf, a NamedTuple and a list with a nested tuple."""
    return {
        "scalar": torch.tensor(0.5),
        "pair": Pair(torch.ones(2, 3), torch.zeros(3)),
        "stack": [torch.full((4,), 2.0), (torch.arange(3.0),)],
    }


def trained(params=None, tx=None):
    """An ``FP16State`` after one applied step, so that the momentum buffers are not zeros."""
    state = ff.fp16_init(params or base_params(), tx or ff.sgd(0.1, momentum=0.9))
    grads = optree.tree_map(lambda p: torch.full_like(p, 0.25), state.params, namespace=NAMESPACE)
    return ff.fp16_update(state, grads)


def good_grads(state):
    return optree.tree_map(lambda p: torch.full_like(p, 0.5), state.params, namespace=NAMESPACE)


# -- fuzzing hyperparameters -------------------------------------------------------------------

ANY_VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-4.0, max_value=4.0),
    st.integers(-3, 2**40),
    st.booleans(),
    st.text(max_size=2),
    st.none(),
    st.just(torch.tensor([1.0])),  # a 0-d float tensor is a valid injected hyperparameter
)

TINY = torch.finfo(torch.float32).tiny


def is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def fits_float32(v) -> bool:
    return math.isfinite(v) and math.isfinite(float(torch.tensor(float(v), dtype=torch.float32)))


class Hyper(NamedTuple):
    """One hyperparameter: a constructor taking its value, the valid values, the name errors use."""

    build: Callable[[Any], Any]
    valid: Callable[[Any], bool]
    name: str


def fuzz_hyperparameters(table: dict[str, Hyper], label: str) -> Counter:
    """Feeds ``FUZZ.max_examples`` random values to the constructors in ``table``.

    A valid value must be accepted; any other must raise ``TypeError`` or
    ``ValueError`` naming the argument. Returns the counts of accepted and
    rejected values, which the caller checks.
    """
    seen = Counter()

    @FUZZ
    @given(which=st.sampled_from(sorted(table)), value=ANY_VALUE)
    def case(which, value):
        build, valid, name = table[which]
        if valid(value):
            build(value)
            seen["accepted"] += 1
            return
        with pytest.raises((TypeError, ValueError)) as info:
            build(value)
        assert name in str(info.value), (which, value, str(info.value))
        seen["rejected"] += 1

    case()
    print(f"\n[fuzz hyperparameters: {label}] cases={sum(seen.values())} {dict(seen)}")
    return seen
