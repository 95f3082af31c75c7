"""The first build of the CPU kernels says so in one line on stderr; a cached build is silent.

The compiler is replaced by a stand-in that writes an empty library, so nothing is
compiled, and the cache is an empty temporary folder. The loader's module state
(``_lib``, ``_loaded``, ``_reason``, ``_ops_loaded``, ``_ops_reason``) is patched, so
the rest of the process keeps the kernels it already has.
"""

import subprocess

import pytest

from functional_fp16._kernels import cpu

LINE = "functional_fp16: building"


class _FakeLibrary:
    """Stands in for the loaded C library: every entry point is an object ctypes would set."""

    def __getattr__(self, name):
        entry = type(name, (), {})()
        setattr(self, name, entry)
        return entry


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty cache folder, a compiler that only writes its output, no real load."""
    compiles = []

    def fake_run(cmd, *args, **kwargs):
        compiles.append(cmd)
        out = cmd[cmd.index("-o") + 1]
        with open(out, "wb"):
            pass
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setenv("FUNCTIONAL_FP16_CACHE", str(tmp_path))
    monkeypatch.delenv("FUNCTIONAL_FP16_NO_KERNEL", raising=False)
    monkeypatch.delenv("FUNCTIONAL_FP16_NO_CPP", raising=False)
    monkeypatch.setattr(cpu, "_compiler", lambda: "cc")
    monkeypatch.setattr(cpu, "_cxx", lambda: "c++")
    monkeypatch.setattr(cpu.subprocess, "run", fake_run)
    monkeypatch.setattr(cpu.ctypes, "CDLL", lambda path: _FakeLibrary())
    for name, value in [("_lib", None), ("_reason", None), ("_loaded", False)]:
        monkeypatch.setattr(cpu, name, value)
    for name, value in [("_ops_loaded", False), ("_ops_reason", None)]:
        monkeypatch.setattr(cpu, name, value)
    return compiles


def _build_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(LINE)]


def test_the_c_build_says_so_once_and_a_cached_load_prints_nothing(empty_cache, capsys, tmp_path):
    assert cpu.available()
    lines = _build_lines(capsys.readouterr().err)
    assert len(empty_cache) == 1  # one compile
    assert len(lines) == 1, lines
    assert "C kernels" in lines[0] and str(tmp_path) in lines[0] and "once per machine" in lines[0]

    cpu._loaded, cpu._lib = False, None  # a new process: load again, from the cache
    assert cpu.available()
    assert len(empty_cache) == 1  # nothing compiled
    assert capsys.readouterr().err == ""


def test_the_cpp_ops_build_says_so_once_and_a_cached_load_prints_nothing(
    empty_cache, capsys, monkeypatch
):
    import torch

    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    assert cpu.ops_available()
    lines = _build_lines(capsys.readouterr().err)
    assert len(lines) == 2, lines  # the C library first, then the C++ ops
    assert "C kernels" in lines[0] and "C++ ops" in lines[1]
    assert len(empty_cache) == 3  # the C library; the C++ ops' object file and library
    assert len(loaded) == 1

    cpu._loaded, cpu._lib, cpu._ops_loaded = False, None, False
    assert cpu.ops_available()
    assert capsys.readouterr().err == ""
    assert len(empty_cache) == 3
    assert len(loaded) == 2
