"""The benchmarks that set our update beside stock PyTorch run end to end at their smallest size.

Split from ``tests/test_benchmarks_smoke.py`` (same checks, same ``_run``) so that the two
halves of about 90 s each can run on different workers under ``pytest-xdist``'s
``--dist loadscope``, which keeps a module on one worker: ``bench_example_vs_stock.py``,
``bench_page_faults.py``, ``bench_cuda_default.py`` and ``bench_tp.py``. No timing is
asserted.
"""

import json

import pytest

from tests.test_benchmarks_smoke import _run

pytestmark = pytest.mark.slow


def test_example_vs_stock_benchmark_runs_every_side():
    out = _run("bench_example_vs_stock.py", "--rounds", "1", "--steps", "1", "--warmup", "0")
    assert "1 rounds of 1 steps" in out
    assert "| example (functional FP16, defaults) |" in out
    assert "| stock recipe (autocast) |" in out
    assert "| stock recipe + tune_malloc |" in out
    assert "example / stock:" in out


def test_page_fault_benchmark_prints_every_row():
    out = _run("bench_page_faults.py", "--params", "300000", "--steps", "2")
    for row in ("eager (default)", "compiled", "eager, plain allocation"):
        assert f"| {row} |" in out


def test_cuda_default_benchmark_counts_every_row_on_cudas_default_path(tmp_path):
    # It sets FUNCTIONAL_FP16_CPU_KERNEL=cuda-default itself (and fails if a C++ op runs).
    report = tmp_path / "cuda_default.json"
    out = _run(
        "bench_cuda_default.py",
        *("--layers", "1", "--small-layers", "0", "--params", "100000"),
        *("--json", str(report)),
    )
    res = json.loads(report.read_text())
    assert res["kernel"] == "generic" and res["leaves"] == [16, 4]
    rows = {r["row"]: r for r in res["rows"]}
    assert len(rows) == 18 and sum(r["row"].startswith("torch: ") for r in res["rows"]) == 2
    for r in rows.values():
        for mode in [m for m in ("pure", "donated", "in place") if m in r]:
            m = r[mode]
            assert all(n > 0 for n in m["launches"]) and m["per_leaf"], (r["row"], mode)
            assert all(x is not None and x >= 0 for x in m["transient_bytes_per_param"])
    # one update's work does not grow with the leaves on these fused rows (issue 40's target)
    for name in ("recipe: clip + adamw(mask, warmup-cosine)", "sgd(0.05, momentum=0.9)"):
        assert rows[name]["path"] == "fused (generic)"
        assert rows[name]["pure"]["per_leaf"] == rows[name]["donated"]["per_leaf"] == "no"
    assert res["cpu"] in out and "| torch: GradScaler + SGD(fused, momentum=0.9) |" in out
    # stored states take the fused step: with TRITON_INTERPRET=1 (the benchmark sets it)
    # their Triton kernels, one launch a leaf, counted as such
    for name in ("recipe, bf16 moments", "recipe, e4m3 moments", "sgd, e4m3 trace"):
        assert rows[name]["path"] == "fused (generic)", rows[name]
    assert rows["lion, e4m3 momentum"]["pure"]["ops"][0]["triton::stored_leaf"] == 16
    # a split master's Adam steps in one Triton launch a leaf, joining and splitting in it
    assert rows["recipe, split master"]["pure"]["ops"][0]["triton::stored_leaf"] == 16


@pytest.mark.distributed
def test_tensor_parallel_benchmark_times_both_sides_and_counts_two_collectives():
    """On the 2 x 2 mesh (leaves sharded over both dimensions, over one, strided, replicated),
    one update of ours runs one all-reduce for the flags and one for the norm: no more."""
    out = _run("bench_tp.py", "--rounds", "1", "--steps", "1", "--width", "64", "--layers",
               "2", "--context", "16", "--batch", "8")  # fmt: skip
    assert "_StridedShard" in out and "(Shard(dim=0), Replicate())" in out
    assert "on 1 mesh(es)" in out and "ours / stock" in out
    assert "  ours    2: allreduce_ 2\n" in out, out
