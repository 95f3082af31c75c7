"""Checkpoints of the retired sharded format (version 1): they still load, into today's states.

``tests/data/sharded_v1`` was written by ``save_checkpoint_sharded`` of that
format at 2 ranks (``{"state": <sharded state>, "epoch": 3}``: clip + masked
AdamW on leaves of 15, 3 and 1 elements after 3 steps), beside
``expected_full.pt``, the gathered state's leaves at the time. Here it loads
in one process; ``tests/test_sharding.py`` loads it at 2 and 3 ranks into a
sharded ``like``.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import optree
import pytest
import torch

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from tests.helpers import bits

LEGACY = Path(__file__).with_name("data") / "sharded_v1"


def legacy_like(lr: float = 1e-2, b_shape=(3,)) -> dict:
    """The template of the legacy checkpoint's tree (values unrelated to the saved ones)."""
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(5, 3, generator=g), "b": torch.randn(b_shape, generator=g)}
    params["c"] = torch.randn(1, generator=g)
    mask = lambda p: optree.tree_map(lambda x: x.ndim > 1, p, namespace=ff.NAMESPACE)  # noqa: E731
    tx = ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(lr, mask=mask))
    state = ff.fp16_init(params, tx, ff.DynamicLossScale(2.0**10, growth_interval=2))
    return {"state": state, "epoch": 0}


def expected_leaves() -> list[torch.Tensor]:
    return torch.load(LEGACY / "expected_full.pt", weights_only=True)["leaves"]


def old_leaves(state: ff.FP16State) -> list[torch.Tensor]:
    """The state's leaves a version-1 file holds: all but the later ``scale_stats`` and
    ``leaf_finite``, which load as zeros and as all finite."""
    assert all(int(x) == 0 for x in state.scale_stats)
    assert bool(state.leaf_finite.all())
    later = ("scale_stats", "leaf_finite")
    fields = [getattr(state, f) for f in ff.FP16State.FIELDS if f not in later]
    return optree.tree_leaves(fields, namespace=ff.NAMESPACE)


def assert_bitwise_leaves(got: list, want: list) -> None:
    assert len(got) == len(want)
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), j
        assert torch.equal(bits(a), bits(b)), f"leaf {j} differs"


def test_a_version_1_checkpoint_loads_bit_for_bit_in_one_process():
    like = legacy_like()
    with pytest.warns(UserWarning, match="before FP16State.scale_stats"):
        loaded = ffd.load_checkpoint_sharded(LEGACY, like)
    assert loaded["epoch"] == 3
    assert_bitwise_leaves(old_leaves(loaded["state"]), expected_leaves())
    assert int(loaded["state"].step) == 3
    # The template's values were not used, nor changed.
    fresh = optree.tree_leaves(legacy_like()["state"], namespace=ff.NAMESPACE)
    kept = optree.tree_leaves(like["state"], namespace=ff.NAMESPACE)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(fresh, kept))
    assert not torch.equal(loaded["state"].master["w"], like["state"].master["w"])


def test_a_converted_checkpoint_resumes_through_dcp(tmp_path):
    loaded = ffd.load_checkpoint_sharded(LEGACY, legacy_like())
    ffd.save_dcp_state(loaded["state"], tmp_path / "converted")
    again = ffd.load_dcp_state(legacy_like()["state"], tmp_path / "converted")
    assert_bitwise_leaves(old_leaves(again), expected_leaves())


def test_a_like_of_another_shape_is_refused_naming_the_path():
    with pytest.raises(ff.CheckpointMismatchError, match=r"\['state'\].params\['b'\].*\(4,\)"):
        ffd.load_checkpoint_sharded(LEGACY, legacy_like(b_shape=(4,)))


def test_a_like_of_another_tree_is_refused():
    like = legacy_like()
    like["extra"] = torch.zeros(2)
    with pytest.raises(ff.CheckpointMismatchError, match=r"missing \[\"\['extra'\]\"\]"):
        ffd.load_checkpoint_sharded(LEGACY, like)


def _copy(tmp_path: Path, change) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(LEGACY, target)
    marker = json.loads((target / "checkpoint.json").read_text())
    change(marker)
    (target / "checkpoint.json").write_text(json.dumps(marker))
    return target


def test_other_versions_and_broken_markers_are_refused(tmp_path):
    with pytest.raises(ff.CheckpointMismatchError, match="version 2"):
        ffd.load_checkpoint_sharded(
            _copy(tmp_path / "a", lambda m: m.update(version=2)), legacy_like()
        )
    with pytest.raises(ff.CheckpointCorruptError, match="no valid 'folder'"):
        ffd.load_checkpoint_sharded(
            _copy(tmp_path / "b", lambda m: m.update(folder="../x")), legacy_like()
        )
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "checkpoint.json").write_text("{not json")
    with pytest.raises(ff.CheckpointCorruptError, match="not JSON"):
        ffd.load_checkpoint_sharded(tmp_path / "c", legacy_like())
    with pytest.raises(FileNotFoundError, match="load_dcp_state"):
        ffd.load_checkpoint_sharded(tmp_path, legacy_like())


def test_the_retired_writer_says_what_replaces_it():
    with pytest.raises(AttributeError, match="save_dcp_state"):
        ffd.save_checkpoint_sharded  # noqa: B018
    with pytest.raises(AttributeError, match="placements"):
        ffd.ShardLayout  # noqa: B018


@pytest.mark.parametrize("case", ["global_system", "data_cut_to_a_third", "outside_folder"])
def test_a_forged_dcp_folder_of_the_old_format_is_refused_and_runs_nothing(case, tmp_path):
    from tests import _forged_dcp as F

    copy = tmp_path / "legacy"
    shutil.copytree(LEGACY, copy)
    folder = next(p for p in copy.iterdir() if p.name.startswith("step-"))
    evidence = tmp_path / "evidence"
    evidence.mkdir()
    if case == "outside_folder":  # this format's chunks are named by another entry
        md = F.metadata(folder)
        key = next(iter(md.storage_data))
        md.storage_data[key].relative_path = "/etc/passwd"
        F.write_metadata(folder, pickle.dumps(md))
    else:
        F.forgeries(evidence)[case](folder)
    with pytest.raises(ff.CheckpointCorruptError, match=folder.name):
        ffd.load_checkpoint_sharded(copy, legacy_like())
    assert not any(evidence.iterdir())
