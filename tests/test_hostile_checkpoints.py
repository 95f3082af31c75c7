"""Hostile checkpoint files: forged, with checksums that match, refused cleanly and quickly.

Whoever can write a checkpoint can compute its checksum, so a file whose
checksum matches may still be built to hang the loader, make it allocate
far more than the file holds, drop data silently, or escape as a raw
exception. The cases of ``tests/_hostile_checkpoints.py`` are loaded in a
child process (a hang or a runaway allocation fails a test instead of the
run): each must raise the library's checkpoint error, within
:data:`SECONDS` and without the process's peak memory rising by more than
:data:`RSS_RISE_KIB`. Then targeted tests of the messages and of what is
still accepted, and a hypothesis test that mutates valid files at random,
each load of which must keep within the same bounds.
"""

from __future__ import annotations

import collections
import faulthandler
import io
import json
import math
import os
import pickle
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_paths
from functional_fp16.checkpoint import _read as _checkpoint_read
from functional_fp16.checkpoint import archive as _checkpoint_archive
from functional_fp16.checkpoint import format as fmt
from tests import _hostile_checkpoints as hostile
from tests.helpers import bits

ROOT = Path(__file__).resolve().parent.parent
SECONDS = 2.0  # per load
RSS_RISE_KIB = 16 * 1024  # forged files of 4-150 KB; unchecked, they expand to 39-117 MB
CHILD_SECONDS = 120  # for the child process loading all the cases

# What each refusal must say: the error type and a part of the message.
EXPECTED = {
    "v2_cycle": ("CheckpointCorruptError", "not a tree"),
    "v2_cycle_with_like": ("CheckpointCorruptError", "not a tree"),
    "v2_shared_2_40": ("CheckpointCorruptError", "not a tree"),
    "v2_shared_leaf_table": ("CheckpointCorruptError", "not a tree"),
    "v2_leaf_used_twice": ("CheckpointCorruptError", "leaf record 0 is used by two nodes"),
    "v2_tensor_used_twice": ("CheckpointCorruptError", "leaf ['b']: tensor 0 belongs to two"),
    "v2_shared_storage": ("CheckpointCorruptError", "share one storage"),
    "v2_duplicate_keys": ("CheckpointCorruptError", "checkpoint root: the key 'w' is stored twice"),
    "v2_equal_keys_of_two_types": (
        "CheckpointCorruptError",
        "checkpoint['opt']: the key True is stored twice",
    ),
    "v2_list_as_key": ("CheckpointCorruptError", "the key ['w'] of type list is not a plain"),
    "v2_list_as_key_with_like": ("CheckpointCorruptError", "the key ['w'] of type list"),
    "v2_scale_meta_list": ("CheckpointCorruptError", "checkpoint['scale']: malformed static"),
    "v2_scale_meta_str": ("CheckpointCorruptError", "checkpoint['scale']: malformed static"),
    "v2_scale_meta_mixed_keys": ("CheckpointCorruptError", "checkpoint['scale']: malformed"),
    "v2_scale_meta_nested": ("CheckpointCorruptError", "checkpoint['scale']: malformed"),
    "device_meta": ("CheckpointCorruptError", "leaf ['w']: stored on device 'meta'"),
    "device_hpu": ("CheckpointError", "checkpoint['w'] was saved on hpu, a device this torch"),
    "device_privateuseone": ("CheckpointError", "saved on privateuseone, a device this torch"),
    "device_not_a_str": ("CheckpointCorruptError", "device ['cpu'] is not a device name"),
    "stride_0_view": ("CheckpointCorruptError", "strides [0]"),
    "stride_0_huge": ("CheckpointCorruptError", "must own exactly its 4398046511104 bytes"),
    "view_of_a_larger_storage": ("CheckpointCorruptError", "at offset 5 of a 8192-byte storage"),
    "transposed_tensor": ("CheckpointCorruptError", "strides [1, 2]"),
    "huge_declared_shape": ("CheckpointCorruptError", "the tensor disagrees with its record"),
    "control_characters_in_path": (
        "CheckpointError",
        r"checkpoint['w']\n\x1b[31mERROR: all is lost\x1b[0m\r was saved on hpu",
    ),
    "control_characters_in_type": ("CheckpointMismatchError", r"holds a Evil\n\x1b[2J"),
    "control_characters_in_meta_key": (
        "CheckpointMismatchError",
        r"checkpoint['scale'].\x1b[2Jx\n does not match",
    ),
    "deep_nesting": ("CheckpointCorruptError", "nests deeper than 100 levels"),
    "unknown_kind": ("CheckpointCorruptError", "checkpoint['opt']: malformed structure node"),
    "none_with_children": ("CheckpointCorruptError", "checkpoint['opt'][1]: None with children"),
    "tensor_subclass": ("CheckpointCorruptError", "refers to torch._utils._rebuild_parameter"),
    "sparse_tensor": ("CheckpointCorruptError", "refers to torch._utils._rebuild_sparse_tensor"),
    "deflated_record": ("CheckpointCorruptError", "is compressed"),
    "overlapping_records": ("CheckpointCorruptError", "declare 39"),
    "legacy_format": ("CheckpointCorruptError", "not a zip archive"),
    "v1_list_contains_itself": ("CheckpointCorruptError", "not a tree"),
    "v1_shared_2_40": ("CheckpointCorruptError", "not a tree"),
    "v1_deep_nesting": ("CheckpointCorruptError", "nests deeper than 100 levels"),
    "v1_duplicate_keys": ("CheckpointCorruptError", "the key 'epoch' is stored twice"),
    "v1_list_as_key": ("CheckpointCorruptError", "the key ['note'] of type list"),
    "v1_malformed_config": ("CheckpointCorruptError", "malformed version-1 structure"),
    "v2_shared_text": ("CheckpointCorruptError", "counting each reference"),
    "v1_shared_text": ("CheckpointCorruptError", "counting each reference"),
    "bytearray_call": ("CheckpointCorruptError", "refers to builtins.bytearray"),
    "deeply_nested_tuple_key": ("CheckpointCorruptError", "nests tuples more than 16 deep"),
    "untyped_storage_call": ("CheckpointCorruptError", "calls torch.storage.UntypedStorage"),
    "ordered_dict_of_a_view": ("CheckpointCorruptError", "calls collections.OrderedDict with"),
    "tensor_in_the_header": ("CheckpointCorruptError", "holds a tensor outside its tensor table"),
    "storage_larger_than_its_record": (
        "CheckpointCorruptError",
        "declares a storage of 268435456 bytes (67108864 items of torch.FloatStorage) in the "
        "record data/0, which holds 24 bytes",
    ),
}


