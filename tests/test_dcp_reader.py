"""DCP checkpoints read without trusting them (``distributed/dcp_reader.py``), in one process.

Every forged directory of ``tests/_forged_dcp.py`` is refused by
``load_dcp_state`` with a :class:`~functional_fp16.CheckpointCorruptError`
(an ``Exception``) naming the file, within 60 s, without running anything the
file names and without touching ``like``; the clean directory loads bit for
bit. The cases that would crash or exhaust a plain unpickler (a tuple nested
300 000 deep, a memoised size bomb) run in a child process, so that a
regression fails the test instead of taking the run down.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16.distributed import dcp_reader, dcp_state
from tests import _forged_dcp as F
from tests.helpers import bit_snapshot, bits

IN_CHILD = {"nested_key", "nested_enum", "size_bomb"}
CASES = sorted(F.forgeries(Path("/nonexistent")))
WHAT = {  # what each refusal says (a fragment of the message)
    "global_mkdir": "refers to the global 'posix.mkdir'",
    "global_system": "refers to the global 'posix.system'",
    "global_eval": "refers to the global 'builtins.eval'",
    "global_print": "refers to the global 'builtins.print'",
    "nested_key": "holds a dict key of type tuple",
    "nested_enum": "calls a constructor with other than plain arguments",
    "size_bomb": "builds more than its bytes can describe",
    "huge_length": "more than its 120 bytes of data need",
    "beyond_file": "lie beyond the end of __0_0.distcp",
    "outside_folder": "stored in '/etc/passwd', not a data file",
    "other_checkpoint": "stored in '../clean/__0_0.distcp', not a data file",
    "transform": "stored through a stream transform",
    "allocating_chunk": "__0_0.distcp, bytes [",
    "overlapping_chunks": "its chunks do not tile it",
    "chunk_outside_entry": "its chunks do not tile it",
    "huge_entry": "its chunks do not tile it",
    "metadata_cut": "not a DCP metadata pickle",
    "metadata_junk": ".metadata",
    "metadata_padded": "bytes follow the pickle's end",
    "metadata_symlink": "cannot be read",
    "metadata_missing": "missing (not a DCP checkpoint)",
    "data_cut_to_a_third": "truncated?",
    "data_junk": "DCP could not read it",
}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return F.save_clean(tmp_path_factory.mktemp("dcp") / "clean")


def test_every_forgery_has_an_expectation():
    assert set(WHAT) == set(CASES)


def test_the_clean_checkpoint_loads_bit_for_bit(clean):
    saved = F.make_state()
    loaded = ffd.load_dcp_state(F.fresh_like(), clean)
    assert len(bit_snapshot(loaded)) == len(bit_snapshot(saved)) > 0
    assert all(torch.equal(a, b) for a, b in zip(bit_snapshot(loaded), bit_snapshot(saved)))


def _refusal(case: str, clean: Path, tmp: Path) -> tuple[BaseException | None, float]:
    evidence = tmp / "evidence"
    evidence.mkdir(exist_ok=True)
    folder = F.forge(case, clean, tmp / case, evidence)
    like = F.fresh_like()
    before = bit_snapshot(like)
    start = time.monotonic()
    try:
        ffd.load_dcp_state(like, folder)
    except BaseException as err:  # noqa: BLE001 - the test asserts what it is
        error = err
    else:
        error = None
    elapsed = time.monotonic() - start
    assert all(torch.equal(a, b) for a, b in zip(bit_snapshot(like), before)), "like changed"
    assert not any(evidence.iterdir()), f"the forged file ran code: {list(evidence.iterdir())}"
    return error, elapsed


@pytest.mark.parametrize("case", sorted(set(CASES) - IN_CHILD))
def test_a_forged_directory_is_refused_naming_the_file(case, clean, tmp_path, capsys):
    error, elapsed = _refusal(case, clean, tmp_path)
    assert isinstance(error, ff.CheckpointCorruptError), repr(error)
    assert isinstance(error, Exception)
    assert WHAT[case] in str(error), str(error)
    assert case in str(error)  # the forged directory's path is named
    assert elapsed < 60
    assert "forged" not in capsys.readouterr().out  # print was not called


def test_dcp_errors_are_chained_to_the_corrupt_error(clean, tmp_path):
    error, _ = _refusal("data_junk", clean, tmp_path)
    assert isinstance(error.__cause__, CheckpointException)  # DCP's, a BaseException
    error, _ = _refusal("metadata_junk", clean, tmp_path)  # the unpickler's own error
    assert isinstance(error.__cause__, pickle.UnpicklingError), repr(error.__cause__)
    error, _ = _refusal("metadata_cut", clean, tmp_path)
    assert isinstance(error.__cause__, pickle.UnpicklingError), repr(error.__cause__)


_CHILD = """
import json, sys, time
from pathlib import Path
from tests import _forged_dcp as F
from functional_fp16 import distributed as ffd
clean, tmp, case = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
folder = F.forge(case, clean, tmp / case, tmp / "evidence")
start = time.monotonic()
try:
    ffd.load_dcp_state(F.fresh_like(), folder)
    out = None
