"""Tests for the sharded FP32 state (ZeRO-1): ``shard_state``, ``unshard_state``, ``sharded_update``.

Two module-scoped launches run ``tests/_shard_workers.py`` on 2 and then 3
gloo processes (127.0.0.1); the 3-process run resumes from the checkpoint the
2-process run wrote. This process then resumes the 3-process run's checkpoint
alone, sharded over a one-process group. The model has 58 parameters in leaves
of 35, 5, 15, 2 and 1 elements, so neither world size divides it evenly and
some leaves are smaller than the number of ranks.
"""

from __future__ import annotations

import functools
from pathlib import Path

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16.distributed.row_shards import rows
from functional_fp16.distributed.sharding import owners
from tests._launch import Launch, launch_workers
from tests._launch import results as _load_results
from tests.helpers import bits, load_module, ulp_distance

pytestmark = pytest.mark.distributed

WORKER_FILE = Path(__file__).with_name("_shard_workers.py")
LAUNCH_TIMEOUT_S = 240  # an upper bound for a slow shared machine, not a timing assertion
WORLDS = (2, 3)


W = load_module(WORKER_FILE, "_functional_fp16_shard_workers")


@functools.cache
def results(launch: Launch, scenario: str) -> list:
    """``tests._launch.results``, read from disk once per launch and scenario: the tests only
    read them, and unpickling the equivalence runs' snapshots (weights-only) took about
    0.7 s for each of the 22 tests that index them. A launch or scenario that failed is
    not cached (``pytest.fail`` raises), so every test that reads it still fails with why."""
    return _load_results(launch, scenario)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("shard_checkpoints")
    env = {"FF_SHARD_CKPT_DIR": str(ckpt)}
    two = launch_workers(WORKER_FILE, tmp_path_factory.mktemp("n2"), 2, LAUNCH_TIMEOUT_S, env)
    env_resume = {**env, "FF_SHARD_RESUME": "2"}
    three = launch_workers(
        WORKER_FILE, tmp_path_factory.mktemp("n3"), 3, LAUNCH_TIMEOUT_S, env_resume
    )
    return {2: two, 3: three, "ckpt": ckpt}


# -- comparisons ---------------------------------------------------------------

# The numerical contract between two implementations of one step sequence:
# decisions, loss scale and counters bitwise; FP16 params within 1 ulp; the
# FP32 master and optimiser state within a few FP32 ulps.
PARAM_ULPS = 1
MASTER_ULPS = 4


def assert_bitwise(a, b, where: str) -> None:
    assert torch.equal(bits(a), bits(b)), f"{where}: bit patterns differ"


def assert_same_state(snap: dict, ref: dict, where: str, *, exact: bool) -> None:
    """``snap`` against ``ref`` (two full-state snapshots): bitwise, or within the contract."""
    for field in ("loss_scale", "step", "grads_finite", "leaf_finite"):
        assert_bitwise(snap[field], ref[field], f"{where} {field}")
    assert snap["nonfinite"] == ref["nonfinite"], where
    for field, ulps in (("params", PARAM_ULPS), ("master", MASTER_ULPS)):
        for k, want in ref[field].items():
            got = snap[field][k]
            if exact:
                assert_bitwise(got, want, f"{where} {field}[{k!r}]")
            else:
                assert got.dtype == want.dtype and got.shape == want.shape
                assert ulp_distance(got, want) <= ulps, f"{where} {field}[{k!r}]"
    assert len(snap["opt_state"]) == len(ref["opt_state"])
    for j, (got, want) in enumerate(zip(snap["opt_state"], ref["opt_state"], strict=True)):
        if exact or not want.is_floating_point():
            assert_bitwise(got, want, f"{where} opt_state leaf {j}")
        else:
            assert got.shape == want.shape and ulp_distance(got, want) <= MASTER_ULPS, (
                f"{where} opt_state leaf {j}"
            )


def assert_ranks_agree(snaps: list[dict], where: str) -> None:
    for r, snap in enumerate(snaps[1:], start=1):
        assert_same_state(snap, snaps[0], f"{where}, rank {r} vs rank 0", exact=True)


