"""Worker side of the forged-file tests of ``tests/test_sharded_checkpoints.py``: one process, one rank.

Run as ``python -m tests._forged_sharded_checkpoints OUT_DIR`` with the
``torchrun`` variables (a world of one) and ``FF_SCKPT_DIR`` set; the
scenarios named in ``FF_SCKPT_SCENARIOS`` write ``OUT_DIR/<scenario>_rank0.pt``
(or ``.err``). Each saves nothing new but copies one small checkpoint
(``bucket_bytes=16``, so DCP holds hundreds of chunks) and forges the copy:
DCP's ``.metadata`` naming globals, byte ranges outside the data, a
decompressing transform, a chunk whose pickle allocates, a marker whose
texts hold control characters or megabytes, and, last because it crashes a
plain unpickler, a ``.metadata`` whose dict key is a tuple nested 300 000 deep.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import sys
import time
import zipfile
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from functional_fp16 import distributed as ffd
from tests import _sharded_checkpoint_workers as W
from tests._launch import error_of, run_scenarios

NESTING = 300_000  # tuple levels: hashing them overflows the C stack of an 8 MiB main thread


class Call:
    """Pickles as ``fn(*args)``: what a forged file would make a plain unpickler run."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _base() -> str:
    """The checkpoint every case forges a copy of (saved once)."""
    path = W.ckpt("base")
    if not os.path.exists(path):
        tree = {"state": ffd.shard_state(W.make_state()), "epoch": 3}
        ffd.save_checkpoint_sharded(path, tree, bucket_bytes=16)
    return path


def _copy(case: str) -> tuple[str, str]:
    """A fresh copy of the base checkpoint, and its DCP folder."""
    path = W.ckpt(case)
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(_base(), path)
    folder = next(n for n in os.listdir(path) if n.startswith("step-"))
    return path, os.path.join(path, folder)


def _metadata(folder: str) -> Any:
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own, unforged file


def _write_metadata(folder: str, data: bytes) -> None:
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(data)


def _load(path: str) -> str | None:
    return error_of(lambda: ffd.load_checkpoint_sharded(path, W.like()))


def _forge_metadata(case: str, change) -> str | None:
    """Loads a copy whose metadata ``change(metadata, folder)`` edited in place."""
    path, folder = _copy(case)
    md = _metadata(folder)
    change(md, folder)
    _write_metadata(folder, pickle.dumps(md))
    return _load(path)


def _first_chunk(md: Any) -> MetadataIndex:
    return next(k for k in md.storage_data if k.fqn == "['state'].master['w1']")


def scenario_forged_globals(rank: int, out: str) -> dict[str, Any]:
    """``.metadata`` files whose pickle calls ``os.mkdir``, ``builtins.eval``, ``os.system``."""
    evidence = {n: os.path.join(out, f"ran_{n}") for n in ("mkdir", "eval", "system")}
    calls = {
        "mkdir": Call(os.mkdir, evidence["mkdir"]),
        "eval": Call(eval, f"__import__('os').mkdir({evidence['eval']!r})"),
        "system": Call(os.system, f"mkdir {evidence['system']}"),
    }
    result = {}
    for name, call in calls.items():

        def plant(md, folder, call=call):
            md.planner_data = call

        error = _forge_metadata(f"global_{name}", plant)
        result[name] = (error, os.path.exists(evidence[name]))
    return result


def _append_chunk(folder: str, md: Any, key: MetadataIndex, data: bytes) -> None:
    """Appends ``data`` to the chunk's data file and points the chunk's record at it."""
    info = md.storage_data[key]
    name = os.path.join(folder, info.relative_path)
    info.offset, info.length = os.path.getsize(name), len(data)
    with open(name, "ab") as f:
        f.write(data)


def _allocating_chunk(nbytes: int) -> bytes:
    """A ``torch.save`` container whose pickle calls ``bytearray(nbytes)``."""
    buf = io.BytesIO()
    torch.save(torch.zeros(1), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):
                data = pickle.dumps(Call(bytearray, nbytes), protocol=2)
            z.writestr(info.filename, data)
    return out.getvalue()