def test_every_forged_case_has_an_expectation():
    assert sorted(EXPECTED) == sorted(hostile.CASES)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Each case's row from one child process that loads them all (see the module docstring)."""
    directory = tmp_path_factory.mktemp("hostile")
    table = hostile.write_cases(directory, list(hostile.CASES))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests._hostile_checkpoints", str(directory)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=CHILD_SECONDS,
        )
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as timeout:
        out = timeout.stdout.decode() if isinstance(timeout.stdout, bytes) else timeout.stdout or ""
        err = "timed out"
    rows = {}
    for line in out.splitlines():
        row = json.loads(line)
        rows[row["case"]] = dict(row, file_bytes=table[row["case"]]["file_bytes"])
    return rows, err


@pytest.mark.parametrize("case", sorted(hostile.CASES))
def test_forged_file_is_refused_quickly_and_within_its_size(outcomes, case):
    rows, err = outcomes
    assert case in rows, f"no result: the loader hung or crashed on it or before it ({err[-2000:]})"
    row = rows[case]
    kind, fragment = EXPECTED[case]
    assert row["outcome"].startswith(f"{kind}: "), row["outcome"]
    assert fragment in row["outcome"], row["outcome"]
    assert f"{case}.ckpt: " in row["outcome"]  # the file is named
    assert row["seconds"] < SECONDS, row
    assert row["rss_rise_kib"] < RSS_RISE_KIB, row


def test_the_clean_file_loads_in_the_same_child_process(outcomes, tmp_path):
    """The cases differ from a file the loader takes only in what they forge."""
    rows, _ = outcomes
    assert rows, "the child process reported nothing"
    path = tmp_path / "clean.ckpt"
    path.write_bytes(hostile.clean_bytes())
    assert hostile.load_outcome(path, None) == "ok"
    assert hostile.load_outcome(path, hostile.clean_like()) == "ok"


# -- targeted ---------------------------------------------------------------------------


