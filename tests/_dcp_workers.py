"""Worker side of the multi-process tests of ``tests/test_dcp_state.py``: one process per rank.

Run as ``python -m tests._dcp_workers OUT_DIR`` with the ``torchrun`` variables
set (2 ranks) and ``FF_DCP_DIR`` (a folder every rank sees). ``FF_DCP_MODE``
picks what the ranks do:

* ``kill:<rank>:<point>``: save generation 0 of a sharded state
  (``shard_state``) to ``FF_DCP_DIR/ckpt``, then generation 1, during which
  ``<rank>`` SIGKILLs itself at ``<point>`` (:data:`tests._dcp_kill.POINTS`);
  the launcher then kills the other rank, as ``torchrun`` would.
* ``hostile``: save a clean checkpoint, then load forged copies of it
  (``tests/_forged_dcp.py``) two ways: each rank from its own copy with only
  rank 1's forged, and both from one shared forged copy. Every rank records
  the error it got and how long it took (``hostile_rank<r>.pt``).
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch

from functional_fp16 import distributed as ffd
from tests import _dcp_kill
from tests import _forged_dcp as F
from tests._launch import exit_now

HOSTILE_CASES = ("global_system", "data_cut_to_a_third", "nested_key", "metadata_missing")
SHARED_CASES = ("data_junk", "global_mkdir")


def sharded(seed: int):
    return ffd.shard_state(F.make_state(seed))


def kill_run(rank: int, root: Path, who: int, point: str) -> None:
    ffd.save_dcp_state(sharded(0), root / "ckpt")
    torch.distributed.barrier()
    if rank == who:
        _dcp_kill.arm(point)
    ffd.save_dcp_state(sharded(1), root / "ckpt")
    raise AssertionError(f"rank {who} was to die at {point!r} but the save finished")


def _attempt(like, folder) -> tuple[str | None, float]:
    start = time.monotonic()
    try:
        ffd.load_dcp_state(like, folder)
        error = None
    except Exception as err:  # noqa: BLE001 - the test reads what it was
        error = f"{type(err).__name__}: {err}"
    return error, time.monotonic() - start


def hostile_run(rank: int, root: Path) -> dict:
    clean = root / "clean"
    ffd.save_dcp_state(sharded(0), clean)
    evidence = root / "evidence"
    evidence.mkdir(exist_ok=True)
    out = {}
    for case in HOSTILE_CASES:  # every rank its own copy, only rank 1's forged
        mine = root / f"{case}_rank{rank}"
        shutil.rmtree(mine, ignore_errors=True)
        shutil.copytree(clean, mine)
        if rank == 1:
            F.forge(case, clean, mine, evidence)
        torch.distributed.barrier()
        out[f"own:{case}"] = _attempt(sharded(7), mine)
    for case in SHARED_CASES:  # one forged copy that both ranks read
        shared = root / f"shared_{case}"
        if rank == 0:
            F.forge(case, clean, shared, evidence)
        torch.distributed.barrier()
        out[f"shared:{case}"] = _attempt(sharded(7), shared)
    out["ran"] = sorted(p.name for p in evidence.iterdir())
    out["clean"] = _attempt(sharded(7), clean)[0]
    return out


def main(out: str) -> int:
    torch.set_num_threads(1)
    info = ffd.init_from_env(timeout=datetime.timedelta(seconds=60))
    root = Path(os.environ["FF_DCP_DIR"])
    mode = os.environ["FF_DCP_MODE"]
    status = 0
    try:
        if mode.startswith("kill:"):
            _, who, point = mode.split(":")
            kill_run(info.rank, root, int(who), point)
        else:
            torch.save(
                hostile_run(info.rank, root), os.path.join(out, f"hostile_rank{info.rank}.pt")
            )
    except Exception:
        status = 1
        with open(os.path.join(out, f"{mode.replace(':', '_')}_rank{info.rank}.err"), "w") as f:
            f.write(traceback.format_exc())
    finally:
        ffd.shutdown()
    return status


if __name__ == "__main__":
    exit_now(main(sys.argv[1]))
