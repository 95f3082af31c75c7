"""The package's layers: the import-linter contracts and the private names of each subpackage.

``lint-imports`` (run by the test command) checks the contracts in
``pyproject.toml`` on every CI run; the test here shows that it would catch a
planted upward import. Private *names* (``_x`` imported from a module of
another subpackage) are below what import-linter sees, so they are checked
here from the syntax trees.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "functional_fp16"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The subpackage (or top-level module) that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_crossings(root: Path) -> list[str]:
    """Every place a module of ``root/functional_fp16`` uses a private name of another subpackage."""
    found = []
    for path in sorted((root / "functional_fp16").rglob("*.py")):
        importer = _module_name(path, root)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}  # local name -> module of another subpackage
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = importer if is_package else importer.rpartition(".")[0]
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                source = (
                    f"{base}.{node.module}" if node.level and node.module else node.module or base
                )
                if not source.startswith("functional_fp16") or _unit(source) == _unit(importer):
                    continue
                inner = source.split(".")[2:]
                for alias in node.names:
                    if any(map(_private, [*inner, alias.name])):
                        found.append(f"{importer}:{node.lineno} imports {source}.{alias.name}")
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("functional_fp16") and alias.asname:
                        if _unit(alias.name) != _unit(importer):
                            aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and _private(node.attr)
            ):
                found.append(f"{importer}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_private_name_crosses_a_subpackage():
    assert private_crossings(ROOT) == []


def test_the_private_name_check_sees_a_planted_crossing(tmp_path):
    copy = tmp_path / "functional_fp16"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "stuck_scale.py"
    target.write_text(
        target.read_text()
        + "\nfrom functional_fp16.update.state import _planted\n"
        + "import functional_fp16.update.step as _step_module\n_step_module._hidden\n"
    )
    found = private_crossings(tmp_path)
    assert [f.split(" ", 1)[1] for f in found] == [
        "imports functional_fp16.update.state._planted",
        "uses functional_fp16.update.step._hidden",
    ]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("lint-imports is not installed (pip install -e '.[test]')")
    return subprocess.run(
        [str(exe), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layer_contracts_hold():
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("transforms/sgd.py", "import functional_fp16.update", "Layers"),
        ("precision/policy.py", "import functional_fp16.transforms.base", "Layers"),
        ("_kernels/cpu.py", "import functional_fp16._util.tree", "The kernels import nothing"),
        ("update/state.py", "import functional_fp16.checkpoint._read", "A private module"),
        (
            "distributed/buckets.py",
            "import functional_fp16.distributed.sharding",
            "No import cycles",
        ),
    ],
)
def test_lint_imports_fails_on_a_planted_violation(tmp_path, module, line, contract):
    copy = tmp_path / "functional_fp16"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # planted\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout
