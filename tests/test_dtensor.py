"""``fp16_update`` on DTensor states, over 2 and 4 ranks on gloo, against one process.

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

FSDP2 runs (a 1-D mesh, and HSDP on a 2 x 2 mesh at 4 ranks) train a small
transformer against one process fed the whole batch; their bounds are in
their tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._dtensor_workers import HSDP_CLIP, HSDP_INJECT, HSDP_STEPS, INJECT_STEP
from tests._launch import Launch, launch_workers, results
from tests.helpers import optimiser_matrix

pytestmark = pytest.mark.distributed

WORKER_FILE = Path(__file__).with_name("_dtensor_workers.py")
LAUNCH_TIMEOUT_S = 240  # an upper bound for a slow shared machine, not a timing assertion
CLIPPING = ("clip", "clip_trace", "clip_l2_adam", "recipe")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def launch(request, tmp_path_factory) -> Launch:
    return launch_workers(
        WORKER_FILE, tmp_path_factory.mktemp("dtensor"), request.param, LAUNCH_TIMEOUT_S
    )


@pytest.mark.parametrize("name", sorted(optimiser_matrix()))
@pytest.mark.parametrize("donate", [False, True])
def test_dtensor_states_step_like_one_process(launch, name, donate):
    per_rank = [r[(name, donate)] for r in results(launch, "matrix")]
    for r in per_rank:
        assert r["decisions"] == r["ref_decisions"], r
        assert r["decisions"].count(False) >= 1  # the injected inf skipped a step
        # Its leaf is named on every rank, though only the last rank's shard held the inf.
        assert r["nonfinite"] == r["ref_nonfinite"], r
        assert r["nonfinite"][INJECT_STEP] == ["h.attn.w"], r
        assert all(names == [] for i, names in enumerate(r["nonfinite"]) if i != INJECT_STEP)
        assert r["scales_equal"] and r["params_equal"] and r["kept"], r
        bound = 1.0 if name in CLIPPING else 0.0
        assert r["master_ulps"] <= bound and r["opt_ulps"] <= bound, r
    # Every rank holds the same answer; the ulps each rank measured on its own shards.
    same = [{k: v for k, v in r.items() if not k.endswith("_ulps")} for r in per_rank]
    assert all(r == same[0] for r in same)
    fused = name not in ("apply_if_finite", "identity", "zero_momentum_trace", "wd_zero_kept")
    assert per_rank[0]["path"] in (("fused",) if fused else ("fused", "foreach", "foreach-sgd"))


def test_split_masters_on_dtensors_step_like_one_process(launch):
    """``master="split"`` on DTensor params: the residuals are int16 DTensors placed like
    their params, decisions are one process's, the decoded master within the float32
    DTensor states' bound (one ulp where the clip's norm is summed across the mesh, else
    bitwise), and a DCP save at this world size loads into one process bitwise."""
    import torch

    import functional_fp16 as ff
    from functional_fp16 import distributed as ffd
    from functional_fp16._util.tree import tree_leaves
    from tests import _dtensor_workers as W

    for r in results(launch, "split"):
        for name in W.SPLIT_TXS:
            got = r[name]
            assert got["decisions"] == got["ref_decisions"] and got["kept"], (name, got)
            assert got["decisions"].count(False) >= 1
            bound = 1.0 if name in CLIPPING else 0.0
            assert got["master_ulps"] <= bound, (name, got)
            assert got["params_equal"] or name in CLIPPING, (name, got)
    like = ff.fp16_init(W.make_params(), optimiser_matrix()[W.SPLIT_TXS[-1]], master="split")
    shared = launch.out / "split_dcp"
    loaded = ffd.load_dcp_state(like, shared / f"dcp_{launch.world}")  # N ranks -> 1 process
    want = torch.load(shared / f"split_truth_{launch.world}.pt")
    got = [x for x in tree_leaves(loaded) if isinstance(x, torch.Tensor)]
    assert len(got) == len(want) and all(
        torch.equal(W.bits(a), W.bits(b)) for a, b in zip(got, want)
    )
    assert ff.master_form(loaded) == "split"


def test_multisteps_of_the_recipe_on_dtensors(launch):
    for r in results(launch, "multisteps"):
        assert all(a == b for a, b in r["decisions"]), r
        assert r["master_ulps"] <= 1.0 and r["path"] == "fused", r
        # An inf loss on the last rank alone mid-window spoils the window on every rank.
        assert r["loss_one_rank"] == (False, False), r


def test_clipping_a_mix_of_replicated_and_sharded_leaves_off_the_fused_path(launch):
    """There the clip sees accumulated or masked values, not the gradients: each leaf's
    own sum reaches the mesh's sum, counted on one holder of each shard, so the master
    stays within one ulp of one process (the norm's float64 sum in another order)."""
    for r in results(launch, "multisteps"):
        for name in ("multisteps", "masked_clip"):
            assert r["mixed"][name]["master_ulps"] <= 1.0, (name, r["mixed"])
            assert r["mixed"][name]["paths"] == (["fused"] if name == "multisteps" else ["foreach"])


def test_plain_gradients_raise_and_otherwise_placed_ones_are_redistributed(launch):
    for r in results(launch, "bad_grads"):
        assert r["plain"] is not None and "grads['wte']: a plain tensor" in r["plain"], r
        assert r["other_mesh"] is not None and "grads['wte']" in r["other_mesh"], r
        assert r["int8_columns"].startswith("params['w']: 'e4m3' moments"), r
        assert r["inf_param"].startswith("params['h.attn.w']: contains inf or NaN"), r
        assert "needs each leaf's own sum" in r["one_number"], r
        assert r["redistributed_equal"] and r["partial_equal"], r


def test_a_rank_with_another_layout_makes_every_rank_raise_promptly(launch):
    """The last rank differs in one thing at a time (its gradients' placement, mesh or
    dtype, a missing gradient leaf, its plan, a sub-mesh, ``impl``, ``tx``, ``loss=``, a
    float64 master its own checks refuse): every rank raises within 10 s (the workers'
    collective timeout is 60 s), naming the path and the last rank."""
    world = launch.world
    for r, res in enumerate(results(launch, "disagree")):
        for case, path in (
            ("grad_placement", "grads['wte']"),
            ("mesh", "state.params"),
            ("plan", "state.params['mlp.w']"),
            ("sub_mesh", "sliced from ('a', 'b')"),
            ("grad_dtype", "grads['mlp.w'] is a torch.float16 DTensor"),
            ("missing_leaf", "grads['h.attn.b']"),
            ("impl", "argument impl is 'auto' on rank 0 but 'reference'"),
            ("tx", "state.tx.spec"),
            ("loss", "argument loss is None on rank 0 but a torch.float32 tensor"),
            ("master_dtype", "state.master['ln.w'] is a torch.float32 DTensor"),
        ):
            message, seconds = res[case]
            assert message is not None, (r, case)
            assert message.startswith("ValueError: fp16_update: the ranks disagree"), message
            assert path in message and f"on rank {world - 1}" in message, (r, case, message)
            assert seconds < 10.0, (r, case, seconds)  # well before the collective timeout
        message, seconds = res["all_float32"]  # wrong alike on every rank: its own error
        assert message.startswith("TypeError: grads['mlp.w']"), message
        assert seconds < 10.0, (r, seconds)


FSDP_RUNS = [("recipe", False), ("recipe", True), ("clip", False)]


def test_fsdp2_training_skips_and_scales_like_one_process(launch):
    """``fully_shard`` per block and at the root (FP16 parameters), 20 steps, an inf in
    the last rank's shard of one gradient at step 7: the recipe pure (``write_params``)
    and donated (in place), and clip + SGD(momentum). Decisions and loss scales are
    bitwise those of the single process fed the whole batch, on every rank.

    Values are not bitwise: FSDP2 averages the FP16 gradients by a reduce-scatter, in
    another rounding order than one backward pass over the whole batch (and each rank's
    FP16 forward pass sees half of it). The bounds: the mean loss within 1e-3 at every
    step; with SGD every master tensor within 5% of how far the single process moved it
    over the run (max |ours - ref| <= 0.05 max |ref - init|; measured below 1%). (Adam normalises each element by its own second moment, so
    on elements whose gradient is rounding noise, such as the key bias of attention, the
    runs part by up to the learning rate per step: its master is not compared.)"""
    import torch
    from torch.distributed.tensor import Shard

    from tests import _dtensor_workers as W

    per_rank = results(launch, "fsdp2")
    for r in per_rank:
        for run in FSDP_RUNS:
            ours, ref = r[run]["ours"], r[run]["ref"]
            assert ours["decisions"] == ref["decisions"] and not ours["decisions"][7], run
            # The inf sat in the last rank's shard: every rank names its leaf, as one process.
            assert ours["nonfinite"] == ref["nonfinite"], run
            assert ours["nonfinite"][7] == ["blocks.1.mlp.0.weight"], run
            assert ours["scales"] == ref["scales"], run
            assert ours["path"] == "fused"
            assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) <= 1e-3, run
        ours, ref = r[("clip", False)]["ours"], r[("clip", False)]["ref"]
        for name, m in ref["master"].items():
            moved = float((m - ref["init"][name]).abs().max())
            assert float((ours["master"][name] - m).abs().max()) <= 0.05 * moved, name
    for run in FSDP_RUNS:
        # What the ranks hold apart makes the whole: each rank's own rows (Shard(0)), in
        # rank order, are bitwise the rows of the gathered master, none twice or missing.
        whole = per_rank[0][run]["ours"]["master"]
        for k, m in whole.items():
            assert per_rank[0][run]["ours"]["placements"][k] == (Shard(0),), k
            rows = torch.cat([r[run]["ours"]["local"][k] for r in per_rank])
            assert torch.equal(W.bits(rows), W.bits(m)), (run, k)


