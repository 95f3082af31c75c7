"""Worker side of ``tests/test_dtensor.py``: one process per rank on gloo, started by the test.

Every rank builds the same parameters, distributes them over a 1-D CPU mesh
(uneven ``Shard(0)`` for most leaves, ``Replicate`` for a few) and steps the
DTensor state with ``fp16_update``; beside it, the single-process run on the
whole tensors. Each scenario returns, per optimiser, what the test compares.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import functional_fp16 as ff
from functional_fp16._util.tree import tree_leaves
from tests._launch import exit_now, run_scenarios
from tests.helpers import optimiser_matrix

STEPS = 6
INJECT_STEP = 2  # an inf in rank 1's shard of one gradient
SHAPES = {"wte": (13, 6), "h.attn.w": (18, 6), "h.attn.b": (18,), "ln.w": (6,), "mlp.w": (7, 6)}
REPLICATED = ("ln.w",)


def make_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: (torch.randn(s, generator=g) * 0.1).half() for k, s in SHAPES.items()}


def make_grads(step: int, world: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = {k: (torch.randn(s, generator=g) * 256).half() for k, s in SHAPES.items()}
    if step == INJECT_STEP:  # the last row lies in the last rank's shard
        out["h.attn.w"][-1, 0] = math.inf
    return out


def placements(name: str):
    return [Replicate()] if name in REPLICATED else [Shard(0)]


def distribute(tree, mesh, sharded_only=False):
    """``tree`` over ``mesh``: ``Shard(0)``, and ``Replicate`` for ``REPLICATED`` (unless
    ``sharded_only``). Every rank builds the same tree (seeded generators), so each cuts its
    own shard locally (``src_data_rank=None``): no scatter from rank 0, one collective a leaf
    fewer on every call."""
    return {
        k: distribute_tensor(
            v, mesh, [Shard(0)] if sharded_only else placements(k), src_data_rank=None
        )
        for k, v in tree.items()
    }


def bits(x: torch.Tensor) -> torch.Tensor:
    x = x.full_tensor() if isinstance(x, DTensor) else x
    return x.detach().reshape(-1).contiguous().view(torch.uint8)


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in float32 ulps of max(|a|, |b|) (0 where bitwise equal)."""
    a = (a.full_tensor() if isinstance(a, DTensor) else a).float()
    b = b.float()
    scale = torch.maximum(a.abs(), b.abs())
    spacing = torch.nextafter(scale, torch.full_like(scale, math.inf)) - scale
    diff = (a - b).abs()
    return float((diff / spacing).max()) if diff.numel() else 0.0


def timed_refusal(fn) -> tuple[str | None, float]:
    """``("Type: message", seconds)`` of the TypeError or ValueError ``fn()`` raises
    (``None`` and the seconds if it returns)."""
    start = time.monotonic()
    try:
        fn()
        return None, time.monotonic() - start
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start


def _run(name: str, donate: bool, rank: int):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tx = optimiser_matrix()[name]
    loss_scale = ff.DynamicLossScale(2.0**10, growth_interval=2)
    ours = ff.fp16_init(distribute(make_params(), mesh), tx, loss_scale)
    ref = ff.fp16_init(make_params(), optimiser_matrix()[name], loss_scale)
    path = ff.update_path(ours)
    out = {"path": path, "decisions": [], "ref_decisions": [], "scales_equal": True}
    out.update(nonfinite=[], ref_nonfinite=[])
    out.update(master_ulps=0.0, opt_ulps=0.0, params_equal=True, kept=True)
    for step in range(STEPS):
        grads = make_grads(step, world)
        ours = ff.fp16_update(ours, distribute(grads, mesh), donate=donate)
        ref = ff.fp16_update(ref, grads)
        out["decisions"].append(bool(ours.grads_finite))
        out["ref_decisions"].append(bool(ref.grads_finite))
        out["nonfinite"].append(ff.nonfinite_leaves(ours))
        out["ref_nonfinite"].append(ff.nonfinite_leaves(ref))
        out["scales_equal"] &= all(
            torch.equal(bits(a), bits(b))
            for a, b in zip(tree_leaves(ours.loss_scale), tree_leaves(ref.loss_scale))
        ) and torch.equal(bits(ours.step), bits(ref.step))
        # Each rank compares its own shards with the same rows of the reference, which it
        # holds whole: no collective (the ranks' shards together are every element).
        for k in SHAPES:
            out["master_ulps"] = max(out["master_ulps"], local_ulps(ours.master[k], ref.master[k]))
            out["params_equal"] &= torch.equal(
                bits(ours.params[k].to_local()), bits(ours.master[k].to_local().half())
            )
            m = ours.master[k]
            out["kept"] &= isinstance(m, DTensor) and m.placements == tuple(placements(k))
        for a, b in zip(tree_leaves(ours.opt_state), tree_leaves(ref.opt_state)):
            out["opt_ulps"] = max(out["opt_ulps"], local_ulps(a, b))
            out["kept"] &= isinstance(a, DTensor) == (a.ndim > 0)
    return out


