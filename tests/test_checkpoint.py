"""Checkpoints: plain format, exact restore, validation against a template, integrity."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_map, tree_paths
from functional_fp16.checkpoint import format as checkpoint_format
from functional_fp16.checkpoint.save_load import FORMAT, VERSION
from tests.helpers import assert_bitwise_unchanged, bit_snapshot, bits


def assert_trees_bitwise_equal(a, b) -> None:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for path, x, y in zip(tree_paths(a), la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), path
            assert x.dtype == y.dtype and x.shape == y.shape, path
            assert torch.equal(bits(x), bits(y)), path
        else:
            assert type(x) is type(y) and x == y, path


class Head(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor


def make_params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {
        "scalar": torch.randn((), generator=g),
        "body": (torch.randn(5, 3, generator=g), torch.randn(7, generator=g)),
        "head": Head(torch.randn(2, 5, generator=g), torch.randn(2, generator=g)),
    }


def make_tx():
    return ff.chain(ff.clip_by_global_norm(10.0), ff.sgd(0.05, momentum=0.9, weight_decay=1e-4))


def make_scale(**kw):
    cfg = dict(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=1.0)
    cfg.update(kw)
    return ff.DynamicLossScale(**cfg)


def trained_state(steps: int = 7, seed: int = 0):
    state = ff.fp16_init(make_params(seed), make_tx(), make_scale())
    g = torch.Generator().manual_seed(seed + 100)
    for i in range(steps):
        grads = tree_map(lambda p: (torch.randn(p.shape, generator=g) * 300).half(), state.params)
        if i == 3:  # one overflow, so the counters are not at their initial values
            grads["scalar"] = torch.tensor(float("inf"), dtype=torch.float16)
        state = ff.fp16_update(state, grads)
    return state


def fresh_like():
    return ff.fp16_init(make_params(1), make_tx(), make_scale())


def plain_types_only(obj) -> bool:
    if isinstance(obj, torch.Tensor) or obj is None or type(obj) in (bool, int, float, str):
        return True
    if type(obj) in (list, tuple):
        return all(plain_types_only(x) for x in obj)
    if type(obj) is dict:
        return all(
            type(k) in (str, int, float, bool) and plain_types_only(v) for k, v in obj.items()
        )
    return False


# -- round trips ------------------------------------------------------------


def test_state_round_trip_is_bitwise_and_keeps_template_tx(tmp_path):
    state = trained_state()
    path = tmp_path / "state.ckpt"
    ff.save_checkpoint(path, state)
    like = fresh_like()
    loaded = ff.load_checkpoint(path, like)
    assert isinstance(loaded, ff.FP16State)
    assert loaded.tx is like.tx
    assert isinstance(loaded.opt_state[1][1], ff.TraceState)
    assert isinstance(loaded.params["head"], Head)
    assert_trees_bitwise_equal(loaded, state)
    assert loaded.loss_scale.config() == state.loss_scale.config()
    # The counters are not the fresh ones: the restore is of the trained state.
    assert int(loaded.step) == 7 and int(like.step) == 0


def test_resumed_state_continues_bitwise_like_the_original(tmp_path):
    state = trained_state()
    ff.save_checkpoint(tmp_path / "s.ckpt", state)
    resumed = ff.load_checkpoint(tmp_path / "s.ckpt", fresh_like())
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        grads = tree_map(lambda p: (torch.randn(p.shape, generator=g) * 100).half(), state.params)
        state = ff.fp16_update(state, grads)
        resumed = ff.fp16_update(resumed, grads)
    assert_trees_bitwise_equal(resumed, state)


def test_whole_training_state_round_trip(tmp_path):
    state = trained_state()
    tree = {
        "state": state,
        "epoch": 3,
        "lr": 0.125,
        "name": "run-1",
        "done": False,
        "rng": {"cpu": torch.get_rng_state(), "seed": 1234},
        "order": torch.randperm(50),
        "history": [1.5, float("nan"), None],
        "static": ff.StaticLossScale(128.0),
    }
    ff.save_checkpoint(tmp_path / "all.ckpt", tree)
    like = {
        "state": fresh_like(),
        "epoch": 0,
        "lr": 0.0,
        "name": "",
        "done": True,
        "rng": {"cpu": torch.get_rng_state(), "seed": 0},
        "order": torch.arange(50),
        "history": [0.0, 0.0, None],
        "static": ff.StaticLossScale(1.0),
    }
    out = ff.load_checkpoint(tmp_path / "all.ckpt", like)
    assert out["epoch"] == 3 and out["lr"] == 0.125 and out["name"] == "run-1"
    assert out["done"] is False and out["rng"]["seed"] == 1234
    assert out["history"][0] == 1.5 and out["history"][1] != out["history"][1]
    assert torch.equal(out["order"], tree["order"])
    assert torch.equal(out["rng"]["cpu"], tree["rng"]["cpu"])
    assert float(out["static"].loss_scale) == 128.0
    assert_trees_bitwise_equal(out["state"], state)


def test_file_holds_only_plain_data_and_loads_with_weights_only(tmp_path):
    state = trained_state()
    ff.save_checkpoint(tmp_path / "s.ckpt", {"state": state, "epoch": 2})
    raw = torch.load(tmp_path / "s.ckpt", weights_only=True)
    assert plain_types_only(raw)
    assert raw["format"] == FORMAT and raw["version"] == VERSION
    # The structure is optree's: class names, entries, and the loss scale's
    # configuration by name as plain numbers.
    root = raw["structure"]
    assert root["type"] == "dict" and root["entries"] == ["state", "epoch"]
    state_node = root["children"][0]
    assert state_node["type"] == "FP16State" and "meta" not in state_node  # tx is not data
    assert state_node["entries"] == [
        "params",
        "master",
        "opt_state",
        "loss_scale",
        "step",
        "grads_finite",
        "scale_stats",
        "leaf_finite",
    ]
    scale_node = state_node["children"][3]
    assert scale_node["type"] == "DynamicLossScale" and scale_node["kind"] == "CUSTOM"
    assert scale_node["meta"]["growth_interval"] == 3 and scale_node["meta"]["hysteresis"] == 2
    # One leaf record per optree leaf (dicts in insertion order), named by its path.
    assert sorted(leaf["path"] for leaf in raw["leaves"]) == sorted(
        ["['state']" + p for p in tree_paths(state)] + ["['epoch']"]
    )
    assert raw["leaves"][root["children"][1]["leaf"]] == {"path": "['epoch']", "value": 2}
    (leaf,) = [r for r in raw["leaves"] if r["path"] == "['state'].master['body'][0]"]
    assert leaf["dtype"] == "torch.float32" and leaf["shape"] == [5, 3]
    assert torch.equal(bits(raw["tensors"][leaf["tensor"]]), bits(state.master["body"][0]))


def test_load_without_template_returns_the_plain_structure(tmp_path):
    state = trained_state()
    ff.save_checkpoint(tmp_path / "s.ckpt", {"state": state, "epoch": 5, "t": (1, "a")})
    out = ff.load_checkpoint(tmp_path / "s.ckpt")
    assert out["epoch"] == 5 and out["t"] == (1, "a")
    plain = out["state"]
    assert set(plain) == set(ff.FP16State.FIELDS)
    assert "scale_stats" in plain
    assert plain["params"]["head"] == {
        "weight": plain["params"]["head"]["weight"],
        "bias": plain["params"]["head"]["bias"],
    }
    # Nodes other than builtin containers come back as dicts of their children.
    assert set(plain["loss_scale"]) == {"loss_scale", "growth_count", "hysteresis_count"}
    assert torch.equal(bits(plain["loss_scale"]["loss_scale"]), bits(state.loss_scale.loss_scale))
    assert list(out) == ["state", "epoch", "t"]  # dicts in the order they were saved
    assert torch.equal(bits(plain["master"]["head"]["weight"]), bits(state.master["head"].weight))
    trace = plain["opt_state"][1][1]
    assert set(trace) == {"trace", "initialized"}
    assert torch.equal(bits(trace["trace"]["scalar"]), bits(state.opt_state[1][1].trace["scalar"]))


def test_loaded_tensors_do_not_alias_each_other_or_the_saved_tree(tmp_path):
    base = torch.arange(6.0)
    tree = {"a": base, "b": base.view(2, 3), "c": base[2:4]}
    ff.save_checkpoint(tmp_path / "v.ckpt", tree)
    out = ff.load_checkpoint(
        tmp_path / "v.ckpt", {"a": torch.zeros(6), "b": torch.zeros(2, 3), "c": torch.zeros(2)}
    )
    out["a"].add_(1)
    assert torch.equal(out["b"], base.view(2, 3)) and torch.equal(out["c"], base[2:4])
    assert torch.equal(base, torch.arange(6.0))
    raw = torch.load(tmp_path / "v.ckpt", weights_only=True)
    # The slice is stored compactly, not as its whole storage.
    assert raw["tensors"][2].untyped_storage().nbytes() == 2 * 4


def test_map_location_and_template_device(tmp_path):
    state = trained_state()
    ff.save_checkpoint(tmp_path / "s.ckpt", state)
    out = ff.load_checkpoint(tmp_path / "s.ckpt", fresh_like(), map_location="cpu")
    assert all(x.device.type == "cpu" for x in tree_leaves(out))
    raw = torch.load(tmp_path / "s.ckpt", weights_only=True)
    assert all(leaf["device"] == "cpu" for leaf in raw["leaves"] if "tensor" in leaf)


def test_tensors_follow_the_template_device_or_map_location(tmp_path):
    # The "meta" device stands in for a second device on a CPU-only machine.
    state = trained_state()
    ff.save_checkpoint(tmp_path / "s.ckpt", {"state": state, "extra": torch.ones(2)})
    meta_params = tree_map(lambda p: p.to("meta"), make_params(1))
    like = {"state": ff.fp16_init(meta_params, make_tx(), make_scale()), "extra": torch.ones(2)}
    out = ff.load_checkpoint(tmp_path / "s.ckpt", like)
    assert all(x.is_meta for x in tree_leaves(out["state"]))
    assert out["extra"].device.type == "cpu"  # each tensor goes where its template is
    out = ff.load_checkpoint(tmp_path / "s.ckpt", like, map_location="cpu")
    assert all(x.device.type == "cpu" for x in tree_leaves(out))
    assert_trees_bitwise_equal(out["state"], state)
    plain = ff.load_checkpoint(tmp_path / "s.ckpt", map_location="meta")
    assert plain["extra"].is_meta
    with pytest.raises(ValueError, match=r"map_location='nonsense' is not a device"):
        ff.load_checkpoint(tmp_path / "s.ckpt", map_location="nonsense")
    # A file saved on a device this machine lacks names the tensor and the way out.
    raw = torch.load(tmp_path / "s.ckpt", weights_only=True)
    assert raw["leaves"][-1]["path"] == "['extra']"
    raw["leaves"][-1]["device"] = "cuda:7" if not torch.cuda.is_available() else "nonsense:0"
    header = (FORMAT, VERSION, raw["structure"], raw["leaves"])
    raw["checksum"] = checkpoint_format.checksum(header, raw["tensors"])
    torch.save(raw, tmp_path / "moved.ckpt")
    with pytest.raises(
        ff.CheckpointError, match=r"checkpoint\['extra'\] was saved on .* pass map_location="
    ):
        ff.load_checkpoint(tmp_path / "moved.ckpt")
    assert (
        ff.load_checkpoint(tmp_path / "moved.ckpt", map_location="cpu")["extra"].device.type
        == "cpu"
    )


def test_parameters_and_autograd_tensors_are_stored_as_plain_data(tmp_path):
    w = torch.nn.Parameter(torch.randn(3))
    y = (w * 2).requires_grad_()
    ff.save_checkpoint(tmp_path / "p.ckpt", {"w": w, "y": y})
    raw = torch.load(tmp_path / "p.ckpt", weights_only=True)
    assert all(type(t) is torch.Tensor and not t.requires_grad for t in raw["tensors"])
    out = ff.load_checkpoint(tmp_path / "p.ckpt")
    assert torch.equal(out["w"], w.detach()) and torch.equal(out["y"], y.detach())


def test_file_mode_is_the_usual_one_not_the_temp_files(tmp_path):
    path = tmp_path / "s.ckpt"
    old = os.umask(0o027)
    try:
        ff.save_checkpoint(path, {"a": 1})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640
    os.chmod(path, 0o604)
    ff.save_checkpoint(path, {"a": 2})  # replacing keeps the existing file's mode
    assert path.stat().st_mode & 0o777 == 0o604


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_both_ways(tmp_path):
    state = trained_state()
    ff.save_checkpoint(tmp_path / "cpu.ckpt", state)
    like_cuda = ff.fp16_init(tree_map(lambda p: p.cuda(), make_params(1)), make_tx(), make_scale())
    on_cuda = ff.load_checkpoint(tmp_path / "cpu.ckpt", like_cuda)
    assert all(x.is_cuda for x in tree_leaves(on_cuda))
    assert_trees_bitwise_equal(on_cuda, state)
    ff.save_checkpoint(tmp_path / "cuda.ckpt", on_cuda)
    back = ff.load_checkpoint(tmp_path / "cuda.ckpt", fresh_like())
    assert all(x.device.type == "cpu" for x in tree_leaves(back))
    assert_trees_bitwise_equal(back, state)
    plain = ff.load_checkpoint(tmp_path / "cuda.ckpt")
    assert plain["master"]["scalar"].is_cuda


# -- format version 1 -------------------------------------------------------------

V1_FILE = Path(__file__).parent / "data" / "checkpoint_v1.ckpt"


def v1_like(scale=None):
    return {
        "state": ff.fp16_init(make_params(1), make_tx(), scale or make_scale()),
        "epoch": 0,
        "note": "",
        "flags": (False, 0.0, None),
        "history": [torch.zeros(4, dtype=torch.int64)],
        "static": ff.StaticLossScale(1.0),
    }


def test_files_of_format_version_1_still_load(tmp_path):
    """``tests/data/checkpoint_v1.ckpt`` was written by the version-1 writer.

    Its tree: ``{"state": trained_state(), "epoch": 3, "note": "written by
    checkpoint format version 1", "flags": (True, 2.5, None), "history":
    [torch.arange(4)], "static": ff.StaticLossScale(128.0)}``. What it must
    load to is read from the file's own tensor table, not from today's code.
    """
    raw = torch.load(V1_FILE, weights_only=True)
    assert raw["version"] == 1
    stored = {info["path"]: t for info, t in zip(raw["tensor_info"], raw["tensors"], strict=True)}
    like = v1_like()
    with pytest.warns(UserWarning, match="before FP16State.scale_stats"):
        out = ff.load_checkpoint(V1_FILE, like)
    state = out["state"]
    assert all(int(x) == 0 for x in state.scale_stats)  # a field added since: zeros
    assert bool(state.leaf_finite.all())  # another: all finite
    assert isinstance(state, ff.FP16State) and state.tx is like["state"].tx
    assert isinstance(state.params["head"], Head)
    assert isinstance(state.opt_state[1][1], ff.TraceState)
    assert state.loss_scale.config() == make_scale().config()
    tensors = [
        (p, x)
        for p, x in zip(tree_paths(out), tree_leaves(out))
        if torch.is_tensor(x) and ".scale_stats." not in p and not p.endswith(".leaf_finite")
    ]
    assert sorted(p for p, _ in tensors) == sorted(stored)
    for path, x in tensors:
        assert x.dtype == stored[path].dtype and torch.equal(bits(x), bits(stored[path])), path
    assert int(state.step) == 7 and float(out["static"].loss_scale) == 128.0
    assert out["epoch"] == 3 and out["note"] == "written by checkpoint format version 1"
    assert out["flags"] == (True, 2.5, None)
    # Without a template, the plain structure; rewritten, it is a version-2 file of the same tree.
    plain = ff.load_checkpoint(V1_FILE)
    assert torch.equal(plain["history"][0], torch.arange(4))
    assert set(plain["state"]) == {  # written before FP16State.scale_stats and leaf_finite
        "params",
        "master",
        "opt_state",
        "loss_scale",
        "step",
        "grads_finite",
    }
    ff.save_checkpoint(tmp_path / "v2.ckpt", out)
    assert torch.load(tmp_path / "v2.ckpt", weights_only=True)["version"] == VERSION
    assert_trees_bitwise_equal(ff.load_checkpoint(tmp_path / "v2.ckpt", v1_like()), out)
    # The version-1 checks still hold: the template and the checksum.
    with pytest.raises(ff.CheckpointMismatchError, match=r"hysteresis=2 in the checkpoint"):
        ff.load_checkpoint(V1_FILE, v1_like(make_scale(hysteresis=1)))
    data = bytearray(V1_FILE.read_bytes())
    at = bytes(data).find(bits(stored["['state'].master['body'][0]"]).numpy().tobytes())
    data[at + 2] ^= 0x10
    with pytest.raises(ff.CheckpointCorruptError, match="checksum mismatch"):
        ff.load_checkpoint(io.BytesIO(bytes(data)), v1_like())


# -- validation against the template -----------------------------------------


def _mismatch(tmp_path, like, match):
    ff.save_checkpoint(tmp_path / "s.ckpt", trained_state())
    with pytest.raises(ff.CheckpointMismatchError, match=match):
        ff.load_checkpoint(tmp_path / "s.ckpt", like)


def test_shape_mismatch_names_the_leaf(tmp_path):
    params = make_params(1)
    params["body"] = (torch.randn(5, 4), params["body"][1])
    like = ff.fp16_init(params, make_tx(), make_scale())
    _mismatch(tmp_path, like, r"\.params\['body'\]\[0\].*shape \(5, 3\) != \(5, 4\)")


def test_dtype_mismatch_names_the_leaf(tmp_path):
    like = ff.fp16_init(make_params(1), make_tx(), make_scale(), param_dtype=torch.bfloat16)
    _mismatch(tmp_path, like, r"\.params\['body'\]\[0\].*dtype torch.float16 != torch.bfloat16")


def test_missing_key_names_the_dict(tmp_path):
    params = make_params(1)
    params["extra"] = torch.zeros(3)
    like = ff.fp16_init(params, make_tx(), make_scale())
    _mismatch(
        tmp_path,
        like,
        r"checkpoint\.params does not match.*missing from the checkpoint \['extra'\]",
    )


def test_loss_scale_configuration_mismatch_is_named(tmp_path):
    like = ff.fp16_init(make_params(1), make_tx(), make_scale(hysteresis=1))
    _mismatch(
        tmp_path,
        like,
        r"loss_scale\.hysteresis.*hysteresis=2 in the checkpoint, hysteresis=1 in like",
    )


def test_loss_scale_kind_mismatch_is_named(tmp_path):
    like = ff.fp16_init(make_params(1), make_tx(), ff.StaticLossScale(8.0))
    _mismatch(tmp_path, like, r"\.loss_scale.*expected a StaticLossScale.*DynamicLossScale")


def test_optimizer_state_mismatch_is_named(tmp_path):
    like = ff.fp16_init(make_params(1), ff.sgd(0.1), make_scale())
    _mismatch(tmp_path, like, r"\.opt_state.*length 2 != 3")


def test_sgd_checkpoints_load_across_momentum_and_weight_decay_settings(tmp_path):
    # sgd keeps one state layout: a run saved with momentum and weight decay
    # resumes with both set to 0, and the other way round.
    params = make_params(0)
    saved = ff.fp16_init(params, ff.sgd(0.1, momentum=0.9, weight_decay=1e-3))
    grads = tree_map(lambda p: torch.ones_like(p), saved.params)
    saved = ff.fp16_update(saved, grads)
    ff.save_checkpoint(tmp_path / "a.ckpt", saved)
    plain = ff.load_checkpoint(tmp_path / "a.ckpt", ff.fp16_init(params, ff.sgd(0.1)))
    assert_trees_bitwise_equal(plain.opt_state, saved.opt_state)
    ff.save_checkpoint(tmp_path / "b.ckpt", plain)
    back = ff.fp16_init(params, ff.sgd(0.1, momentum=0.5, weight_decay=1e-2))
    assert_trees_bitwise_equal(ff.load_checkpoint(tmp_path / "b.ckpt", back), plain)


def test_template_of_another_type_is_refused(tmp_path):
    _mismatch(tmp_path, {"state": fresh_like()}, r"checkpoint does not match like: expected a dict")


# -- integrity ------------------------------------------------------------------


def test_truncated_files_are_rejected(tmp_path):
    path = tmp_path / "s.ckpt"
    ff.save_checkpoint(path, trained_state())
    data = path.read_bytes()
    cuts = sorted({0, 1, 10, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1})
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.ckpt"
        bad.write_bytes(data[:cut])
        with pytest.raises(ff.CheckpointCorruptError, match=f"cut{cut}.ckpt"):
            ff.load_checkpoint(bad, fresh_like())


def test_flipped_tensor_byte_is_detected(tmp_path):
    path = tmp_path / "s.ckpt"
    state = trained_state()
    ff.save_checkpoint(path, state)
    data = bytearray(path.read_bytes())
    # Find the bytes of the first master tensor in the (uncompressed) archive.
    needle = bits(state.master["body"][0]).numpy().tobytes()
    at = bytes(data).find(needle)
    assert at > 0
    data[at + 5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ff.CheckpointCorruptError, match="checksum mismatch"):
        ff.load_checkpoint(path, fresh_like())
    with pytest.raises(ff.CheckpointCorruptError, match="checksum mismatch"):
        ff.load_checkpoint(path)


def test_rewritten_metadata_is_detected(tmp_path):
    path = tmp_path / "s.ckpt"
    ff.save_checkpoint(path, trained_state())
    raw = torch.load(path, weights_only=True)
    raw["structure"]["children"][3]["meta"]["min_scale"] = 4.0
    torch.save(raw, path)
    with pytest.raises(ff.CheckpointCorruptError, match="checksum mismatch"):
        ff.load_checkpoint(path, fresh_like())


def test_foreign_files_are_rejected(tmp_path):
    torch.save({"weight": torch.zeros(3)}, tmp_path / "plain.pt")
    with pytest.raises(ff.CheckpointCorruptError, match="not a functional_fp16 checkpoint"):
        ff.load_checkpoint(tmp_path / "plain.pt")
    torch.save(Head(torch.zeros(1), torch.zeros(1)), tmp_path / "pickled.pt")  # a pickled class
    with pytest.raises(ff.CheckpointCorruptError, match=r"refers to tests\.test_checkpoint\.Head"):
        ff.load_checkpoint(tmp_path / "pickled.pt")
    path = tmp_path / "future.ckpt"
    ff.save_checkpoint(path, {"a": 1})
    raw = torch.load(path, weights_only=True)
    raw["version"] = VERSION + 1
    torch.save(raw, path)
    with pytest.raises(ff.CheckpointCorruptError, match="version 3 is not supported"):
        ff.load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        ff.load_checkpoint(tmp_path / "missing.ckpt")


# -- atomic writes ----------------------------------------------------------------


def test_failed_save_keeps_the_previous_file_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "s.ckpt"
    ff.save_checkpoint(path, {"step": 1, "w": torch.ones(3)})
    before = path.read_bytes()
    with pytest.raises(TypeError, match=r"tree\['bad'\]: cannot store object"):
        ff.save_checkpoint(path, {"step": 2, "bad": object()})
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.ckpt"]


def test_save_replaces_atomically_via_os_replace(tmp_path, monkeypatch):
    path = tmp_path / "s.ckpt"
    ff.save_checkpoint(path, {"step": 1})
    calls = []
    real_replace, real_fsync = os.replace, os.fsync

    def spy_fsync(fd):
        calls.append("fsync")
        return real_fsync(fd)

    def failing_replace(src, dst):
        calls.append("replace")
        assert os.path.dirname(os.fspath(src)) == os.path.dirname(os.fspath(dst))
        assert ff.load_checkpoint(src) == {"step": 2}  # the new file is complete first
        raise OSError("disk gone")

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk gone"):
        ff.save_checkpoint(path, {"step": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    assert calls == ["fsync", "replace"]
    assert ff.load_checkpoint(path) == {"step": 1}
    assert os.listdir(tmp_path) == ["s.ckpt"]
    calls.clear()
    ff.save_checkpoint(path, {"step": 3})
    assert calls == ["fsync", "fsync"]  # the file, then its directory
    assert ff.load_checkpoint(path) == {"step": 3}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")  # what torch says of flipped metadata
def test_no_bit_flip_in_the_tensor_section_loads_differently_without_an_error(tmp_path):
    """Every bit of the pickled metadata and of every tensor record, flipped one at a time.

    A flip must either raise a CheckpointError or load a tree bitwise equal to
    the original, with every tensor detached and owning its storage (a flipped
    ``requires_grad`` or a storage shared between two leaves must not survive).
    The file is loaded from memory.
    """
    import io
    import zipfile

    def load(data: bytes):
        return ff.load_checkpoint(io.BytesIO(data), like)

    params = {"w": torch.randn(3)}  # one leaf: every kind of state tensor, few bytes to flip
    ff.save_checkpoint(tmp_path / "s.ckpt", ff.fp16_init(params, ff.sgd(0.1, momentum=0.9)))
    data = bytearray((tmp_path / "s.ckpt").read_bytes())
    like = ff.fp16_init({k: torch.zeros_like(v) for k, v in params.items()}, ff.sgd(0.1))
    want = [bits(x) for x in tree_leaves(load(bytes(data)))]
    # The byte ranges of data.pkl and of the tensor records (not the zip directory).
    spans = []
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        for info in z.infolist():
            if info.filename.endswith("data.pkl") or "/data/" in info.filename:
                h = info.header_offset  # the local header gives the name and padding lengths
                name_len = int.from_bytes(data[h + 26 : h + 28], "little")
                extra_len = int.from_bytes(data[h + 28 : h + 30], "little")
                start = h + 30 + name_len + extra_len
                spans.append((start, start + info.compress_size))
    silent, checked = [], 0
    for start, end in spans:
        for byte in range(start, end):
            for bit in range(8):
                data[byte] ^= 1 << bit
                try:
                    leaves = tree_leaves(load(bytes(data)))
                except ff.CheckpointError:
                    leaves = None
                data[byte] ^= 1 << bit
                checked += 1
                if leaves is None:
                    continue
                same = len(leaves) == len(want) and all(
                    x.shape == w.shape and torch.equal(bits(x), w) for x, w in zip(leaves, want)
                )
                owners = {x.untyped_storage().data_ptr() for x in leaves}
                if not same or any(x.requires_grad for x in leaves) or len(owners) < len(leaves):
                    silent.append((byte, bit))
    assert checked > 15_000
    assert silent == []


# -- bad inputs (moved from test_bad_inputs.py) --
# Random damage to a saved file (truncation, bit flips, overwritten runs) and
# templates that differ from the file in one leaf: a CheckpointError naming the
# file or the leaf, or, for bytes the format never reads, the original content.
# Run with ``-s`` to see the case counts.
from collections import Counter  # noqa: E402

import optree  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from functional_fp16._util.tree import NAMESPACE  # noqa: E402
from tests import _bad_inputs  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "state.ckpt"
    state = _bad_inputs.trained()
    ff.save_checkpoint(path, {"state": state, "epoch": 4})
    return path.read_bytes(), state


def test_fuzz_truncated_and_tampered_checkpoints(checkpoint_bytes, tmp_path):
    data, state = checkpoint_bytes
    like = {"state": _bad_inputs.trained(), "epoch": 0}
    seen = Counter()
    path = tmp_path / "bad.ckpt"

    @_bad_inputs.FUZZ
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
        assert_bitwise_unchanged(out["state"], bit_snapshot(state))
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
    like = {"state": _bad_inputs.trained(), "epoch": 0}
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
