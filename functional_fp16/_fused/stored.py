"""What every fused step with stored states shares: the dtypes a state may have, the
rounding's encoding, the checks of the block scales, the formats the plain kernels encode
into.

A step with stored states (:mod:`.adam_stored`, Lion's in :mod:`.lion`) takes each
per-parameter state as one tensor per leaf (float32, float16, bfloat16, or ``uint8``
E4M3 codes laid out like the leaf) and the block scales of the coded ones as a list
``<state>_scales``: one float32 tensor per coded state, in leaf order, of shape
``scales_shape`` of the leaf (after the members' dimension under ``vmap``). Its
op also takes the applied-step count of each group (``count``, int64), ``block_size``,
``rounding`` (an index into :data:`ROUNDINGS`) and ``salt_ids`` (each leaf's index in
its optimiser's tree): the stochastic rounding's salt.
"""

from __future__ import annotations

import torch

from functional_fp16._fused import op_checks
from functional_fp16.precision import master_split
from functional_fp16.precision.master_split import RESIDUAL_DTYPE
from functional_fp16.precision.moment_storage import (
    MIN_ROW,
    BlockCodes,
    MomentFormat,
    scales_shape,
)

__all__ = ["STORED_DTYPES", "ROUNDINGS", "check_stored", "formats", "write_master", "write_state"]
__all__ += ["read_master"]

STORED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
"""How the op takes a moment: as it is, in 16 bits, or as E4M3 codes (``uint8``)."""
ROUNDINGS = ("nearest", "stochastic")
"""The op's ``rounding`` argument is the index of one of these."""


def check_stored(op: str, a: dict, states: tuple[str, ...], scalars: tuple[str, ...]) -> list[str]:
    """Checks a stored step's own arguments (``scalars`` given, the block size, the
    rounding, one salt id per leaf, and each of ``states``' block scales: one per coded
    state, each contiguous float32 of its leaf's scales' shape, on its device); returns the
    state lists in use (all of them, scales included)."""
    for name in scalars:
        if a[name] is None:
            op_checks.fail(op, f"{name} is required", TypeError)
    block, members = a["block_size"], a["members"]
    if block < 1 or block & (block - 1):
        op_checks.fail(op, f"block_size must be a positive power of two, got {block}")
    if a["rounding"] not in (0, 1):
        op_checks.fail(op, f"rounding must be 0 (nearest) or 1 (stochastic), got {a['rounding']}")
    if len(a["salt_ids"]) != len(a["grads"]):
        op_checks.fail(op, f"salt_ids has {len(a['salt_ids'])} entries, expected one per leaf")
    for name in states:
        scales = a[f"{name}_scales"]
        coded = [i for i, x in enumerate(a[name]) if x.dtype == torch.uint8]
        if len(coded) != len(scales):
            op_checks.fail(
                op, f"{name}_scales has {len(scales)} tensors, expected {len(coded)} (one per "
                f"coded {name})",
            )  # fmt: skip
        for j, (i, sc) in enumerate(zip(coded, scales)):
            g = a["grads"][i]
            shape = g.shape[1:] if members > 1 else g.shape
            expected = (members, *scales_shape(shape, block)) if members > 1 else None
            expected = expected or scales_shape(shape, block)
            if len(shape) < 2 or not g.is_contiguous():
                op_checks.fail(op, f"{name}[{i}] is coded but its leaf is not a dense matrix")
            if (
                not isinstance(sc, torch.Tensor)
                or sc.dtype != torch.float32
                or sc.device != g.device
                or tuple(sc.shape) != tuple(expected)
                or not sc.is_contiguous()
            ):
                got = (
                    f"{sc.dtype} of shape {tuple(sc.shape)} on {sc.device}"
                    if isinstance(sc, torch.Tensor)
                    else type(sc).__name__
                )
                op_checks.fail(
                    op, f"{name}_scales[{j}] (of {name}[{i}]) must be contiguous float32 of shape "
                    f"{tuple(expected)} on {g.device}, got {got}",
                )  # fmt: skip
    return [*states, *[f"{name}_scales" for name in states]]


def formats(block_size: int, rounding: int) -> dict:
    """The moment formats the plain kernel encodes into, by stored dtype and moment."""
    r = ROUNDINGS[rounding]
    return {
        (dtype, second): MomentFormat(kind, second and kind == "e4m3", None, block_size, MIN_ROW, r)
        for dtype, kind in (
            (torch.bfloat16, "bfloat16"),
            (torch.float16, "float16"),
            (torch.uint8, "e4m3"),
            (torch.float32, "float32"),
        )
        for second in (False, True)
    }


def read_master(master, params) -> torch.Tensor:
    """One leaf of one member's float32 master: itself, or a split master joined from its
    params and residuals (``master_split.join``)."""
    return master_split.join(params, master) if master.dtype == RESIDUAL_DTYPE else master


def write_master(ok, new, old, master_out, params_out, params_old) -> None:
    """One leaf of one member of a plain kernel: the master ``where(ok, new, old)`` and
    its working copy refreshed where it is its own tensor (else kept bit for bit); a
    split master's params and residuals split from it (a skipped step's split back into
    the same bits)."""
    if master_out.dtype == RESIDUAL_DTYPE:
        p, q = master_split.split(torch.where(ok, new, old))
        params_out.copy_(p)
        master_out.copy_(q)
        return
    if params_out.data_ptr() != master_out.data_ptr():
        params_out.copy_(torch.where(ok, new.to(params_out.dtype), params_old))
    master_out.copy_(torch.where(ok, new, old))


def write_state(ok, new, old, out, scales_out=None) -> None:
    """One stored state of one leaf of one member: ``where(ok, new, old)`` on its values,
    or on its codes and (into ``scales_out``) its block scales."""
    if isinstance(new, BlockCodes):
        out.copy_(torch.where(ok, new.codes, old.codes))
        scales_out.copy_(torch.where(ok, new.scales, old.scales))
    else:
        out.copy_(torch.where(ok, new, old))