def local_ulps(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """:func:`max_ulps` of this rank's shard of ``ours`` (a DTensor) against the same elements
    of ``ref`` (whole, in this process), cut as DTensor cuts them, with no communication;
    of the tensors themselves if ``ours`` is plain."""
    if not isinstance(ours, DTensor):
        return max_ulps(ours, ref)
    want = distribute_tensor(ref, ours.device_mesh, ours.placements, src_data_rank=None)
    return max_ulps(ours.to_local(), want.to_local())


def scenario_matrix(rank: int, out_dir: str):
    return {(n, d): _run(n, d, rank) for n in optimiser_matrix() for d in (False, True)}


def scenario_multisteps(rank: int, out_dir: str):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    recipe = optimiser_matrix()["recipe"]
    ours = ff.fp16_init(distribute(make_params(), mesh, True), ff.MultiSteps(recipe, 2))
    ref = ff.fp16_init(make_params(), ff.MultiSteps(optimiser_matrix()["recipe"], 2))
    decisions, worst = [], 0.0
    for step in range(STEPS):
        grads = make_grads(step, world)
        ours = ff.fp16_update(ours, distribute(grads, mesh, True))
        ref = ff.fp16_update(ref, grads)
        decisions.append((bool(ours.grads_finite), bool(ref.grads_finite)))
        for k in SHAPES:
            worst = max(worst, max_ulps(ours.master[k], ref.master[k]))
    out = {"decisions": decisions, "master_ulps": worst, "path": ff.update_path(ours)}
    # A loss that is inf on the last rank alone, at a micro-batch that does not close the
    # window: every rank records the window as spoilt (its micro-batch flags and the loss
    # check ride in one reduction).
    spoilt = ff.fp16_init(distribute(make_params(), mesh, True), ff.MultiSteps(ff.sgd(0.1), 2))
    last = rank == world - 1
    loss = torch.tensor(math.inf if last else 1.0)
    spoilt = ff.fp16_update(spoilt, distribute(make_grads(0, world), mesh, True), loss=loss)
    out["loss_one_rank"] = (bool(spoilt.grads_finite), bool(spoilt.opt_state.acc_finite))
    # Clipping a mix of replicated and sharded leaves off the fused path (accumulated,
    # masked): each leaf's squares counted once, as in one process.
    mixed = {}
    for name, make in {
        # max_norm well under the gradients' norm (about 0.06), so the clip acts
        "multisteps": lambda: ff.MultiSteps(
            ff.chain(ff.clip_by_global_norm(1e-3), ff.sgd(0.05, momentum=0.9)), 2
        ),
        "masked_clip": lambda: ff.chain(
            ff.masked(ff.clip_by_global_norm(1e-3), lambda t: {k: k != "wte" for k in t}),
            ff.sgd(0.05),
        ),
    }.items():
        state = ff.fp16_init(distribute(make_params(), mesh), make())
        one = ff.fp16_init(make_params(), make())
        worst, paths = 0.0, set()
        for step in range(STEPS):
            grads = make_grads(step, world)
            paths.add(ff.update_path(state))
            state = ff.fp16_update(state, distribute(grads, mesh))
            one = ff.fp16_update(one, grads)
            for k in SHAPES:
                worst = max(worst, max_ulps(state.master[k], one.master[k]))
        mixed[name] = {"master_ulps": worst, "paths": sorted(paths)}
    out["mixed"] = mixed
    return out


def scenario_bad_grads(rank: int, out_dir: str):
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = ff.fp16_init(distribute(make_params(), mesh), ff.sgd(0.1))
    grads = make_grads(0, world)
    errors = {}
    try:
        ff.fp16_update(state, {**distribute(grads, mesh), "wte": grads["wte"]})
        errors["plain"] = None
    except (TypeError, ValueError) as err:
        errors["plain"] = f"{type(err).__name__}: {err}"
    # An initial parameter with an inf in the last rank's shard: every rank refuses it.
    bad = make_params()
    bad["h.attn.w"][-1, 0] = math.inf
    try:
        ff.fp16_init(distribute(bad, mesh), ff.sgd(0.1))
        errors["inf_param"] = None
    except ValueError as err:
        errors["inf_param"] = str(err)

    # A transform of one's own that sums one number over a mixed layout (replicated and
    # sharded leaves: some ranks count some leaves only): every rank raises, none waits.
    def one_number(updates, state, params=None, *, global_sum=None):
        if global_sum is not None:
            global_sum(torch.zeros((), dtype=torch.float64))
        return updates, state

    own = ff.chain(ff.GradientTransformation(lambda p: ff.EmptyState(), one_number), ff.sgd(0.1))
    try:
        ff.fp16_update(ff.fp16_init(distribute(make_params(), mesh), own), distribute(grads, mesh))
        errors["one_number"] = None
    except NotImplementedError as err:
        errors["one_number"] = str(err)
    # int8 moments of a leaf sharded along its rows' length: refused at init, naming it.
    try:
        wide = {"w": distribute_tensor(torch.zeros(8, 128, dtype=torch.float16), mesh,
                                       [Shard(1)])}  # fmt: skip
        ff.fp16_init(wide, ff.adamw(1e-3, mu_dtype="int8", nu_dtype="int8"))
        errors["int8_columns"] = None
    except NotImplementedError as err:
        errors["int8_columns"] = str(err)
    # A gradient on another mesh (the same ranks, laid out 1 x world): refused, naming it.
    other = init_device_mesh("cpu", (1, world))
    try:
        ff.fp16_update(state, {
            **distribute(grads, mesh), "wte": distribute_tensor(grads["wte"], other,
                                                                [Replicate(), Shard(0)]),
        })  # fmt: skip
        errors["other_mesh"] = None
    except (TypeError, ValueError) as err:
        errors["other_mesh"] = f"{type(err).__name__}: {err}"
    # Replicated gradients of sharded parameters are redistributed to the parameters'
    # placements (a local slice): the update is bitwise the one from placed gradients.
    placed = ff.fp16_update(state, distribute(grads, mesh))
    replicated = {k: distribute_tensor(v, mesh, [Replicate()]) for k, v in grads.items()}
    moved = ff.fp16_update(state, replicated)
    errors["redistributed_equal"] = all(
        torch.equal(bits(a.to_local()), bits(b.to_local()))
        for a, b in zip(placed.master.values(), moved.master.values())
    )
    # A Partial sum (rank 0 holds the gradient, the others zeros: an exact sum) is
    # reduce-scattered to the parameters' shards.
    partial = {
        k: DTensor.from_local(v if rank == 0 else torch.zeros_like(v), mesh, [Partial()],
                              run_check=False)
        for k, v in grads.items()
    }  # fmt: skip
    summed = ff.fp16_update(state, partial)
    errors["partial_equal"] = all(
        torch.equal(bits(a.to_local()), bits(b.to_local()))
        for a, b in zip(placed.master.values(), summed.master.values())
    )
    return errors


def scenario_disagree(rank: int, out_dir: str):
    """The last rank differs in one thing; every rank must raise, promptly, naming it."""

    world = torch.distributed.get_world_size()
    odd = rank == world - 1
    mesh = init_device_mesh("cpu", (world,))
    state = ff.fp16_init(distribute(make_params(), mesh), ff.sgd(0.1))
    grads = distribute(make_grads(0, world), mesh)
    odd_grads = {**grads, "wte": grads["wte"].redistribute(mesh, [Replicate()])}
    flat = torch.distributed.device_mesh.DeviceMesh("cpu", torch.arange(world).view(1, world))
    odd_state = ff.fp16_init(
        {k: distribute_tensor(v, flat, [Replicate(), Shard(0)]) for k, v in make_params().items()},
        ff.sgd(0.1),
    )
    odd_state_grads = {
        k: distribute_tensor(v, flat, [Replicate(), Shard(0)])
        for k, v in make_grads(0, world).items()
    }

    # Another plan: one leaf sharded on another dimension. Wrapped locally (no scatter,
    # which would mismatch between the ranks); the values do not matter, the error does.
    def planned(tree, mesh_, odd_leaf=None):
        out = {}
        for k, v in tree.items():
            (where,) = [Shard(1)] if k == odd_leaf else placements(k)
            local = v
            if isinstance(where, Shard):
                parts = v.chunk(world, where.dim)
                local = parts[rank] if rank < len(parts) else v.narrow(where.dim, 0, 0)
            out[k] = DTensor.from_local(
                local, mesh_, [where], run_check=False, shape=v.shape, stride=v.stride()
            )
        return out

    odd_leaf = "mlp.w" if odd else None
    plan_case = (
        ff.fp16_init(planned(make_params(), mesh, odd_leaf), ff.sgd(0.1)),
        planned(make_grads(0, world), mesh, odd_leaf),
    )
    # A sub-mesh: the same ranks, sliced from a 2-D mesh on the last rank.
    sub = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))["b"]
    on = sub if odd else mesh
    sub_case = (
        ff.fp16_init(planned(make_params(), on), ff.sgd(0.1)),
        planned(make_grads(0, world), on),
    )
    # What only the odd rank's own checks would refuse, or what changes its collectives:
    # a float32 gradient, a missing gradient leaf, another implementation, another
    # optimiser, a loss passed on one rank only, a state whose master is not float32.
    other_tx = ff.fp16_init(distribute(make_params(), mesh), ff.sgd(0.2))
    float32_grads = {**grads, "mlp.w": grads["mlp.w"].float()}
    missing = {k: v for k, v in grads.items() if k != "h.attn.b"}
    bad_master = state.replace(master={**state.master, "ln.w": state.master["ln.w"].double()})
    loss = torch.tensor(1.0)
    cases = {
        "grad_placement": (state, odd_grads if odd else grads, {}),
        "mesh": (*((odd_state, odd_state_grads) if odd else (state, grads)), {}),
        "plan": (*plan_case, {}),
        "sub_mesh": (*sub_case, {}),
        "grad_dtype": (state, float32_grads if odd else grads, {}),
        "missing_leaf": (state, missing if odd else grads, {}),
        "impl": (state, grads, {"impl": "reference"} if odd else {}),
        "tx": (other_tx if odd else state, grads, {}),
        "loss": (state, grads, {"loss": loss} if odd else {}),
        "master_dtype": (bad_master if odd else state, grads, {}),
    }
    out = {}
    for name, (st, gr, kwargs) in cases.items():
        out[name] = timed_refusal(lambda: ff.fp16_update(st, gr, **kwargs))
    stepped = ff.fp16_update(state, grads)  # the group still works
    # Every rank refuses alike what every rank gets wrong alike: its own error, no hang.
    out["all_float32"] = timed_refusal(lambda: ff.fp16_update(stepped, float32_grads))
    return out


