"""Forged checkpoint files for tests/test_hostile_checkpoints.py.

Each forgery starts from a clean file written by ``save_checkpoint`` (or the
format-1 file in ``tests/data``), changes what ``torch.load(weights_only=True)``
gives back, and writes it again with ``torch.save``, with a checksum computed
the way the loader computes it wherever one can be computed: whoever can
write a file can compute its checksum, so the checksum proves nothing.

:func:`write_cases` writes the cases' files into a folder;
``python -m tests._hostile_checkpoints FOLDER`` then loads them, one after
another, in a fresh process, and prints one JSON line per case: the outcome,
the seconds the load took and how far the process's peak resident memory
rose (:func:`peak_rise_kib`). The tests run it in a subprocess, so that a
load that hangs or allocates gigabytes fails the test instead of taking the
run down.
"""

from __future__ import annotations

import collections
import copy
import functools
import io
import json
import resource
import struct
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import functional_fp16 as ff
from functional_fp16.checkpoint import format as fmt

V1_FILE = Path(__file__).parent / "data" / "checkpoint_v1.ckpt"


def clean_tree() -> dict[str, Any]:
    """A small tree with every kind of node and leaf the format stores."""
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(2, 3, generator=g),
        "b": torch.arange(3, dtype=torch.float16),
        "epoch": 4,
        "name": "run",
        "scale": ff.DynamicLossScale(2.0**8, growth_interval=5),
        "opt": [torch.ones(2, dtype=torch.int32), None, (1.5, True)],
    }


def clean_like() -> dict[str, Any]:
    """A template for :func:`clean_tree`: same structure, other values."""
    return {
        "w": torch.zeros(2, 3),
        "b": torch.zeros(3, dtype=torch.float16),
        "epoch": 0,
        "name": "",
        "scale": ff.DynamicLossScale(2.0**8, growth_interval=5),
        "opt": [torch.zeros(2, dtype=torch.int32), None, (0.0, False)],
    }


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def clean_bytes() -> bytes:
    """The bytes ``save_checkpoint`` writes for :func:`clean_tree`."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "clean.ckpt"
        ff.save_checkpoint(path, clean_tree())
        return path.read_bytes()


def raw(data: bytes) -> dict[str, Any]:
    """What ``torch.load(weights_only=True)`` gives for ``data``."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _dense(tensors: list[Any]) -> list[Any]:
    """The tensors as a loader that materialised them would hash them."""
    out = []
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = (t.to_dense() if t.layout != torch.strided else t.contiguous()).detach()
        out.append(t)
    return out


def v2_checksum(payload: dict[str, Any]) -> str:
    """The checksum the loader computes for a format-2 payload."""
    header = (fmt.FORMAT, 2, payload["structure"], payload["leaves"])
    return fmt.checksum(header, _dense(payload["tensors"]))


def v1_checksum(payload: dict[str, Any]) -> str:
    """The checksum the loader computes for a format-1 payload."""
    header = (fmt.FORMAT, 1, payload["tree"], payload["tensor_info"])
    return fmt.checksum(header, _dense(payload["tensors"]))


def forge(payload: dict[str, Any], checksum: str | None = "valid") -> bytes:
    """``payload`` saved with a valid checksum (``"valid"``), or the given one, or as it is (``None``)."""
    payload = dict(payload)
    if checksum is None:
        return to_bytes(payload)
    if checksum == "valid":
        checksum = v2_checksum(payload) if payload.get("version") == 2 else v1_checksum(payload)
    payload["checksum"] = checksum
    return to_bytes(payload)


def leaf_index(payload: dict[str, Any], path: str) -> int:
    return next(i for i, leaf in enumerate(payload["leaves"]) if leaf["path"] == path)


def child(payload: dict[str, Any], key: Any) -> dict[str, Any]:
    """The structure node of the root dict's entry ``key``."""
    root = payload["structure"]
    return root["children"][root["entries"].index(key)]


def rezip(data: bytes, edit: Callable[[dict[str, bytes]], None], **zip_kw: Any) -> bytes:
    """``data``'s zip archive with its records edited by ``edit`` (a dict name -> bytes)."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        records = {n: z.read(n) for n in z.namelist()}
    edit(records)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", **zip_kw) as z:
        for name, body in records.items():
            z.writestr(name, body)
    return out.getvalue()


def shared_chain(depth: int, bottom: Any, make: Callable[[Any], Any]) -> Any:
    """``depth`` levels, each node holding the one below twice: 2**depth paths."""
    node = bottom
    for _ in range(depth):
        node = make(node)
    return node


# -- the cases ---------------------------------------------------------------------
# Each returns (file bytes, whether to load with like=clean_like()). Every one
# must be refused with a CheckpointError.


def case_v2_cycle():
    p = raw(clean_bytes())
    opt = child(p, "opt")
    opt["children"].append(opt)
    opt["entries"].append(3)
    return forge(p), False


def case_v2_cycle_with_like():
    p = raw(clean_bytes())
    opt = child(p, "opt")
    opt["children"][1] = opt  # where like holds None
    return forge(p), True


def case_v2_shared_2_40():
    p = raw(clean_bytes())
    bottom = {"leaf": 0}
    top = shared_chain(
        40,
        bottom,
        lambda n: {"type": "list", "kind": "LIST", "entries": [0, 1], "children": [n, n]},
    )
    p["structure"]["children"][0] = top
    return forge(p, checksum="0" * 64), False


def case_v2_shared_leaf_table():
    p = raw(clean_bytes())
    p["leaves"] = [p["leaves"][0]] * len(p["leaves"])
    return forge(p), False


def case_v2_leaf_used_twice():
    p = raw(clean_bytes())
    w = p["structure"]["children"][0]
    child(p, "b")["leaf"] = w["leaf"]
    return forge(p), False


def case_v2_tensor_used_twice():
    p = raw(clean_bytes())
    i = leaf_index(p, "['b']")
    p["leaves"][i] = copy.deepcopy(p["leaves"][leaf_index(p, "['w']")])
    p["leaves"][i]["path"] = "['b']"
    return forge(p), False


def case_v2_shared_storage():
    """Two leaves whose tensors are one tensor: its bytes would be restored twice."""
    p = raw(clean_bytes())
    w, b = p["leaves"][leaf_index(p, "['w']")], p["leaves"][leaf_index(p, "['b']")]
    t = p["tensors"][w["tensor"]]
    p["tensors"][b["tensor"]] = t
    b["dtype"], b["shape"] = str(t.dtype), list(t.shape)
    return forge(p), False


def case_v2_duplicate_keys():
    p = raw(clean_bytes())
    root = p["structure"]
    root["entries"][root["entries"].index("b")] = "w"
    return forge(p), False


def case_v2_equal_keys_of_two_types():
    p = raw(clean_bytes())
    opt = child(p, "opt")
    opt["type"], opt["kind"] = "dict", "DICT"
    opt["entries"] = [1, True, 1.0]
    return forge(p), False


def case_v2_list_as_key():
    p = raw(clean_bytes())
    p["structure"]["entries"][0] = ["w"]
    return forge(p), False


def case_v2_list_as_key_with_like():
    p = raw(clean_bytes())
    p["structure"]["entries"][0] = ["w"]
    return forge(p), True


def case_v2_scale_meta_list():
    p = raw(clean_bytes())
    child(p, "scale")["meta"] = [1, 2]
    return forge(p), True


def case_v2_scale_meta_str():
    p = raw(clean_bytes())
    child(p, "scale")["meta"] = "growth_interval"
    return forge(p), True


def case_v2_scale_meta_mixed_keys():
    p = raw(clean_bytes())
    meta = child(p, "scale")["meta"]
    meta[7] = meta.pop("growth_interval")
    return forge(p), True


def case_v2_scale_meta_nested():
    p = raw(clean_bytes())
    child(p, "scale")["meta"]["growth_interval"] = {"a": [1]}
    return forge(p), True


def _device(device: Any, like: bool = False):
    p = raw(clean_bytes())
    p["leaves"][leaf_index(p, "['w']")]["device"] = device
    return forge(p), like


def case_device_meta():
    return _device("meta")


def case_device_hpu():
    return _device("hpu")


def case_device_privateuseone():
    return _device("privateuseone")


def case_device_not_a_str():
    return _device(["cpu"])


def case_stride_0_view():
    """A 4-byte storage viewed as 2**24 floats: 64 MiB from a 4 KB file."""
    p = raw(clean_bytes())
    i = leaf_index(p, "['w']")
    n = 2**24
    p["tensors"][p["leaves"][i]["tensor"]] = torch.zeros(1).expand(n)
    p["leaves"][i]["shape"] = [n]
    return forge(p), False


def case_stride_0_huge():
    """2**40 float32 elements on a 4-byte storage: no valid checksum can be computed."""
    p = raw(clean_bytes())
    i = leaf_index(p, "['w']")
    n = 2**40
    p["tensors"][p["leaves"][i]["tensor"]] = torch.zeros(1).expand(n)
    p["leaves"][i]["shape"] = [n]
    return forge(p, checksum="0" * 64), False


def case_view_of_a_larger_storage():
    p = raw(clean_bytes())
    i = leaf_index(p, "['b']")
    big = torch.arange(4096, dtype=torch.float16)
    p["tensors"][p["leaves"][i]["tensor"]] = big[5:8]
    return forge(p), False


def case_transposed_tensor():
    p = raw(clean_bytes())
    i = leaf_index(p, "['w']")
    t = p["tensors"][p["leaves"][i]["tensor"]]
    p["tensors"][p["leaves"][i]["tensor"]] = t.reshape(3, 2).t()
    return forge(p), False


def case_huge_declared_shape():
    p = raw(clean_bytes())
    p["leaves"][leaf_index(p, "['w']")]["shape"] = [2**40]
    return forge(p), False


def case_control_characters_in_path():
    p = raw(clean_bytes())
    i = leaf_index(p, "['w']")
    p["leaves"][i]["path"] = "['w']\n\x1b[31mERROR: all is lost\x1b[0m\r"
    p["leaves"][i]["device"] = "hpu"
    return forge(p), False


def case_control_characters_in_type():
    p = raw(clean_bytes())
    child(p, "scale")["type"] = "Evil\n\x1b[2J"
    return forge(p), True


def case_control_characters_in_meta_key():
    p = raw(clean_bytes())
    child(p, "scale")["meta"]["\x1b[2Jx\n"] = 1
    return forge(p), True


DEEP = 3000  # levels: past Python's recursion limit, within what pickle writes


def deep_bytes(payload: dict[str, Any]) -> bytes:
    """``torch.save`` of a payload nested :data:`DEEP` levels deep."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * DEEP + 1000))
    try:
        return forge(payload, checksum=None)
    finally:
        sys.setrecursionlimit(limit)


