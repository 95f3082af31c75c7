"""Sharded checkpoints on ``torch.distributed.checkpoint`` and the ranks' agreement on a configuration.

One chain of world sizes, 1 -> 2 -> 3 -> 1, in two launches of gloo
processes (127.0.0.1) and this process:

1. this process, alone in a one-process group, trains 3 steps and saves a
   sharded checkpoint (and, as the reference, a whole-file one);
2. 2 processes load it, step, save; then try loads and saves that must fail
   on every rank; then saves that fail in the writer, in the marker's commit,
   and one whose last rank is killed (SIGKILL) mid-write;
3. 3 processes load what the killed save left (the last committed
   checkpoint), step, save at 3 ranks (which removes the remains of the failed
   saves), and check the configuration agreement of ``shard_state``,
   ``tree_all_reduce_mean`` and ``sharded_update`` with one rank differing;
4. this process loads the 3-rank checkpoint alone.

Every sharded load is compared bit for bit with the whole-file checkpoint of
the same state loaded by ``load_checkpoint_broadcast``, which is
``shard_state(unshard_state(saved))`` for the loading group.
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from functional_fp16 import distributed as ffd
from functional_fp16._util.tree import tree_flatten, tree_paths
from functional_fp16.distributed.dcp_io import AliasingSavePlanner, chunked
from functional_fp16.distributed.shard_layout import layout_for
from functional_fp16.distributed.sharded_checkpoints import MARKER
from tests import _forged_sharded_checkpoints as F
from tests import _sharded_checkpoint_workers as W
from tests._launch import launch_workers, results
from tests.helpers import bits

pytestmark = pytest.mark.distributed

WORKER_FILE = Path(__file__).with_name("_sharded_checkpoint_workers.py")
FORGED_FILE = Path(__file__).with_name("_forged_sharded_checkpoints.py")
LAUNCH_TIMEOUT_S = 240  # an upper bound for a slow shared machine, not a timing assertion
PROMPT_S = 10.0  # a refusal must come well before the workers' 60 s collective timeout


def _one_process_group(store: Path) -> None:
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(store), 1), rank=0, world_size=1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sharded_checkpoints")
    _one_process_group(tmp_path_factory.mktemp("store") / "store")
    try:
        state = ffd.shard_state(W.make_state())
        for step in range(W.FIRST_STEPS):
            state = W.advance(state, step)
        tree = {"state": state, "epoch": W.FIRST_STEPS}
        ffd.save_checkpoint_sharded(directory / "ckpt", tree)
        ffd.save_checkpoint_rank0(directory / "one_full.ckpt", tree)
    finally:
        dist.destroy_process_group()
    env = {"FF_SCKPT_DIR": str(directory)}
    two = launch_workers(
        WORKER_FILE,
        tmp_path_factory.mktemp("n2"),
        2,
        LAUNCH_TIMEOUT_S,
        {
            **env,
            "FF_SCKPT_SCENARIOS": (
                "resume_one,refusals,one_rank_arguments,writer_raises,commit_raises,killed"
            ),
        },
    )
    three = launch_workers(
        WORKER_FILE,
        tmp_path_factory.mktemp("n3"),
        3,
        LAUNCH_TIMEOUT_S,
        {**env, "FF_SCKPT_SCENARIOS": "resume_two,fingerprint"},
    )
    return {2: two, 3: three, "dir": directory}


def assert_same_leaves(got: list, want: list, where: str, *, strides: list | None = None) -> None:
    """The same leaves, bit for bit; with ``strides``, each tensor laid out as given
    (the template's memory format: a channels-last parameter stays channels-last)."""
    assert len(got) == len(want), where
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{where}: leaf {j}"
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: leaf {j}"
            assert torch.equal(bits(a), bits(b)), f"{where}: leaf {j} differs"
            if strides is not None:
                assert a.stride() == strides[j].stride(), f"{where}: leaf {j} layout"
        else:
            assert type(a) is type(b) and a == b, f"{where}: leaf {j}"


def assert_resumed(res: dict, world: int, rank: int, epoch: int, where: str) -> None:
    assert res["same_structure"], where
    assert res["layout"]["world_size"] == world and res["layout"]["rank"] == rank, where
    assert res["epoch"] == epoch, where
    assert_same_leaves(res["loaded"], res["expected"], where, strides=res["fresh"])
    # The load brought the trained values, not the template's.
    moved = [
        not torch.equal(bits(a), bits(b))
        for a, b in zip(res["loaded"], res["fresh"], strict=True)
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel()
    ]
    assert sum(moved) >= 10, where


# -- resharding: 1 -> 2 -> 3 -> 1 ---------------------------------------------------------


def test_a_one_rank_checkpoint_loads_on_two_ranks(runs):
    for r, res in enumerate(results(runs[2], "resume_one")):
        assert_resumed(res, 2, r, W.FIRST_STEPS, f"1 -> 2, rank {r}")


def test_a_two_rank_checkpoint_loads_on_three_ranks(runs):
    for r, res in enumerate(results(runs[3], "resume_two")):
        assert_resumed(res, 3, r, W.FIRST_STEPS + W.MORE_STEPS, f"2 -> 3, rank {r}")


def test_replicated_and_sharded_states_load_into_each_other(runs):
    for r, res in enumerate(results(runs[3], "resume_two")):
        for case in ("replicated_to_sharded", "sharded_to_replicated"):
            got, want = res[case]
            assert_same_leaves(got, want, f"{case}, rank {r}", strides=want)


def test_a_three_rank_checkpoint_loads_on_one_rank(runs, tmp_path):
    results(runs[3], "resume_two")  # the 3-rank save happened
    _one_process_group(tmp_path / "store")
    try:
        template = {"state": ffd.shard_state(W.make_state()), "epoch": 0}
        loaded = ffd.load_checkpoint_sharded(runs["dir"] / "ckpt", template)
        expected = ffd.load_checkpoint_broadcast(runs["dir"] / "three_full.ckpt", template)
    finally:
        dist.destroy_process_group()
    assert loaded["state"].shard == expected["state"].shard
    assert loaded["state"].shard.world_size == 1
    assert loaded["epoch"] == W.FIRST_STEPS + 2 * W.MORE_STEPS
    assert_same_leaves(W.raw(loaded), W.raw(expected), "3 -> 1", strides=W.raw(template))
    assert not torch.equal(loaded["state"].master["w1"], template["state"].master["w1"])


def test_each_rank_wrote_only_its_own_pieces_in_bucket_sized_chunks(runs):
    results(runs[3], "resume_two")
    directory = runs["dir"] / "ckpt"
    marker = json.loads((directory / MARKER).read_text())
    assert marker["world_size"] == 3 and marker["bucket_bytes"] == 16
    meta = dcp.FileSystemReader(str(directory / marker["folder"])).read_metadata()
    params = tree_flatten(W.make_state().params)[0]
    names = [p[2:-2] for p in tree_paths(W.make_state().params)]  # "['w1']" -> "w1"
    layouts = [layout_for(params, 3, r) for r in range(3)]
    checked = 0
    for i, (name, p) in enumerate(zip(names, params, strict=True)):
        for field, itemsize in (("params", p.element_size()), ("master", 4)):
            fqn = f"['state'].{field}['{name}']"
            if p.numel() == 0:
                assert fqn not in meta.state_dict_metadata
                continue
            md = meta.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata) and tuple(md.size) == (p.numel(),)
            covered = 0
            for index, info in meta.storage_data.items():
                if index.fqn != fqn:
                    continue
                start = index.offset[0]
                size = next(c.sizes[0] for c in md.chunks if c.offsets[0] == start)
                assert size * itemsize <= max(16 // 4, itemsize), (fqn, size)  # bucket / 4
                writer = int(info.relative_path.split("_")[2])  # "__<rank>_0.distcp"
                lo, hi = layouts[writer].piece(i)
                assert lo <= start and start + size <= hi, (fqn, writer, start, size)
                covered += size
            assert covered == p.numel(), fqn
            checked += 1
    assert checked >= 12


# -- crashes during a save ---------------------------------------------------------------


def test_a_writer_that_fails_on_one_rank_fails_the_save_on_every_rank(runs):
    for r, res in enumerate(results(runs[2], "writer_raises")):
        assert res["error"] is not None and res["error"].startswith("CheckpointError:"), r
        assert "injected write failure" in res["error"] and "rank 1" in res["error"]
        assert_same_leaves(res["after"], res["expected"], f"rank {r} after the failed save")
        assert len(res["folders"]) == 2  # the committed one and the failed one's remains


def test_a_failed_commit_keeps_the_previous_checkpoint(runs):
    for r, res in enumerate(results(runs[2], "commit_raises")):
        assert res["error"] is not None and res["error"].startswith("OSError:"), r
        assert "injected commit failure" in res["error"]
        if r > 0:
            assert "failed on rank 0" in res["error"]
        assert_same_leaves(res["after"], res["expected"], f"rank {r} after the failed commit")
        assert len(res["folders"]) == 3


def test_a_killed_save_leaves_the_previous_checkpoint_and_the_next_save_cleans_up(runs):
    killed = runs[2].out
    assert not (killed / "killed_rank1.pt").exists() and not (killed / "killed_rank1.err").exists()
    for res in results(runs[3], "resume_two"):
        folders = [n for n in res["before"] if n.startswith("step-")]
        # The committed checkpoint, the remains of the failed write, the complete
        # but uncommitted folder of the failed commit, and the killed save's part.
        assert len(folders) == 4 and MARKER in res["before"], res["before"]
        # What loaded is the last committed checkpoint (its epoch, its values:
        # test_a_two_rank_checkpoint_loads_on_three_ranks).
        assert res["epoch"] == W.FIRST_STEPS + W.MORE_STEPS
        after = res["after"]
        assert MARKER in after and len([n for n in after if n.startswith("step-")]) == 1, after
        assert not [n for n in after if n.endswith(".tmp")], after


# -- refusals ------------------------------------------------------------------------------

REFUSALS = {
    "lr": ("CheckpointMismatchError", ["tx.spec", "learning_rate", "0.01 in the checkpoint"]),
    "shape": ("CheckpointMismatchError", ["['state'].params['w1']", "(7, 5)", "(7, 6)"]),
    "dtype": ("CheckpointMismatchError", ["['state'].params['s']", "torch.float16"]),
    "extra_leaf": ("CheckpointMismatchError", ["['extra']"]),
    "value_type": ("CheckpointMismatchError", ["['epoch']", "float"]),
    "missing": ("FileNotFoundError", ["nowhere", "no sharded checkpoint"]),
    "one_rank_lr": ("CheckpointMismatchError", ["learning_rate"]),
    "one_rank_lr_unchecked": ("ValueError", ["the ranks disagree", "learning_rate", "rank 1"]),
    "edited_marker": ("CheckpointCorruptError", ["checksum"]),
    "lost_chunk": ("CheckpointCorruptError", ["['state'].master['w1']", "do not tile"]),
    "truncated": ("CheckpointCorruptError", ["__1_0.distcp", "beyond the end"]),
    "garbled": ("CheckpointCorruptError", ["reading step-", "__1_0.distcp", "not a zip archive"]),
    "save_object": ("TypeError", ["['obj']", "object"]),
    "save_one_rank_extra": ("ValueError", ["['extra']", "rank 1"]),
    "save_to_a_file": ("NotADirectoryError", ["two_full.ckpt", "is a file"]),
}


def test_refusals_raise_on_every_rank_naming_the_path(runs):
    for r, res in enumerate(results(runs[2], "refusals")):
        assert set(res["errors"]) == set(REFUSALS)
        for case, (kind, texts) in REFUSALS.items():
            message = res["errors"][case]
            assert message is not None, f"rank {r}: {case} did not raise"
            assert message.split(":")[0] == kind, (r, case, message)
            for text in texts:
                assert text in message, (r, case, text, message)
        assert "failed on rank 1" in res["errors"]["one_rank_lr"] or r == 1
        assert not res["unused_exists"]  # refused before anything was written
        assert_same_leaves(res["after"], res["expected"], f"rank {r} after the refusals")


ONE_RANK_ARGUMENTS = {
    "save_bucket_bytes": ("ValueError", ["bucket_bytes must be a positive int"]),
    "save_path_type": ("TypeError", ["float"]),
    "load_path_type": ("TypeError", ["NoneType"]),
    "load_bytes_path": ("TypeError", ["bytes"]),
}


def test_an_invalid_argument_on_one_rank_makes_every_rank_raise_promptly(runs):
    # The argument checks run inside the step whose outcome every rank gathers,
    # so the other rank is not left waiting in the gather until its timeout.
    for r, res in enumerate(results(runs[2], "one_rank_arguments")):
        for case, (kind, texts) in ONE_RANK_ARGUMENTS.items():
            message, seconds = res[case]
            assert message is not None, f"rank {r}: {case} did not raise"
            assert message.startswith(f"{kind}:"), (r, case, message)
            for text in texts:
                assert text in message, (r, case, text, message)
            assert r == 1 or "failed on rank 1" in message, (r, case, message)
            assert seconds < PROMPT_S, (r, case, seconds)
        assert not res["unused_exists"]
        assert_same_leaves(res["after"], res["expected"], f"rank {r} after the refusals")


# -- forged files ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    """The forged-file scenarios, in one process of a one-rank group (a crash fails them, not pytest)."""
    return launch_workers(
        FORGED_FILE,
        tmp_path_factory.mktemp("forged"),
        1,
        LAUNCH_TIMEOUT_S,
        {
            "FF_SCKPT_DIR": str(tmp_path_factory.mktemp("forged_checkpoints")),
            "FF_SCKPT_SCENARIOS": "forged_globals,forged_ranges,forged_marker,forged_nested",
        },
    )


def assert_refused(message: str | None, kind: str, texts: list[str], where: str) -> None:
    assert message is not None, f"{where}: loaded"
    assert message.startswith(f"{kind}:"), (where, message)
    for text in texts:
        assert text in message, (where, text, message)


def test_a_forged_metadata_naming_a_global_is_refused_without_running_it(forged):
    res = results(forged, "forged_globals")[0]
    for name, target in (
        ("mkdir", "posix.mkdir"),
        ("eval", "builtins.eval"),
        ("system", "posix.system"),
    ):
        error, ran = res[name]
        assert not ran, f"the forged .metadata ran {target}"
        assert_refused(error, "CheckpointCorruptError", [".metadata", f"'{target}'"], name)


FORGED_RANGES = {
    "huge_length": ["['state'].master['w1']", "1099511627776 stored bytes", "its 4 bytes"],
    "beyond_file": ["['state'].master['w1']", "beyond the end of __0_0.distcp"],
    "outside_folder": ["'/etc/passwd'", "not a data file"],
    "other_checkpoint": ["not a data file"],
    "transform": ["stream transform"],
    "allocates": ["reading step-", "bytearray"],
    "padded": [".metadata", "larger than"],
}


def test_forged_chunk_records_are_refused_before_anything_is_allocated(forged):
    res = results(forged, "forged_ranges")[0]
    assert set(res) == set(FORGED_RANGES)
    for case, texts in FORGED_RANGES.items():
        assert_refused(res[case], "CheckpointCorruptError", texts, case)


def test_marker_texts_reach_messages_escaped_and_cut(forged):
    res = results(forged, "forged_marker")[0]
    cases = {
        "twice": ("CheckpointCorruptError", ["appears twice", "\\x1b[2J\\nstate"]),
        "huge_value": ("CheckpointMismatchError", ["checkpoint['epoch']", "AAAA", "..."]),
        "config_escape": ("CheckpointMismatchError", ["learning_rate", "\\x1b]0;forged\\x07"]),
    }
    for case, (kind, texts) in cases.items():
        message = res[case]
        assert_refused(message, kind, texts, case)
        assert message.isprintable() and len(message) < 2000, (case, message[:3000])
    message, seconds = res["duplicate_keys"]
    assert_refused(message, "CheckpointCorruptError", ["the key 'k0' appears twice"], "keys")
    assert seconds < PROMPT_S, seconds


def test_a_forged_metadata_nested_deep_is_refused_without_crashing(forged):
    res = results(forged, "forged_nested")[0]
    assert_refused(res["key"], "CheckpointCorruptError", ["dict key of type tuple"], "key")
    assert_refused(res["enum"], "CheckpointCorruptError", ["other than plain arguments"], "enum")
    assert F.NESTING >= 300_000


# -- one configuration on every rank ------------------------------------------------------

FINGERPRINT_TEXTS = {
    ("shard_state", "shape"): ["state.params['w1']", "(7, 5)", "(7, 6)"],
    ("shard_state", "dtype"): ["state.params['s']", "torch.float32", "torch.float16"],
    ("shard_state", "tx"): ["state.tx.spec", "learning_rate", "0.01", "0.02"],
    ("shard_state", "structure"): ["state.params['extra']", "exists on rank 2"],
    ("tree_all_reduce_mean", "shape"): ["tree['w2']", "(5, 3)", "(5, 4)"],
    ("tree_all_reduce_mean", "dtype"): ["tree['b1']", "torch.float32"],
    ("tree_all_reduce_mean", "structure"): ["tree['extra']", "exists on rank 2"],
    ("tree_all_reduce_mean", "bucket_bytes"): ["argument bucket_bytes", "1024"],
    ("sharded_update", "tx"): ["state.tx.spec", "learning_rate", "0.02"],
    ("sharded_update", "grads_dtype"): ["grads['b1']", "torch.float32"],
    ("sharded_update", "comm_dtype"): ["argument comm_dtype", "torch.float32"],
    ("sharded_update", "bucket_bytes"): ["argument bucket_bytes", "64"],
    ("sharded_update", "piece_length"): ["state pieces' lengths", "not those of the layout"],
}


def test_a_rank_with_another_configuration_makes_every_rank_raise_promptly(runs):
    for r, res in enumerate(results(runs[3], "fingerprint")):
        for case, texts in FINGERPRINT_TEXTS.items():
            message, seconds = res[case]
            assert message is not None, f"rank {r}: {case} did not raise"
            assert message.startswith("ValueError:") and "rank 2" in message, (r, case, message)
            for text in texts:
                assert text in message, (r, case, text, message)
            assert seconds < PROMPT_S, (r, case, seconds)


def test_the_agreement_runs_once_per_configuration(runs):
    for r, res in enumerate(results(runs[3], "fingerprint")):
        calls = res["calls"]
        assert calls["sharded_update_first"] >= 1 and calls["mean_first"] >= 1, (r, calls)
        assert calls["sharded_update_later"] == 0 and calls["mean_later"] == 0, (r, calls)


def test_sharded_checkpoints_need_a_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    for fn in (
        lambda: ffd.save_checkpoint_sharded(tmp_path / "c", {"x": torch.ones(1)}),
        lambda: ffd.load_checkpoint_sharded(tmp_path / "c", {"x": torch.ones(1)}),
    ):
        with pytest.raises(RuntimeError, match="needs a torch.distributed process group"):
            fn()
    assert not os.path.exists(tmp_path / "c")
    for fn in (ffd.save_checkpoint_sharded, ffd.load_checkpoint_sharded):
        params = inspect.signature(fn).parameters
        assert list(params)[:2] in (["path", "tree"], ["path", "like"])
        assert params["group"].kind == inspect.Parameter.KEYWORD_ONLY


def test_the_writer_gets_each_chunk_as_an_alias_of_its_bytes():
    # DCP's writer copies a tensor whose storage is larger than itself and keeps
    # the last tensor of every entry until the file is complete; the planner hands
    # it chunks that alias exactly their bytes, so a save copies nothing.
    piece = torch.arange(10, dtype=torch.float32)
    flat = chunked(piece.view(-1), 25, 7, 4)  # elements 7 .. 16 of 25, chunks of 4
    planner = AliasingSavePlanner()
    planner.set_up_planner({"w": flat, "s": torch.tensor(3)}, None, True)
    items = [i for i in planner.create_local_plan().items if i.index.fqn == "w"]
    assert [tuple(i.index.offset) for i in items] == [(7,), (11,), (15,)]
    for item, start in zip(items, (0, 4, 8), strict=True):
        chunk = planner.resolve_data(item)
        assert chunk.untyped_storage().nbytes() == chunk.nbytes  # written as it is
        assert chunk.data_ptr() == piece.data_ptr() + 4 * start  # no copy
        assert torch.equal(chunk, piece[start : start + 4])