# -- FSDP2 -------------------------------------------------------------------------------

VOCAB, WIDTH, CONTEXT, BATCH, FSDP_STEPS, FSDP_INJECT = 17, 16, 8, 8, 20, 7


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(WIDTH)
        self.attn = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = torch.nn.Linear(WIDTH, WIDTH)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x):
        q, k, v = self.attn(self.ln(x)).chunk(3, dim=-1)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a)
        return x + self.mlp(x)


class TinyTransformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x).float()


def fsdp_batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def fsdp_loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _fsdp_run(
    model, state, rank, world, sharded, donate, steps=FSDP_STEPS, inject=FSDP_INJECT,
    leaf="blocks.1.mlp.0.weight", batch=fsdp_batch,
):  # fmt: skip
    """``steps`` steps of the recipe, an overflow at step ``inject``; with ``sharded`` each rank
    takes its rows of the batch. The single process (not ``sharded``) also records each
    step's global norm of the unscaled gradients (``norms``: whether a clip bound), the
    sharded run its master's placements after the last step (``placements``). ``rank``
    and ``world`` say which share of the batch this process takes (its data-parallel
    coordinate and their number); the inf goes into the last process's shard of ``leaf``."""
    out = {"decisions": [], "scales": [], "losses": [], "nonfinite": [], "norms": []}
    out["init"] = {
        n: (m.full_tensor() if isinstance(m, DTensor) else m).clone()
        for n, m in state.master.items()
    }
    for step in range(steps):
        x, y = batch(step)
        if sharded:
            n = BATCH // world
            x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        loss = fsdp_loss(model, x, y)
        state.loss_scale.scale(loss).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        if not sharded:
            out["norms"].append(float(ff.global_norm(state.loss_scale.unscale(grads))))
        if step == inject:  # an overflow in the last rank's shard of one gradient
            g = grads[leaf]
            last = torch.distributed.get_world_size() - 1
            if sharded and torch.distributed.get_rank() == last:
                g.to_local()[-1, 0] = math.inf
            elif not sharded:
                g[-1, 0] = math.inf
        state = ff.fp16_update(state, grads, donate=donate)
        if not donate:
            ff.write_params(model, state.params)
        model.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        if sharded:  # the ranks of one data-parallel share hold the same loss
            torch.distributed.all_reduce(loss)
            loss = loss / torch.distributed.get_world_size()
        out["decisions"].append(bool(state.grads_finite))
        out["scales"].append(float(state.loss_scale.loss_scale))
        out["losses"].append(float(loss))
        out["nonfinite"].append(ff.nonfinite_leaves(state))
    if sharded:
        out["placements"] = {n: tuple(m.placements) for n, m in state.master.items()}
        out["local"] = {n: m.to_local().clone() for n, m in state.master.items()}
    full = {
        n: (m.full_tensor() if isinstance(m, DTensor) else m).clone()
        for n, m in state.master.items()
    }
    out["master"] = full
    out["path"] = ff.update_path(state)
    return out


def scenario_fsdp2(rank: int, out_dir: str):
    from torch.distributed.fsdp import fully_shard

    world = torch.distributed.get_world_size()
    results = {}
    for tx_name, donate in [("recipe", False), ("recipe", True), ("clip", False)]:
        torch.manual_seed(0)
        model = TinyTransformer().half()
        reference = TinyTransformer().half()
        reference.load_state_dict(model.state_dict())
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        loss_scale = ff.DynamicLossScale(2.0**8, growth_interval=4)
        tx = optimiser_matrix()[tx_name]
        ours = _fsdp_run(
            model, ff.fp16_init(dict(model.named_parameters()), tx, loss_scale), rank, world,
            sharded=True, donate=donate,
        )  # fmt: skip
        ref = _fsdp_run(
            reference,
            ff.fp16_init(dict(reference.named_parameters()), optimiser_matrix()[tx_name],
                         loss_scale),
            rank, world, sharded=False, donate=donate,
        )  # fmt: skip
        results[(tx_name, donate)] = {"ours": ours, "ref": ref}
    return results


HSDP_STEPS, HSDP_INJECT, HSDP_CLIP = 6, 3, 0.5


def hsdp_tx():
    """Clip + SGD(momentum). The threshold lies below every step's global norm of this run's
    unscaled gradients (about 0.7 to 0.8): the clip scales every update, so the norm the
    mesh completes (summed over the ``"shard"`` dimension only) enters the master."""
    return ff.chain(ff.clip_by_global_norm(HSDP_CLIP), ff.sgd(0.05, momentum=0.9))


def scenario_hsdp(rank: int, out_dir: str):
    """HSDP at 4 ranks: ``fully_shard`` per block and at the root over a 2 x 2 mesh
    (``("replicate", "shard")``: each parameter ``(Replicate(), Shard(0))``; FSDP2
    reduce-scatters the gradients within a replica and all-reduces them across the two,
    an average over all 4 ranks), clip + SGD(momentum), each rank fed its quarter of the
    batch, an overflow in the last rank's shard at one step (rank 3, coordinate (1, 1):
    rank 1 holds the same shard, finite). Beside it, the same model unsharded in one
    process on the whole batch. ``None`` at other world sizes."""
    from torch.distributed.fsdp import fully_shard

    world = torch.distributed.get_world_size()
    if world != 4:
        return None
    torch.manual_seed(0)
    model = TinyTransformer().half()
    reference = TinyTransformer().half()
    reference.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    loss_scale = ff.DynamicLossScale(2.0**8, growth_interval=2)
    state = ff.fp16_init(dict(model.named_parameters()), hsdp_tx(), loss_scale)
    out = {"coordinate": tuple(mesh.get_coordinate()), "mesh_names": mesh.mesh_dim_names}
    out["param_placements"] = {n: tuple(p.placements) for n, p in model.named_parameters()}
    out["ours"] = _fsdp_run(
        model, state, rank, world, sharded=True, donate=False, steps=HSDP_STEPS,
        inject=HSDP_INJECT,
    )  # fmt: skip
    ref_state = ff.fp16_init(dict(reference.named_parameters()), hsdp_tx(), loss_scale)
    out["ref"] = _fsdp_run(
        reference, ref_state, rank, world, sharded=False, donate=False, steps=HSDP_STEPS,
        inject=HSDP_INJECT,
    )  # fmt: skip
    # The parameters the module holds after the run (written by write_params), gathered.
    out["params"] = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}
    return out