def case_deep_nesting():
    p = raw(clean_bytes())
    node = {"leaf": 0}
    for _ in range(DEEP):
        node = {"type": "list", "kind": "LIST", "entries": [0], "children": [node]}
    p["structure"]["children"][0] = node
    p["checksum"] = "0" * 64  # repr() of the header would need the recursion limit raised
    return deep_bytes(p), False


def case_unknown_kind():
    p = raw(clean_bytes())
    child(p, "opt")["kind"] = "SET"
    return forge(p), False


def case_none_with_children():
    p = raw(clean_bytes())
    none = child(p, "opt")["children"][1]
    none["entries"], none["children"] = [0], [{"leaf": 0}]
    return forge(p), False


def case_tensor_subclass():
    p = raw(clean_bytes())
    i = p["leaves"][leaf_index(p, "['w']")]["tensor"]
    p["tensors"][i] = torch.nn.Parameter(p["tensors"][i])
    return forge(p), False


def case_sparse_tensor():
    p = raw(clean_bytes())
    i = leaf_index(p, "['w']")
    p["tensors"][p["leaves"][i]["tensor"]] = torch.sparse_coo_tensor(
        torch.zeros(2, 1, dtype=torch.int64), torch.ones(1), (64, 64), check_invariants=True
    )
    p["leaves"][i]["shape"] = [64, 64]
    return forge(p), False


def case_deflated_record():
    """A stored record compressed 1000:1: a small file that inflates to 64 MiB."""
    data = clean_bytes()
    p = raw(data)
    i = p["leaves"][leaf_index(p, "['w']")]["tensor"]
    p["tensors"][i] = torch.zeros(2**24)
    p["leaves"][leaf_index(p, "['w']")]["shape"] = [2**24]
    return rezip(forge(p), lambda records: None, compression=zipfile.ZIP_DEFLATED), False


def write_zip(records: dict[str, bytes], aliases: dict[str, str]) -> bytes:
    """A stored zip archive of ``records``, plus a directory entry ``alias`` for each
    ``aliases[alias]``: a second name for that record's bytes."""
    out, directory, at = bytearray(), bytearray(), {}
    for name, body in records.items():
        n, crc = name.encode(), zlib.crc32(body)
        at[name] = (len(out), crc, len(body))
        out += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, crc, len(body), len(body), len(n), 0
        )
        out += n + body
    entries = [(name, name) for name in records] + list(aliases.items())
    for name, target in entries:
        offset, crc, size = at[target]
        n = name.encode()
        directory += struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            20,
            20,
            0,
            0,
            0,
            0,
            crc,
            size,
            size,
            len(n),
            0,
            0,
            0,
            0,
            0,
            offset,
        )
        directory += n
    end = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries), len(directory), len(out), 0
    )
    return bytes(out + directory + end)