def _load(tmp_path, data: bytes, like=None, **kw):
    path = tmp_path / "forged.ckpt"
    path.write_bytes(data)
    return ff.load_checkpoint(path, like, **kw)


def _refusal(tmp_path, case: str, with_like: bool | None = None) -> str:
    """The message of the case's refusal, loaded with a template as the case says or as asked."""
    data, like = hostile.CASES[case]()
    like = like if with_like is None else with_like
    with pytest.raises(ff.CheckpointError) as info:
        _load(tmp_path, data, hostile.clean_like() if like else None)
    return str(info.value)


@pytest.mark.parametrize(
    "case",
    ["control_characters_in_path", "control_characters_in_type", "control_characters_in_meta_key"],
)
def test_messages_escape_the_control_characters_of_a_file(tmp_path, case):
    message = _refusal(tmp_path, case)
    assert message.isprintable(), repr(message)
    assert "\\x1b[" in message  # shown escaped, not sent to the terminal


def test_shown_text_is_escaped_and_cut():
    assert fmt.show("a\nb\x1b[2J\u202e") == "a\\nb\\x1b[2J\\u202e"
    assert fmt.show("ok ['w'] é") == "ok ['w'] é"
    assert fmt.show("x" * 500) == "x" * 120 + "..."
    assert fmt.show(10**5000).startswith("<int of ")
    assert fmt.show("k", quoted=True) == "'k'"


def test_stored_meta_device_is_refused_but_a_meta_template_still_loads(tmp_path):
    data, _ = hostile.case_device_meta()
    for like in (None, hostile.clean_like()):
        with pytest.raises(ff.CheckpointCorruptError, match=r"stored on device 'meta'"):
            _load(tmp_path, data, like)
    # The caller may still ask for meta tensors (shapes only), from a clean file.
    clean = hostile.clean_bytes()
    assert all(
        t.is_meta
        for t in tree_leaves(_load(tmp_path, clean, map_location="meta"))
        if torch.is_tensor(t)
    )


@pytest.mark.parametrize("device", ["hpu", "privateuseone", "hpu:0", "nonsense"])
def test_a_device_this_build_lacks_is_used_only_when_nothing_overrides_it(tmp_path, device):
    data, _ = hostile._device(device)
    with pytest.raises(
        ff.CheckpointError, match=r"checkpoint\['w'\] was saved on .* map_location="
    ):
        _load(tmp_path, data)
    expected = hostile.clean_tree()["w"]
    assert torch.equal(_load(tmp_path, data, map_location="cpu")["w"], expected)
    assert torch.equal(_load(tmp_path, data, hostile.clean_like())["w"], expected)


@pytest.mark.parametrize(
    "case", ["v2_duplicate_keys", "v2_equal_keys_of_two_types", "v1_duplicate_keys"]
)
def test_duplicate_keys_are_refused_not_dropped(tmp_path, case):
    assert "is stored twice" in _refusal(tmp_path, case)


@pytest.mark.parametrize(
    "case",
    ["v2_scale_meta_list", "v2_scale_meta_str", "v2_scale_meta_mixed_keys", "v2_list_as_key"],
)
def test_malformed_keys_and_configurations_are_checkpoint_errors_with_a_template(tmp_path, case):
    message = _refusal(tmp_path, case, with_like=True)
    assert "checkpoint['scale']: malformed static" in message or "of type list" in message


def test_save_refuses_a_tree_deeper_than_a_checkpoint_holds_and_loads_the_deepest(tmp_path):
    def nest(levels):
        tree = torch.ones(1)
        for _ in range(levels):
            tree = [tree]
        return tree

    ff.save_checkpoint(tmp_path / "deep.ckpt", nest(fmt.MAX_DEPTH))
    out = ff.load_checkpoint(tmp_path / "deep.ckpt", nest(fmt.MAX_DEPTH))
    assert torch.equal(tree_leaves(out)[0], torch.ones(1))
    with pytest.raises(ValueError, match=rf"nested deeper than {fmt.MAX_DEPTH} levels"):
        ff.save_checkpoint(tmp_path / "deeper.ckpt", nest(fmt.MAX_DEPTH + 1))


def test_a_file_object_is_checked_the_same_way(tmp_path):
    data, _ = hostile.case_stride_0_view()
    with pytest.raises(ff.CheckpointCorruptError, match="strides"):
        ff.load_checkpoint(io.BytesIO(data))
    out = ff.load_checkpoint(io.BytesIO(hostile.clean_bytes()), hostile.clean_like())
    assert out["name"] == "run" and torch.equal(out["w"], hostile.clean_tree()["w"])