# -- equivalence with the replicated run ------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("run", W.RUNS, ids=lambda r: f"{r[0]}-{r[1]}-{r[2]}B-{r[3]}")
def test_sharded_run_matches_the_replicated_run(runs, world, run):
    per_rank = [r[run] for r in results(runs[world], "equivalence")]
    applied = []
    for step in range(W.STEPS):
        rep = [h[step][0] for h in per_rank]
        sharded = [h[step][1] for h in per_rank]
        assert_ranks_agree(sharded, f"step {step} sharded")
        assert_same_state(sharded[0], rep[0], f"step {step}", exact=False)
        applied.append(bool(sharded[0]["grads_finite"]))
    # An inf on the last rank only skipped the step on every rank ...
    assert applied[W.INJECT_STEP] is False
    assert applied.count(False) == 1
    # ... and every rank names its leaf, whichever rank's rows of the mean held it.
    for step in range(W.STEPS):
        names = per_rank[0][step][1]["nonfinite"]
        if step == W.INJECT_STEP:
            assert names == ["w1"], names
        elif run[0] != "multisteps":  # (a window's flags hold until it closes)
            assert names == [], (step, names)
    # ... as a no-op on every tensor of the (gathered) state, bit for bit.
    for r, history in enumerate(per_rank):
        before, after = history[W.INJECT_STEP - 1][1], history[W.INJECT_STEP][1]
        for field in ("params", "master"):
            for k in before[field]:
                assert_bitwise(after[field][k], before[field][k], f"rank {r} skipped {field}")
        if run[0] == "multisteps":
            continue  # a closing window empties its accumulator (tests/test_accumulation.py)
        for a, b in zip(after["opt_state"], before["opt_state"], strict=True):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                assert_bitwise(a, b, f"rank {r} skipped opt_state")
    # The run went somewhere: the master moved and the loss scale changed.
    first, last = per_rank[0][0][1], per_rank[0][-1][1]
    assert not torch.equal(first["master"]["w1"], last["master"]["w1"])
    scales = {float(h[1]["loss_scale"]) for h in per_rank[0]}
    assert len(scales) > 1


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("tx_name", ["sgd", "adamw_masked"])
def test_exact_means_give_bitwise_the_replicated_run(runs, world, tx_name):
    # Integer FP16 gradients averaged in FP32 have the same mean in any
    # summation order; then the two runs differ only in where the elementwise
    # step runs (whole leaves or pieces of them), which must not change a bit.
    per_rank = [r[tx_name] for r in results(runs[world], "exact_sums")]
    for step in range(W.STEPS):
        for r, history in enumerate(per_rank):
            rep, sharded = history[step]
            assert_same_state(sharded, rep, f"step {step} rank {r}", exact=True)


@pytest.mark.parametrize("world", WORLDS)
def test_sharded_update_writes_to_none_of_its_inputs(runs, world):
    for r, res in enumerate(results(runs[world], "purity")):
        (state0, grads0), (state1, grads1) = res["before"], res["after"]
        assert len(state0) == len(state1) and len(grads0) == len(grads1)
        for a, b in zip(state0 + grads0, state1 + grads1, strict=True):
            assert torch.equal(a, b), f"rank {r}: an input changed"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("tx_name", ["sgd", "clip_adamw"])
def test_mixed_dtypes_channels_last_and_empty_leaves(runs, world, tx_name):
    # An FP32 working leaf makes a second dtype group (its own slices); a
    # channels-last leaf keeps its layout through the gather; an empty leaf
    # has empty pieces everywhere; gradients come channels-last and expanded;
    # 32-byte buckets cut every collective into rounds. The means are exact,
    # so the runs must agree bit for bit.
    per_rank = [r[tx_name] for r in results(runs[world], "awkward")]
    for r, res in enumerate(per_rank):
        assert res["placements"] == ["(Shard(dim=0),)"] and res["master_types"] == ["DTensor"]
        assert res["channels_last"] and res["master_channels_last"]
        for step, (rep, sharded) in enumerate(res["history"]):
            assert_same_state(sharded, rep, f"rank {r} step {step}", exact=True)
            assert sharded["params"]["s"].dtype == torch.float32
            assert sharded["params"]["z"].shape == (0,)
    assert not torch.equal(
        per_rank[0]["history"][-1][1]["master"]["k"], W.awkward_state(tx_name).master["k"]
    )


