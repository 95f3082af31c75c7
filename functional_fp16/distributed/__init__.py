"""Data-parallel training on ``torch.distributed``: the same pure update on every rank.

Each process (rank) computes gradients on its own shard of the batch; the
gradients are averaged across the process group, and every rank then runs the
same :func:`~functional_fp16.fp16_update` on bitwise identical inputs, so every
rank holds bitwise identical parameters after every step. ``torch.distributed``
is the engine (gloo on CPU, NCCL on CUDA); this module only arranges the calls.

Two places to average, pick one:

* **Before the update, on the raw gradients** (:func:`tree_all_reduce_mean`):
  the scaled FP16 gradients are averaged, in FP16 by default, which halves the
  bytes sent compared with FP32. Each value is divided by the world size
  *before* the sum (``predivide_factor``), so the sum of finite values stays
  within the FP16 range (up to the rounding of ``max / N`` when ``N`` is not
  a power of two: a sum of values all at the FP16 maximum can still round to
  inf, which only skips that step). This is the usual data-parallel path
  (DeepSpeed in FP16 mode reduces the FP16 gradients the same way, with its
  ``gradient_predivide_factor``). The
  averaged tree is identical on every rank, so every rank also reaches the
  same finite/non-finite decision.
* **Inside the optimiser** (:func:`all_reduce_mean` in ``chain``): the
  transform sees the *unscaled* FP32 gradients, so the average is formed in
  FP32 (twice the bytes, no range or rounding concern). The finite check of
  :func:`~functional_fp16.fp16_update` runs before the optimiser on the local
  gradients, so this path **needs** ``agree=agree_finite``: otherwise a rank
  whose own gradients were finite would apply an update that another rank's
  inf has poisoned.

Passing ``agree=agree_finite`` is right on either path, and required whenever
the decision can differ between ranks (the local ``loss=`` check, gradients
clipped or reduced differently). It all-reduces the local "not finite" flag
with MAX, the rule Megatron-LM and DeepSpeed use, without reading the flag on
the host.

A training step on ``N`` ranks, each fed ``B / N`` examples::

    info = init_from_env()                               # under torchrun
    state = broadcast_state(fp16_init(params, sgd(0.1, momentum=0.9)))
    grad_fn = scaled_grad_and_value(loss_fn)             # loss_fn(params, x, y)
    for x, y in shard:                                   # B / N per rank
        grads, loss = grad_fn(state.loss_scale, state.params, x, y)  # scaled FP16
        grads = tree_all_reduce_mean(grads)              # mean over ranks
        state = fp16_update(state, grads, loss=loss, agree=agree_finite)

To divide the FP32 master and optimiser state between the ranks instead of
replicating it (ZeRO-1), shard the state: its master and per-parameter
optimiser state become DTensors ``Shard(0)`` over a 1-D mesh of the ranks,
beside whole FP16 ``params``. :func:`sharded_update` reduce-scatters the
gradients, steps this rank's rows and all-gathers the FP16 parameters, and
DCP saves and reshards the state like any DTensor state::

    state = shard_state(broadcast_state(fp16_init(params, adamw(1e-3))))
    for x, y in shard:
        grads, loss = grad_fn(state.loss_scale, state.params, x, y)
        state = sharded_update(state, grads, loss=loss)
    save_dcp_state(state, "ckpt")                        # each rank writes its shards
    state = load_dcp_state(shard_state(fp16_init(params, adamw(1e-3))), "ckpt")  # any world size

FSDP2 states (DTensor ``params``, from ``fully_shard``) need none of this:
:func:`~functional_fp16.fp16_update` steps them on the local shards
(:mod:`functional_fp16.update.dtensor`).

The package's modules, one job each: :mod:`.process_group` (set-up under
torchrun, rank queries), :mod:`.all_reduce` (averaging and the agreed finite
flag), :mod:`.replicas` (identical trees on every rank),
:mod:`functional_fp16.update.fingerprint` (the ranks' agreement on a configuration before they
communicate), :mod:`.checkpoints` (rank-0 writes, broadcast resumes),
:mod:`.dcp_state` (DTensor states through ``torch.distributed.checkpoint``),
and for ZeRO-1 :mod:`.row_shards` (DTensor's ``Shard(0)`` rows and the
bucketed collectives that move them), :mod:`.sharding` (:func:`shard_state`,
:func:`unshard_state`), :mod:`.sharded_step` (:func:`sharded_update`) and
:mod:`.sharded_checkpoints` (reading the retired sharded format of version 1).

The top layer of the package: it may import every other subpackage, and none
imports it (the root ``functional_fp16`` re-exports a few of its names).
"""

from importlib import import_module as _import_module

from functional_fp16.distributed.all_reduce import (
    DEFAULT_BUCKET_BYTES,
    agree_finite,
    all_reduce_mean,
    tree_all_reduce_mean,
)
from functional_fp16.distributed.process_group import (
    DistInfo,
    ProcessGroup,
    backend_for,
    get_rank,
    get_world_size,
    init_from_env,
    is_initialized,
    is_main_process,
    shutdown,
)
from functional_fp16.distributed.replicas import broadcast_state, check_same_tree

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DistInfo",
    "ProcessGroup",
    "backend_for",
    "init_from_env",
    "shutdown",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "is_main_process",
    "tree_all_reduce_mean",
    "all_reduce_mean",
    "agree_finite",
    "check_same_tree",
    "broadcast_state",
    "save_checkpoint_rank0",
    "load_checkpoint_broadcast",
    "load_checkpoint_sharded",
    "state_to_dcp",
    "save_dcp_state",
    "load_dcp_state",
    "CheckedReader",
    "shard_state",
    "unshard_state",
    "is_sharded",
    "sharded_update",
]

# The names whose modules import DTensor or torch.distributed.checkpoint (a second or
# so between them): each module is loaded on the first use of one of its names, not
# with the package.
_LAZY = {
    "CheckedReader": "dcp_reader",
    "load_dcp_state": "dcp_state",
    "save_dcp_state": "dcp_state",
    "state_to_dcp": "dcp_state",
    "load_checkpoint_sharded": "sharded_checkpoints",
    "load_checkpoint_broadcast": "checkpoints",
    "save_checkpoint_rank0": "checkpoints",
    "sharded_update": "sharded_step",
    "is_sharded": "sharding",
    "shard_state": "sharding",
    "unshard_state": "sharding",
}
# The modules loaded with those names (and row_shards, which sharding imports): an
# attribute of the package once imported, and on first access before that.
_LAZY_MODULES = frozenset(_LAZY.values()) | {"row_shards"}
_RETIRED = {
    "save_checkpoint_sharded": (
        "save_checkpoint_sharded was retired with its format: a sharded state's FP32 tensors "
        "are DTensors, saved by DCP itself with save_dcp_state(state, path) on every rank "
        "(load_checkpoint_sharded still reads the old format)"
    ),
    "ShardLayout": (
        "ShardLayout was retired: a sharded state's layout is its DTensors' placements "
        "(Shard(0) over a 1-D mesh; see functional_fp16.distributed.row_shards)"
    ),
}


def __getattr__(name: str):
    if name in _LAZY:
        module = _import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    if name in _LAZY_MODULES:
        return _import_module(f"{__name__}.{name}")
    if name in _RETIRED:
        raise AttributeError(_RETIRED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | _LAZY_MODULES)