def test_a_file_renamed_over_the_path_during_a_load_is_not_read(tmp_path, monkeypatch):
    """The file checked before ``torch.load`` is the file it reads: one handle, opened once."""
    path, other = tmp_path / "c.ckpt", tmp_path / "other.ckpt"
    path.write_bytes(hostile.clean_bytes())
    ff.save_checkpoint(other, {**hostile.clean_tree(), "epoch": 5})
    checked = _checkpoint_read.check_archive

    def check_then_rename_over(f, name):
        out = checked(f, name)
        os.replace(other, path)  # an atomic save of another checkpoint, now
        return out

    monkeypatch.setattr(_checkpoint_read, "check_archive", check_then_rename_over)
    assert ff.load_checkpoint(path, hostile.clean_like())["epoch"] == 4
    monkeypatch.undo()
    assert ff.load_checkpoint(path, hostile.clean_like())["epoch"] == 5


QUANTIZED = [torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4]
NOT_QUANTIZED_DTYPES = sorted(
    {v for v in list(vars(torch).values()) if isinstance(v, torch.dtype)} - set(QUANTIZED),
    key=str,
)


@pytest.mark.filterwarnings("ignore:.*support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", NOT_QUANTIZED_DTYPES, ids=str)
def test_every_dtype_torch_save_stores_passes_the_pickle_check(tmp_path, dtype):
    """The pickle's allow-list holds what torch.save writes for every dtype and rank."""
    tensors = {}
    for shape in [(), (0, 1, 2, 3), (5,), (2, 3), (4, 3, 2), (2, 1, 2, 1, 2)]:
        t = torch.empty(shape, dtype=dtype)
        raw = t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        raw.copy_(torch.arange(raw.numel()) % (2 if dtype == torch.bool else 256))
        tensors[str(shape)] = t
    try:
        torch.save(tensors, io.BytesIO())
    except Exception as err:  # noqa: BLE001 - some sub-byte dtypes have no storage format
        pytest.skip(f"torch.save cannot store {dtype}: {err}")
    ff.save_checkpoint(tmp_path / "d.ckpt", tensors)
    out = ff.load_checkpoint(tmp_path / "d.ckpt", tensors)
    for key, t in tensors.items():
        assert out[key].dtype == dtype and out[key].shape == t.shape
        assert torch.equal(out[key].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


class _Calls:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (pickle.dumps(_Calls(bytearray, (10,)), 2), "refers to builtins.bytearray"),
        (pickle.dumps(_Calls(set, ([1],)), 2), "refers to builtins.set"),
        (pickle.dumps(_Calls(getattr, (1, "real")), 2), "refers to builtins.getattr"),
        (b"\x80\x02cevil\x1b[2J\nname\n.", "refers to evil\\x1b[2J.name, which"),
        (
            pickle.dumps(_Calls(collections.OrderedDict, ([(1, 2)],)), 2),
            "calls collections.OrderedDict with arguments",
        ),
        (pickle.dumps(_Calls(torch.FloatStorage, (5,)), 2), "calls torch.FloatStorage, which"),
        (
            pickle.dumps(_Calls(torch._utils._rebuild_tensor_v2, (1, 2)), 2),
            "calls torch._utils._rebuild_tensor_v2 with arguments other than",
        ),
        (pickle.dumps({"a": 1}, 4), "uses the opcode FRAME (at byte 2)"),
        (b"\x80\x02(]q\x00e.", "a malformed pickle"),  # APPENDS to a list inside its mark
    ],
)
def test_the_pickle_may_name_and_call_only_what_checkpoints_use(data, message):
    with pytest.raises(ff.CheckpointCorruptError, match=re.escape(message)) as info:
        _checkpoint_archive.check_pickle(data, {}, "archive/", "f.ckpt")
    assert str(info.value).startswith("f.ckpt: ") and str(info.value).isprintable()


def test_a_truncated_pickle_is_unreadable_not_a_crash():
    data = pickle.dumps({"a": [1, 2, "x" * 50]}, protocol=2)
    for end in range(len(data) - 1):
        with pytest.raises(ff.CheckpointCorruptError, match="not a readable checkpoint"):
            _checkpoint_archive.check_pickle(data[:end], {}, "archive/", "f.ckpt")