def test_hsdp_training_on_a_2x2_mesh_steps_like_one_process(launch):
    """HSDP: ``fully_shard`` per block and at the root over a 2 x 2 mesh
    (``("replicate", "shard")``), 4 ranks each fed a quarter of the batch, clip + SGD(momentum)
    for 6 steps, an inf in the last rank's shard of one gradient at step 3 (rank 3; rank 1,
    its replica, holds that shard finite). Against one process on the whole batch:

    * every parameter, and the master after the run, is ``(Replicate(), Shard(0))``;
    * decisions, the leaf named at the skip and the loss scales (grown, halved at the skip,
      grown again): bitwise, on every rank; the one skipped step is the injected one;
    * the clip binds at every step (the one process's norm is above the threshold), so the
      master also tests the norm the mesh completes: summed over ``"shard"`` only, not the
      replicas (summing those too would scale every update by about 1/sqrt(2));
    * the master after the run: every tensor within ``2**-7`` (8 FP16 ulps at 1) of how far
      the one process moved it (``max |ours - ref| <= 2**-7 max |ref - init|``; measured
      below ``2**-9``). Not a few FP32 ulps: the update is fed FP16 gradients, which HSDP sums
      in another order (each rank's backward over 16 tokens, then FSDP2's FP16
      reduce-scatter within a replica and all-reduce across the two, an average over the 4
      ranks) than one backward over 64 tokens. Those differ by a few FP16 roundings of the
      gradient (an FP16 ulp is 2**13 FP32 ulps: measured, up to about 5e5 FP32 ulps), which
      the 5 applied steps add up in proportion to the movement; the float64 norm adds
      nothing at that level. A learning rate 2% off, or replicas that do not all-reduce,
      exceed the bound;
    * the mean loss within 1e-3 at every step (as the FSDP2 test; measured below 1e-4);
    * every rank ends with the same gathered FP16 parameters, the round-to-nearest of the
      same gathered master."""
    import torch
    from torch.distributed.tensor import Replicate, Shard

    if launch.world != 4:
        pytest.skip("a 2 x 2 mesh takes 4 ranks")
    per_rank = results(launch, "hsdp")
    assert [r["coordinate"] for r in per_rank] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in per_rank:
        ours, ref = r["ours"], r["ref"]
        assert r["mesh_names"] == ("replicate", "shard")
        assert len(r["param_placements"]) == len(ref["master"])
        assert all(p == (Replicate(), Shard(0)) for p in r["param_placements"].values()), r
        assert ours["placements"] == r["param_placements"]  # the master keeps them
        assert ours["path"] == "fused"
        assert ours["decisions"] == ref["decisions"]
        assert [i for i, d in enumerate(ours["decisions"]) if not d] == [HSDP_INJECT]
        assert ours["nonfinite"] == ref["nonfinite"]
        assert ours["nonfinite"][HSDP_INJECT] == ["blocks.1.mlp.0.weight"]
        assert ours["scales"] == ref["scales"]
        before, at = ours["scales"][HSDP_INJECT - 1], ours["scales"][HSDP_INJECT]
        assert at == before / 2 and max(ours["scales"]) > ours["scales"][0], ours["scales"]
        assert len(ref["norms"]) == HSDP_STEPS and min(ref["norms"]) > HSDP_CLIP, ref["norms"]
        assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) <= 1e-3
        for name, m in ref["master"].items():
            assert torch.equal(ours["init"][name], ref["init"][name]), name
            moved = float((m - ref["init"][name]).abs().max())
            off = float((ours["master"][name] - m).abs().max())
            assert off <= 2**-7 * moved, (name, off, moved)
            assert torch.equal(r["params"][name], ours["master"][name].half()), name
    first = per_rank[0]
    for other in per_rank[1:]:  # every rank holds the same model
        for name, p in first["params"].items():
            assert torch.equal(p, other["params"][name]), name
            assert torch.equal(first["ours"]["master"][name], other["ours"]["master"][name])