def case_overlapping_records():
    """300 tensors of 128 KiB whose records are one record's bytes under 300 names:
    39 MB from a 150 KB file (torch.load alone reads it)."""
    p = raw(clean_bytes())
    n, size = 300, 2**15
    p["structure"]["children"][0] = {
        "type": "list",
        "kind": "LIST",
        "entries": list(range(n)),
        "children": [{"leaf": len(p["leaves"]) + i} for i in range(n)],
    }
    first = len(p["tensors"])
    p["leaves"] += [
        {
            "path": f"['w'][{i}]",
            "tensor": first + i,
            "dtype": "torch.float32",
            "shape": [size],
            "device": "cpu",
        }
        for i in range(n)
    ]
    p["tensors"] += [torch.zeros(size) for _ in range(n)]
    data = forge(p)
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        records = {info.filename: z.read(info.filename) for info in z.infolist()}
    prefix = next(name for name in records if name.endswith("/data.pkl"))[: -len("data.pkl")]
    keys = [f"{prefix}data/{first + i}" for i in range(n)]
    kept = {name: body for name, body in records.items() if name not in keys[1:]}
    return write_zip(kept, {alias: keys[0] for alias in keys[1:]}), False


def case_legacy_format():
    """The pre-zip torch.save format, which declares its storages' sizes itself."""
    buf = io.BytesIO()
    torch.save(raw(clean_bytes()), buf, _use_new_zipfile_serialization=False)
    return buf.getvalue(), False


def _v1() -> dict[str, Any]:
    return torch.load(V1_FILE, weights_only=True)


def case_v1_list_contains_itself():
    p = _v1()
    history = p["tree"]["values"][p["tree"]["keys"].index("history")]
    history["items"].append(history)
    return forge(p), False


def case_v1_shared_2_40():
    p = _v1()
    bottom = {"kind": "value", "value": 1}
    top = shared_chain(40, bottom, lambda n: {"kind": "list", "items": [n, n]})
    p["tree"]["values"][p["tree"]["keys"].index("history")] = top
    return forge(p, checksum="0" * 64), False


def case_v1_deep_nesting():
    p = _v1()
    node = {"kind": "value", "value": 1}
    for _ in range(DEEP):
        node = {"kind": "list", "items": [node]}
    p["tree"]["values"][p["tree"]["keys"].index("history")] = node
    p["checksum"] = "0" * 64
    return deep_bytes(p), False


def case_v1_duplicate_keys():
    p = _v1()
    keys = p["tree"]["keys"]
    keys[keys.index("note")] = "epoch"
    return forge(p), False


def case_v1_list_as_key():
    p = _v1()
    keys = p["tree"]["keys"]
    keys[keys.index("note")] = ["note"]
    return forge(p), False


def case_v1_malformed_config():
    p = _v1()
    static = p["tree"]["values"][p["tree"]["keys"].index("static")]
    static["config"] = [["a", "b", "c"]]
    return forge(p), False


class Reduces:
    """Pickles as ``fn(*args)``: a call that ``torch.load(weights_only=True)`` may make."""

    def __init__(self, fn: Any, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple]:
        return self.fn, self.args

    def __repr__(self) -> str:
        return f"Reduces({getattr(self.fn, '__name__', self.fn)})"


ALLOCATES = 2**26  # bytes the calls below ask for: 64 MiB from a 4 KB file


def _calls(fn: Any, args: tuple):
    p = raw(clean_bytes())
    p["leaves"][leaf_index(p, "['epoch']")]["value"] = Reduces(fn, args)
    return forge(p, checksum="0" * 64), False


def case_bytearray_call():
    """``bytearray(64 MiB)``: the weights-only loader allows it."""
    return _calls(bytearray, (ALLOCATES,))


def case_untyped_storage_call():
    """A storage class the format uses, called to allocate instead of naming a record."""
    return _calls(torch.UntypedStorage, (ALLOCATES,))