def test_shared_strings_numbers_and_keys_are_charged_at_each_reference():
    """A value the pickle stores once counts at every reference, as ``repr`` writes it."""
    assert fmt.text_budget(1000) == 16 * 1000 + 2**20
    for shared in ["a" * 10**4, "\x1b" * 3000, 10**600, {"k" * 10**4: None}]:
        # 3000 references, as a pickle of some 15 KB would hold them
        payload = {
            "leaves": [shared] * 3000
            if type(shared) is not dict
            else [dict(shared) for _ in range(3000)]
        }
        with pytest.raises(ff.CheckpointCorruptError, match="counting each reference"):
            fmt.check_objects(payload, 15_000, "f.ckpt")
    fmt.check_objects({"leaves": ["a" * 100] * 3000}, 15_000, "f.ckpt")  # 312 KB of text


def test_a_long_string_held_in_many_places_saves_and_loads(tmp_path):
    """The writer stores a long str at each place, so what a file stands for stays in its bound."""
    key, value = "k" * 4096, "v" * 4096
    tree = {"values": [value] * 500, "dicts": [{key: None} for _ in range(500)]}
    ff.save_checkpoint(tmp_path / "s.ckpt", tree)
    assert ff.load_checkpoint(tmp_path / "s.ckpt") == tree
    assert ff.load_checkpoint(tmp_path / "s.ckpt", tree) == tree


# -- random mutations of valid files ------------------------------------------------------

JUNK = [
    None,
    True,
    0,
    -1,
    7,
    2**70,
    1.5,
    math.nan,
    "",
    "x\n\x1b[0m",
    "meta",
    "hpu",
    "LIST",
    "torch.float32",
    [],
    {},
    [0],
    [2**40],
    {"leaf": 0},
    {"a": 1},
    ["w"],
]
TENSOR_TRICKS = ["expand", "slice", "transpose", "share", "parameter", "empty_huge", "int64"]
MUTATIONS = [
    "junk",
    "share",
    "cycle",
    "duplicate_key",
    "tensor",
    "delete",
    "swap",
    # These leave a well-formed file, with other content or the same.
    "value",
    "rename",
    "reorder",
]
# What would make the loader allocate or write out far more than the file
# holds, unchecked: planted at a random place by the last test.
BOMBS = [
    "shared_text",  # a string referenced 2500 times: 20 MB of repr from a 10 KB pickle
    "call",  # a call the weights-only loader allows: bytearray(n) and the like
]
PLAIN = st.one_of(
    st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.sampled_from(["w", "b"])
)
BIG = 2**20  # elements: 4 MiB from a stride-0 view in a 4-12 KB file
CALLS = [
    (bytearray, (hostile.ALLOCATES,)),
    (torch.UntypedStorage, (hostile.ALLOCATES,)),
    (collections.OrderedDict, (torch.zeros(2).expand(2**16, 2),)),
]


def _sites(payload) -> list[tuple[object, object]]:
    """Every (container, key) slot of the payload's dicts and lists, tensors' slots included."""
    sites, seen, stack = [], set(), [payload]
    while stack:
        x = stack.pop()
        if id(x) in seen or not isinstance(x, (dict, list)):
            continue
        seen.add(id(x))
        for key in list(x) if isinstance(x, dict) else range(len(x)):
            sites.append((x, key))
            stack.append(x[key])
    return sites


def _trick(kind: str, t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    if kind == "expand":
        return t.reshape(-1)[:1].expand(BIG)
    if kind == "slice":
        return torch.cat([t.reshape(-1), t.reshape(-1)])[1 : 1 + t.numel()]
    if kind == "transpose":
        return t.reshape(-1, 1).expand(-1, 2).t()
    if kind == "share":
        return other
    if kind == "parameter":
        return torch.nn.Parameter(t.float())
    if kind == "empty_huge":
        return torch.zeros(2**40, 0)
    return t.to(torch.int64)


def _nodes(payload) -> list[dict]:
    """The structure's nodes (either format), found without recursion, cycles and all."""
    root = payload.get("structure", payload.get("tree")) if isinstance(payload, dict) else None
    nodes, seen, stack = [], set(), [root]
    while stack:
        x = stack.pop()
        if not isinstance(x, dict) or id(x) in seen:
            continue
        seen.add(id(x))
        nodes.append(x)
        for key in ("children", "items", "values"):
            if isinstance(x.get(key), list):
                stack.extend(x[key])
        if isinstance(x.get("fields"), dict):
            stack.extend(x["fields"].values())
    return nodes


def _mutate(payload, data, n: int) -> list[str]:
    """Applies ``n`` drawn mutations to ``payload``; returns their kinds."""
    kinds = []
    for _ in range(n):
        kind = data.draw(st.sampled_from(MUTATIONS))
        kinds.append(kind)
        sites = _sites(payload)
        nodes = _nodes(payload)
        pick = data.draw(st.integers(0, 10**6))
        box, key = sites[pick % len(sites)]
        if kind == "junk":
            box[key] = data.draw(st.sampled_from(JUNK))
        elif kind in ("share", "swap"):
            other_box, other_key = sites[data.draw(st.integers(0, 10**6)) % len(sites)]
            if kind == "share":
                box[key] = other_box[other_key]
            else:
                box[key], other_box[other_key] = other_box[other_key], box[key]
        elif kind == "cycle":
            box[key] = box
        elif kind in ("duplicate_key", "rename"):
            keyed = [
                node[name]
                for node in nodes
                for name in ("entries", "keys")
                if isinstance(node.get(name), list) and len(node[name]) >= 2
            ]
            if keyed:
                target = keyed[pick % len(keyed)]
                target[1] = target[0] if kind == "duplicate_key" else data.draw(PLAIN)
        elif kind == "value":
            leaves = payload.get("leaves") if isinstance(payload, dict) else None
            holders = [
                x for x in (leaves if isinstance(leaves, list) else nodes) if isinstance(x, dict)
            ]
            holders = [x for x in holders if "value" in x and x.get("value") is not None]
            if holders:
                holders[pick % len(holders)]["value"] = data.draw(PLAIN)
        elif kind == "reorder":
            _swap_leaf_records(payload, nodes, pick, data.draw(st.integers(0, 10**6)))
        elif kind == "tensor":
            tensors = payload.get("tensors") if isinstance(payload, dict) else None
            if isinstance(tensors, list) and tensors:
                i = pick % len(tensors)
                other = tensors[(i + 1) % len(tensors)]
                if not isinstance(tensors[i], torch.Tensor):
                    continue
                other = other if isinstance(other, torch.Tensor) else tensors[i]
                trick = data.draw(st.sampled_from(TENSOR_TRICKS))
                tensors[i] = _trick(trick, tensors[i], other)
                if data.draw(st.booleans()):  # the records follow the tensor, or not
                    _follow(payload, i)
        elif isinstance(box, dict):
            del box[key]
        else:
            box.pop(key)
    return kinds


def _plant(payload, bomb: str, data) -> None:
    """Puts a :data:`BOMBS` entry in place of a random slot of the payload."""
    sites = _sites(payload)
    box, key = sites[data.draw(st.integers(0, 10**6)) % len(sites)]
    if bomb == "shared_text":
        box[key] = ["t" * 4096] * 2500
    else:
        box[key] = hostile.Reduces(*data.draw(st.sampled_from(CALLS)))


def _swap_leaf_records(payload, nodes, i: int, j: int) -> None:
    """Swaps two format-2 leaf records and the nodes' references to them: the same content."""
    leaves = payload.get("leaves") if isinstance(payload, dict) else None
    if payload.get("version") != 2 or not isinstance(leaves, list) or len(leaves) < 2:
        return
    i, j = i % len(leaves), j % len(leaves)
    leaves[i], leaves[j] = leaves[j], leaves[i]
    for node in nodes:
        if node.get("leaf") in (i, j) and type(node.get("leaf")) is int:
            node["leaf"] = i + j - node["leaf"]


def _follow(payload, i: int) -> None:
    """Makes the leaf records of tensor ``i`` (either format) describe it."""
    t = payload["tensors"][i]
    records = payload.get("leaves") or payload.get("tensor_info") or []
    for j, rec in enumerate(records if isinstance(records, list) else []):
        if not isinstance(rec, dict):
            continue
        if (rec.get("tensor") == i) if "leaves" in payload else (j == i):
            rec["dtype"], rec["shape"] = str(t.dtype), list(t.shape)


def _checksummed(payload) -> bytes:
    try:
        return hostile.forge(payload)
    except Exception:  # nothing the checksum can be computed over: a wrong one
        return hostile.forge(payload, checksum="0" * 64)


def _owned_bytes(tree) -> int:
    total = 0
    for t in tree_leaves(tree):
        if torch.is_tensor(t):
            storage = t.untyped_storage()
            assert t.storage_offset() == 0 and storage.nbytes() == t.numel() * t.element_size()
            total += storage.nbytes()
    return total


def _assert_same(a, b) -> None:
    assert tree_paths(a) == tree_paths(b)
    for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True):
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
        else:
            assert type(x) is type(y) and (x == y or x != x and y != y)


def _record_bytes(data: bytes) -> int:
    """The bytes of a file's tensor records (``.../data/N``)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)


def _load_or_refuse(path: Path, like):
    try:
        return ff.load_checkpoint(path, like)
    except ff.CheckpointError as err:
        return err


def _check_load(path: Path, like, size: int, stats: dict, same_as=None) -> None:
    start = time.perf_counter()
    out, rise = hostile.peak_rise_kib(lambda: _load_or_refuse(path, like))
    assert time.perf_counter() - start < SECONDS
    assert rise < RSS_RISE_KIB, f"the load's peak memory rose {rise} KiB ({out!r:.300})"
    if isinstance(out, ff.CheckpointError):
        stats["refused"] += 1
        return
    stats["loaded"] += 1
    # No more tensor bytes than the file's tensor records hold, each tensor
    # with storage of its own ...
    assert _owned_bytes(out) <= size
    # ... and exactly what a clean file of the same content loads.
    clean = path.with_suffix(".clean")
    ff.save_checkpoint(clean, out)
    _assert_same(out, ff.load_checkpoint(clean, like))
    if same_as is not None:  # the content was not changed: the original file's
        _assert_same(out, ff.load_checkpoint(same_as, like))
        stats["same as the original"] += 1


def test_mutated_files_with_valid_checksums_load_exactly_or_are_refused(tmp_path):
    originals = {"v2": tmp_path / "clean_v2.ckpt", "v1": hostile.V1_FILE}
    originals["v2"].write_bytes(hostile.clean_bytes())
    likes = {"v2": [None, hostile.clean_like()], "v1": [None]}
    stats = {"loaded": 0, "refused": 0, "same as the original": 0}
    path = tmp_path / "mutated.ckpt"

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        version=st.sampled_from(sorted(originals)),
        trick=st.none() | st.sampled_from(TENSOR_TRICKS),
        which=st.integers(0, 2),
        n=st.integers(0, 3),
        data=st.data(),
    )
    def case(version, trick, which, n, data):
        payload = hostile.raw(originals[version].read_bytes())
        if trick is not None:  # one tensor trick, its records made to agree
            tensors = payload["tensors"]
            tensors[which] = _trick(trick, tensors[which], tensors[(which + 1) % len(tensors)])
            _follow(payload, which)
        kinds = _mutate(payload, data, n) + ([trick] if trick else [])
        forged = _checksummed(payload)
        path.write_bytes(forged)
        same = originals[version] if set(kinds) == {"reorder"} else None
        for like in likes[version]:
            _check_load(path, like, _record_bytes(forged), stats, same)

    # A hang is reported with every thread's traceback instead of waiting forever.
    faulthandler.dump_traceback_later(240, exit=True)
    try:
        case()
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"\n[mutated checkpoints] {stats}")
    assert stats["refused"] >= 50 and stats["loaded"] >= 20 and stats["same as the original"] >= 2


def test_planted_bombs_are_refused_within_the_bounds(tmp_path):
    """A :data:`BOMBS` entry anywhere in a valid file of either format, with a valid checksum."""
    originals = {"v2": tmp_path / "clean_v2.ckpt", "v1": hostile.V1_FILE}
    originals["v2"].write_bytes(hostile.clean_bytes())
    path = tmp_path / "planted.ckpt"
    stats = {"loaded": 0, "refused": 0}

    @settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(version=st.sampled_from(sorted(originals)), bomb=st.sampled_from(BOMBS), data=st.data())
    def case(version, bomb, data):
        payload = hostile.raw(originals[version].read_bytes())
        _plant(payload, bomb, data)
        forged = _checksummed(payload)
        path.write_bytes(forged)
        _check_load(path, None, _record_bytes(forged), stats)

    case()
    assert stats["loaded"] == 0 and stats["refused"] >= 20, stats
