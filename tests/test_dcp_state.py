"""``save_dcp_state`` is atomic, and a damaged directory fails every rank (``distributed/dcp_state.py``).

A save is killed with SIGKILL at each point of ``tests/_dcp_kill.py``, in one
process and at 2 gloo ranks (``tests/_dcp_workers.py``): the directory then
holds the previous checkpoint, bit for bit (or the new one, once the swap has
happened), and the next save removes what the killed one left. Forged
directories at 2 ranks, where only one rank's copy is damaged, make every
rank raise ``CheckpointCorruptError`` within 60 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from functional_fp16 import distributed as ffd
from functional_fp16.checkpoint import atomic_file
from tests import _dcp_kill
from tests import _forged_dcp as F
from tests._launch import launch_workers
from tests.helpers import bit_snapshot

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_dcp_workers.py")


def assert_holds(folder: Path, seed: int) -> None:
    """``folder`` loads, and equals ``F.make_state(seed)`` bit for bit."""
    loaded = ffd.load_dcp_state(F.fresh_like(), folder)
    want = bit_snapshot(F.make_state(seed))
    got = bit_snapshot(loaded)
    assert len(got) == len(want) > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{folder} is not generation {seed}"


def temporaries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".tmp"))


_CHILD = """
import sys
from pathlib import Path
from tests import _dcp_kill, _forged_dcp as F
from functional_fp16 import distributed as ffd
_dcp_kill.arm(sys.argv[2])
ffd.save_dcp_state(F.make_state(1), Path(sys.argv[1]))
print("the save finished")
"""


@pytest.mark.parametrize("point", _dcp_kill.POINTS)
def test_a_save_killed_in_one_process_leaves_a_loadable_checkpoint(point, tmp_path):
    ckpt = tmp_path / "ckpt"
    ffd.save_dcp_state(F.make_state(0), ckpt)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(ckpt), point],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert_holds(ckpt, 1 if point == "swapped" else 0)
    assert temporaries(tmp_path), "the killed save left nothing: it was not killed mid-save"
    ffd.save_dcp_state(F.make_state(2), ckpt)
    assert temporaries(tmp_path) == []
    assert_holds(ckpt, 2)


@pytest.mark.distributed
@pytest.mark.parametrize(("who", "point"), [(1, "data"), (0, "metadata"), (0, "swapped")])
def test_a_save_killed_at_two_ranks_leaves_a_loadable_checkpoint(who, point, tmp_path):
    run = launch_workers(
        WORKER,
        tmp_path / "out",
        world=2,
        timeout_s=120,
        env={"FF_DCP_DIR": str(tmp_path), "FF_DCP_MODE": f"kill:{who}:{point}"},
    )
    assert not run.timed_out, run.logs
    # The killed rank never got to report; the other one was killed by the launcher, or saw
    # its peer vanish first (gloo: connection reset) and raised. Rank 0, if it survived,
    # removed the temporary itself (the launcher may kill it first: not checked).
    reports = {p.name: p.read_text() for p in run.out.glob("*.err")}
    assert f"_rank{who}.err" not in " ".join(reports), reports
    assert_holds(tmp_path / "ckpt", 1 if point == "swapped" else 0)
    if who == 0:
        assert temporaries(tmp_path), run.logs
    ffd.save_dcp_state(F.make_state(2), tmp_path / "ckpt")  # the next save, one process
    assert temporaries(tmp_path) == []
    assert_holds(tmp_path / "ckpt", 2)


def test_a_failed_save_keeps_the_previous_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ffd.save_dcp_state(F.make_state(0), ckpt)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(RuntimeError, match="No space left on device") as info:
        ffd.save_dcp_state(F.make_state(1), ckpt)
    assert isinstance(info.value, Exception)
    monkeypatch.undo()
    assert temporaries(tmp_path) == []
    assert_holds(ckpt, 0)


def test_a_save_replaces_a_checkpoint_and_keeps_its_mode(tmp_path):
    ckpt = tmp_path / "ckpt"
    ffd.save_dcp_state(F.make_state(0), ckpt)
    os.chmod(ckpt, 0o750)
    ffd.save_dcp_state(F.make_state(1), ckpt)
    assert (ckpt.stat().st_mode & 0o777) == 0o750
    assert sorted(p.name for p in ckpt.iterdir()) == [".metadata", "__0_0.distcp"]
    assert_holds(ckpt, 1)


def test_a_save_over_a_file_is_refused_and_leaves_it(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a directory")
    with pytest.raises(NotADirectoryError):
        ffd.save_dcp_state(F.make_state(0), path)
    assert path.read_text() == "not a directory"
    assert temporaries(tmp_path) == []


def test_temporaries_of_live_writers_and_other_hosts_are_kept(tmp_path):
    ckpt = tmp_path / "ckpt"
    host = atomic_file._host()
    live = tmp_path / f".ckpt.{host}.{os.getpid()}.abc_1.tmp"
    other = tmp_path / ".ckpt.otherhost.12345.abc_2.tmp"
    dead = tmp_path / f".other.{host}.{2**22 - 1}.abc_3.tmp"  # no such pid
    for d in (live, other, dead):
        d.mkdir()
        (d / "__0_0.distcp").write_bytes(b"x")
    ffd.save_dcp_state(F.make_state(0), ckpt)
    assert live.exists() and other.exists() and not dead.exists()


def test_without_the_exchange_the_old_directory_is_still_replaced(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ffd.save_dcp_state(F.make_state(0), ckpt)
    monkeypatch.setattr(atomic_file, "_exchange", lambda a, b: False)
    ffd.save_dcp_state(F.make_state(1), ckpt)
    assert temporaries(tmp_path) == []
    assert_holds(ckpt, 1)


def test_the_exchange_swaps_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not atomic_file._exchange(str(a), str(b)):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available here")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("dcp_hostile")
    run = launch_workers(
        WORKER, root / "out", world=2, timeout_s=240,
        env={"FF_DCP_DIR": str(root), "FF_DCP_MODE": "hostile"},
    )  # fmt: skip
    assert not run.timed_out, run.logs
    errors = list(run.out.glob("*.err"))
    assert not errors, errors[0].read_text()
    return [torch.load(run.out / f"hostile_rank{r}.pt") for r in range(2)]


@pytest.mark.distributed
def test_one_damaged_rank_makes_every_rank_raise_promptly(hostile):
    from tests._dcp_workers import HOSTILE_CASES, SHARED_CASES

    keys = [f"own:{c}" for c in HOSTILE_CASES] + [f"shared:{c}" for c in SHARED_CASES]
    for rank, out in enumerate(hostile):
        for key in keys:
            error, elapsed = out[key]
            assert error is not None and error.startswith("CheckpointCorruptError: "), (
                rank,
                key,
                error,
            )
            assert elapsed < 60, (rank, key, elapsed)
        assert out["ran"] == [], out["ran"]
        assert out["clean"] is None, out["clean"]
    for key in (f"own:{c}" for c in HOSTILE_CASES):  # rank 0's copy was clean: told of rank 1
        assert "rank 1: " in hostile[0][key][0], hostile[0][key][0]
