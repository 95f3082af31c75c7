"""What ``import functional_fp16`` loads: DTensor's and DCP's modules only where used.

``torch.distributed.tensor`` (with sympy) and ``torch.distributed.checkpoint`` take
about a second to import between them, and most programs never make a DTensor. The
package recognises DTensors without importing their module
(:mod:`functional_fp16._util.dtensors`) and loads the distributed modules that need
them on the first use of one of their names. Each check runs in a fresh interpreter.
"""

from __future__ import annotations

from tests.helpers import fresh_json

HEAVY = ("torch.distributed.tensor", "torch.distributed.checkpoint")


def test_importing_the_package_and_updating_a_plain_state_loads_no_dtensor_module():
    got = fresh_json(
        f"""
        import json, sys, torch
        import functional_fp16 as ff
        after_import = [m for m in {HEAVY!r} if m in sys.modules]
        params = {{"w": torch.ones(4, 3, dtype=torch.float16), "b": torch.zeros(3, dtype=torch.float16)}}
        grads = {{k: torch.full_like(v, 2.0) for k, v in params.items()}}
        for tx in (ff.sgd(0.1, momentum=0.9), ff.chain(ff.clip_by_global_norm(1.0), ff.adamw(1e-3))):
            for impl in ("auto", "foreach", "reference"):
                state = ff.fp16_init(params, tx)
                state = ff.fp16_update(ff.fp16_update(state, grads, impl=impl), grads, impl=impl)
                ff.update_path(state, impl)
        print(json.dumps({{"after_import": after_import,
                           "after_update": [m for m in {HEAVY!r} if m in sys.modules]}}))
        """
    )
    assert got == {"after_import": [], "after_update": []}


def test_every_distributed_name_resolves_and_loads_its_module_on_first_use():
    got = fresh_json(
        f"""
        import json, sys
        import functional_fp16.distributed as ffd
        before = [m for m in {HEAVY!r} if m in sys.modules]
        # The submodules the package imported before they were loaded lazily stay
        # attributes of the package, imported on first access.
        unloaded, not_modules = [], []
        for m in ("dcp_reader", "sharded_checkpoints", "dcp_state", "checkpoints",
                  "sharded_step", "sharding", "row_shards"):
            name = f"functional_fp16.distributed.{{m}}"
            if name not in sys.modules:
                unloaded.append(m)
            found = getattr(ffd, m, None)
            if found is None or found is not sys.modules.get(name):
                not_modules.append(m)
        absent = object()
        missing = [n for n in ffd.__all__ if getattr(ffd, n, absent) is absent]
        names = {{}}
        exec("from functional_fp16.distributed import *", names)
        print(json.dumps({{"before": before, "unloaded": unloaded, "not_modules": not_modules,
                           "after": [m for m in {HEAVY!r} if m in sys.modules], "missing": missing,
                           "star": sorted(set(ffd.__all__) - set(names)),
                           "dir": sorted(set(ffd.__all__) - set(dir(ffd)))}}))
        """
    )
    assert got["before"] == [] and "torch.distributed.tensor" in got["after"], got
    assert "dcp_reader" in got["unloaded"] and got["not_modules"] == [], got
    assert got["missing"] == [] and got["star"] == [] and got["dir"] == [], got


def test_dtensors_are_recognised_once_their_module_is_loaded():
    got = fresh_json(
        """
        import json, torch
        import torch.distributed as dist
        from functional_fp16._util.dtensors import any_dtensor, is_dtensor
        plain = torch.ones(4)
        before = [is_dtensor(plain), any_dtensor([plain])]
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        dt = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
        after = [is_dtensor(plain), is_dtensor(dt), any_dtensor([plain, dt]), any_dtensor([plain])]
        dist.destroy_process_group()
        print(json.dumps({"before": before, "after": after}))
        """
    )
    assert got == {"before": [False, False], "after": [False, True, True, False]}
