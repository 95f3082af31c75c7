"""Tests for ``functional_fp16.distributed``: data parallelism on 2 gloo processes.

One module-scoped launch starts two worker processes (``tests/_dist_workers.py``)
with the ``torchrun`` environment variables on a free 127.0.0.1 port; they run
every scenario in one process group and write their results to a temporary
directory, which the tests below read. The launch is bounded: after
``LAUNCH_TIMEOUT_S`` the workers are killed and the tests fail with their logs.
Errors that need no process group are checked in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from tests._launch import Launch, launch_workers, results
from tests.helpers import load_module

pytestmark = pytest.mark.distributed

WORKER_FILE = Path(__file__).with_name("_dist_workers.py")
WORLD = 2
LAUNCH_TIMEOUT_S = 240  # an upper bound for a slow shared machine, not a timing assertion


W = load_module(WORKER_FILE, "_functional_fp16_dist_workers")


# -- the launch -----------------------------------------------------------------


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launch:
    return launch_workers(
        WORKER_FILE, tmp_path_factory.mktemp("distributed"), WORLD, LAUNCH_TIMEOUT_S
    )


# -- comparisons ---------------------------------------------------------------

_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bool: torch.uint8}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (so NaN payloads and signed zeros count too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = _INT_OF.get(a.dtype)
    if view is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def assert_ranks_identical(snap0: dict[str, Any], snap1: dict[str, Any], where: str) -> None:
    for field in ("params", "master"):
        for k in snap0[field]:
            assert bitwise_equal(snap0[field][k], snap1[field][k]), (
                f"{where}: {field}[{k!r}] differs"
            )
    for field in ("loss_scale", "grads_finite", "step"):
        assert bitwise_equal(snap0[field], snap1[field]), f"{where}: {field} differs"


def scaled_error(a: torch.Tensor, b: torch.Tensor, unit: torch.dtype | None = None) -> float:
    """max |a - b| in units of the leaf's magnitude times the epsilon of ``unit``
    (default ``a``'s dtype)."""
    eps = torch.finfo(unit or a.dtype).eps
    a64, b64 = a.double(), b.double()
    magnitude = float(torch.maximum(a64.abs().max(), b64.abs().max()))
    if magnitude == 0.0:
        return 0.0
    return float((a64 - b64).abs().max()) / (magnitude * eps)


# -- data parallel == one process fed the whole batch ----------------------------

# Tolerances in epsilons of the working dtype, times the leaf's magnitude.
# FP32 working parameters: the only difference is where the FP32 sums are
# rounded (two half-batch means averaged vs one full-batch mean), a few
# epsilons at most (observed after 6 steps: 0.8).
# FP16 working parameters: each rank's gradient is rounded to FP16 before the
# average, the whole batch's only once; that moves an update by up to an FP16
# ulp of the gradient (observed in the master: 0.2). The FP16 working copy may
# then round the other way: one FP16 ulp, up to one epsilon of the leaf's
# magnitude (observed: 0.6), on top of the master's difference.
PARITY_TOLERANCE = {
    ("torch.float32", "master"): 16.0,
    ("torch.float32", "params"): 16.0,
    ("torch.float16", "master"): 1.0,
    ("torch.float16", "params"): 2.0,
}


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.float16"])
@pytest.mark.parametrize("path", ["raw", "tx"])
def test_two_ranks_match_one_process_fed_the_whole_batch(launch, path, dtype):
    r0, r1 = (r[(path, dtype)] for r in results(launch, "parity"))
    param_dtype = getattr(torch, dtype.split(".")[1])
    reference = W.run_reference(param_dtype)
    assert len(r0) == len(r1) == len(reference) == W.STEPS
    for step, (s0, s1, ref) in enumerate(zip(r0, r1, reference, strict=True)):
        assert_ranks_identical(s0, s1, f"step {step}")
        assert bool(s0["grads_finite"]) and int(s0["step"]) == step + 1
        assert float(s0["loss_scale"]) == float(ref["loss_scale"])
        for field in ("master", "params"):
            for k, want in ref[field].items():
                got = s0[field][k]
                assert got.dtype == want.dtype and got.shape == want.shape
                err = scaled_error(got, want, param_dtype)
                assert err <= PARITY_TOLERANCE[dtype, field], (
                    f"step {step}: {field}[{k!r}] is {err:.3g} {dtype} epsilons of its "
                    "magnitude away from the one-process run"
                )
    # The run moved: parity is not the trivial result of nothing happening.
    start = W.make_params(0)
    assert not torch.allclose(r0[-1]["master"]["w1"], start["w1"], atol=1e-3)


def test_ranks_start_from_rank0_values(launch):
    # Each rank built its state from a different seed; broadcast_state made
    # them rank 0's, which is what the one-process reference starts from.
    r0, r1 = (r[("raw", "torch.float32")] for r in results(launch, "parity"))
    reference = W.run_reference(torch.float32, steps=1)
    assert scaled_error(r1[0]["master"]["w1"], reference[0]["master"]["w1"]) <= 16.0


def test_broadcast_state_sends_every_leaf_of_rank0(launch):
    r0, r1 = results(launch, "broadcast")
    assert r0["leaves"].keys() == r1["leaves"].keys()
    assert any("opt_state" in path for path in r0["leaves"])
    assert any("loss_scale" in path for path in r0["leaves"])
    for path, leaf in r0["leaves"].items():
        assert bitwise_equal(leaf, r1["leaves"][path]), path
    assert float(r1["leaves"][".loss_scale.loss_scale"]) == 2.0**10
    assert int(r1["leaves"][".step"]) == 0
    assert r0["epoch"] == r1["epoch"] == 10
    for res in (r0, r1):
        assert res["is_fp16_state"] and res["input_unchanged"]


# -- overflow on one rank ------------------------------------------------------


@pytest.mark.parametrize("path", ["tx", "raw"])
def test_inf_on_one_rank_skips_the_step_on_every_rank(launch, path):
    r0, r1 = (r[(path, True)] for r in results(launch, "overflow"))
    k = W.INJECT_STEP
    for step in range(W.STEPS):
        assert_ranks_identical(r0[step], r1[step], f"step {step}")
    for snaps in (r0, r1):
        before, skipped, after = snaps[k - 1], snaps[k], snaps[k + 1]
        assert not bool(skipped["grads_finite"])
        assert int(skipped["step"]) == k + 1
        assert float(skipped["loss_scale"]) == float(before["loss_scale"]) / 2
        for field in ("master", "params"):
            for name in before[field]:
                assert bitwise_equal(skipped[field][name], before[field][name])
        # Training continues.
        assert bool(after["grads_finite"])
        assert not torch.equal(after["master"]["w1"], skipped["master"]["w1"])
        assert all(bool(s["grads_finite"]) for i, s in enumerate(snaps) if i != k)
        assert all(torch.isfinite(v).all() for v in snaps[-1]["master"].values())


def test_without_agreement_the_ranks_diverge(launch):
    # The control for the test above: averaging inside the optimiser without
    # agree_finite lets rank 0, whose own gradients were finite, apply an
    # update poisoned by rank 1's inf, while rank 1 skips.
    r0, r1 = (r[("tx", False)] for r in results(launch, "overflow"))
    k = W.INJECT_STEP
    assert bool(r0[k]["grads_finite"]) and not bool(r1[k]["grads_finite"])
    assert not torch.isfinite(r0[k]["master"]["w1"]).all()
    assert float(r0[k]["loss_scale"]) != float(r1[k]["loss_scale"])


def test_agree_finite_is_the_and_of_all_ranks(launch):
    for rank, res in enumerate(results(launch, "agree")):
        for flags, (agreed, local) in res.items():
            assert agreed.dtype == torch.bool and agreed.ndim == 0
            assert bool(agreed) == all(flags)
            assert bool(local) == flags[rank]  # the input flag was not modified


# -- bucketed all-reduce -----------------------------------------------------------


def test_all_reduce_mean_buckets_preserve_structure_and_inputs(launch):
    r0, r1 = results(launch, "buckets")
    trees = [W._plain(W.bucket_tree(rank)) for rank in range(WORLD)]
    for rank, res in enumerate((r0, r1)):
        assert res["keeps_namedtuple"]
        # One collective per (device, dtype) group with the default bucket size
        # (FP16 and FP32 leaves here), more when the buckets are tiny.
        assert res["calls_default"] == 2
        assert res["calls_small"] > 2
        for path, x in trees[rank].items():
            assert bitwise_equal(res["tree"][path], x), f"input {path} was modified"
            assert bitwise_equal(res["before"][path], x)
        for path in trees[0]:
            want = (trees[0][path].double() + trees[1][path].double()) / 2
            got = res["default"][path]
            assert got.dtype == trees[0][path].dtype and got.shape == trees[0][path].shape
            assert torch.allclose(got.double(), want, rtol=torch.finfo(got.dtype).eps, atol=0)
            # Bucket size and the transform form do not change a bit.
            assert bitwise_equal(res["small"][path], got)
            assert bitwise_equal(res["via_tx"][path], got)
            # FP16 on the wire: dtype preserved, values within FP16 rounding.
            half = res["half_comm"][path]
            assert half.dtype == got.dtype
            assert torch.allclose(half.double(), want, rtol=2 * 2**-10, atol=0)
    for path in trees[0]:
        assert bitwise_equal(r0["default"][path], r1["default"][path])


def test_fp16_predivide_keeps_the_sum_in_range(launch):
    for res in results(launch, "buckets"):
        # 40000 + 40000 overflows FP16 (max 65504); halving first does not.
        assert torch.equal(res["big_default"], torch.full((4,), 40000.0, dtype=torch.float16))
        assert torch.isinf(res["big_no_predivide"]).all()
        # FP32 leaves sent as FP16: 100000 does not fit FP16, 100000 / 2 does.
        wide = res["wide_half_comm"]
        assert wide.dtype == torch.float32
        halves = torch.tensor([50000.0, 15000.0]).half()  # each rank's share, on the wire
        assert torch.equal(wide, halves.sum().float().expand(4))
        assert torch.isfinite(wide).all()


# -- checkpoints, rank checks, environment ----------------------------------------


def test_resume_from_a_rank0_checkpoint(launch):
    for rank, res in enumerate(results(launch, "resume")):
        assert res["exists"]
        assert res["epoch"] == W.STEPS // 2
        assert int(res["resumed_at"]["step"]) == W.STEPS // 2
        # Rank 1 never read the file, yet resumed to the same bits.
        assert_ranks_identical(res["uninterrupted"], res["resumed"], f"rank {rank}")
        assert "missing.ckpt" in res["missing_error"]
        if rank == 0:
            assert res["missing_error"].startswith("FileNotFoundError")
        else:
            assert "failed on rank 0" in res["missing_error"]


def test_differently_shaped_trees_raise_on_every_rank_naming_the_leaf(launch):
    for res in results(launch, "mismatch"):
        assert res["shape_error"].startswith("ValueError")
        assert "state.params['w2']" in res["shape_error"]
        assert "(16, 4)" in res["shape_error"] and "(16, 5)" in res["shape_error"]
        assert "rank 1" in res["shape_error"]
        assert "params['w2']" in res["init_error"]
        assert "params['extra']" in res["structure_error"]
        assert "rank 1" in res["structure_error"]
        assert torch.equal(res["alive"], torch.full((2,), 0.5))


def test_init_from_env_reads_the_torchrun_variables(launch):
    for rank, res in enumerate(results(launch, "env")):
        assert res == {
            "rank": rank,
            "world_size": WORLD,
            "local_rank": rank,
            "backend": "gloo",
            "device": "cpu",
            "is_main": rank == 0,
        }


def test_shutdown_frees_the_group_even_after_torch_imports_its_collectives_late(launch):
    # torch.distributed.nn binds the default group into its functions' defaults
    # when first imported with a group alive; that reference would keep gloo's
    # worker threads running into interpreter exit, where they can abort the
    # process. Without /proc the threads cannot be listed.
    late = results(launch, "late_import")
    after = results(launch, "after_shutdown")
    for rank in range(WORLD):
        assert float(late[rank]["total"]) == WORLD * (WORLD + 1) / 2
        assert late[rank]["group_default_is_none"]
        if late[rank]["threads"] is None:
            pytest.skip("this system does not list a process's threads")
        assert "pt_gloo_runloop" in late[rank]["threads"]  # the check below can fail
        assert not [n for n in after[rank] if "gloo" in n], (rank, after[rank])


# -- errors that need no second process --------------------------------------------


@pytest.fixture
def no_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process already has a process group")


def test_collectives_without_a_process_group_raise(no_group, tmp_path):
    tree = {"w": torch.ones(3)}
    calls = {
        "tree_all_reduce_mean": lambda: ffd.tree_all_reduce_mean(tree),
        "all_reduce_mean": lambda: ffd.all_reduce_mean().update(tree, ff.EmptyState()),
        "agree_finite": lambda: ffd.agree_finite(torch.tensor(True)),
        "check_same_tree": lambda: ffd.check_same_tree(tree),
        "broadcast_state": lambda: ffd.broadcast_state(tree),
        "save_checkpoint_rank0": lambda: ffd.save_checkpoint_rank0(tmp_path / "c", tree),
        "load_checkpoint_broadcast": lambda: ffd.load_checkpoint_broadcast(tmp_path / "c", tree),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name} needs a torch.distributed process group"):
            call()
    with pytest.raises(RuntimeError, match="init_from_env"):
        ff.fp16_init(tree, ff.chain(ffd.all_reduce_mean(), ff.sgd(0.1)))
    assert not (tmp_path / "c").exists()
    # The rank helpers fall back to a single process.
    assert ffd.get_rank() == 0 and ffd.get_world_size() == 1 and ffd.is_main_process()


def test_init_from_env_outside_torchrun_names_the_missing_variables(no_group, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"):
        ffd.init_from_env()
    assert not dist.is_initialized()


def test_init_from_env_rejects_a_rank_outside_the_world(no_group, monkeypatch):
    env = {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**env, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"RANK=2 must lie in \[0, WORLD_SIZE=2\)"):
        ffd.init_from_env()


def test_backend_follows_the_device():
    assert ffd.backend_for("cpu") == "gloo"
    assert ffd.backend_for(torch.device("cuda", 1)) == "nccl"


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"bucket_bytes": 0}, ValueError),
        ({"bucket_bytes": 1.5}, ValueError),
        ({"comm_dtype": torch.int32}, TypeError),
        ({"predivide_factor": 0.0}, ValueError),
        ({"predivide_factor": float("nan")}, ValueError),
        ({"predivide_factor": "2"}, TypeError),
    ],
)
def test_all_reduce_mean_rejects_bad_configuration(kwargs, error):
    with pytest.raises(error):
        ffd.all_reduce_mean(**kwargs)