def test_dcp_saves_without_gathering_and_resumes_at_another_world_size(launch):
    """Saved through DCP by every rank. At 4 ranks a state sharded 2 ways (a 2 x 2 mesh)
    is saved and resumed sharded 4 ways, bitwise, with its placements, and steps on.
    Then one process (no process group) resumes the 4-rank save into a plain state,
    bitwise, and a plain DCP user loads the FP32 master into an unsharded module."""
    import torch

    import functional_fp16 as ff
    from functional_fp16 import distributed as ffd
    from functional_fp16._util.tree import tree_leaves
    from tests import _dtensor_workers as W

    per_rank = results(launch, "dcp")
    dcp_dir = launch.out / "dcp"
    assert all(r["saved"] for r in per_rank)
    if launch.world == 2:
        assert all(r["resumed_equal"] is None for r in per_rank)
        return
    for r in per_rank:
        assert r["resumed_equal"] is True and r["placements_kept"], r
        assert r["steps_after_resume"] == 4
    # 4 ranks -> 1 process
    like = ff.fp16_init(W.make_params(), optimiser_matrix()["recipe"])
    before = [x.clone() for x in tree_leaves(like)]
    loaded = ffd.load_dcp_state(like, dcp_dir / "dcp_4")  # 4 ranks -> 1 process
    want = torch.load(dcp_dir / "truth_4.pt")
    got = [x for x in tree_leaves(loaded) if isinstance(x, torch.Tensor)]
    assert len(got) == len(want)
    assert all(torch.equal(W.bits(a), W.bits(b)) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(like), before))  # untouched
    assert not torch.equal(loaded.master["wte"], like.master["wte"])  # it did read something
    # a plain DCP user: the FP32 master into a module's state dict, in place
    import torch.distributed.checkpoint as dcp

    module = {k: torch.zeros(v.shape) for k, v in W.make_params().items()}
    with pytest.warns(UserWarning, match="single process"):  # DCP's note, no process group
        dcp.load({"master": module}, checkpoint_id=str(dcp_dir / "dcp_4"), no_dist=True)
    for k, m in loaded.master.items():
        assert torch.equal(module[k], m), k


