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


def _crossing(importer: str, dotted: str) -> bool:
    """Whether ``dotted`` (a name under ``functional_fp16``) is private to another subpackage."""
    parts = dotted.split(".")
    return (
        parts[0] == "functional_fp16"
        and len(parts) > 2
        and _unit(dotted) != _unit(importer)
        and any(map(_private, parts[2:]))
    )


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` (or ``getattr(a.b, "c")``) with its root name replaced by what it is bound to."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return None if base is None else f"{base}.{node.attr}"
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        base = _dotted(node.args[0], aliases)
        return None if base is None else f"{base}.{node.args[1].value}"
    return None


def private_crossings(root: Path) -> list[str]:
    """Every place a module of ``root/functional_fp16`` uses a private name of another subpackage.

    Seen: ``from M import _x``, an import of a private module, and any
    attribute chain or constant ``getattr`` on a name bound by an import
    (``import functional_fp16.a.b`` binds ``functional_fp16``; ``as m`` binds
    ``m``; ``from P import m`` binds ``m`` to ``P.m``).
    """
    found = []
    for path in sorted((root / "functional_fp16").rglob("*.py")):
        importer = _module_name(path, root)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = importer if is_package else importer.rpartition(".")[0]
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                source = (
                    f"{base}.{node.module}" if node.level and node.module else node.module or base
                )
                if not source.startswith("functional_fp16"):
                    continue
                for alias in node.names:
                    if _crossing(importer, f"{source}.{alias.name}"):
                        found.append(f"{importer}:{node.lineno} imports {source}.{alias.name}")
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if not alias.name.startswith("functional_fp16"):
                        continue
                    if _crossing(importer, alias.name):
                        found.append(f"{importer}:{node.lineno} imports {alias.name}")
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases[alias.name.partition(".")[0]] = alias.name.partition(".")[0]
        seen = set()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Attribute, ast.Call)):
                continue
            dotted = _dotted(node, aliases)
            if dotted and _crossing(importer, dotted) and (node.lineno, dotted) not in seen:
                # Report the shortest chain that crosses (not every longer one).
                parts = dotted.split(".")
                first = next(i for i in range(2, len(parts)) if _private(parts[i]))
                short = ".".join(parts[: first + 1])
                if (node.lineno, short) not in seen:
                    seen.add((node.lineno, short))
                    found.append(f"{importer}:{node.lineno} uses {short}")
                seen.add((node.lineno, dotted))
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
        + "import functional_fp16.update.dispatch\nfunctional_fp16.update.dispatch._route\n"
        + "from functional_fp16 import update as upd\nupd.step._check_state\n"
        + "getattr(_step_module, '_by_getattr')\n"
        + "from functional_fp16.checkpoint import _read\n"
    )
    found = private_crossings(tmp_path)
    assert sorted(f.split(" ", 1)[1] for f in found) == sorted(
        [
            "imports functional_fp16.update.state._planted",
            "uses functional_fp16.update.step._hidden",
            "uses functional_fp16.update.dispatch._route",
            "uses functional_fp16.update.step._check_state",
            "uses functional_fp16.update.step._by_getattr",
            "imports functional_fp16.checkpoint._read",
        ]
    )


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
