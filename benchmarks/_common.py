"""Shared helpers for the benchmark scripts: timing, memory, machine description, reports, ranks."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import gc
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.multiprocessing as mp

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
    shuffle: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each function, taking turns one call each per repetition.

    Load from other programs then affects every row alike. ``prepare[name]``
    (untimed) runs before each timed call of ``name``. ``shuffle``: the turns of each
    repetition in a new order (seeded), so that no row always follows the same one; a
    row over more memory than the last-level cache otherwise inherits its predecessor's
    cache, dirty lines from an update in place included.
    """
    prepare = prepare or {}
    order = random.Random(0)
    for _ in range(warmup):
        for name, fn in fns.items():
            if name in prepare:
                prepare[name]()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        turns = list(fns.items())
        if shuffle:
            order.shuffle(turns)
        for name, fn in turns:
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


def machine_line() -> str:
    """:func:`machine_description` as one markdown line, ``Machine: key: value; ...``."""
    return "Machine: " + "; ".join(f"{k}: {v}" for k, v in machine_description().items())


def print_report(md: list[str], out: str | None) -> None:
    """Prints the markdown lines ``md``; with ``out``, also writes them to that file."""
    text = "\n".join(md)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


# Side-against-side benchmarks: each side's worker in a fresh process, taking turns.


def run_worker(cmd: list[str], env: dict[str, str] | None = None) -> dict | None:
    """Runs one worker process; its last JSON line, or None (its output on stderr) if it failed."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        print(out.stdout + out.stderr, file=sys.stderr)
        return None
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])


def alternate_rounds(
    rounds: int,
    sides: Sequence[str],
    run_side: Callable[[str], dict | None],
    rate_key: str,
    unit: str,
) -> tuple[dict[str, list[float]], dict[str, list[float]]] | None:
    """Each side once per round (``run_side(side)``), the order reversed every other round.

    ``run_side`` runs one side's worker and returns its JSON line (see
    :func:`run_worker`), or None if it failed. Returns each side's rates (the
    lines' ``rate_key``) and first-call seconds (``first_call_s``), one per
    round; None as soon as a side fails. Each result goes to stderr as
    ``[round r] side: rate unit``.
    """
    rates: dict[str, list[float]] = {side: [] for side in sides}
    first_calls: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            line = run_side(side)
            if line is None:
                return None
            rates[side].append(line[rate_key])
            first_calls[side].append(line["first_call_s"])
            print(f"[round {r + 1}] {side}: {rates[side][-1]:.0f} {unit}", file=sys.stderr)
    return rates, first_calls


def rounds_table(
    unit: str,
    sides: Sequence[str],
    labels: dict[str, str],
    rates: dict[str, list[float]],
    first_calls: dict[str, list[float]],
    cold_compile: Iterable[str] = (),
) -> list[str]:
    """Markdown table: per side its label, median rate and every round's rate.

    The rows of the sides in ``cold_compile`` also give the median first call
    (the cold compile, which the warm-up steps absorb).
    """
    cold = set(cold_compile)
    md = [f"| side | {unit} (median) | every round |", "|---|---:|---|"]
    for side in sides:
        note = ""
        if side in cold:
            note = f" (cold compile, the first call: {median(first_calls[side]):.1f} s)"
        md.append(
            f"| {labels[side]} | {median(rates[side]):.0f} | "
            + ", ".join(f"{v:.0f}" for v in rates[side])
            + note
            + " |"
        )
    return md


def time_steps(
    step: Callable[[torch.Tensor, torch.Tensor], None],
    batches: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]],
    warmup: int,
    steps: int,
    device: torch.device,
    sync_warmup: bool,
) -> tuple[float, float]:
    """(first call s, seconds of ``steps`` timed steps) after ``max(1, warmup)`` untimed ones.

    ``batches(k)`` draws k (inputs, targets) pairs; the timed ones are drawn
    after the warm-up, outside the timing. On CUDA the timing is synchronised;
    with ``sync_warmup`` each warm-up step is too (the first call then counts
    the device's work, not only the launch).
    """
    first = None
    for x, y in batches(max(1, warmup)):
        t0 = time.perf_counter()
        step(x, y)
        if sync_warmup and device.type == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - t0 if first is None else first
    work = batches(steps)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in work:
        step(x, y)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return first, time.perf_counter() - t0


# Benchmarks over several CPU processes (gloo on 127.0.0.1).


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable[..., None], world: int, *args) -> None:
    """Runs ``worker(rank, world, port, *args)`` in ``world`` fresh processes and waits for them.

    ``port``: a free port on 127.0.0.1 for the ranks to meet at (:func:`init_gloo_rank`).
    """
    mp.spawn(worker, args=(world, free_port(), *args), nprocs=world, join=True)


def init_gloo_rank(rank: int, world: int, port: int) -> None:
    """Joins this process to the gloo group as ``rank`` of ``world``, one torch thread.

    Through the environment variables of ``torch.distributed`` (meeting at
    127.0.0.1:``port``) and ``functional_fp16.distributed.init_from_env``.
    """
    from functional_fp16 import distributed as ffd

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    ffd.init_from_env(device="cpu")


# -- whole training steps on gloo ranks, two sides interleaved (bench_fsdp, bench_tp) -----


def add_step_flags(p, *, width: int = 128, layers: int = 4, context: int = 64) -> None:
    """The flags of a benchmark that times whole steps of the GPT example's model."""
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=width)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--context", type=int, default=context)
    p.add_argument("--batch", type=int, default=32)


def time_step_rounds(sides: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict:
    """Per side, this rank's mean step in each of ``rounds`` rounds of ``steps`` calls, the
    sides interleaved round by round, every rank starting and ending a side together."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def gather_to_parent(result, out) -> None:
    """Sends every rank's ``result`` (rank 0 puts the list on ``out``) and leaves the group."""
    import torch.distributed as dist

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if dist.get_rank() == 0:
        out.put(everyone)
    dist.destroy_process_group()


def run_ranks(worker: Callable[..., None], world: int, args) -> list:
    """``worker(rank, world, port, args, out)`` on ``world`` fresh gloo processes; the list
    of their results (:func:`gather_to_parent`)."""
    out = mp.get_context("spawn").SimpleQueue()
    spawn_ranks(worker, world, args, out)
    return out.get()


def slowest_rank_medians(ranks: list, sides, rounds: int) -> dict[str, float]:
    """Per side, the median over rounds of the slowest rank's mean step."""
    return {
        side: median([max(r["times"][side][i] for r in ranks) for i in range(rounds)])
        for side in sides
    }