def test_fsdp2_mixed_precision_policy_keeps_one_fp32_copy(launch):
    """``MixedPrecisionPolicy(param_dtype=torch.float16)``: FSDP2 keeps FP32 shards and
    all-gathers FP16 copies. The state built with ``param_dtype=torch.float32`` takes the
    module's FP32 shards as its master *and* working copy (the same tensors: no third
    copy), a donated update writes them in place, the overflow in one rank's shard skips
    the step on every rank with the master bitwise unchanged, and the run learns."""
    per_rank = results(launch, "fsdp2_mixed_precision")
    for r in per_rank:
        assert r["one_copy"] and r["in_place"], r
        assert not r["decisions"][7] and r["decisions"].count(False) == 1, r
        assert r["skip_kept_master"] is True
        assert r["path"] == "fused"
        assert r["losses"][-2] < r["losses"][0] - 0.1, r["losses"]  # the same batch, 0.1 nats lower
    assert all(r["scales"] == per_rank[0]["scales"] for r in per_rank)
    assert all(r["decisions"] == per_rank[0]["decisions"] for r in per_rank)


def test_loading_in_place_keeps_a_shared_master_shared(tmp_path):
    """``load_dcp_state(like, ..., in_place=True)`` reads into ``like``'s own tensors, so a
    ``copy_master=False`` master stays the module's storage (one process, no group)."""
    import torch

    import functional_fp16 as ff
    from functional_fp16 import distributed as ffd

    module = torch.nn.Linear(4, 3)
    params = dict(module.named_parameters())
    make = lambda: ff.fp16_init(  # noqa: E731
        params, ff.sgd(0.1), param_dtype=torch.float32, copy_master=False
    )
    state = ff.fp16_update(make(), {k: torch.ones_like(v) for k, v in params.items()})
    saved = {k: v.clone() for k, v in state.master.items()}
    ffd.save_dcp_state(state, tmp_path / "ckpt")
    with torch.no_grad():
        for p in params.values():
            p.zero_()
    like = make()
    copied = ffd.load_dcp_state(like, tmp_path / "ckpt")
    assert copied.master["weight"].data_ptr() != params["weight"].data_ptr()
    assert not params["weight"].detach().any()  # the default leaves `like` untouched
    loaded = ffd.load_dcp_state(like, tmp_path / "ckpt", in_place=True)
    for k, p in params.items():
        assert loaded.master[k].data_ptr() == p.data_ptr() and torch.equal(p, saved[k]), k


def test_tensor_parallel_training_decides_and_scales_like_one_process(launch):
    r"""The GPT example's model under torchtitan's plan: tensor parallelism over 2 ranks,
    and 2 x 2 (TP inside, FSDP2 over ``"dp"``) at 4, SGD(momentum), the AdamW recipe and
    Lion, each clipped, an inf in the last rank's shard of one gradient. Against one
    process fed the whole batch:

    * the layouts are the plan's: leaves sharded over ``"tp"`` only (on dimension 0 or 1),
      replicated norms (``SequenceParallel``), the tied embedding; at 4 ranks sharded over
      both dimensions, FSDP2's strided shards among them;
    * decisions, the leaf named at the skip and the loss scales: bitwise, on every rank;
    * the clip binds at every step (the one process's norm above the threshold), so the
      norm the mesh completes, each distinct shard counted once, enters every update;
    * the mean loss within 5e-3 at every step;
    * the master within 5 % of how far the one process moved it, per tensor. The
      gradients are not bitwise: the FP16 forward and backward passes add the shards'
      products in another order, each FP16 rounding (unit 2^-11) landing elsewhere, so the
      two runs' gradients part by a relative :math:`\delta` of a few FP16 units per chain
      of roundings (the SGD run measures it: about 0.3 % of the movement). SGD is linear
      in the gradients, so it is held element by element (``max |ours - ref| <= 0.05 max
      |ref - init|``). Adam divides each element by its own second moment: an element
      with a consistent gradient moves by :math:`2\delta` relative at most, but one whose
      gradient is near zero moves by up to the learning rate either way, and which
      elements those are, and how far the unluckiest one goes, depends on the order of
      rounding (one element of ``attn.proj.weight`` is 4.6 % at 2 ranks and 5.02 % at 4
      on the same AMD EPYC). So AdamW is held over each tensor's elements, ``||ours - ref||_2 <= 0.05
      ||ref - init||_2`` (measured at most 1.2 %, ``ln_1.weight``, on AMD EPYC), a bound
      no single element sets. One exception, with AdamW: the key bias (``qkv.bias[1]``).
      Its gradient is zero in exact
      arithmetic (a softmax does not change when every logit of a query moves by the same
      amount), so it holds rounding noise alone, which Adam's normalisation turns into
      steps of about the learning rate either way (measured: 17 to 30 % of the movement).
      Its queries' and values' biases are held to the bound (with Lion too). Lion steps
      every element by the learning rate times a sign, and an element whose momentum is
      rounding noise takes either sign: its bound is on the whole model's L2 distance
      (per tensor, the small biases part by up to 15 %)."""
    import torch

    from tests._dtensor_workers import TP_CLIP, TP_INJECT, TP_LEAF, TP_STEPS

    per_rank = results(launch, "tp")
    for r in per_rank:
        for name, run in r.items():
            ours, ref, placements = run["ours"], run["ref"], run["placements"]
            shown = {leaf: tuple(map(repr, ps)) for leaf, ps in placements.items()}
            if launch.world == 2:
                assert shown["blocks.0.ln_1.weight"] == ("Replicate()",), shown
                assert shown["blocks.0.mlp.proj.weight"] == ("Shard(dim=1)",), shown
                assert shown["wte.weight"] == shown[TP_LEAF] == ("Shard(dim=0)",), shown
            else:
                assert shown["blocks.0.ln_1.weight"] == ("Shard(dim=0)", "Replicate()"), shown
                assert shown["blocks.0.mlp.proj.weight"] == ("Shard(dim=0)", "Shard(dim=1)")
                assert shown[TP_LEAF][0].startswith("_StridedShard(dim=0"), shown
            assert ours["placements"] == placements, name  # the master keeps them
            assert ours["path"] == "fused", (name, ours["path"])
            assert ours["decisions"] == ref["decisions"], name
            assert [i for i, d in enumerate(ours["decisions"]) if not d] == [TP_INJECT], name
            assert ours["nonfinite"] == ref["nonfinite"], name
            assert ours["nonfinite"][TP_INJECT] == [TP_LEAF], name
            assert ours["scales"] == ref["scales"], name
            assert len(ref["norms"]) == TP_STEPS and min(ref["norms"]) > TP_CLIP, ref["norms"]
            assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) <= 5e-3, name
            far, off2, moved2 = [], 0.0, 0.0
            for leaf, m in ref["master"].items():
                got, init = ours["master"][leaf], ref["init"][leaf]
                if name != "sgd" and leaf.endswith("attn.qkv.bias"):  # the key's: noise
                    m, got, init = m[[0, 2]], got[[0, 2]], init[[0, 2]]
                if name == "lion":  # bounded over the whole model, below
                    off2 += float((got - m).square().sum())
                    moved2 += float((m - init).square().sum())
                    continue
                if name == "sgd":  # linear in the gradients: element by element
                    moved = float((m - init).abs().max())
                    off = float((got - m).abs().max())
                else:  # Adam: over the tensor's elements (see the docstring)
                    moved = float((m - init).float().norm())
                    off = float((got - m).float().norm())
                if off > 0.05 * moved:
                    far.append((leaf, off / moved))
            assert not far, (name, far)
            assert off2 <= 0.05**2 * moved2, (name, (off2 / moved2) ** 0.5)
    for other in per_rank[1:]:  # every rank holds the same model
        for name, run in other.items():
            for leaf, m in run["ours"]["master"].items():
                assert torch.equal(m, per_rank[0][name]["ours"]["master"][leaf]), (name, leaf)