# -- the CIFAR-10 example, data parallel -------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cifar10_functional.py"
EXAMPLE_ARGS = [
    "--dataset",
    "fake",
    "--fake-train-size",
    "256",
    "--fake-test-size",
    "64",
    "--batch-size",
    "32",
    "--epochs",
    "1",
    "--max-steps-per-epoch",
    "3",
    "--lr",
    "0.01",
    "--no-progress",
    "--no-plot",
    "--compute-dtype",
    "fp32",
]
EXAMPLE_TIMEOUT_S = 300  # an upper bound for a slow shared machine, not a timing assertion


def _run_example(args: list[str], out_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, *args, "--out-dir", str(out_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_example_two_ranks_train_like_one_process(tmp_path):
    one = _run_example([str(EXAMPLE), *EXAMPLE_ARGS], tmp_path / "one")
    two = _run_example(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(WORLD),
            str(EXAMPLE),
            *EXAMPLE_ARGS,
            "--distributed",
        ],
        tmp_path / "two",
    )
    # Only rank 0 prints and writes.
    assert two.stdout.count("epoch 1/1:") == 1
    assert f"global batch 32 = {32 // WORLD} per rank" in two.stdout
    assert "epoch 1/1:" in one.stdout
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == WORLD and summary["per_rank_batch"] == 32 // WORLD
    # Evaluation is split over the ranks and the counts summed: the same accuracy.
    ref_summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["test_accuracy_per_epoch"] == ref_summary["test_accuracy_per_epoch"]
    rows = [json.loads(line) for line in open(tmp_path / "two" / "metrics.jsonl")]
    ref_rows = [json.loads(line) for line in open(tmp_path / "one" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3]
    for row, ref in zip(rows, ref_rows, strict=True):
        # The logged loss is the mean over the ranks: the whole batch's loss.
        assert row["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert row["loss_scale"] == ref["loss_scale"] and row["skipped"] == ref["skipped"]
    ckpt = "checkpoint_epoch_001.pt"
    state = ff.load_checkpoint(tmp_path / "two" / ckpt)["state"]
    ref_state = ff.load_checkpoint(tmp_path / "one" / ckpt)["state"]
    assert int(state["step"]) == 3
    for k, want in ref_state["master"].items():
        assert scaled_error(state["master"][k], want, torch.float16) <= 1.0, k

    # --shard-master: each rank steps its half of the FP32 state. With two
    # ranks every reduction sums two values, which does not depend on the
    # order, so the run is bitwise the replicated one; its checkpoint holds
    # the full state.
    sharded = _run_example(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(WORLD),
            str(EXAMPLE),
            *EXAMPLE_ARGS,
            "--distributed",
            "--shard-master",
        ],
        tmp_path / "sharded",
    )
    assert "sharded FP32 state (ZeRO-1)" in sharded.stdout
    sharded_summary = json.loads((tmp_path / "sharded" / "summary.json").read_text())
    assert sharded_summary["shard_master"] is True and summary["shard_master"] is False
    assert sharded_summary["test_accuracy_per_epoch"] == summary["test_accuracy_per_epoch"]
    sharded_rows = [json.loads(line) for line in open(tmp_path / "sharded" / "metrics.jsonl")]
    assert sharded_rows == rows
    sharded_state = ff.load_checkpoint(tmp_path / "sharded" / ckpt)["state"]
    for field in ("params", "master"):
        for k, want in state[field].items():
            assert bitwise_equal(sharded_state[field][k], want), (field, k)
    assert bitwise_equal(
        sharded_state["loss_scale"]["loss_scale"], state["loss_scale"]["loss_scale"]
    )


def test_shard_master_needs_distributed(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *EXAMPLE_ARGS, "--shard-master", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert proc.returncode == 2 and "--shard-master needs --distributed" in proc.stderr


def test_shutdown_waits_for_its_peers_before_the_group_goes_where_asked(monkeypatch):
    """``wait_for_peers``: a barrier, then the group destroyed; without it, no barrier
    (a rank leaving after an error must not wait for peers that never come)."""
    from functional_fp16.distributed import process_group

    calls: list[str] = []
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(process_group.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(
        process_group.dist, "destroy_process_group", lambda: calls.append("destroy")
    )
    ffd.shutdown(wait_for_peers=True)
    assert calls == ["barrier", "destroy"]
    calls.clear()
    ffd.shutdown()
    assert calls == ["destroy"]
