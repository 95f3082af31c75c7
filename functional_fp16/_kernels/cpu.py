"""The compiled fused steps for CPU tensors (``fused_step.c``).

The C source next to this module is compiled once per machine with the
system's C compiler (``$CC``, else ``cc``/``gcc``) for the host CPU
(``-O3 -march=native -ffp-contract=off -fopenmp``) into a cache folder
(``$FUNCTIONAL_FP16_CACHE``, else ``$XDG_CACHE_HOME/functional_fp16``, else
``~/.cache/functional_fp16``), keyed by the source, the flags and the CPU, and
loaded with ``ctypes``. The first call on a machine pays the compilation (about
half a second); later processes load the cached library.

Every entry point's arguments are declared once in
:mod:`functional_fp16._kernels.signatures`; the ctypes signatures are derived
from there and :func:`call` checks every argument, by name, before a pointer
reaches C. Nothing here reads a tensor's value: scalars held in tensors are
passed by address.

Where no compiler is found, or the build fails, :func:`available` is false and
says why in :func:`unavailable_reason`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from functional_fp16._kernels.signatures import SIGNATURES, pack

__all__ = ["available", "unavailable_reason", "call"]

_SOURCE = Path(__file__).with_name("fused_step.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
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


def _build() -> Path:
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set $CC, or install gcc)")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *_FLAGS]).encode() + _cpu_signature().encode())
    target = _cache_dir() / f"ff_fused_step_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
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