def test_a_tensor_parallel_state_resumes_at_other_layouts_bitwise(launch):
    """2 x 2 (TP + FSDP2) -> 4 x 1 (FSDP2 alone) -> one process: DCP reshards every leaf
    of the state (FP16 parameters, master, AdamW's moments, counters), bitwise."""
    import torch

    import functional_fp16 as ff
    from functional_fp16 import distributed as ffd
    from functional_fp16._util.tree import tree_leaves
    from tests import _dtensor_workers as W

    if launch.world != 4:
        pytest.skip("a 2 x 2 mesh takes 4 ranks")
    for r in results(launch, "tp_dcp"):
        assert r["equal"] and r["step"] == 3, r
        assert set(r["placements"].values()) == {("Shard(dim=0)",)}, r["placements"]
    like = ff.fp16_init(dict(W.tp_model().named_parameters()), W.tp_txs()["recipe"])
    loaded = ffd.load_dcp_state(like, launch.out / "dcp" / "dcp_tp_4x1")
    want = torch.load(launch.out / "dcp" / "truth_tp.pt")
    got = [x for x in tree_leaves(loaded) if isinstance(x, torch.Tensor)]
    assert len(got) == len(want)
    assert all(torch.equal(W.bits(a), W.bits(b)) for a, b in zip(got, want))
    assert int(loaded.step) == 3


