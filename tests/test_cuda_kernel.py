"""The Triton kernel of the fused update, run here by Triton's interpreter on CPU tensors.

On a machine with a GPU, ``tests/test_cuda.py`` runs it for real; without one,
``TRITON_INTERPRET=1`` executes the same kernel source with NumPy, which checks
its logic: masks, flags, dtypes, donation, skipped steps and the arithmetic
(see ``tests/_triton_interpret_worker.py`` for what the interpreter cannot
show exactly).
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_triton_kernel_logic_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "_triton_interpret_worker.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("\nok ") + proc.stdout.startswith("ok ") == 10, proc.stdout
    assert proc.stdout.rstrip().endswith("ALL OK")
