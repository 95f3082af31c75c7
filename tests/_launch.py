"""Starting worker processes the way torchrun would, for the multi-process tests, and their main.

Each worker runs its module (``tests/_*_workers.py``) as ``__main__`` with ``OUT_DIR``
as its argument and the ``torchrun`` variables set (127.0.0.1, a free port), runs its
scenarios in one process group and writes ``OUT_DIR/<scenario>_rank<r>.pt`` (results)
or ``.err`` (a traceback). A launch is bounded: after ``timeout_s`` the workers are
killed and the tests that read it fail with the workers' logs.

The workers are forked from a server process that has imported torch, the library and
the worker modules once (``multiprocessing``'s ``forkserver``, one a test process), so
that a launch does not pay the imports again in every rank (about 4 s of CPU a rank on
a 2-vCPU machine). The server runs no torch op and joins no process group (a fork of
it is what a ``DataLoader`` worker is of its parent): each worker reads its environment
and joins its group as a fresh interpreter would.
Where ``forkserver`` is not available the workers are fresh interpreters
(``python -m tests.<module> OUT_DIR``).
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch


class Launch(NamedTuple):
    out: Path
    logs: str
    timed_out: bool
    world: int
    timeout_s: float


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = [
    "torch",
    "torch.distributed.tensor",
    "functional_fp16",
    "functional_fp16.distributed",
    *sorted(f"tests.{p.stem}" for p in Path(__file__).parent.glob("_*_workers.py")),
]
"""What the fork server imports before it forks a worker: torch, the library and every
worker module of the tests (a module it cannot import is imported by the worker itself)."""


@functools.cache
def _context():
    """``multiprocessing``'s ``forkserver`` context with :data:`PRELOAD`, or ``None``."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _forked_worker(module: str, out: str, env: dict[str, str], log_path: str, root: str) -> None:
    """A worker forked from the server: its output to ``log_path``, its environment
    ``env``, in the repository ``root``, then its module as ``__main__`` (which ends the
    process with its status)."""
    os.chdir(root)
    if root not in sys.path:
        sys.path.insert(0, root)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, out]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except BaseException:
        traceback.print_exc()
        exit_now(1)
    exit_now(0)


class _Popen:
    """One fresh interpreter a worker, for a platform without ``forkserver``."""

    def __init__(self, module: str, out: Path, env: dict[str, str], log_path: Path, cwd: Path):
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module, str(out)],
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def poll(self) -> int | None:
        return self._proc.poll()

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        self._log.close()


class _Forked:
    """One worker forked from the server."""

    def __init__(self, ctx, module: str, out: Path, env: dict[str, str], log_path: Path, cwd: Path):
        self._proc = ctx.Process(
            target=_forked_worker, args=(module, str(out), env, str(log_path), str(cwd))
        )
        self._proc.start()

    def poll(self) -> int | None:
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()
        self._proc.join()

    def close(self) -> None:
        self._proc.join()
        self._proc.close()


def _start(worker: Path, out: Path, world: int, timeout_s: float, env: dict[str, str]) -> Launch:
    port = _free_port()
    ctx = _context()
    module = f"tests.{worker.stem}"
    procs: list[_Popen | _Forked] = []
    for rank in range(world):
        rank_env = {
            **os.environ,
            **env,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        log = out / f"worker{rank}.log"
        # As a module of the tests package, from the repository, so that the worker
        # imports the shared helpers here like any test does.
        root = worker.resolve().parents[1]
        if ctx is None:
            procs.append(_Popen(module, out, rank_env, log, root))
        else:
            procs.append(_Forked(ctx, module, out, rank_env, log, root))
    deadline = time.monotonic() + timeout_s
    timed_out = False
    try:
        # Until all exit; a worker that failed leaves the others waiting in a
        # collective, so those are stopped at once.
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.close()
    text = "\n".join(
        f"--- worker {r} ---\n" + _log_text(out / f"worker{r}.log") for r in range(world)
    )
    return Launch(out, text, timed_out, world, timeout_s)


def _log_text(path: Path) -> str:
    return path.read_text() if path.exists() else "(no output: the worker did not start)\n"


def launch_workers(
    worker: Path, out: Path, world: int, timeout_s: float, env: dict[str, str] | None = None
) -> Launch:
    """Runs ``world`` workers once; retried (twice at most) if another program took the port."""
    for attempt in range(3):
        run_dir = out / f"attempt{attempt}"
        run_dir.mkdir(parents=True)
        run = _start(worker, run_dir, world, timeout_s, env or {})
        if "address already in use" not in run.logs.lower():
            break
    return run


def results(launch: Launch, scenario: str) -> list[Any]:
    """The results of ``scenario`` from every rank, or a failure showing why not."""
    if launch.timed_out:
        pytest.fail(f"the workers did not finish within {launch.timeout_s} s\n{launch.logs}")
    out = []
    for rank in range(launch.world):
        err = launch.out / f"{scenario}_rank{rank}.err"
        if err.exists():
            pytest.fail(f"scenario {scenario!r} failed on rank {rank}:\n{err.read_text()}")
        path = launch.out / f"{scenario}_rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"scenario {scenario!r} left no result on rank {rank}\n{launch.logs}")
        out.append(torch.load(path))
    return out


def error_of(fn: Callable[[], Any]) -> str | None:
    """``"Type: message"`` of the exception ``fn()`` raises, or ``None`` if it returns."""
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def thread_names() -> list[str] | None:
    """The names of this process's threads (Linux), or ``None`` where ``/proc`` does not list them."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        return None
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, tid, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended while listing
            pass
    return sorted(names)


def exit_now(status: int) -> None:
    """Ends a worker process with ``status`` at once, without Python's finalisation (torch's
    module teardown takes about a second per process); results are saved and closed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_scenarios(
    scenarios: dict[str, Callable[[int, str], Any]],
    out: str,
    on_init: Callable[[Any], None] | None = None,
) -> int:
    """A worker's main: joins the process group, runs every scenario, saves each result or traceback.

    A failing scenario does not stop the others. ``TEST_SCENARIOS`` in the environment
    (names, comma-separated) runs only those: for working on one scenario. After :func:`functional_fp16.distributed.shutdown`
    the names of the threads still running are saved as the ``after_shutdown`` result.
    Returns the exit status (1 if any failed).
    """
    from functional_fp16 import distributed as ffd

    torch.set_num_threads(1)
    info = ffd.init_from_env(timeout=datetime.timedelta(seconds=60))
    if on_init is not None:
        on_init(info)
    failed = 0
    chosen = os.environ.get("TEST_SCENARIOS")
    if chosen:
        scenarios = {k: v for k, v in scenarios.items() if k in chosen.split(",")}
    try:
        for name, fn in scenarios.items():
            started = time.monotonic()
            try:
                result = fn(info.rank, out)
            except Exception:
                failed += 1
                with open(os.path.join(out, f"{name}_rank{info.rank}.err"), "w") as f:
                    f.write(traceback.format_exc())
                continue
            torch.save(result, os.path.join(out, f"{name}_rank{info.rank}.pt"))
            print(f"scenario {name}: {time.monotonic() - started:.1f} s", flush=True)
    finally:
        ffd.shutdown()
    torch.save(thread_names(), os.path.join(out, f"after_shutdown_rank{info.rank}.pt"))
    return 1 if failed else 0