def test_leaves_on_a_mesh_and_its_sub_meshes_step_like_one_process(launch):
    """Five leaves, five layouts on a 2 x 2 mesh: ``(Shard(0), Shard(1))``, ``(Shard(0),
    Replicate())``, ``(Replicate(), Shard(0))``, ``Shard(0)`` on ``mesh["dp"]`` and
    ``Replicate()`` on ``mesh["tp"]``. Clipped (the clip binding: max_norm 1e-3 against
    norms near 0.06) SGD, AdamW, and a masked clip off the fused path: decisions, named
    leaves and scales bitwise against one process; the master within one ulp (the norm's
    float64 sum in another order). Counting each replica of a leaf would move it by
    thousands of ulps."""
    if launch.world != 4:
        pytest.skip("a 2 x 2 mesh takes 4 ranks")
    per_rank = results(launch, "submesh")
    for r in per_rank:
        for name, run in r.items():
            assert run["decisions"] == run["ref_decisions"], name
            assert run["decisions"][INJECT_STEP] is False, name
            assert run["nonfinite"] == run["ref_nonfinite"], name
            assert run["scales_equal"], name
            assert run["master_ulps"] <= 1.0, (name, run["master_ulps"])
        assert r["masked_clip"]["path"] == "foreach" and r["clip_sgd"]["path"] == "fused"
    assert all(r == per_rank[0] for r in per_rank)


def test_leaves_on_two_meshes_over_the_same_ranks_count_each_shard_once(launch):
    """Two 2 x 2 meshes made apart over the same ranks, their dimensions in the other order,
    leaves ``Shard(0)`` on each one's ``"dp"`` sub-mesh (so the two ``"dp"`` slices pair
    other ranks): one clipped SGD step from a zero master scales the gradients by
    ``max_norm / norm`` where ``norm`` is ``torch.linalg.vector_norm`` of the gathered whole
    gradients, computed apart from the library. Bound: 4 float32 rounding units, from the
    norm's rounding to float32, the clip's division and product (one rounding each) and the
    float64 sums that read the factor back (terms of one sign). Counting one leaf's shards
    by the other's root (one shard twice, one never) is off by percents."""
    if launch.world != 4:
        pytest.skip("two 2 x 2 meshes take 4 ranks")
    for r in results(launch, "two_roots"):
        ours, expected = r["factor"]
        assert abs(ours - expected) <= 4 * 2.0**-24 * expected, (ours, expected)
        assert all(a == b for a, b in r["decisions"]), r
        assert r["decisions"][INJECT_STEP] == (False, False), r
        assert r["master_ulps"] <= 1.0, r


