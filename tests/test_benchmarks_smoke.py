"""The benchmark scripts' smoke modes: every row runs and agrees numerically.

No timing is asserted: the smoke modes run tiny trees for a few steps and
compare each row's FP32 weights with ``fp16_update(impl="reference")``.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )


def test_update_benchmark_rows_agree():
    pytest.importorskip("torchopt")
    pytest.importorskip("jmp")
    pytest.importorskip("optax")
    proc = _run("bench_update.py", "--smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("- ")]
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
        assert row in names, proc.stdout
    assert not any(line.startswith("- FAIL") for line in lines), proc.stdout
    assert sum(line.startswith("- PASS") for line in lines) >= 18, proc.stdout


def test_train_step_benchmark_loops_agree():
    proc = _run("bench_train_step.py", "--smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS train-step smoke" in proc.stdout


def test_cuda_checks_script_runs_on_cpu(tmp_path):
    # The GPU script's --device cpu mode exercises its code paths here; the
    # CUDA-only checks report SKIP.
    out = tmp_path / "cuda_checks.md"
    proc = _run("cuda_checks.py", "--device", "cpu", "--smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout, proc.stdout
    assert "PASS" in proc.stdout
    summary = out.read_text()
    assert "All checks passed." in summary and "| fp16_update compiled donated |" in summary


def test_example_vs_stock_benchmark_runs_every_side():
    proc = _run("bench_example_vs_stock.py", "--smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| example (functional FP16, defaults) |" in proc.stdout
    assert "| stock recipe (autocast) |" in proc.stdout
    assert "example / stock:" in proc.stdout