def scenario_fsdp2_mixed_precision(rank: int, out_dir: str):
    """FSDP2's own mixed precision: FP32 shards, FP16 all-gathers and compute
    (``MixedPrecisionPolicy(param_dtype=torch.float16)``). The module's FP32 shards are the
    master and the working copy (``param_dtype=torch.float32``): no third copy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    params = dict(model.named_parameters())
    state = ff.fp16_init(
        params, optimiser_matrix()["recipe"], ff.DynamicLossScale(2.0**8, growth_interval=4),
        param_dtype=torch.float32, copy_master=False,
    )  # fmt: skip
    out = {"decisions": [], "scales": [], "losses": [], "skip_kept_master": None}
    out["one_copy"] = all(
        state.params[k] is state.master[k]
        and state.master[k].to_local().data_ptr() == params[k].to_local().data_ptr()
        for k in params
    )
    for step in range(FSDP_STEPS):
        x, y = fsdp_batch(step % 2)  # two batches, again and again: it must learn them
        n = BATCH // world
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        loss = fsdp_loss(model, x, y)
        state.loss_scale.scale(loss).backward()
        grads = {k: p.grad for k, p in model.named_parameters()}
        if step == FSDP_INJECT and rank == world - 1:
            grads["blocks.1.mlp.0.weight"].to_local()[-1, 0] = math.inf
        before = [m.to_local().clone() for m in state.master.values()]
        state = ff.fp16_update(state, grads, donate=True)
        model.zero_grad(set_to_none=True)
        if step == FSDP_INJECT:
            out["skip_kept_master"] = all(
                torch.equal(bits(a), bits(m.to_local()))
                for a, m in zip(before, state.master.values())
            )
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss)
        out["losses"].append(float(loss) / world)
        out["decisions"].append(bool(state.grads_finite))
        out["scales"].append(float(state.loss_scale.loss_scale))
    out["in_place"] = all(
        state.master[k].to_local().data_ptr() == p.to_local().data_ptr()
        for k, p in model.named_parameters()
    )
    out["path"] = ff.update_path(state)
    local_bytes = sum(p.to_local().numel() * 4 for p in model.parameters())
    out["state_bytes"] = local_bytes
    return out


# -- DCP --------------------------------------------------------------------------------


def _full(state) -> list[torch.Tensor]:
    return [
        (x.full_tensor() if isinstance(x, DTensor) else x).clone()
        for x in tree_leaves(state)
        if isinstance(x, torch.Tensor)
    ]


def _dcp_state(mesh, extra=()):
    """The recipe's state on ``mesh``; ``extra`` placements go before each leaf's own."""
    params = {
        k: distribute_tensor(v, mesh, [*extra, *placements(k)]) for k, v in make_params().items()
    }
    return ff.fp16_init(params, optimiser_matrix()["recipe"])


def _trained(mesh, extra=()):
    state = _dcp_state(mesh, extra)
    world = torch.distributed.get_world_size()
    for step in range(3):
        g = make_grads(step, world)
        g = {k: distribute_tensor(v, mesh, [*extra, *placements(k)]) for k, v in g.items()}
        state = ff.fp16_update(state, g)
    return state


def scenario_dcp(rank: int, out_dir: str):
    """Trains 3 steps and saves (``dcp_<world>``); at 4 ranks also loads the 2-rank save."""
    import os

    from functional_fp16 import distributed as ffd

    world = torch.distributed.get_world_size()
    shared = os.path.join(out_dir, "dcp")
    mesh = init_device_mesh("cpu", (world,))
    state = _trained(mesh)
    ffd.save_dcp_state(state, os.path.join(shared, f"dcp_{world}"))
    truth = _full(state)  # a collective: every rank
    if rank == 0:
        torch.save(truth, os.path.join(shared, f"truth_{world}.pt"))
    out = {"saved": True, "resumed_equal": None}
    if world == 4:
        # Saved sharded 2 ways (a 2 x 2 mesh: replicated over its first dimension), resumed
        # sharded 4 ways.
        two_way = _trained(init_device_mesh("cpu", (2, 2)), extra=(Replicate(),))
        earlier = os.path.join(shared, "dcp_2x2")
        ffd.save_dcp_state(two_way, earlier)
        want = _full(two_way)
        like = _dcp_state(mesh)
        loaded = ffd.load_dcp_state(like, earlier)
        got = _full(loaded)
        out["resumed_equal"] = len(got) == len(want) and all(
            a.dtype == b.dtype and torch.equal(bits(a), bits(b)) for a, b in zip(got, want)
        )
        out["placements_kept"] = all(
            m.placements == tuple(placements(k)) for k, m in loaded.master.items()
        )
        # the resumed state steps like the saved one would have
        nxt = ff.fp16_update(loaded, distribute(make_grads(3, world), mesh))
        out["steps_after_resume"] = int(nxt.step)
    return out


SPLIT_TXS = ("momentum", "recipe", "lion")


def scenario_split(rank: int, out_dir: str):
    """Split masters on DTensor params: each optimiser of ``SPLIT_TXS`` against one
    process's split state; the recipe's state saved with DCP (``split_dcp/dcp_<world>``)
    with its values (``split_truth_<world>.pt``) for the test to load into one process."""
    import os

    from functional_fp16 import distributed as ffd

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in SPLIT_TXS:
        scale = ff.DynamicLossScale(2.0**10, growth_interval=2)
        ours = ff.fp16_init(
            distribute(make_params(), mesh), optimiser_matrix()[name], scale, master="split"
        )
        ref = ff.fp16_init(make_params(), optimiser_matrix()[name], scale, master="split")
        r = {"decisions": [], "ref_decisions": [], "master_ulps": 0.0, "kept": True}
        r["params_equal"] = True
        for step in range(STEPS):
            grads = make_grads(step, world)
            ours = ff.fp16_update(ours, distribute(grads, mesh), donate=step % 2 == 1)
            ref = ff.fp16_update(ref, grads)
            r["decisions"].append(bool(ours.grads_finite))
            r["ref_decisions"].append(bool(ref.grads_finite))
            wide, ref_wide = ff.master_weights(ours), ff.master_weights(ref)
            for k in SHAPES:
                q = ours.master[k]
                r["kept"] &= (
                    isinstance(q, DTensor)
                    and q.dtype == torch.int16
                    and q.placements == tuple(placements(k))
                )
                r["master_ulps"] = max(r["master_ulps"], local_ulps(wide[k], ref_wide[k]))
                r["params_equal"] &= torch.equal(bits(ours.params[k]), bits(ref.params[k]))
        out[name] = r
    shared = os.path.join(out_dir, "split_dcp")
    ffd.save_dcp_state(ours, os.path.join(shared, f"dcp_{world}"))
    # a collective, every rank; gloo gathers no int16, so residuals travel as int32
    truth = [
        (
            x.to(torch.int32).full_tensor().to(torch.int16)
            if x.dtype == torch.int16
            else x.full_tensor()
        )
        if isinstance(x, DTensor)
        else x.clone()
        for x in tree_leaves(ours)
        if isinstance(x, torch.Tensor)
    ]
    if rank == 0:
        torch.save(truth, os.path.join(shared, f"split_truth_{world}.pt"))
    return out


# -- tensor parallelism: the GPT example's model and torchtitan's plan ---------------------

TP_STEPS, TP_INJECT, TP_CLIP, TP_BATCH = 8, 3, 0.25, 8
TP_LEAF = "blocks.1.mlp.fc.weight"  # ColwiseParallel: Shard(0) over "tp" (FSDP2 strides it)


def tp_txs() -> dict:
    """One optimiser of each family, each clipped (the threshold lies below every step's
    norm of this run, so the norm the mesh completes enters every update)."""
    from tests.helpers import matrices

    def clip(tx):
        return ff.chain(ff.clip_by_global_norm(TP_CLIP), tx)

    return {
        "sgd": clip(ff.sgd(0.05, momentum=0.9)),
        "recipe": clip(
            ff.adamw(
                ff.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 20, 1e-4),
                b2=0.95,
                weight_decay=0.1,
                mask=matrices,
            )
        ),  # fmt: skip
        "lion": clip(ff.lion(1e-4, weight_decay=0.1)),
    }


def tp_batch(step: int):
    g = torch.Generator().manual_seed(900 + step)
    ids = torch.randint(0, 16, (TP_BATCH, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def tp_model():
    from tests.helpers import load_example

    gpt_model = load_example("gpt_model")
    cfg = gpt_model.GPTConfig(vocab_size=16, context=8, layers=2, heads=4, width=32)
    return gpt_model.build_model(cfg, 0).half()


def scenario_tp(rank: int, out_dir: str):
    """The GPT example's model with torchtitan's plan (``examples/gpt_tp.py``): at 2 ranks
    tensor parallelism alone (a 1-D ``("tp",)`` mesh, every rank the whole batch), at 4
    ranks a 2 x 2 ``("dp", "tp")`` mesh (the plan on ``mesh["tp"]``, then ``fully_shard``
    per block and at the root over ``mesh["dp"]``; each data-parallel pair its half of
    the batch). One optimiser of each family, ``TP_STEPS`` steps, an inf in the last
    rank's shard of ``TP_LEAF`` at ``TP_INJECT``; beside it, the same model in one process
    fed the whole batch."""
    from torch.distributed.fsdp import fully_shard

    from tests.helpers import load_example

    gpt_tp = load_example("gpt_tp")
    world = torch.distributed.get_world_size()
    results = {}
    for name, tx in tp_txs().items():
        model, reference = tp_model(), tp_model()
        if world == 2:
            mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
            gpt_tp.parallelize(model, mesh)
            share, shares = 0, 1
        else:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
            gpt_tp.parallelize(model, mesh["tp"])
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            share, shares = mesh.get_coordinate()[0], world // 2
        loss_scale = ff.DynamicLossScale(2.0**8, growth_interval=2)
        placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
        ours = _fsdp_run(
            model, ff.fp16_init(dict(model.named_parameters()), tx, loss_scale), share, shares,
            sharded=True, donate=False, steps=TP_STEPS, inject=TP_INJECT, leaf=TP_LEAF,
            batch=tp_batch,
        )  # fmt: skip
        ref = _fsdp_run(
            reference, ff.fp16_init(dict(reference.named_parameters()), tp_txs()[name], loss_scale),
            share, shares, sharded=False, donate=False, steps=TP_STEPS, inject=TP_INJECT,
            leaf=TP_LEAF, batch=tp_batch,
        )  # fmt: skip
        results[name] = {"ours": ours, "ref": ref, "placements": placements}
    return results


def scenario_tp_dcp(rank: int, out_dir: str):
    """At 4 ranks: the recipe trained 3 steps on the GPT model under TP + FSDP2 (2 x 2),
    saved (``dcp_tp_2x2``); loaded into the same model under FSDP2 alone over 4 ranks
    (4 x 1), compared with the saved state's full tensors, and saved again
    (``dcp_tp_4x1``, the test loads it into one process). ``None`` at other sizes."""
    import os

    from torch.distributed.fsdp import fully_shard

    from functional_fp16 import distributed as ffd
    from tests.helpers import load_example

    world = torch.distributed.get_world_size()
    if world != 4:
        return None
    gpt_tp = load_example("gpt_tp")
    shared = os.path.join(out_dir, "dcp")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp_model()
    gpt_tp.parallelize(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    state = ff.fp16_init(dict(model.named_parameters()), tp_txs()["recipe"])
    x, y = tp_batch(0)
    for _ in range(3):
        loss = fsdp_loss(model, x[mesh.get_coordinate()[0] :: 2], y[mesh.get_coordinate()[0] :: 2])
        state.loss_scale.scale(loss).backward()
        state = ff.fp16_update(state, {n: p.grad for n, p in model.named_parameters()})
        ff.write_params(model, state.params)
        model.zero_grad(set_to_none=True)
    ffd.save_dcp_state(state, os.path.join(shared, "dcp_tp_2x2"))
    truth = _full(state)
    flat = init_device_mesh("cpu", (world,))
    other = tp_model()
    for block in other.blocks:
        fully_shard(block, mesh=flat)
    fully_shard(other, mesh=flat)
    like = ff.fp16_init(dict(other.named_parameters()), tp_txs()["recipe"])
    loaded = ffd.load_dcp_state(like, os.path.join(shared, "dcp_tp_2x2"))
    got = _full(loaded)
    ffd.save_dcp_state(loaded, os.path.join(shared, "dcp_tp_4x1"))
    if rank == 0:
        torch.save(truth, os.path.join(shared, "truth_tp.pt"))
    return {
        "equal": len(got) == len(truth)
        and all(a.dtype == b.dtype and torch.equal(bits(a), bits(b)) for a, b in zip(got, truth)),
        "placements": {k: tuple(map(repr, m.placements)) for k, m in loaded.master.items()},
        "step": int(loaded.step),
    }


def scenario_submesh(rank: int, out_dir: str):
    """At 4 ranks, leaves laid out every way at once on a 2 x 2 ``("dp", "tp")`` mesh and
    its sub-meshes: sharded over both dimensions, over one with the other replicated,
    replicated over both, and on ``mesh["dp"]`` and ``mesh["tp"]`` alone; clipped SGD and
    AdamW (the clip binding), an inf in one shard at ``INJECT_STEP``, against one process.
    ``None`` at other sizes."""
    world = torch.distributed.get_world_size()
    if world != 4:
        return None
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layout = {
        "wte": (mesh, [Shard(0), Shard(1)]),
        "h.attn.w": (mesh, [Shard(0), Replicate()]),
        "h.attn.b": (mesh["dp"], [Shard(0)]),
        "ln.w": (mesh["tp"], [Replicate()]),
        "mlp.w": (mesh, [Replicate(), Shard(0)]),
    }

    def laid(tree):
        return {k: distribute_tensor(v, *layout[k]) for k, v in tree.items()}

    out = {}
    for name, make in {
        "clip_sgd": lambda: ff.chain(ff.clip_by_global_norm(1e-3), ff.sgd(0.05, momentum=0.9)),
        "clip_adamw": lambda: ff.chain(ff.clip_by_global_norm(1e-3), ff.adamw(1e-3)),
        "masked_clip": lambda: ff.chain(
            ff.masked(ff.clip_by_global_norm(1e-3), lambda t: {k: k != "wte" for k in t}),
            ff.sgd(0.05),
        ),
    }.items():
        ours = ff.fp16_init(laid(make_params()), make(), ff.DynamicLossScale(2.0**10))
        ref = ff.fp16_init(make_params(), make(), ff.DynamicLossScale(2.0**10))
        run = {"decisions": [], "ref_decisions": [], "nonfinite": [], "ref_nonfinite": []}
        run.update(scales_equal=True, master_ulps=0.0, path=ff.update_path(ours))
        for step in range(STEPS):
            grads = make_grads(step, world)
            ours = ff.fp16_update(ours, laid(grads))
            ref = ff.fp16_update(ref, grads)
            run["decisions"].append(bool(ours.grads_finite))
            run["ref_decisions"].append(bool(ref.grads_finite))
            run["nonfinite"].append(ff.nonfinite_leaves(ours))
            run["ref_nonfinite"].append(ff.nonfinite_leaves(ref))
            run["scales_equal"] &= torch.equal(
                bits(ours.loss_scale.loss_scale), bits(ref.loss_scale.loss_scale)
            )
            for k in SHAPES:
                run["master_ulps"] = max(
                    run["master_ulps"], max_ulps(ours.master[k], ref.master[k])
                )
        out[name] = run
    return out


# -- Counting shards once, whatever the meshes ----------------------------------------------


def _comm_counts(fn) -> dict[str, int]:
    """The collectives ``fn()`` runs, by op name (DTensor's ``CommDebugMode``, which sees
    ``torch.distributed``'s collectives too)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn()
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


CLIP_MAX = 1e-3  # well under the gradients' norm (about 0.06): the clip binds


def clip_factor(state, grads_full: dict, lr: float) -> tuple[float, float]:
    r"""``(ours, expected)``: the factor :math:`c / \lVert g \rVert` by which one clipped SGD
    step (``lr``, from a zero master) scaled the gradients, read from the new master as
    :math:`-\sum m' g / (\mathrm{lr} \sum g^2)`, and the one an independent norm gives:
    ``torch.linalg.vector_norm`` of the gathered whole gradients in float64, unscaled."""
    scale = float(state.loss_scale.loss_scale)  # before the step: a power of two
    g = {k: v.double() / scale for k, v in grads_full.items()}
    norm = float(torch.linalg.vector_norm(torch.cat([v.reshape(-1) for v in g.values()])))
    num = sum(float((bits_full(state, k).double() * g[k]).sum()) for k in g)
    den = sum(float(g[k].square().sum()) for k in g)
    return -num / (lr * den), CLIP_MAX / norm


def bits_full(state, k):
    m = state.master[k]
    return m.full_tensor() if isinstance(m, DTensor) else m


def _zeros():
    return {k: torch.zeros(s, dtype=torch.float16) for k, s in SHAPES.items()}


def scenario_two_roots(rank: int, out_dir: str):
    """At 4 ranks, two 2 x 2 meshes over the same ranks, made apart with their dimensions in
    the other order (``("dp", "tp")`` and ``("tp", "dp")``), leaves ``Shard(0)`` on each
    one's ``"dp"`` sub-mesh: the clipped step's factor against an independent norm of the
    gathered gradients, and decisions against one process. ``None`` at other sizes."""
    if torch.distributed.get_world_size() != 4:
        return None
    a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    b = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    layout = {
        "wte": (a["dp"], [Shard(0)]),
        "h.attn.b": (a["dp"], [Shard(0)]),
        "h.attn.w": (b["dp"], [Shard(0)]),
        "mlp.w": (b["dp"], [Shard(0)]),
        "ln.w": (b["dp"], [Shard(0)]),
    }

    def laid(tree):
        return {k: distribute_tensor(v, *layout[k]) for k, v in tree.items()}

    tx = ff.chain(ff.clip_by_global_norm(CLIP_MAX), ff.sgd(1.0))
    state = ff.fp16_init(laid(_zeros()), tx)
    grads = make_grads(0, 4)
    new = ff.fp16_update(state, laid(grads))
    ours, expected = clip_factor(new.replace(loss_scale=state.loss_scale), grads, 1.0)
    ref = ff.fp16_init(make_params(), tx)
    mine = ff.fp16_init(laid(make_params()), tx)
    decisions = []
    for step in range(STEPS):
        g = make_grads(step, 4)
        ref, mine = ff.fp16_update(ref, g), ff.fp16_update(mine, laid(g))
        decisions.append((bool(mine.grads_finite), bool(ref.grads_finite)))
    worst = max(max_ulps(mine.master[k], ref.master[k]) for k in SHAPES)
    return {"factor": (ours, expected), "decisions": decisions, "master_ulps": worst}


def scenario_own_mesh(rank: int, out_dir: str):
    """At 4 ranks, two 1 x 2 meshes ``("dp", "tp")`` that each span half of the world
    (ranks 0-1 and 2-3): the mesh's reductions and its agreement run over its own groups,
    one per dimension. An inf in rank 1's shard at ``fp16_init``: refused by ranks 0 and 1
    alike, naming the leaf; rank 1 alone passing a float32 gradient at the first call:
    ranks 0 and 1 raise, naming it; clipped AdamW against one process (an inf in rank 1's
    shard at ``INJECT_STEP``); the collectives of one update. ``None`` at other sizes."""

    from torch.distributed.device_mesh import DeviceMesh

    if torch.distributed.get_world_size() != 4:
        return None
    meshes = [DeviceMesh("cpu", [[0, 1]], mesh_dim_names=("dp", "tp")),
              DeviceMesh("cpu", [[2, 3]], mesh_dim_names=("dp", "tp"))]  # fmt: skip
    mesh = meshes[rank // 2]
    out = {}
    bad = make_params()
    if rank // 2 == 0:
        bad["h.attn.w"][-1, 0] = math.inf  # in rank 1's shard
    try:
        ff.fp16_init(distribute(bad, mesh["tp"]), ff.sgd(0.1))
        out["inf_param"] = None
    except ValueError as err:
        out["inf_param"] = str(err)
    tx = ff.chain(ff.clip_by_global_norm(CLIP_MAX), ff.adamw(1e-3))

    def laid_out(tree):
        return {k: distribute_tensor(v, mesh, [Replicate(), placements(k)[0]])
                for k, v in tree.items()}  # fmt: skip

    ours = ff.fp16_init(laid_out(make_params()), tx)
    # Before the configuration is agreed (its first call): rank 1 alone passes a float32
    # gradient; ranks 0 and 1 raise, naming it, and ranks 2 and 3 step.
    laid = laid_out(make_grads(0, 2))
    odd = {**laid, "mlp.w": laid["mlp.w"].float()} if rank == 1 else laid
    out["float32_grad"] = timed_refusal(lambda: ff.fp16_update(ours, odd))
    ref = ff.fp16_init(make_params(), tx)
    run = {"decisions": [], "ref_decisions": [], "nonfinite": [], "ref_nonfinite": []}
    for step in range(STEPS):
        g = make_grads(step, 2)
        laid = laid_out(g)
        ours, ref = ff.fp16_update(ours, laid), ff.fp16_update(ref, g)
        run["decisions"].append(bool(ours.grads_finite))
        run["ref_decisions"].append(bool(ref.grads_finite))
        run["nonfinite"].append(ff.nonfinite_leaves(ours))
        run["ref_nonfinite"].append(ff.nonfinite_leaves(ref))
    run["master_ulps"] = max(max_ulps(ours.master[k], ref.master[k]) for k in SHAPES)
    run["comms"] = _comm_counts(lambda: ff.fp16_update(ours, laid))
    out["run"] = run
    # After the ranks have stepped this state together, rank 1 alone passes a float32
    # gradient: it raises its own error at once, entering no collective (the others are
    # not called here; they would wait in the step's collective).
    out["later_float32"] = out["later_master"] = None
    if rank == 1:
        bad_master = ours.replace(master={**ours.master, "ln.w": ours.master["ln.w"].double()})
        for name, (st, gr) in {
            "later_float32": (ours, {**laid, "mlp.w": laid["mlp.w"].float()}),
            "later_master": (bad_master, laid),
        }.items():
            out[name] = timed_refusal(lambda: ff.fp16_update(st, gr))  # noqa: B023 - called now
    return out


def scenario_collectives(rank: int, out_dir: str):
    """The collectives of one update of an agreed configuration, by kind, on the 1-D mesh
    (and at 4 ranks the 2 x 2 mesh): clipped AdamW, unclipped SGD, and a ``MultiSteps`` of
    the clipped chain (a micro-batch inside a window, and the one that closes it)."""
    world = torch.distributed.get_world_size()
    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["2x2"] = init_device_mesh("cpu", (2, 2))
    clipped = ff.chain(ff.clip_by_global_norm(CLIP_MAX), ff.adamw(1e-3))
    out = {}
    for name, mesh in meshes.items():

        def laid(tree):
            if mesh.ndim == 1:
                return distribute(tree, mesh)
            return {k: distribute_tensor(v, mesh, [Shard(0), Replicate()]) for k, v in tree.items()}

        for tx_name, tx in {"clipped": clipped, "sgd": ff.sgd(0.1),
                            "multisteps": ff.MultiSteps(clipped, 2)}.items():  # fmt: skip
            state = ff.fp16_init(laid(make_params()), tx)
            grads = laid(make_grads(0, world))
            state = ff.fp16_update(state, grads)  # agreed here, once
            counts = [_comm_counts(lambda: ff.fp16_update(state, grads))]
            if tx_name == "multisteps":  # the window's closing micro-batch too
                state = ff.fp16_update(state, grads)
                counts.append(_comm_counts(lambda: ff.fp16_update(state, grads)))
            out[(name, tx_name)] = counts
    return out


def scenario_empty_shard(rank: int, out_dir: str):
    """Leaves whose first dimension is smaller than the number of ranks (a ViT's
    ``(1, 197, 64)`` position embedding, a ``(3, 64, 64)`` QKV weight), ``Shard(0)``: the
    last ranks hold no rows. AdamW with FP32 and with int8 moments (rounded to nearest and
    stochastically), an inf in rank 0's
    shard at ``INJECT_STEP``: the update runs on every rank and matches one process
    bitwise (an elementwise step, each row whole on the rank that holds it)."""
    world = torch.distributed.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    shapes = {"pos": (1, 197, 64), "qkv": (3, 64, 64), "b": (5,)}
    g0 = torch.Generator().manual_seed(11)
    params = {k: (torch.randn(s, generator=g0) * 0.1).half() for k, s in shapes.items()}
    out = {"empty": [k for k, s in shapes.items() if s[0] <= rank]}
    txs = {
        "fp32": ff.adamw(1e-3),
        "int8": ff.adamw(1e-3, mu_dtype="int8", nu_dtype="int8"),
        # rounded by a hash of each value, never of its position: bitwise one process too
        "int8_stochastic": ff.adamw(
            1e-3, mu_dtype="int8", nu_dtype="int8", moment_rounding="stochastic"
        ),
    }
    for name, tx in txs.items():
        ours = ff.fp16_init({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in params.items()},
                            tx)  # fmt: skip
        ref = ff.fp16_init(params, tx)
        decisions, equal = [], True
        for step in range(STEPS):
            g = torch.Generator().manual_seed(200 + step)
            grads = {k: (torch.randn(s, generator=g) * 256).half() for k, s in shapes.items()}
            if step == INJECT_STEP:
                grads["pos"][0, 0, 0] = math.inf  # the first row: rank 0's
            ours = ff.fp16_update(ours, {k: distribute_tensor(v, mesh, [Shard(0)])
                                         for k, v in grads.items()})  # fmt: skip
            ref = ff.fp16_update(ref, grads)
            decisions.append((bool(ours.grads_finite), bool(ref.grads_finite)))
            equal &= all(torch.equal(bits(ours.master[k]), bits(ref.master[k])) for k in shapes)
        out[name] = {"decisions": decisions, "equal": equal}
    return out


SCENARIOS = {
    "matrix": scenario_matrix,
    "multisteps": scenario_multisteps,
    "bad_grads": scenario_bad_grads,
    "disagree": scenario_disagree,
    "fsdp2": scenario_fsdp2,
    "hsdp": scenario_hsdp,
    "fsdp2_mixed_precision": scenario_fsdp2_mixed_precision,
    "dcp": scenario_dcp,
    "split": scenario_split,
    "tp": scenario_tp,
    "tp_dcp": scenario_tp_dcp,
    "submesh": scenario_submesh,
    "two_roots": scenario_two_roots,
    "own_mesh": scenario_own_mesh,
    "collectives": scenario_collectives,
    "empty_shard": scenario_empty_shard,
}

if __name__ == "__main__":
    exit_now(run_scenarios(SCENARIOS, sys.argv[1]))