def test_meshes_that_do_not_span_the_world_reduce_and_agree_over_their_own_groups(launch):
    """Ranks 0-1 and 2-3 each on their own 1 x 2 mesh: an inf in rank 1's initial shard is
    refused by ranks 0 and 1 (not only by rank 1), and by neither of 2 and 3; a float32
    gradient on rank 1 alone makes ranks 0 and 1 raise naming it, within 10 s; clipped
    AdamW decides, names leaves and moves the master as one process does (within one
    ulp); one update runs one all-reduce per mesh dimension for the flags and one per
    dimension for the norm: 4; and once the state has stepped, rank 1 alone passing a
    float32 gradient raises its own error within 10 s without waiting for the others."""
    if launch.world != 4:
        pytest.skip("two meshes of 2 take 4 ranks")
    for rank, r in enumerate(results(launch, "own_mesh")):
        if rank < 2:
            assert r["inf_param"].startswith("params['h.attn.w']: contains inf or NaN"), r
            message, seconds = r["float32_grad"]
            assert message.startswith("ValueError: fp16_update: the ranks disagree"), message
            assert "grads['mlp.w']" in message and "on rank 1" in message, message
            assert seconds < 10.0, seconds
        else:
            assert r["inf_param"] is None and r["float32_grad"][0] is None, r
        run = r["run"]
        assert run["decisions"] == run["ref_decisions"] and not run["decisions"][INJECT_STEP]
        assert run["nonfinite"] == run["ref_nonfinite"], run
        assert run["master_ulps"] <= 1.0, run
        assert run["comms"] == {"allreduce_": 4}, run["comms"]
        if rank == 1:  # alone, after the state was agreed and stepped: its own error, at once
            for case, start in (("later_float32", "TypeError: grads['mlp.w']"),
                                ("later_master", "TypeError: state.master['ln.w']")):  # fmt: skip
                message, seconds = r[case]
                assert message.startswith(start), (case, message)
                assert seconds < 10.0, (case, seconds)


def test_one_update_runs_two_collectives_at_most(launch):
    """Counted with ``CommDebugMode`` on an agreed configuration, on a mesh that spans the
    world (1-D, and 2 x 2 at 4 ranks): clipped AdamW runs two all-reduces (the leaves'
    flags, the norm), SGD without a clip one, and each micro-batch of a ``MultiSteps`` of
    the clipped chain two (its flags ride with the mean's)."""
    for r in results(launch, "collectives"):
        for (mesh, tx), counts in r.items():
            want = {"allreduce_": 1 if tx == "sgd" else 2}
            assert all(c == want for c in counts), (mesh, tx, counts)
        assert ("2x2", "clipped") in r or launch.world != 4


def test_ranks_that_hold_no_rows_step_like_one_process(launch):
    """Leaves shorter than the number of ranks along ``Shard(0)``: the last ranks hold empty
    shards (at 4 ranks both 3-row and 1-row leaves, at 2 the 1-row one), with FP32 and
    int8 moments (rounded to nearest and stochastically: the rounding hashes each value,
    never its position); decisions and masters bitwise those of one process."""
    for rank, r in enumerate(results(launch, "empty_shard")):
        assert r["empty"] == [k for k, n in (("pos", 1), ("qkv", 3)) if n <= rank], r
        for name in ("fp32", "int8", "int8_stochastic"):
            run = r[name]
            assert all(a == b for a, b in run["decisions"]), (name, run)
            assert run["decisions"][INJECT_STEP] == (False, False), (name, run)
            assert run["equal"], (name, run)