# -- memory --------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("tx_name,copies", [("sgd", 1), ("adamw_masked", 2)])
def test_each_rank_holds_its_share_of_the_fp32_state(runs, world, tx_name, copies):
    per_rank = [r[tx_name] for r in results(runs[world], "memory")]
    n = sum(x.numel() for x in W.make_params(0).values())
    # The most elements a rank holds: ceil(rows / N) rows of every leaf (Shard(0)).
    share = sum(
        -(-s[0] // world) * (x.numel() // s[0])
        for s, x in ((x.shape, x) for x in W.make_params(0).values())
    )
    full = per_rank[0]
    # The master: exactly the full state's bytes between the ranks, no padding stored.
    assert sum(r["master"] for r in per_rank) == full["full_master"] == 4 * n
    for r in per_rank:
        assert r["master"] <= 4 * share
        # The per-parameter optimiser tensors are sharded the same way; only
        # 0-d counters and flags stay whole on every rank (a few bytes).
        per_param_full = 4 * n * copies
        whole = full["full_opt"] - per_param_full
        assert 0 <= whole <= 16
        assert r["opt"] - whole <= 4 * share * copies
        assert r["params"] == full["full_params"]  # the FP16 working copy stays whole
    per_param = [r["opt"] - (full["full_opt"] - 4 * n * copies) for r in per_rank]
    assert sum(per_param) == 4 * n * copies
    # Each rank's shards are the ones DTensor itself gives it (distribute_tensor).
    for r in per_rank:
        assert r["local_shapes"] == r["dtensor_shapes"]
        assert r["global_shapes"] == {k: tuple(v) for k, v in W.SHAPES.items()}
    assert len({str(r["local_shapes"]) for r in per_rank}) > 1  # the ranks hold different rows


# -- misuse ----------------------------------------------------------------------

EXPECTED_ERRORS = {
    "shard_twice": ("ValueError", "state already holds DTensors"),
    "fp16_update_sharded": ("ValueError", "sharded_update"),
    "update_path_sharded": ("ValueError", "sharded_update"),
    "sharded_update_full": ("ValueError", "shard_state(state) first"),
    "unshard_full": ("ValueError", "shard_state(state) first"),
    "replicated_master": (
        "ValueError",
        "state.master['b1']: a DTensor of shape (5,), placements (Replicate(),)",
    ),
    "bad_grads": ("ValueError", "grads['w2']"),
    "mesh_2d": ("ValueError", "mesh must be 1-D"),
    "plain_save": ("TypeError", "save_dcp_state"),
    "bad_loss": ("TypeError", "loss must be a tensor"),
    "bad_impl": ("ValueError", "impl must be"),
    "stale_layout": ("ValueError", "state.params['b1']: shape (6,), but the sharded master"),
    "all_reduce_in_tx": ("ValueError", "all_reduce_mean()"),
}


@pytest.mark.parametrize("world", WORLDS)
def test_misuse_raises_on_every_rank_without_a_hang(runs, world):
    for r, res in enumerate(results(runs[world], "errors")):
        errors = res["errors"]
        assert set(errors) == set(EXPECTED_ERRORS)
        for case, (kind, text) in EXPECTED_ERRORS.items():
            message = errors[case]
            assert message is not None, f"rank {r}: {case} did not raise"
            assert message.startswith(kind + ":") and text in message, (r, case, message)
        assert all(res["unchanged"]), f"rank {r}: a failed call changed the state"


# -- checkpoints across world sizes -------------------------------------------------


def _load_full(path: Path) -> dict:
    like = {"state": W.make_state("adamw_masked", seed=1), "epoch": 0}
    return ff.load_checkpoint(path, like=like)


def test_a_sharded_checkpoint_holds_the_full_state(runs):
    for world in WORLDS:
        written = results(runs[world], "checkpoint")[0]["written"]
        loaded = _load_full(runs["ckpt"] / f"sharded_n{world}.ckpt")
        assert loaded["epoch"] == W.RESUME_AFTER
        assert not ffd.is_sharded(loaded["state"])
        assert_same_state(W.full_snapshot(loaded["state"]), written, f"n={world} file", exact=True)


def _continue_alone(state: ff.FP16State) -> list[dict]:
    """The reference continuation: one process, the whole batch, plain fp16_update."""
    history = []
    for step in range(W.RESUME_AFTER, W.RESUME_AFTER + W.CONTINUE_STEPS):
        state = ff.fp16_update(state, W.grads_of(state, W.batch(step, 0)))
        history.append(W.full_snapshot(state))
    return history


def test_a_two_rank_checkpoint_resumes_on_three_ranks(runs):
    per_rank = results(runs[3], "checkpoint")
    saved = _load_full(runs["ckpt"] / "sharded_n2.ckpt")
    reference = _continue_alone(saved["state"])
    for r, res in enumerate(per_rank):
        assert res["resumed_mesh"] == 3
        assert set(res["resumed_placements"].values()) == {(Shard(0),)}
        assert set(res["dcp_placements"].values()) == {(Shard(0),)}
        assert res["resumed_epoch"] == W.RESUME_AFTER
        assert_same_state(res["resumed"], W.full_snapshot(saved["state"]), "resumed", exact=True)
        # The DCP checkpoint of the same state, written shard by shard at 2 ranks and
        # resharded by DCP for 3, holds the same bits.
        assert_same_state(res["resumed_dcp"], res["resumed"], "resumed from DCP", exact=True)
        # Every rank had the whole batch's gradients and averaged them in FP32,
        # so the mean is exact and the continuation is the one-process run's.
        for step, (got, want) in enumerate(zip(res["continued"], reference, strict=True)):
            assert_same_state(got, want, f"rank {r} continued step {step}", exact=True)


@pytest.fixture
def one_process_group(tmp_path):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_three_rank_checkpoint_resumes_on_one_rank(runs, one_process_group):
    path = runs["ckpt"] / "sharded_n3.ckpt"
    reference = _continue_alone(_load_full(path)["state"])
    like = {"state": ffd.shard_state(W.make_state("adamw_masked", seed=1)), "epoch": 0}
    loaded = ffd.load_checkpoint_broadcast(path, like)
    state = loaded["state"]
    assert state.master["w1"].device_mesh.size() == 1 and loaded["epoch"] == W.RESUME_AFTER
    from_dcp = ffd.load_dcp_state(like["state"], runs["ckpt"] / "dcp_n3")
    assert_same_state(
        W.full_snapshot(ffd.unshard_state(from_dcp)),
        W.full_snapshot(ffd.unshard_state(state)),
        "3 -> 1 through DCP",
        exact=True,
    )
    for step, want in zip(range(W.RESUME_AFTER, W.RESUME_AFTER + W.CONTINUE_STEPS), reference):
        state = W._same_grads_step(state, step)
        assert_same_state(W.full_snapshot(ffd.unshard_state(state)), want, f"{step}", exact=True)


def test_one_rank_sharded_is_bitwise_the_plain_update(one_process_group):
    # With one rank there is nothing to exchange: the pieces are whole leaves
    # and the sharded step is the replicated one's (mean over one rank, then
    # fp16_update), bit for bit, with every averaging option.
    for kwargs in ({}, {"comm_dtype": torch.float32}, {"predivide_factor": 4.0}):
        plain = W.make_state("clip_adamw", seed=0)
        sharded = ffd.shard_state(plain)
        for step in range(3):
            grads = W.grads_of(plain, W.batch(step, 0))
            plain = ff.fp16_update(plain, ffd.tree_all_reduce_mean(grads, **kwargs))
            sharded = ffd.sharded_update(sharded, grads, **kwargs)
            got = W.full_snapshot(ffd.unshard_state(sharded))
            assert_same_state(got, W.full_snapshot(plain), f"{kwargs} step {step}", exact=True)


def test_pieces_keep_their_parameters_number_of_dimensions(one_process_group):
    state = ffd.shard_state(W.make_state("adamw_ndim_mask", seed=0))
    for k, p in state.params.items():
        assert state.master[k].ndim == p.ndim and state.master[k].numel() == p.numel(), k


def _stored_params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 64, generator=g) * 0.1, "b": torch.randn(8, generator=g) * 0.1}


