"""The compiled fused steps for CPU tensors (``fused_step.c``).

The C source next to this module is compiled once per machine with the
system's C compiler (``$CC``, else ``cc``/``gcc``) for the host CPU
(``-O3 -march=native -ffp-contract=off -fno-math-errno -fno-trapping-math -fopenmp``;
none of them changes a result) into a cache folder
(``$FUNCTIONAL_FP16_CACHE``, else ``$XDG_CACHE_HOME/functional_fp16``, else
``~/.cache/functional_fp16``), keyed by the source, the flags and the CPU, and
loaded with ``ctypes``. The first call on a machine pays the compilation (about
20 s on a 2-core AMD EPYC) and says so in one line on stderr when it starts;
later processes load the cached library and print nothing.

Every entry point's arguments are declared once in
:mod:`functional_fp16._kernels.signatures`; the ctypes signatures are derived
from there and :func:`call` checks every argument, by name, before a pointer
reaches C. Nothing here reads a tensor's value: scalars held in tensors are
passed by address.

Where no compiler is found, or the build fails, :func:`available` is false and
says why in :func:`unavailable_reason`.

The same C source, linked with ``fused_ops.cpp`` against the installed torch,
also makes a library of private ``torch.library`` ops
(``functional_fp16_cpu::sgd`` / ``adam`` / ``grad_stats``, and ``step``, which runs
any step of ``fused_step.h``'s convention by name; loaded with
``torch.ops.load_library``): the fused ops' CPU kernels call them to check
their tensors, allocate their outputs and collect the pointers in C++, one
loop instead of a Python loop per tensor. It is built on first use too (about
30 s on the same machine, ``g++`` with C++20; one line on stderr when the
compile starts), cached beside the C library and keyed by both
sources, the flags, the torch version and the CPU; :func:`ops_available` says
whether it loaded, :func:`ops_reason` why not. Without it the ops run the same
C kernels through :func:`call`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from functional_fp16._kernels.signatures import SIGNATURES, pack

__all__ = ["available", "unavailable_reason", "call", "ops_available", "ops_reason", "run_op"]
__all__ += ["layout_op", "ops_loaded"]

_SOURCE = Path(__file__).with_name("fused_step.c")
_HEADER = Path(__file__).with_name("fused_step.h")  # included by both sources
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
_FLAGS += ["-fopenmp"]
_FLAGS += ["-shared", "-fPIC"]

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False


def _cache_dir() -> Path:
    root = os.environ.get("FUNCTIONAL_FP16_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "functional_fp16"


def _cpu_signature() -> str:
    # -march=native code is only valid on the CPU it was built for.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _announce(what: str, folder: Path, when: str) -> None:
    """One line on stderr as a compile starts (a cached build prints nothing)."""
    print(f"functional_fp16: building {what} in {folder} ({when})...", file=sys.stderr, flush=True)


def _build() -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    source = _SOURCE.read_bytes() + _HEADER.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *_FLAGS]).encode() + _cpu_signature().encode())
    target = _cache_dir() / f"ff_fused_step_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _announce("the C kernels", target.parent, "once per machine, about 20 s")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *_FLAGS, "-o", tmp, str(_SOURCE)], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: concurrent builders agree on the result
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> None:
    global _lib, _reason, _loaded
    _loaded = True
    if os.environ.get("FUNCTIONAL_FP16_NO_KERNEL"):
        _reason = "disabled by $FUNCTIONAL_FP16_NO_KERNEL"
        return
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError) as err:
        _reason = f"the CPU kernel could not be built or loaded: {err}"
        return
    for sig in SIGNATURES.values():
        fn = getattr(lib, sig.symbol)
        fn.argtypes = sig.argtypes()
        fn.restype = None
    _lib = lib


def available() -> bool:
    """Whether the compiled kernel can be used (builds it on the first call)."""
    if not _loaded:
        _load()
    return _lib is not None


def unavailable_reason() -> str | None:
    """Why :func:`available` is false, or ``None``."""
    available()
    return _reason


def call(
    entry: str, *, n_groups: int, members: int = 1, leaves_checked: bool = False, **arguments: Any
) -> None:
    """Runs the entry point ``entry`` of :data:`~functional_fp16._kernels.signatures.SIGNATURES`.

    The arguments are given by name and checked against the declaration
    (see :func:`~functional_fp16._kernels.signatures.pack`) before the call.
    """
    if not available():
        raise RuntimeError(f"the CPU kernel is not available: {_reason}")
    sig = SIGNATURES[entry]
    packed = pack(
        sig, n_groups=n_groups, members=members, leaves_checked=leaves_checked, **arguments
    )
    getattr(_lib, sig.symbol)(*packed.args)


_CXX_FLAGS = ["-O2", "-ffp-contract=off", "-std=c++20", "-fPIC", "-shared", "-fopenmp"]
_OPS_SOURCE = Path(__file__).with_name("fused_ops.cpp")
_ops_loaded = False
_ops_reason: str | None = None


def _cxx() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed: {proc.stderr.strip()[-500:]}")


def _build_ops() -> Path:
    import torch

    cc, cxx = _compiler(), _cxx()
    if cc is None or cxx is None:
        raise RuntimeError("no C and C++ compilers found (set $CC and $CXX, or install gcc/g++)")
    root = Path(torch.__file__).parent
    abi = int(torch.compiled_with_cxx11_abi())
    flags = [*_CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{root / 'include'}"]
    libs = [f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root / 'lib'}"]
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), _HEADER.read_bytes(), _OPS_SOURCE.read_bytes()):
        key.update(part)
    key.update(" ".join([cc, cxx, *_FLAGS, *flags, *libs, torch.__version__]).encode())
    key.update(_cpu_signature().encode())
    target = _cache_dir() / f"ff_fused_ops_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _announce("the C++ ops", target.parent, "once per machine and torch version, about 30 s")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj = os.path.join(tmp, "fused_step.o")
        c_flags = [f for f in _FLAGS if f != "-shared"]
        _run([cc, *c_flags, "-c", str(_SOURCE), "-o", obj])
        out = os.path.join(tmp, "ops.so")
        _run([cxx, *flags, str(_OPS_SOURCE), obj, *libs, "-o", out])
        os.replace(out, target)  # atomic: concurrent builders agree on the result
    return target


def ops_available() -> bool:
    """Whether the C++ op library is loaded (builds and loads it on the first call)."""
    global _ops_loaded, _ops_reason
    if _ops_loaded:
        return _ops_reason is None
    _ops_loaded = True
    if os.environ.get("FUNCTIONAL_FP16_NO_KERNEL") or os.environ.get("FUNCTIONAL_FP16_NO_CPP"):
        _ops_reason = "disabled by $FUNCTIONAL_FP16_NO_KERNEL or $FUNCTIONAL_FP16_NO_CPP"
        return False
    if not available():
        _ops_reason = f"the C kernel is not available: {_reason}"
        return False
    try:
        import torch

        torch.ops.load_library(str(_build_ops()))
    except (OSError, RuntimeError) as err:
        _ops_reason = f"the C++ op library could not be built or loaded: {err}"
        return False
    return True


def ops_reason() -> str | None:
    """Why :func:`ops_available` is false, or ``None``."""
    ops_available()
    return _ops_reason


def ops_loaded() -> bool:
    """Whether the C++ op library is loaded already (never builds or loads it)."""
    return _ops_loaded and _ops_reason is None


def layout_op(name: str, *args: Any) -> Any:
    """Calls ``functional_fp16_layout::<name>`` (``leaves_layout``, ``leaves_match``): the
    library's checks of tensors' metadata, for tensors of any device (no CPU kernel)."""
    return _overload("functional_fp16_layout", name)(*args)


def run_op(name: str, *args: Any) -> Any:
    """Calls ``functional_fp16_cpu::<name>`` (``sgd``, ``adam``, ``step`` or ``grad_stats``)."""
    return _overload("functional_fp16_cpu", name)(*args)


_OVERLOADS: dict[tuple[str, str], Any] = {}


def _overload(namespace: str, name: str) -> Any:
    """The op's one overload (``torch.ops.<namespace>.<name>.default``), looked up once: a
    call through the overload packet matches the arguments against its overloads' schemas
    first (about 15 us for a list of 600 tensors)."""
    op = _OVERLOADS.get((namespace, name))
    if op is None:
        import torch

        op = _OVERLOADS[namespace, name] = getattr(getattr(torch.ops, namespace), name).default
    return op
