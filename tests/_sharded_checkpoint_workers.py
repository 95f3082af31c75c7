"""Worker side of ``tests/test_sharded_checkpoints.py``: one process per rank, started by the test.

Run as ``python -m tests._sharded_checkpoint_workers OUT_DIR`` with the ``torchrun`` variables
and ``FF_SCKPT_DIR`` (the checkpoints' directory) set. ``FF_SCKPT_SCENARIOS``
names the scenarios to run, in order (comma-separated). Each scenario writes
``OUT_DIR/<scenario>_rank<r>.pt`` or ``.err``; the last scenario of the
2-process run kills rank 1 in the middle of a save, so that run ends there.

The state has FP16 and FP32 working leaves (two dtype groups), a channels-last
4-D leaf, an empty leaf and leaves smaller than the number of ranks; the
optimiser is AdamW after a global-norm clip (two moments, counters).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import sys
import time
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem

import functional_fp16 as ff
from functional_fp16 import distributed as ffd
from functional_fp16.distributed import sharded_checkpoints
from tests import _shard_workers as SW
from tests._launch import error_of, exit_now, run_scenarios

LR = 1e-2
FIRST_STEPS = 3  # steps before the 1-process checkpoint
MORE_STEPS = 2  # steps taken after each resume


def make_tx(lr: float = LR) -> ff.GradientTransformation:
    return ff.chain(ff.clip_by_global_norm(0.05), ff.adamw(lr, mask=SW.ndim_mask))


def make_state(*, lr: float = LR, w1_shape=(7, 5), s_dtype=torch.float32, extra: bool = False):
    """The awkward state of ``tests/_shard_workers.py``, with one thing changed on request."""
    params = SW.make_params(0)
    params["w1"] = torch.randn(w1_shape, generator=torch.Generator().manual_seed(3)) * 0.5
    g = torch.Generator().manual_seed(7)
    params["k"] = (torch.randn(3, 2, 3, 3, generator=g) * 0.5).to(memory_format=torch.channels_last)
    params["z"] = torch.zeros(0)
    params["s"] = torch.randn(4, generator=g)
    if extra:
        params["extra"] = torch.zeros(2)
    scale = ff.DynamicLossScale(2.0**10, growth_interval=2)
    state = ff.fp16_init(params, make_tx(lr), scale)
    return state.replace(params={**state.params, "s": state.master["s"].to(s_dtype)})


def advance(state: ff.FP16State, step: int) -> ff.FP16State:
    """One sharded step with the same integer gradients on every rank (an exact mean)."""
    return ffd.sharded_update(state, SW.awkward_grads(state, step, 0), comm_dtype=torch.float32)


def raw(tree: Any) -> list[Any]:
    """Every leaf of ``tree``: tensors cloned (memory format kept), values as they are."""
    return [
        x.detach().clone() if isinstance(x, torch.Tensor) else x
        for x in optree.tree_leaves(tree, namespace=ff.NAMESPACE)
    ]


def like(**changes: Any) -> dict[str, Any]:
    """The template: a fresh state, sharded for this group."""
    return {"state": ffd.shard_state(make_state(**changes)), "epoch": 0}


def like_with_lr(lr: float) -> dict[str, Any]:
    """The template with another learning rate, set after sharding (so on this rank alone)."""
    template = like()
    return {**template, "state": template["state"].replace(tx=make_tx(lr))}


def ckpt(name: str) -> str:
    return os.path.join(os.environ["FF_SCKPT_DIR"], name)


def step_folders(name: str) -> list[str]:
    return sorted(n for n in os.listdir(ckpt(name)) if n.startswith("step-"))


def load_both(name: str, full: str, template: dict[str, Any]) -> dict[str, Any]:
    """The sharded load of ``name`` and, as the reference, the whole-file load of ``full``
    sharded for this group (``shard_state(unshard(saved))``)."""
    loaded = ffd.load_checkpoint_sharded(ckpt(name), template)
    expected = ffd.load_checkpoint_broadcast(ckpt(full), template)
    same = optree.tree_structure(loaded, namespace=ff.NAMESPACE) == optree.tree_structure(
        expected, namespace=ff.NAMESPACE
    )
    return {
        "loaded": loaded,
        "result": {
            "same_structure": same,
            "loaded": raw(loaded),
            "expected": raw(expected),
            "fresh": raw(template),
            "layout": dict(loaded["state"].shard._asdict()),
            "epoch": loaded["epoch"],
        },
    }


def save_both(name: str, full: str, state: ff.FP16State, epoch: int, **kwargs: Any) -> None:
    tree = {"state": state, "epoch": epoch}
    ffd.save_checkpoint_sharded(ckpt(name), tree, **kwargs)
    ffd.save_checkpoint_rank0(ckpt(full), tree)


# -- 2 processes -------------------------------------------------------------------


def scenario_resume_one(rank: int, out: str) -> dict[str, Any]:
    """1 -> 2: load the one-process checkpoint, step, save at 2 ranks."""
    both = load_both("ckpt", "one_full.ckpt", like())
    state = both["loaded"]["state"]
    for step in range(FIRST_STEPS, FIRST_STEPS + MORE_STEPS):
        state = advance(state, step)
    save_both("ckpt", "two_full.ckpt", state, FIRST_STEPS + MORE_STEPS)
    return {**both["result"], "folders": step_folders("ckpt")}


def _copy_of(name: str, copy: str) -> str:
    """Rank 0 copies checkpoint ``name`` to ``copy``; every rank waits for it."""
    if dist.get_rank() == 0:
        shutil.rmtree(ckpt(copy), ignore_errors=True)
        shutil.copytree(ckpt(name), ckpt(copy))
    dist.barrier()
    return ckpt(copy)


def _dcp_folder(path: str) -> str:
    return os.path.join(path, [n for n in os.listdir(path) if n.startswith("step-")][0])


def scenario_refusals(rank: int, out: str) -> dict[str, Any]:
    """Loads and saves that must fail on every rank together, each naming what is wrong."""
    odd = rank == dist.get_world_size() - 1
    path = ckpt("ckpt")
    load = ffd.load_checkpoint_sharded
    errors: dict[str, Any] = {
        "lr": error_of(lambda: load(path, like(lr=2e-2))),
        "shape": error_of(lambda: load(path, like(w1_shape=(7, 6)))),
        "dtype": error_of(lambda: load(path, like(s_dtype=torch.float16))),
        "extra_leaf": error_of(lambda: load(path, {**like(), "extra": torch.zeros(2)})),
        "value_type": error_of(lambda: load(path, {**like(), "epoch": 0.0})),
        "missing": error_of(lambda: load(ckpt("nowhere"), like())),
        "one_rank_lr": error_of(lambda: load(path, like_with_lr(2e-2 if odd else LR))),
        "one_rank_lr_unchecked": error_of(
            lambda: load(path, like_with_lr(2e-2 if odd else LR), check_tx=False)
        ),
    }
    # A marker edited by hand (its checksum no longer matches).
    bad = _copy_of("ckpt", "edited_marker")
    if rank == 0:
        marker = os.path.join(bad, sharded_checkpoints.MARKER)
        text = open(marker).read().replace('"shape": [7, 5]', '"shape": [5, 7]')
        open(marker, "w").write(text)
    dist.barrier()
    errors["edited_marker"] = error_of(lambda: load(bad, like()))
    # DCP's metadata without one chunk of a master leaf: the chunks no longer tile it.
    bad = _copy_of("ckpt", "lost_chunk")
    if rank == 0:
        meta_path = os.path.join(_dcp_folder(bad), ".metadata")
        with open(meta_path, "rb") as f:
            meta = pickle.load(f)
        meta.state_dict_metadata["['state'].master['w1']"].chunks.pop()
        with open(meta_path, "wb") as f:
            pickle.dump(meta, f)
    dist.barrier()
    errors["lost_chunk"] = error_of(lambda: load(bad, like()))
    # A data file cut short.
    bad = _copy_of("ckpt", "truncated")
    if rank == 0:
        data = os.path.join(_dcp_folder(bad), "__1_0.distcp")
        os.truncate(data, os.path.getsize(data) // 2)
    dist.barrier()
    errors["truncated"] = error_of(lambda: load(bad, like()))
    # A data file whose first chunk no longer starts with a zip header: found while DCP reads.
    bad = _copy_of("ckpt", "garbled")
    if rank == 0:
        with open(os.path.join(_dcp_folder(bad), "__1_0.distcp"), "r+b") as f:
            f.write(b"XXXX")
    dist.barrier()
    errors["garbled"] = error_of(lambda: load(bad, like()))
    # Saves.
    state = ffd.shard_state(make_state())
    errors["save_object"] = error_of(
        lambda: ffd.save_checkpoint_sharded(ckpt("unused"), {"state": state, "obj": object()})
    )
    errors["save_one_rank_extra"] = error_of(
        lambda: ffd.save_checkpoint_sharded(
            ckpt("unused"), {"state": state, **({"extra": 1} if odd else {})}
        )
    )
    errors["save_to_a_file"] = error_of(
        lambda: ffd.save_checkpoint_sharded(ckpt("two_full.ckpt"), {"state": state})
    )
    # Nobody was left in a collective: a good load still works, and is unchanged.
    loaded = load(path, like())
    return {
        "errors": errors,
        "after": raw(loaded),
        "expected": raw(ffd.load_checkpoint_broadcast(ckpt("two_full.ckpt"), like())),
        "unused_exists": os.path.exists(ckpt("unused")),
    }


def scenario_one_rank_arguments(rank: int, out: str) -> dict[str, Any]:
    """One rank (the last) passes an invalid argument: every rank raises at once, naming it."""
    odd = rank == dist.get_world_size() - 1
    state = ffd.shard_state(make_state())
    save, load = ffd.save_checkpoint_sharded, ffd.load_checkpoint_sharded
    path = ckpt("ckpt")
    cases = {
        "save_bucket_bytes": lambda: save(
            ckpt("unused"), {"state": state}, bucket_bytes=0 if odd else 1024
        ),
        "save_path_type": lambda: save(3.5 if odd else ckpt("unused"), {"state": state}),
        "load_path_type": lambda: load(None if odd else path, like()),
        "load_bytes_path": lambda: load(os.fsencode(path) if odd else path, like()),
    }
    result: dict[str, Any] = {case: _timed(fn) for case, fn in cases.items()}
    # Nobody was left in a collective: a good load still works.
    result["after"] = raw(load(path, like()))
    result["expected"] = raw(ffd.load_checkpoint_broadcast(ckpt("two_full.ckpt"), like()))
    result["unused_exists"] = os.path.exists(ckpt("unused"))
    return result


def _next_state() -> ff.FP16State:
    state = ffd.load_checkpoint_sharded(ckpt("ckpt"), like())["state"]
    return advance(state, FIRST_STEPS + MORE_STEPS)


def scenario_writer_raises(rank: int, out: str) -> dict[str, Any]:
    """A save whose writer fails on the last rank: every rank raises, the old checkpoint stays."""
    state = _next_state()
    original = filesystem._write_item

    def failing(*args, **kwargs):
        raise OSError("injected write failure")

    if rank == dist.get_world_size() - 1:
        filesystem._write_item = failing
    try:
        error = error_of(lambda: ffd.save_checkpoint_sharded(ckpt("ckpt"), {"state": state}))
    finally:
        filesystem._write_item = original
    return {
        "error": error,
        "after": raw(ffd.load_checkpoint_sharded(ckpt("ckpt"), like())),
        "expected": raw(ffd.load_checkpoint_broadcast(ckpt("two_full.ckpt"), like())),
        "folders": step_folders("ckpt"),
    }


def scenario_commit_raises(rank: int, out: str) -> dict[str, Any]:
    """Every rank's data written, then the marker's commit fails on rank 0."""
    state = _next_state()
    original = sharded_checkpoints.commit_marker

    def failing(directory, body):
        raise OSError("injected commit failure")

    if rank == 0:
        sharded_checkpoints.commit_marker = failing
    try:
        error = error_of(
            lambda: ffd.save_checkpoint_sharded(ckpt("ckpt"), {"state": state, "epoch": 9})
        )
    finally:
        sharded_checkpoints.commit_marker = original
    return {
        "error": error,
        "after": raw(ffd.load_checkpoint_sharded(ckpt("ckpt"), like())),
        "expected": raw(ffd.load_checkpoint_broadcast(ckpt("two_full.ckpt"), like())),
        "folders": step_folders("ckpt"),
    }


def scenario_killed(rank: int, out: str) -> None:
    """The last rank is killed (SIGKILL) after writing its first chunk of a save."""
    state = _next_state()
    original = filesystem._write_item

    def write_then_die(*args, **kwargs):
        result = original(*args, **kwargs)
        args[1].flush()
        os.kill(os.getpid(), signal.SIGKILL)
        return result

    if rank == dist.get_world_size() - 1:
        filesystem._write_item = write_then_die
    ffd.save_checkpoint_sharded(ckpt("ckpt"), {"state": state, "epoch": 9})
    time.sleep(60)  # rank 0 waits here (or in the save) until the test kills it


# -- 3 processes -------------------------------------------------------------------


def scenario_resume_two(rank: int, out: str) -> dict[str, Any]:
    """2 -> 3: the checkpoint the killed save left in place loads; a save at 3 ranks cleans up."""
    before = sorted(os.listdir(ckpt("ckpt")))
    both = load_both("ckpt", "two_full.ckpt", like())
    state = both["loaded"]["state"]
    for step in range(FIRST_STEPS + MORE_STEPS, FIRST_STEPS + 2 * MORE_STEPS):
        state = advance(state, step)
    save_both("ckpt", "three_full.ckpt", state, FIRST_STEPS + 2 * MORE_STEPS, bucket_bytes=16)
    after = sorted(os.listdir(ckpt("ckpt")))
    # A replicated state saves the same way (each element written once) and loads
    # sharded; a sharded checkpoint loads into a replicated template.
    full = ffd.unshard_state(state)
    ffd.save_checkpoint_sharded(ckpt("replicated"), {"state": full}, bucket_bytes=16)
    as_sharded = ffd.load_checkpoint_sharded(ckpt("replicated"), {"state": like()["state"]})
    as_full = ffd.load_checkpoint_sharded(ckpt("ckpt"), {"state": make_state(), "epoch": 0})
    return {
        **both["result"],
        "before": before,
        "after": after,
        "replicated_to_sharded": (raw(as_sharded), raw({"state": ffd.shard_state(full)})),
        "sharded_to_replicated": (raw(as_full), raw({"state": full, "epoch": 7})),
    }


class _Counter:
    """Counts the calls of ``dist.all_gather_object`` while installed."""

    def __init__(self) -> None:
        self.calls = 0
        self.original = dist.all_gather_object

    def __enter__(self) -> _Counter:
        def counted(*args, **kwargs):
            self.calls += 1
            return self.original(*args, **kwargs)

        dist.all_gather_object = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_object = self.original


def _timed(fn) -> tuple[str | None, float]:
    start = time.monotonic()
    error = error_of(fn)
    return error, time.monotonic() - start


def scenario_fingerprint(rank: int, out: str) -> dict[str, Any]:
    """One rank (the last) differs in one thing at a time: every rank raises, naming it."""
    odd = rank == dist.get_world_size() - 1
    base = dict(lr=LR, w1_shape=(7, 5), s_dtype=torch.float32, extra=False)
    variants = {
        "shape": {"w1_shape": (7, 6)},
        "dtype": {"s_dtype": torch.float16},
        "tx": {"lr": 2e-2},
        "structure": {"extra": True},
    }
    result: dict[str, Any] = {}
    for kind, change in variants.items():
        state = make_state(**{**base, **(change if odd else {})})
        result[("shard_state", kind)] = _timed(lambda: ffd.shard_state(state))
    grads = {k: v.to(torch.float16) for k, v in SW.awkward_grads(make_state(), 0, rank).items()}
    grad_variants = {
        "shape": ({**grads, "w2": torch.zeros(5, 4, dtype=torch.float16)}, {}),
        "dtype": ({**grads, "b1": grads["b1"].float()}, {}),
        "structure": ({**grads, "extra": torch.zeros(2, dtype=torch.float16)}, {}),
        "bucket_bytes": (grads, {"bucket_bytes": 1024}),
    }
    for kind, (variant, kwargs) in grad_variants.items():
        tree, kw = (variant, kwargs) if odd else (grads, {})
        result[("tree_all_reduce_mean", kind)] = _timed(
            lambda: ffd.tree_all_reduce_mean(tree, **kw)
        )
    sharded = ffd.shard_state(make_state())  # the same on every rank
    g = SW.awkward_grads(sharded, 0, rank)
    update_variants = {
        "tx": (sharded.replace(tx=make_tx(2e-2)), g, {}),
        "grads_dtype": (sharded, {**g, "b1": g["b1"].float()}, {}),
        "comm_dtype": (sharded, g, {"comm_dtype": torch.float32}),
        "bucket_bytes": (sharded, g, {"bucket_bytes": 64}),
        "piece_length": (
            sharded.replace(
                master={**sharded.master, "b1": torch.cat([sharded.master["b1"], torch.zeros(1)])}
            ),
            g,
            {},
        ),
    }
    for kind, (st, gr, kwargs) in update_variants.items():
        st, gr, kw = (st, gr, kwargs) if odd else (sharded, g, {})
        result[("sharded_update", kind)] = _timed(lambda: ffd.sharded_update(st, gr, **kw))
    # The agreed configuration runs; the first call agrees, the next ones communicate
    # nothing beyond the step's own collectives.
    with _Counter() as first:
        stepped = ffd.sharded_update(sharded, g)
    with _Counter() as later:
        for _ in range(3):
            stepped = ffd.sharded_update(stepped, g)
    with _Counter() as first_mean:
        ffd.tree_all_reduce_mean(grads)
    with _Counter() as later_mean:
        ffd.tree_all_reduce_mean(grads)
    result["calls"] = {
        "sharded_update_first": first.calls,
        "sharded_update_later": later.calls,
        "mean_first": first_mean.calls,
        "mean_later": later_mean.calls,
    }
    return result


SCENARIOS = {
    "resume_one": scenario_resume_one,
    "refusals": scenario_refusals,
    "one_rank_arguments": scenario_one_rank_arguments,
    "writer_raises": scenario_writer_raises,
    "commit_raises": scenario_commit_raises,
    "killed": scenario_killed,
    "resume_two": scenario_resume_two,
    "fingerprint": scenario_fingerprint,
}


if __name__ == "__main__":
    names = os.environ["FF_SCKPT_SCENARIOS"].split(",")
    exit_now(run_scenarios({n: SCENARIOS[n] for n in names}, sys.argv[1]))