@pytest.mark.parametrize(
    "tx, where, words",
    [
        (ff.adam(1e-3, nu_dtype=torch.float16, nu_scale="tensor"), r"\[0\]\.nu\['b'\]",
         "float16 moments with a per-tensor scale"),
        (ff.adam(1e-3, nu_dtype=torch.float16, nu_scale=2.0**-20), r"\[0\]\.nu\['b'\]",
         "float16 moments with a per-tensor scale"),
        (ff.adamw(1e-3, mu_dtype="int8", nu_dtype="int8"), r"\[0\]\.mu\['w'\]", "'e4m3' moments"),
        (ff.lion(1e-4, mu_dtype="int8"), r"\[0\]\.mu\['w'\]", "'e4m3' moments"),
        (ff.sgd(0.1, momentum=0.9, accumulator_dtype="int8"), r"\[1\]\.trace\['w'\]",
         "'e4m3' moments"),
    ],
    ids=["fp16-tensor-scale", "fp16-fixed-scale", "adamw-int8", "lion-int8", "sgd-int8"],
)  # fmt: skip
def test_moments_stored_with_scales_are_refused_naming_the_leaf(
    one_process_group, tx, where, words
):
    # A per-tensor scale would stay a plain tensor that each rank picks from its own rows
    # (after a DCP save and load, one rank's scale for all); block scales are not shaped
    # like their parameter. shard_state refuses both, naming the first such leaf.
    state = ff.fp16_init(_stored_params(0), tx)
    with pytest.raises(ValueError, match=rf"state\.opt_state{where}: {words}.*shard_state"):
        ffd.shard_state(state)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ff.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16),
        lambda: ff.adam(1e-3, mu_dtype=torch.float16, nu_dtype=torch.bfloat16),
        lambda: ff.sgd(0.1, momentum=0.9, accumulator_dtype=torch.float16),
    ],
    ids=["adamw-bf16", "adam-fp16-mu", "sgd-fp16"],
)
def test_moments_without_scales_shard_step_and_round_trip_through_dcp(
    one_process_group, tmp_path, make
):
    # bfloat16 and unscaled float16 moments are plain tensors shaped like their
    # parameters: sharded like FP32 ones, stepped bitwise as the plain update (one rank),
    # and saved and loaded through DCP bitwise.
    plain = ff.fp16_init(_stored_params(0), make())
    sharded = ffd.shard_state(plain)
    kinds = {x.dtype for x in optree.tree_leaves(sharded.opt_state, namespace=ff.NAMESPACE)}
    assert kinds & {torch.bfloat16, torch.float16}, kinds
    for step in range(3):
        grads = {k: (torch.randn(p.shape) * 1e-2).half() for k, p in plain.params.items()}
        plain = ff.fp16_update(plain, grads)
        sharded = ffd.sharded_update(sharded, grads)
        got = W.full_snapshot(ffd.unshard_state(sharded))
        assert_same_state(got, W.full_snapshot(plain), f"step {step}", exact=True)
    ffd.save_dcp_state(sharded, tmp_path / "dcp")
    loaded = ffd.load_dcp_state(
        ffd.shard_state(ff.fp16_init(_stored_params(1), make())), tmp_path / "dcp"
    )
    assert_same_state(
        W.full_snapshot(ffd.unshard_state(loaded)), W.full_snapshot(plain), "dcp", exact=True
    )