def case_ordered_dict_of_a_view():
    """``OrderedDict(view)`` iterates a stride-0 view of 8 bytes: 2**16 rows, each two tensors."""
    return _calls(collections.OrderedDict, (torch.zeros(2).expand(2**16, 2),))


def case_tensor_in_the_header():
    """A 128 KB tensor as a value: the checksum's ``repr`` would print all 2**17 elements."""
    p = raw(clean_bytes())
    p["leaves"][leaf_index(p, "['epoch']")]["value"] = torch.zeros([2] * 17, dtype=torch.uint8)
    return forge(p, checksum="0" * 64), False


def case_storage_larger_than_its_record():
    """The pickle declares 2**26 floats for the 24-byte record of ``w``."""

    def edit(records: dict[str, bytes]) -> None:
        name = next(n for n in records if n.endswith("/data.pkl"))
        pickle = records[name]
        numel = b"K\x06t"  # BININT1 6, then the TUPLE that ends w's storage reference
        assert pickle.count(numel) == 1
        records[name] = pickle.replace(numel, b"J" + (2**26).to_bytes(4, "little") + b"t")

    return rezip(clean_bytes(), edit), False


SHARED_TEXT = "a" * 10**4
SHARED_TIMES = 5000  # references to one 10 KB string: 50 MB of text from a 24-32 KB file


def case_v2_shared_text():
    """One string referenced 5000 times: what the checksum's ``repr`` would write out."""
    p = raw(clean_bytes())
    p["leaves"] = [SHARED_TEXT] * SHARED_TIMES
    return forge(p, checksum="0" * 64), False


def case_v1_shared_text():
    p = _v1()
    history = p["tree"]["values"][p["tree"]["keys"].index("history")]
    history["items"] = [{"kind": "value", "value": [SHARED_TEXT] * SHARED_TIMES}]
    return forge(p, checksum="0" * 64), False


def case_deeply_nested_tuple_key():
    """A dict keyed by a tuple nested 300,000 deep (1 MB): hashing it while unpickling
    recurses in C and crashes the process."""

    def edit(records: dict[str, bytes]) -> None:
        name = next(n for n in records if n.endswith("/data.pkl"))
        # PROTO 2, EMPTY_DICT, the key: EMPTY_TUPLE then TUPLE1 300,000 times, NONE, SETITEM, STOP
        records[name] = b"\x80\x02}" + b")" + b"\x85" * 300_000 + b"Ns."

    return rezip(clean_bytes(), edit), False


CASES: dict[str, Callable[[], tuple[bytes, bool]]] = {
    name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}


def write_cases(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Writes the named cases' files, and ``cases.json`` listing them, into ``directory``."""
    table = {}
    for name in names:
        data, like = CASES[name]()
        path = directory / f"{name}.ckpt"
        path.write_bytes(data)
        table[name] = {"file": str(path), "like": like, "file_bytes": len(data)}
    (directory / "clean.ckpt").write_bytes(clean_bytes())
    (directory / "cases.json").write_text(json.dumps(table))
    return table


def load_outcome(path: Path, like: Any) -> str:
    """``"ok"``, ``"<ErrorType>: message"`` for a checkpoint error, or ``"RAW <Type>: ..."``."""
    try:
        ff.load_checkpoint(path, like)
    except ff.CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    except BaseException as err:  # noqa: BLE001 - reported, not hidden
        return f"RAW {type(err).__name__}: {str(err)[:300]}"
    return "ok"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def peak_rise_kib(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), how far this process's peak resident memory rose above its current one)``.

    On Linux the peak is reset first (``/proc/self/clear_refs``), so that an
    earlier, larger peak does not hide this one. Elsewhere the rise is that of
    ``ru_maxrss``, which only shows a peak above every earlier one.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak (VmHWM) to the current resident size
        before = _status_kib("VmRSS")
        out = fn()
        return out, _status_kib("VmHWM") - before
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = fn()
        return out, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before


def _main(directory: Path) -> None:
    torch.set_num_threads(1)
    table = json.loads((directory / "cases.json").read_text())
    for like in (None, clean_like()):  # warm up: lazy imports, allocator pools
        assert load_outcome(directory / "clean.ckpt", like) == "ok"
    for name, case in table.items():
        like = clean_like() if case["like"] else None
        start = time.perf_counter()
        outcome, rise = peak_rise_kib(lambda: load_outcome(Path(case["file"]), like))  # noqa: B023
        row = {
            "case": name,
            "outcome": outcome,
            "seconds": time.perf_counter() - start,
            "rss_rise_kib": rise,
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
