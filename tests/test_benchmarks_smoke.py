"""Each benchmark script runs end to end at the smallest size it accepts and prints its report.

Only that is checked here: that the scripts parse their arguments, build
every row and print their tables. What the rows compute is the library's,
tested in ``test_update.py``, ``test_fast_update.py``, ``test_fused_update.py``, ``test_ops.py``,
``test_compile.py`` and ``test_references.py``; no timing is asserted.
``bench_update.py`` and ``bench_adam.py`` have no tiny timed mode (their
smallest timed tree is the example CNN), so they run their ``--smoke`` modes,
whose agreement lines are the one place the benchmarks' own rows
(``GradScaler``, apex's algorithm, torchopt, optax) are checked.
``bench_allreduce.py`` (two gloo processes spawned afresh),
``bench_against_commit.py`` (it exports an earlier commit from the git
history) and ``bench_compiled_step_parts.py`` (it compiles the CNN's whole
backward, about 20 s) are not run here. The benchmarks set beside stock PyTorch
(``bench_example_vs_stock.py``, ``bench_page_faults.py``, ``bench_cuda_default.py``,
``bench_tp.py``) are run by ``tests/test_benchmarks_smoke_vs_stock.py``, a module of
their own so that ``--dist loadscope`` can give the two halves to different workers.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

from tests.helpers import load_module

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_CHECKS = load_module(Path(ROOT) / "benchmarks" / "cuda_checks.py", "cuda_checks")


def _run(script, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_update_benchmark_builds_every_row_and_they_agree():
    pytest.importorskip("torchopt")
    pytest.importorskip("jmp")
    pytest.importorskip("optax")
    out = _run("bench_update.py", "--smoke")
    lines = [line for line in out.splitlines() if line.startswith("- ")]
    names = " ".join(lines)
    for row in (
        "fp16_update eager",
        "fp16_update compiled",
        "GradScaler+SGD(fused)",
        "GradScaler+SGD(foreach)",
        "apex",
        "torchopt",
        "optax",
        "fp16_update + clip (pure, default)",
        "GradScaler + clip + SGD(fused)",
    ):
        assert row in names, out
    assert not any(line.startswith("- FAIL") for line in lines), out
    assert sum(line.startswith("- PASS") for line in lines) >= 18, out


def test_adam_benchmark_builds_every_row_and_they_agree():
    out = _run("bench_adam.py", "--smoke")
    lines = [line for line in out.splitlines() if line.startswith("- ")]
    assert len(lines) == 5 and all(line.startswith("- PASS") for line in lines), out
    assert "GradScaler+AdamW(fused)" in " ".join(lines), out


def test_train_step_benchmark_prints_its_table():
    out = _run("bench_train_step.py", "--batch", "1", "--reps", "1", "--warmup", "0")
    header, *rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert header.startswith("| row | ms/step |"), out
    names = [row.split(" | ")[0][2:] for row in rows]
    assert len(names) == 6 and "functional compiled" in names, out


@pytest.mark.parametrize("check", list(CUDA_CHECKS.CHECKS))
def test_cuda_checks_script_check_passes_on_cpu(check):
    # Each check the GPU script declares, run here on the CPU (in this process);
    # the CUDA-only ones report SKIP. tests/test_cuda.py runs them on a GPU.
    results = CUDA_CHECKS.run_check(check, torch.device("cpu"))
    torch._dynamo.reset()
    verdicts = {verdict for verdict, _, _ in results}
    assert results and "FAIL" not in verdicts, results
    if verdicts == {"SKIP"}:
        pytest.skip(f"{check}: {results[0][2]}")
    assert verdicts == {"PASS"}, results


def test_cuda_checks_script_runs_on_cpu(tmp_path):
    # The script itself: its arguments, one check (each is a test above), the
    # speed table and the summary.
    summary = tmp_path / "cuda_checks.md"
    out = _run(
        "cuda_checks.py",
        *("--device", "cpu", "--smoke", "--check", "foreach-vs-reference"),
        *("--out", str(summary)),
    )
    assert "FAIL" not in out, out
    assert "PASS" in out
    text = summary.read_text()
    assert "All checks passed." in text and "| fp16_update compiled donated |" in text


def test_vmap_benchmark_checks_the_members_and_prints_its_table():
    out = _run("bench_vmap.py", "--smoke")
    assert "| vmap(fp16_update) |" in out and "cross-talk" in out


def test_lion_benchmark_runs_both_optimisers_on_the_fused_path():
    out = _run("bench_lion.py", "--smoke")
    assert "| lion pure |" in out and "| adamw donated |" in out


def test_rmsprop_benchmark_runs_the_fused_and_the_multi_tensor_rows_against_torch():
    out = _run("bench_rmsprop.py", "--smoke")
    assert "| fused pure |" in out and "| multi-tensor donated |" in out
    assert "| GradScaler+RMSprop(foreach) |" in out


def test_moment_fidelity_benchmark_prints_every_format_and_case():
    out = _run("bench_moment_fidelity.py", "--smoke")
    for fmt in ("bfloat16", "float16", "e4m3"):
        for rounding in ("nearest", "stochastic"):
            assert f"| {fmt}, {rounding} |" in out, out
    assert "| float32 | 1.000e-03 (1.00x) |" in out and "lion, +1 -> -1 (steps)" in out


def test_moments_benchmark_counts_state_bytes_and_times_every_format():
    out = _run("bench_moments.py", "--smoke")
    for row in ("| fp32 | 2.000 | 4.000 | 8.000", "| bf16 | 2.000 | 4.000 | 4.000", "| e4m3 |"):
        assert row in out, out
    for fmt in ("fp32", "bf16", "fp16 (scaled v)", "e4m3", "e4m3, nearest", "bf16, nearest"):
        assert f"| recipe, {fmt} moments |" in out
    for fmt in ("fp32", "bf16", "e4m3"):  # stored moments take the fused step
        assert f"| recipe, {fmt} moments | fused |" in out, out
    assert "| recipe, fp16 (scaled v) moments | foreach |" in out, out


def test_master_benchmark_counts_bytes_and_times_both_forms():
    out = _run("bench_master.py", "--smoke")
    assert "| FP32 master, FP32 moments | 6.00 B | 8.00 B | 14.00 B |" in out, out
    assert "| split master, FP32 moments | 4.00 B | 8.00 B | 12.00 B |" in out, out
    for name in ("recipe", "sgd-momentum", "recipe, donated", "sgd-momentum, donated"):
        assert f"| {name}: split master | fused |" in out, out