except Exception as err:
    out = f"{type(err).__name__}: {err}"
print(json.dumps([out, time.monotonic() - start]))
"""


@pytest.mark.parametrize("case", sorted(IN_CHILD))
def test_a_forged_metadata_that_would_crash_a_plain_unpickler_is_refused(case, clean, tmp_path):
    (tmp_path / "evidence").mkdir()
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(clean), str(tmp_path), case],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    error, elapsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert error is not None and error.startswith("CheckpointCorruptError: "), error
    assert WHAT[case] in error and ".metadata" in error
    assert elapsed < 60


def test_a_like_of_another_shape_is_a_mismatch_naming_the_entry(clean):
    params = {"w": torch.zeros(6, 4).half(), "b": torch.zeros(5).half()}
    like = ff.fp16_init(params, ff.adamw(1e-3))
    with pytest.raises(
        ff.CheckpointMismatchError, match=r"'params\.w' is torch.float16 of shape \(6, 5\)"
    ):
        ffd.load_dcp_state(like, clean)


def test_a_like_with_an_entry_the_checkpoint_lacks_is_a_mismatch(clean):
    params = {**F.make_state().params, "extra": torch.zeros(2).half()}
    with pytest.raises(ff.CheckpointMismatchError, match="holds no entry 'params.extra'"):
        ffd.load_dcp_state(ff.fp16_init(params, ff.adamw(1e-3)), clean)


def test_checkpoint_id_must_be_a_path():
    with pytest.raises(TypeError, match="checkpoint_id must be a directory path"):
        ffd.load_dcp_state(F.make_state(), 3)
    with pytest.raises(TypeError, match="checkpoint_id must be a directory path"):
        ffd.save_dcp_state(F.make_state(), None)


def test_the_reader_plugs_into_dcp_load_as_its_storage_reader(clean):
    import torch.distributed.checkpoint as dcp

    target = {"master": {k: torch.empty_like(v) for k, v in F.make_state().master.items()}}
    with dcp_state.one_process_is_intended():
        dcp.load(target, storage_reader=dcp_reader.CheckedReader(clean), no_dist=True)
    for k, v in F.make_state().master.items():
        assert torch.equal(bits(target["master"][k]), bits(v))


def test_per_rank_metadata_files_are_never_read(clean):
    with pytest.raises(ff.CheckpointCorruptError):
        dcp_reader.CheckedReader(clean).read_metadata(rank=0)


@pytest.mark.parametrize(
    "chunks, size, ok",
    [
        ([((0,), (3,)), ((3,), (2,))], (5,), True),
        ([((0, 0), (2, 5)), ((2, 0), (2, 5))], (4, 5), True),
        ([((0, 0), (4, 2)), ((0, 2), (4, 3))], (4, 5), True),  # column shards
        ([((0, 0), (2, 2)), ((0, 2), (2, 3)), ((2, 0), (2, 5))], (4, 5), True),
        ([((0, 0), (3, 5)), ((2, 0), (1, 5))], (4, 5), False),  # overlap + gap
        ([((0, 0), (2, 3)), ((0, 2), (2, 3))], (2, 5), False),  # columns overlap, one missing
        ([((0,), (1,)), ((1,), (0,))], (1,), True),  # a rank's empty shard
        ([((0,), (1,)), ((2,), (0,))], (1,), False),  # an empty shard outside
        ([((0,), (5,)), ((0,), (5,))], (10,), False),  # twice the same half
        ([((0,), (6,))], (5,), False),
        ([((), ())], (), True),
        ([((), ()), ((), ())], (), False),
    ],
)
def test_chunks_tile_a_tensor_exactly_once(chunks, size, ok):
    assert dcp_reader._tiles(chunks, size) is ok
