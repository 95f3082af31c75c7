"""The compiled single-pass SGD kernel for CPU tensors (``_sgd_kernel.c``).

The C source next to this module is compiled once per machine with the
system's C compiler (``$CC``, else ``cc``/``gcc``) for the host CPU
(``-O3 -march=native -ffp-contract=off -fopenmp``) into a cache folder
(``$FUNCTIONAL_FP16_CACHE``, else ``$XDG_CACHE_HOME/functional_fp16``, else
``~/.cache/functional_fp16``), keyed by the source, the flags and the CPU, and
loaded with ``ctypes``. The first call on a machine pays the compilation (about
half a second); later processes load the cached library. Nothing here reads a
tensor's value: scalars held in tensors are passed to the kernel by address.

Where no compiler is found, or the build fails, :func:`available` is false and
says why in :func:`unavailable_reason`; the update then runs the multi-tensor
path and warns once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from array import array
from pathlib import Path

import torch

from functional_fp16.kernel_args import AdamScalars, AdamTensors, KernelScalars, KernelTensors

__all__ = [
    "available",
    "unavailable_reason",
    "grad_stats",
    "sgd_update",
    "adam_update",
    "keep_unless",
    "DTYPE_CODES",
]

_SOURCE = Path(__file__).with_name("_sgd_kernel.c")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
_FLAGS += ["-shared", "-fPIC"]

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
"""The dtypes the kernel reads and writes, with their codes in the C source."""

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
_f32 = ctypes.c_float


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
    target = _cache_dir() / f"ff_sgd_{key.hexdigest()[:16]}.so"
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
    lib.ff_grad_stats.argtypes = [_i64, _p, _p, _p, _p, _i32, _i32, _p, _p]
    lib.ff_grad_stats.restype = None
    lib.ff_sgd_update.argtypes = [_i64] + [_p] * 16 + [_f32, _f32, _f32, _i32, _i32, _p]
    lib.ff_sgd_update.restype = None
    lib.ff_adam_update.argtypes = [_i64] + [_p] * 19 + [_f32] * 6 + [_i32]
    lib.ff_adam_update.restype = None
    lib.ff_keep_unless.argtypes = [_i64] + [_p] * 9 + [_i32]
    lib.ff_keep_unless.restype = None
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


class _Arrays:
    """Packs per-leaf values into C arrays (``array.array``), kept alive while a call runs."""

    def __init__(self) -> None:
        self._keep: list[array] = []

    def ptrs(self, tensors: list[torch.Tensor] | None) -> int | None:
        if tensors is None:
            return None
        return self._pack("Q", [t.data_ptr() for t in tensors])

    def _pack(self, code: str, values: list[int]) -> int:
        a = array(code, values)
        self._keep.append(a)
        return a.buffer_info()[0]

    def i64(self, values: list[int]) -> int:
        return self._pack("q", values)

    def i32(self, values: list[int]) -> int:
        return self._pack("i", values)


def _addr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def grad_stats(
    grads: list[torch.Tensor], inv: torch.Tensor | None, *, sum_squares: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One read of the gradients: (largest |g| as float32, +inf if any is inf or NaN; and
    the float64 sum of ``fl32(g * inv)**2`` if ``sum_squares``). 0-d tensors."""
    peak = torch.empty((), dtype=torch.float32)
    sq = torch.empty((), dtype=torch.float64) if sum_squares else None
    c = _Arrays()
    _lib.ff_grad_stats(
        len(grads),
        c.ptrs(grads),
        c.i64([g.numel() for g in grads]),
        c.i32([DTYPE_CODES[g.dtype] for g in grads]),
        _addr(inv),
        int(sum_squares),
        torch.get_num_threads(),
        peak.data_ptr(),
        _addr(sq),
    )
    return peak, sq


def _step_args(c: _Arrays, t: KernelTensors | AdamTensors, s: KernelScalars | AdamScalars):
    """The arguments every update entry point starts with, in the C order.

    The leaf count, one pointer array per field of ``t`` (gradients, state
    inputs, outputs), the sizes and dtype codes, then 1/scale, the clip
    divisor and factor (NULL: none) and the signed learning rate.
    """
    return [
        len(t.grads),
        *[c.ptrs(x) for x in t],
        c.i64([g.numel() for g in t.grads]),
        c.i32([DTYPE_CODES[g.dtype] for g in t.grads]),
        c.i32([DTYPE_CODES[p.dtype] for p in t.params_out]),
        _addr(s.inv),
        _addr(s.clip[0]) if s.clip is not None else None,
        _addr(s.clip[1]) if s.clip is not None else None,
        s.lr.data_ptr(),
    ]


def sgd_update(
    tensors: KernelTensors, scalars: KernelScalars, peak_out: torch.Tensor | None = None
) -> None:
    """Runs the update of ``_sgd_kernel.c`` into ``tensors``' outputs.

    The arguments are described in :mod:`functional_fp16.kernel_args`; all
    tensors are dense CPU tensors. ``scalars.apply=None`` runs a speculative
    pure step and writes the gradients' largest magnitude (as
    :func:`grad_stats`) into the 0-d float32 ``peak_out``; :func:`keep_unless`
    then undoes it if needed.
    """
    t, s = tensors, scalars
    c = _Arrays()
    _lib.ff_sgd_update(
        *_step_args(c, t, s),
        _addr(s.apply),
        _addr(s.started),
        s.weight_decay,
        s.momentum,
        1.0 - s.dampening,  # rounded once to float32, as the reference's scalar
        int(s.nesterov),
        torch.get_num_threads(),
        _addr(peak_out),
    )


def keep_unless(apply: torch.Tensor, tensors: KernelTensors) -> None:
    """If the 0-d bool ``apply`` is false, copies the old tensors over the outputs, bitwise.

    Undoes a speculative :func:`sgd_update`; ``tensors.grads`` is not read.
    """
    t = tensors
    c = _Arrays()
    _lib.ff_keep_unless(
        len(t.master),
        *[c.ptrs(x) for x in t[1:]],  # master, trace, params and the three outputs
        c.i64([m.numel() for m in t.master]),
        c.i32([DTYPE_CODES[p.dtype] for p in t.params_out]),
        apply.data_ptr(),
        torch.get_num_threads(),
    )


def adam_update(tensors: AdamTensors, scalars: AdamScalars) -> None:
    """Runs the Adam update of the C kernel into ``tensors``' outputs.

    The arguments are described in :mod:`functional_fp16.kernel_args`; all
    tensors are dense CPU tensors. A skipped step (``scalars.apply`` false)
    leaves the outputs equal to the inputs, bit for bit.
    """
    t, s = tensors, scalars
    c = _Arrays()
    _lib.ff_adam_update(
        *_step_args(c, t, s),
        s.apply.data_ptr(),
        s.inv_c1.data_ptr(),
        s.sqrt_c2.data_ptr(),
        s.l2_decay,
        1.0 - s.b1,  # rounded once to float32, as torch.lerp's scalar weight
        s.b2,
        1.0 - s.b2,  # as addcmul's scalar value
        s.eps,
        s.decoupled_decay,
        torch.get_num_threads(),
    )