def scenario_forged_ranges(rank: int, out: str) -> dict[str, Any]:
    """Chunk records that point outside the data, a transform, a chunk that allocates, a large file."""

    def huge_length(md, folder):
        md.storage_data[_first_chunk(md)].length = 1 << 40

    def beyond_file(md, folder):
        info = md.storage_data[_first_chunk(md)]
        info.offset = os.path.getsize(os.path.join(folder, info.relative_path))

    def outside_folder(md, folder):
        md.storage_data[_first_chunk(md)].relative_path = "/etc/passwd"

    def other_checkpoint(md, folder):
        info = md.storage_data[_first_chunk(md)]
        base_folder = next(n for n in os.listdir(_base()) if n.startswith("step-"))
        info.relative_path = os.path.join("..", "..", "base", base_folder, info.relative_path)

    def transform(md, folder):
        md.storage_data[_first_chunk(md)].transform_descriptors = ["stream.zstd/1"]

    def allocates(md, folder):
        _append_chunk(folder, md, _first_chunk(md), _allocating_chunk(1 << 27))

    cases = {
        "huge_length": huge_length,
        "beyond_file": beyond_file,
        "outside_folder": outside_folder,
        "other_checkpoint": other_checkpoint,
        "transform": transform,
        "allocates": allocates,
    }
    result = {name: _forge_metadata(name, change) for name, change in cases.items()}
    # A .metadata padded past what a save of these entries writes (a plain
    # unpickler stops at STOP and never notices).
    path, folder = _copy("padded")
    with open(os.path.join(folder, ".metadata"), "ab") as f:
        f.write(b"\0" * (8 << 20))
    result["padded"] = _load(path)
    return result


def _rewrite_marker(path: str, change) -> None:
    """Edits the marker with ``change(body)`` and recomputes its checksum, as a forger can."""
    name = os.path.join(path, "checkpoint.json")
    with open(name) as f:
        body = json.load(f)
    body.pop("checksum")
    change(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = hashlib.sha256(canonical.encode()).hexdigest()
    with open(name, "w") as f:
        json.dump(body, f)


def scenario_forged_marker(rank: int, out: str) -> dict[str, Any]:
    """Markers with a valid checksum whose texts would forge or flood a message, or hang the parse."""
    result = {}

    def twice(body):
        leaf = dict(body["leaves"][0], path="['\x1b[2J\nstate']")
        body["leaves"] += [leaf, dict(leaf)]

    def huge_value(body):
        rec = next(r for r in body["leaves"] if r["path"] == "['epoch']")
        rec["value"] = "A" * (4 << 20)

    def config_escape(body):
        entry = next(e for e in body["config"] if e[0].endswith("learning_rate"))
        entry[1] = "\x1b]0;forged\x07" + "9" * 10_000

    for name, change in (
        ("twice", twice),
        ("huge_value", huge_value),
        ("config_escape", config_escape),
    ):
        path, _ = _copy(f"marker_{name}")
        _rewrite_marker(path, change)
        result[name] = _load(path)
    # 200 000 keys in one JSON object, one of them twice: refused in time linear in the keys.
    path, _ = _copy("marker_duplicate_keys")
    name = os.path.join(path, "checkpoint.json")
    with open(name) as f:
        text = f.read()
    keys = ",".join(f'"k{i}":0' for i in range(200_000))
    with open(name, "w") as f:
        f.write(text[:-1] + ',"padding":{' + keys + ',"k0":1}}')
    start = time.monotonic()
    result["duplicate_keys"] = (_load(path), time.monotonic() - start)
    return result


def scenario_forged_nested(rank: int, out: str) -> dict[str, Any]:
    """A ``.metadata`` whose dict key, or an enum's argument, is a tuple nested ``NESTING`` deep."""
    nested = b")" + b"\x85" * NESTING  # EMPTY_TUPLE, then TUPLE1 per level
    key = b"\x80\x04}" + nested + b"K\x01s."  # {((...),): 1}
    enum = (
        b"\x80\x04\x8c\x25torch.distributed.checkpoint.metadata\x94"
        b"\x8c\x14_MEM_FORMAT_ENCODING\x94\x93" + nested + b"\x85R."
    )  # _MEM_FORMAT_ENCODING(((...),))
    result = {}
    for name, data in (("enum", enum), ("key", key)):
        path, folder = _copy(f"nested_{name}")
        _write_metadata(folder, data)
        result[name] = _load(path)
    return result


SCENARIOS = {
    "forged_globals": scenario_forged_globals,
    "forged_ranges": scenario_forged_ranges,
    "forged_marker": scenario_forged_marker,
    "forged_nested": scenario_forged_nested,
}


if __name__ == "__main__":
    names = os.environ["FF_SCKPT_SCENARIOS"].split(",")
    sys.exit(run_scenarios({n: SCENARIOS[n] for n in names}, sys.argv[1]))
