"""``fp16_update`` on DTensor states, over 2 ranks on gloo, against one process.

The workers (``tests/_dtensor_workers.py``) distribute the same FP16
parameters over a 1-D CPU mesh (uneven ``Shard(0)``, a ``Replicate`` leaf)
and step them with every optimiser of the matrix, pure and donated, with an
inf in one rank's shard at one step; beside it, the whole tensors in one
process. The bounds:

* decisions, loss scales and ``step``: bitwise, on every rank;
* master and optimiser state: bitwise for every optimiser without
  clipping (the same elementwise kernel on each shard); with clipping within
  one float32 ulp of the element, from the global norm's sum of squares, which
  the mesh adds in another order (float64, then rounded once to float32);
* every state tensor keeps its DTensor placements; the working copy is the
  round-to-nearest of the master.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._launch import Launch, launch_workers, results
from tests.helpers import optimiser_matrix

pytestmark = pytest.mark.distributed

WORKER_FILE = Path(__file__).with_name("_dtensor_workers.py")
WORLD = 2
LAUNCH_TIMEOUT_S = 240  # an upper bound for a slow shared machine, not a timing assertion
CLIPPING = ("clip", "clip_trace", "clip_l2_adam", "recipe")


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    return launch_workers(WORKER_FILE, tmp_path_factory.mktemp("dtensor"), WORLD, LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("name", sorted(optimiser_matrix()))
@pytest.mark.parametrize("donate", [False, True])
def test_dtensor_states_step_like_one_process(launch, name, donate):
    per_rank = [r[(name, donate)] for r in results(launch, "matrix")]
    for r in per_rank:
        assert r["decisions"] == r["ref_decisions"], r
        assert r["decisions"].count(False) >= 1  # the injected inf skipped a step
        assert r["scales_equal"] and r["params_equal"] and r["kept"], r
        bound = 1.0 if name in CLIPPING else 0.0
        assert r["master_ulps"] <= bound and r["opt_ulps"] <= bound, r
    assert per_rank[0] == per_rank[1]  # every rank holds the same answer
    fused = name not in ("apply_if_finite", "identity", "zero_momentum_trace", "wd_zero_kept")
    assert per_rank[0]["path"] in (("fused",) if fused else ("fused", "foreach", "foreach-sgd"))


def test_multisteps_of_the_recipe_on_dtensors(launch):
    for r in results(launch, "multisteps"):
        assert all(a == b for a, b in r["decisions"]), r
        assert r["master_ulps"] <= 1.0 and r["path"] == "fused", r


def test_gradients_that_are_not_placed_like_the_params_raise_naming_the_leaf(launch):
    for r in results(launch, "bad_grads"):
        assert r["plain"] is not None and "grads['wte']: a plain tensor" in r["plain"], r
        assert r["placement"] is not None and "placements" in r["placement"], r