# -- one process: the optimiser-state probe, and calls without a group -----------------


@pytest.mark.parametrize("world", WORLDS)
def test_an_old_format_checkpoint_loads_into_a_sharded_state(runs, world):
    from tests.test_sharded_checkpoints import expected_leaves

    for r, res in enumerate(results(runs[world], "legacy")):
        assert res["epoch"] == 3 and res["sharded"], r
        want = expected_leaves()
        assert len(res["full"]) == len(want)
        for j, (a, b) in enumerate(zip(res["full"], want, strict=True)):
            assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), (r, j)


@pytest.mark.parametrize("d", [0, 1, 2, 3, 5, 7, 8])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_are_torch_chunks_in_rank_order(d, world):
    # DTensor's Shard(0) splits as torch.chunk, the ranks past the last chunk empty.
    chunks = list(torch.arange(d).chunk(world)) if d else []
    chunks += [torch.arange(0)] * (world - len(chunks))
    for r in range(world):
        lo, hi = rows(d, world, r)
        assert torch.equal(torch.arange(d)[lo:hi], chunks[r]), (d, world, r)


@pytest.mark.parametrize(
    "tx",
    [
        ff.sgd(0.1),
        ff.sgd(0.1, momentum=0.9),
        ff.adamw(1e-3, mask=W.DECAY_MASK),
        ff.MultiSteps(ff.adam(1e-3), 2),
        ff.multi_transform(
            {"a": ff.sgd(0.1, momentum=0.9), "b": ff.adam(1e-3)},
            {"w1": "a", "b1": "b", "w2": "a", "b2": "b", "c": "a"},
        ),
    ],
    ids=["sgd", "momentum", "adamw-mask", "multisteps-adam", "multi-transform"],
)
def test_the_probe_finds_the_parameter_of_every_optimiser_leaf(tx):
    # Every parameter has its own shape, so here a leaf's shape names its parameter.
    state = ff.fp16_init(W.make_params(0), tx)
    shapes = [p.shape for p in optree.tree_leaves(state.params, namespace=ff.NAMESPACE)]
    assert len(set(shapes)) == len(shapes)
    leaves = optree.tree_leaves(state.opt_state, namespace=ff.NAMESPACE)
    expected = [
        shapes.index(x.shape) if isinstance(x, torch.Tensor) and x.ndim else None for x in leaves
    ]
    assert owners(state) == expected


def test_sharding_needs_a_process_group():
    assert not dist.is_initialized()
    state = W.make_state("sgd", seed=0)
    for fn in (
        lambda: ffd.shard_state(state),
        lambda: ffd.unshard_state(state),
        lambda: ffd.sharded_update(state, state.params),
    ):
        with pytest.raises(RuntimeError, match="init_from_env"):
            fn()
