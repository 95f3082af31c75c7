"""Shared helpers for the benchmark scripts: timing, memory, machine description."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            _LIBC = False
    return _LIBC or None


def rss_bytes() -> int | None:
    """Current resident set size (Linux ``/proc``), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def peak_rss_bytes() -> int | None:
    """Peak resident set size since the last :func:`reset_peak_rss` (``VmHWM``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets ``VmHWM`` to the current RSS (Linux >= 4.0, ``clear_refs`` mode 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_free_memory() -> None:
    """Garbage-collects and returns glibc's free heap pages to the system."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        try:
            libc.malloc_trim(0)
        except AttributeError:
            pass


def peak_growth(fn: Callable[[], None], calls: int) -> int | None:
    """Peak RSS growth (bytes) over ``calls`` calls of ``fn``, above the RSS before them."""
    release_free_memory()
    before = rss_bytes()
    if before is None or not reset_peak_rss():
        for _ in range(calls):
            fn()
        return None
    for _ in range(calls):
        fn()
    peak = peak_rss_bytes()
    return None if peak is None else max(0, peak - before)


def time_interleaved(
    fns: dict[str, Callable[[], None]],
    reps: int,
    warmup: int,
    prepare: dict[str, Callable[[], None]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, taking turns one call each per repetition.

    Load from other programs then affects every row alike. ``prepare[name]``
    (untimed) runs before each timed call of ``name``.
    """
    prepare = prepare or {}
    for _ in range(warmup):
        for name, fn in fns.items():
            if name in prepare:
                prepare[name]()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if name in prepare:
                prepare[name]()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def set_threads(n: int) -> None:
    """Uses ``n`` intra-op threads in PyTorch and (if not yet imported) in JAX/XLA."""
    torch.set_num_threads(n)
    if "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if n == 1 and "multi_thread_eigen" not in flags:
            flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = flags.strip()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def machine_description() -> dict[str, str]:
    """CPU model, core count, load average, versions and the date."""
    model = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": model,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "load average (1, 5, 15 min)": load,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.0f} MiB"
