"""Crash safety: SIGKILL in the middle of a checkpoint write, and bit-identical resume.

``test_sigkill_mid_write_keeps_the_last_checkpoint`` kills a writer process
(``tests/_checkpoint_writer.py``) with SIGKILL at random moments while it
saves a 24 MiB checkpoint over and over; after every kill the checkpoint on
disk must load, validate against its template and equal, bitwise, the last
generation that was completely written (or the one whose rename had just
happened). ``test_killed_saves_of_per_epoch_names_leave_no_temporaries``
kills writers of one new file per epoch and checks that the temporary
files of killed saves are removed by later saves of other names.
``test_interrupted_runs_resume_bit_identically`` stops a small training loop
at random steps, resumes it from its last checkpoint, and compares the end
state with an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves, tree_paths
from tests.helpers import bits

WRITER = Path(__file__).with_name("_checkpoint_writer.py")
KILLS = 40
KILL_BUDGET_S = 45.0  # stop early (but after at least MIN_KILLS) on a slow machine
MIN_KILLS = 20


def assert_bitwise(a, b) -> None:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb)
    for path, x, y in zip(tree_paths(a), la, lb, strict=True):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, path
            assert torch.equal(bits(x), bits(y)), f"{path} differs"
        else:
            assert type(x) is type(y) and x == y, path


def _load_writer_module():
    spec = importlib.util.spec_from_file_location("_checkpoint_writer", WRITER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Server:
    """The writer process, with its output read on a thread."""

    def __init__(self, path: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(WRITER), str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next_line(120.0) == "ready"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def next_line(self, timeout: float = 30.0) -> str:
        return self.lines.get(timeout=timeout)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the writer forks its children")
def test_sigkill_mid_write_keeps_the_last_checkpoint(tmp_path):
    writer = _load_writer_module()
    path = tmp_path / "run.ckpt"
    like = writer.payload(0)
    ff.save_checkpoint(path, like)
    server = _Server(path)
    rng = random.Random(6)
    gen = 0
    kills = mid_write = before_write = saves_seen = 0
    partial_rejected = partial_complete = 0
    start = time.monotonic()
    try:
        while kills < KILLS and (kills < MIN_KILLS or time.monotonic() - start < KILL_BUDGET_S):
            server.send(f"fork {gen}")
            line = server.next_line()
            assert line.startswith("pid "), line
            pid = int(line.split()[1])
            time.sleep(rng.uniform(0.0, 0.45))
            os.kill(pid, signal.SIGKILL)
            server.send(f"reap {pid}")
            last_saved = gen
            while True:
                line = server.next_line()
                if line.startswith("saved "):
                    last_saved = int(line.split()[1])
                    saves_seen += 1
                elif line.startswith("reaped "):
                    assert line == f"reaped {pid} {int(signal.SIGKILL)}", line
                    break
            kills += 1

            leftovers = [p for p in tmp_path.iterdir() if p.name != path.name]
            assert len(leftovers) <= 1, leftovers
            assert all(p.name.startswith(".run.ckpt.") and p.suffix == ".tmp" for p in leftovers)
            if leftovers:
                mid_write += 1
                try:  # a half-written temporary file is refused, never half-read
                    ff.load_checkpoint(leftovers[0], like)
                    partial_complete += 1  # killed after its fsync, before the rename
                except ff.CheckpointCorruptError:
                    partial_rejected += 1
                leftovers[0].unlink()
            else:
                before_write += 1

            loaded = ff.load_checkpoint(path, like)
            # The file is the last completed save, or the next one if the kill
            # came after its rename but before the child could report it.
            assert last_saved <= loaded["gen"] <= last_saved + 1, (last_saved, loaded["gen"])
            assert loaded["tag"] == f"generation {loaded['gen']}"
            assert_bitwise(loaded, writer.payload(loaded["gen"]))
            gen = loaded["gen"]
    finally:
        server.close()
    print(
        f"\n[crash safety] kills={kills} killed_mid_write={mid_write} "
        f"killed_outside_write={before_write} saves_completed={saves_seen} "
        f"partial_files_rejected={partial_rejected} partial_files_complete={partial_complete} "
        f"final_generation={gen} seconds={time.monotonic() - start:.1f}"
    )
    assert kills >= MIN_KILLS
    assert mid_write >= 5, "too few kills landed inside a write to prove anything"
    assert partial_rejected >= 1
    assert gen > 0


# -- an interrupted training loop resumes bit-identically -------------------------------


class Layer(NamedTuple):
    weight: torch.Tensor
    bias: torch.Tensor


STEPS = 120
EVERY = 10  # checkpoint period


class Interrupted(Exception):
    pass


def init_params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": Layer(torch.randn(8, 4, generator=g) * 0.5, torch.zeros(8)),
        "out": Layer(torch.randn(1, 8, generator=g) * 0.5, torch.zeros(1)),
    }


def loss_fn(params, x, y):
    h = torch.tanh(x @ params["hidden"].weight.float().T + params["hidden"].bias.float())
    out = h @ params["out"].weight.float().T + params["out"].bias.float()
    return torch.mean((out - y) ** 2)


def next_batch(gen: torch.Generator):
    x = torch.randn(16, 4, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    if torch.rand((), generator=gen) < 0.1:  # a poisoned batch: overflow or NaN
        x[0, 0] = float("nan") if torch.rand((), generator=gen) < 0.5 else 3e38
    return x, y


def fresh(seed: int):
    tx = ff.chain(ff.clip_by_global_norm(5.0), ff.sgd(0.05, momentum=0.9, nesterov=True))
    state = ff.fp16_init(init_params(seed), tx, ff.DynamicLossScale(2.0**12, growth_interval=5))
    gen = torch.Generator().manual_seed(seed + 1)
    monitor = ff.StuckScaleMonitor(patience=5)
    monitor.observe(state)
    return {
        "state": state,
        "step": 0,
        "skipped": 0,
        "rng": gen.get_state(),
        "monitor": monitor.state,
    }


def train(run: dict, stop: int, path: Path | None, interrupt_at: int | None) -> dict:
    state, step, skipped = run["state"], run["step"], run["skipped"]
    gen = torch.Generator()
    gen.set_state(run["rng"])
    monitor = ff.StuckScaleMonitor(patience=5, state=run["monitor"])
    while step < stop:
        if step == interrupt_at:
            raise Interrupted
        x, y = next_batch(gen)

        def scaled(params, x=x, y=y, s=state.loss_scale):
            loss = loss_fn(params, x, y)
            return s.scale(loss), loss

        grads, loss = torch.func.grad(scaled, has_aux=True)(state.params)
        state = ff.fp16_update(state, grads, loss=loss)
        monitor.observe(state, loss)
        step += 1
        skipped += int(not bool(state.grads_finite))
        if step % EVERY == 0:
            monitor.check()  # where the loop talks to the host anyway
        run = {
            "state": state,
            "step": step,
            "skipped": skipped,
            "rng": gen.get_state(),
            "monitor": monitor.state,
        }
        if path is not None and step % EVERY == 0:
            ff.save_checkpoint(path, run)
    return run


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interrupted_runs_resume_bit_identically(tmp_path, seed):
    reference = train(fresh(seed), STEPS, None, None)
    rng = random.Random(seed)
    interrupts = sorted(rng.sample(range(1, STEPS), 4))
    path = tmp_path / "train.ckpt"
    run, resumes = fresh(seed), 0
    for stop_at in interrupts + [None]:
        try:
            run = train(run, STEPS, path, stop_at)
        except Interrupted:
            # Everything in memory is lost; start again from the file, or from
            # scratch if none was written yet.
            resumes += 1
            if path.exists():
                template = fresh(seed + 100)
                run = ff.load_checkpoint(path, template)
                assert run["state"].tx is template["state"].tx
            else:
                run = fresh(seed)
            assert run["step"] == stop_at // EVERY * EVERY
    assert resumes == 4
    assert int(run["state"].step) == STEPS
    assert_bitwise(run, reference)
    # The runs met poisoned batches, so skips and backoffs crossed the resumes.
    assert reference["skipped"] >= 3


def test_a_save_removes_temporaries_of_dead_writers_only(tmp_path):
    import socket

    path = tmp_path / "run.ckpt"
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    host = socket.gethostname().replace(".", "_")
    stale = tmp_path / f".run.ckpt.{host}.{dead}.k3j2.tmp"
    other = tmp_path / f".checkpoint_epoch_007.pt.{host}.{dead}.zz_9.tmp"  # another name's
    dotted = tmp_path / f".a.b.{host}.c.pt.{host}.{dead}.q1.tmp"  # the host's name in the name
    live = tmp_path / f".run.ckpt.{host}.{os.getppid()}.a1b2.tmp"  # a running writer
    live_other = tmp_path / f".epoch_002.pt.{host}.{os.getpid()}.x1.tmp"  # this very process
    remote = tmp_path / f".run.ckpt.otherhost.{dead}.x9y8.tmp"  # another machine's writer
    # Files that are not temporaries of a writer: left alone whatever their names say.
    unrelated = [
        tmp_path / f".notes.{host}.{dead}.tmp",  # no random part
        tmp_path / f".notes.{host}.{dead}.a.txt",
        tmp_path / f"notes.{host}.{dead}.ab.tmp.bak",
        tmp_path / f".{host}.{dead}.ab.tmp",  # no target name
        tmp_path / f".notes.{host}.12x.ab.tmp",
        tmp_path / f".notes.{host}.{dead}.A-B.tmp",  # not tempfile's characters
        tmp_path / f".notes.{host}.{10**30}.ab.tmp",  # no such pid
    ]
    for f in (stale, other, dotted, live, live_other, remote, *unrelated):
        f.write_bytes(b"half a checkpoint")
    ff.save_checkpoint(path, {"x": torch.ones(2)})
    assert not stale.exists() and not other.exists() and not dotted.exists()
    assert live.exists() and live_other.exists() and remote.exists()
    assert all(f.exists() for f in unrelated)
    assert torch.equal(ff.load_checkpoint(path, {"x": torch.zeros(2)})["x"], torch.ones(2))


EPOCH_KILLS_MAX = 30
EPOCH_MID_WRITE = 3  # kills that must land inside a write


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the writer forks its children")
def test_killed_saves_of_per_epoch_names_leave_no_temporaries(tmp_path):
    """Runs write ``checkpoint_epoch_NNN.pt``, one new name per epoch, and are killed mid-write.

    Each run here numbers its epochs on from the last one any run began, so a
    killed save's name is never saved again: only a cleanup across names
    removes its temporary file. Every run's first save removes the one the
    run before it left, so after each kill at most the killed writer's own
    temporary file is there. Then a run resumes from the newest checkpoint,
    its next save removes the last one, and no ``.tmp`` file is left.
    """
    writer = _load_writer_module()
    server = _Server(tmp_path / "anchor")  # the children write beside it
    rng = random.Random(21)
    epoch, kills, mid_write, left = 1, 0, 0, []
    try:
        while kills < EPOCH_KILLS_MAX and not (mid_write >= EPOCH_MID_WRITE and left):
            server.send(f"epochs {epoch}")
            line = server.next_line()
            assert line.startswith("pid "), line
            pid = int(line.split()[1])
            time.sleep(rng.uniform(0.02, 0.4))
            os.kill(pid, signal.SIGKILL)
            server.send(f"reap {pid}")
            last_saved = epoch - 1
            saved_any = False
            while True:
                line = server.next_line()
                if line.startswith("saved "):
                    last_saved = int(line.split()[1])
                    saved_any = True
                elif line.startswith("reaped "):
                    break
            kills += 1
            before, left = (
                left,
                sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")),
            )
            assert len(left) <= 1, left
            if left and not saved_any and left == before:
                # Killed before its first save began (building the payload on a loaded
                # machine): nothing was cleaned yet, and the temporary is the last run's.
                epoch = last_saved + 3
                continue
            if left:
                mid_write += 1
                # The killed save's file: of the epoch after the last one reported
                # (or the one after that, killed before it could report).
                named = [writer.EPOCH_NAME.format(last_saved + k) for k in (1, 2)]
                assert any(left[0].startswith(f".{n}.") for n in named), (left, named)
            epoch = last_saved + 3  # past the save that was killed
    finally:
        server.close()
    assert mid_write >= EPOCH_MID_WRITE, f"only {mid_write} of {kills} kills landed in a write"
    assert len(left) == 1
    # Resume from the newest checkpoint, as a restarted run does, and save the next epoch.
    newest = max(tmp_path.glob("checkpoint_epoch_*.pt"))
    resumed = ff.load_checkpoint(newest, writer.payload(0))
    assert newest.name == writer.EPOCH_NAME.format(resumed["gen"])
    assert_bitwise(resumed, writer.payload(resumed["gen"]))
    ff.save_checkpoint(tmp_path / writer.EPOCH_NAME.format(epoch), writer.payload(epoch))
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    print(
        f"\n[per-epoch kills] kills={kills} killed_mid_write={mid_write} resumed_from={newest.name}"
    )
