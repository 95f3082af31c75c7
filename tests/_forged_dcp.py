"""Forged DCP checkpoints for tests/test_dcp_reader.py and tests/_dcp_workers.py.

Each forgery starts from a clean directory written by ``save_dcp_state`` and
changes one thing: what ``.metadata`` unpickles to (read here with plain
:mod:`pickle`, since the file is our own), its bytes, or a data file. A
forged ``.metadata`` that would run code under a plain ``pickle.load``
creates an evidence directory, so a test can tell that nothing ran.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

import functional_fp16 as ff
from functional_fp16 import distributed as ffd

NESTING = 300_000  # tuple levels: hashing them overflows the C stack of an 8 MiB main thread


class Call:
    """Pickles as ``fn(*args)``: what a forged file would make a plain unpickler run."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def make_state(seed: int = 3) -> ff.FP16State:
    """A small AdamW state with two parameters (one 2-D); ``seed`` picks the values."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(6, 5, generator=g).half(),
        "b": torch.randn(5, generator=g).half(),
    }
    return ff.fp16_init(params, ff.adamw(1e-3))


def fresh_like() -> ff.FP16State:
    """A template of the same tree, with other values (a load must overwrite them)."""
    like = make_state()
    return ff.fp16_init({k: torch.zeros_like(v) for k, v in like.params.items()}, ff.adamw(1e-3))


def save_clean(path: Path) -> Path:
    ffd.save_dcp_state(make_state(), path)
    return path


def metadata(folder: Path) -> Any:
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # our own, unforged file


def write_metadata(folder: Path, data: bytes) -> None:
    (folder / ".metadata").write_bytes(data)


def first_chunk(md: Any, fqn: str = "master.w") -> MetadataIndex:
    return next(k for k in md.storage_data if k.fqn == fqn)


def data_file(folder: Path) -> Path:
    return next(p for p in folder.iterdir() if p.suffix == ".distcp")


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


def _edit(change: Callable[[Any, Path], None]) -> Callable[[Path], None]:
    """A forgery that edits the unpickled metadata in place and pickles it again."""

    def forge(folder: Path) -> None:
        md = metadata(folder)
        change(md, folder)
        write_metadata(folder, pickle.dumps(md))

    return forge


def _set_chunk(**fields: Any) -> Callable[[Path], None]:
    def change(md: Any, folder: Path) -> None:
        for k, v in fields.items():
            setattr(md.storage_data[first_chunk(md)], k, v)

    return _edit(change)


def _append_allocating(md: Any, folder: Path) -> None:
    info = md.storage_data[first_chunk(md)]
    data = _allocating_chunk(1 << 27)
    name = folder / info.relative_path
    info.offset, info.length = name.stat().st_size, len(data)
    with open(name, "ab") as f:
        f.write(data)


def _overlap(md: Any, folder: Path) -> None:
    """``master.w`` stored as two chunks that overlap (and leave a gap)."""
    entry = md.state_dict_metadata["master.w"]
    chunk = entry.chunks[0]
    half = type(chunk)(offsets=torch.Size([0, 0]), sizes=torch.Size([3, 5]))
    entry.chunks = [half, type(chunk)(offsets=torch.Size([0, 0]), sizes=torch.Size([3, 5]))]


def _outside(md: Any, folder: Path) -> None:
    entry = md.state_dict_metadata["master.w"]
    entry.chunks[0].sizes = torch.Size([7, 5])


def _huge_entry(md: Any, folder: Path) -> None:
    md.state_dict_metadata["master.w"].size = torch.Size([1 << 40, 5])


def _cut_data(fraction: float) -> Callable[[Path], None]:
    def forge(folder: Path) -> None:
        path = data_file(folder)
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(int(size * fraction))

    return forge


def _junk_data(folder: Path) -> None:
    path = data_file(folder)
    path.write_bytes(os.urandom(path.stat().st_size))


def _cut_metadata(folder: Path) -> None:
    raw = (folder / ".metadata").read_bytes()
    write_metadata(folder, raw[: len(raw) // 2])


def _junk_metadata(folder: Path) -> None:
    write_metadata(folder, b"not a pickle at all; " * 200)


def _padded_metadata(folder: Path) -> None:
    with open(folder / ".metadata", "ab") as f:
        f.write(b"\0" * (1 << 20))


def _size_bomb(folder: Path) -> None:
    """A tuple of 100 000 ints memoised once and made into ``torch.Size`` 500 times, each
    kept in a list (200 KiB of pickle for 400 MB of sizes under a plain unpickler)."""
    tup = b"(" + b"K\x01" * 100_000 + b"t\x94"  # MARK, BININT1 1 ..., TUPLE; memo 0
    size = b"\x8c\x05torch\x94\x8c\x04Size\x94\x93\x94"  # torch.Size; memo 3
    one = b"h\x03h\x00\x85Ra"  # BINGET Size, BINGET tuple, TUPLE1, REDUCE, APPEND
    write_metadata(folder, b"\x80\x04" + tup + size + b"]" + one * 500 + b".")


def _nested(kind: str) -> Callable[[Path], None]:
    nested = b")" + b"\x85" * NESTING  # EMPTY_TUPLE, then TUPLE1 per level

    def forge(folder: Path) -> None:
        if kind == "key":
            data = b"\x80\x04}" + nested + b"K\x01s."  # {((...),): 1}
        else:
            data = (
                b"\x80\x04\x8c\x25torch.distributed.checkpoint.metadata\x94"
                b"\x8c\x14_MEM_FORMAT_ENCODING\x94\x93" + nested + b"\x85R."
            )  # _MEM_FORMAT_ENCODING(((...),))
        write_metadata(folder, data)

    return forge


def _global(kind: str, evidence: Path) -> Callable[[Path], None]:
    calls = {
        "mkdir": lambda: Call(os.mkdir, str(evidence)),
        "system": lambda: Call(os.system, f"mkdir {evidence}"),
        "eval": lambda: Call(eval, f"__import__('os').mkdir({str(evidence)!r})"),
        "print": lambda: Call(print, "forged"),
    }

    def change(md: Any, folder: Path) -> None:
        md.planner_data = calls[kind]()

    return _edit(change)


def _symlinked_metadata(folder: Path) -> None:
    target = folder.parent / f"{folder.name}.elsewhere"
    shutil.move(folder / ".metadata", target)
    os.symlink(target, folder / ".metadata")


def forgeries(evidence: Path) -> dict[str, Callable[[Path], None]]:
    """Each forgery by name: ``forge(folder)`` changes a clean checkpoint directory."""
    cases: dict[str, Callable[[Path], None]] = {
        f"global_{k}": _global(k, evidence / k) for k in ("mkdir", "system", "eval", "print")
    }
    cases.update(
        {
            "nested_key": _nested("key"),
            "nested_enum": _nested("enum"),
            "size_bomb": _size_bomb,
            "huge_length": _set_chunk(length=1 << 40),
            "beyond_file": _set_chunk(offset=1 << 20),
            "outside_folder": _set_chunk(relative_path="/etc/passwd"),
            "other_checkpoint": _set_chunk(relative_path="../clean/__0_0.distcp"),
            "transform": _set_chunk(transform_descriptors=["stream.zstd/1"]),
            "allocating_chunk": _edit(_append_allocating),
            "overlapping_chunks": _edit(_overlap),
            "chunk_outside_entry": _edit(_outside),
            "huge_entry": _edit(_huge_entry),
            "metadata_cut": _cut_metadata,
            "metadata_junk": _junk_metadata,
            "metadata_padded": _padded_metadata,
            "metadata_symlink": _symlinked_metadata,
            "metadata_missing": lambda folder: (folder / ".metadata").unlink(),
            "data_cut_to_a_third": _cut_data(1 / 3),
            "data_junk": _junk_data,
        }
    )
    return cases


def forge(case: str, clean: Path, into: Path, evidence: Path) -> Path:
    """A copy of ``clean`` at ``into`` with the forgery ``case`` applied."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(clean, into, symlinks=True)
    forgeries(evidence)[case](into)
    return into
