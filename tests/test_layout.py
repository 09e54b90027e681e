"""The layout's rules (pyproject.toml, [tool.importlinter]) hold, and would catch an import that breaks them."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=folder, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(folder)})


def test_every_import_contract_is_kept():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "0 broken" in result.stdout


def test_an_import_against_the_layers_or_into_a_protected_module_breaks_a_contract(tmp_path):
    shutil.copytree(ROOT / "replay_proxy", tmp_path / "replay_proxy",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    wire = tmp_path / "replay_proxy" / "wire" / "encode.py"
    wire.write_text(wire.read_text() + "\nfrom replay_proxy.store import tables  # noqa: E402\n")  # the wire, up
    cli = tmp_path / "replay_proxy" / "cli" / "common.py"
    cli.write_text(cli.read_text() + "\nfrom replay_proxy.store import rows  # noqa: E402\n"  # the writer's own
                   "from replay_proxy.recorder import tap  # noqa: E402\n")  # the recorder's own
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "Data flows one way, from the wire up BROKEN" in result.stdout
    assert "replay_proxy.wire.encode -> replay_proxy.store.tables" in result.stdout
    assert "A file's writer and its rows are the recorder's and the file operations' BROKEN" in result.stdout
    assert "The recorder's processes and protocol are its own BROKEN" in result.stdout


def ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "ruff"), "check", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_the_code_keeps_the_lint_rules_and_they_would_catch_a_break():
    """[tool.ruff]'s rules hold over the product, its tests and scripts; a `# noqa` that silences nothing
    would be reported, and so would an unused import (the rules are live, not just configured)."""
    result = ruff("replay_proxy", "tests", "scripts", "setup.py")
    assert result.returncode == 0, result.stdout[-3000:]
    broken = ruff("--stdin-filename", "replay_proxy/example.py", "-", stdin="import os\nx = 1  # noqa: E731\n")
    assert broken.returncode == 1 and "F401" in broken.stdout and "RUF100" in broken.stdout


def mypy(folder: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "mypy"), "--cache-dir", str(cache)], cwd=folder,
                          capture_output=True, text=True, timeout=300)


def test_the_types_check_strictly_and_the_checker_would_catch_a_break(tmp_path):
    """[tool.mypy] holds over its packages, strictly; on a copy, a function without types and a call with a
    wrong one are reported (the checker is live, and reads the packages it names)."""
    result = mypy(ROOT, tmp_path / "cache")
    assert result.returncode == 0 and "Success" in result.stdout, result.stdout[-3000:]
    shutil.copytree(ROOT / "replay_proxy", tmp_path / "copy" / "replay_proxy",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "copy")
    store = tmp_path / "copy" / "replay_proxy" / "store" / "reserve.py"
    store.write_text(store.read_text() + "\n\ndef untyped(path):\n    return hold(path)\n\n\n"
                     "def wrong() -> bool:\n    return hold(3)\n")
    broken = mypy(tmp_path / "copy", tmp_path / "cache")
    assert broken.returncode == 1
    assert "reserve.py" in broken.stdout and "[no-untyped-def]" in broken.stdout and "[arg-type]" in broken.stdout


def test_docs_architecture_names_every_module_in_its_package_row():
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `replay_proxy/(\w*)/?` \| (.*) \|$", text, re.M))
    packages = {p.parent.name for p in (ROOT / "replay_proxy").glob("*/__init__.py")}
    assert packages | {""} == set(rows)
    unnamed = [f"{package or 'replay_proxy'}/{module.name}" for package, row in rows.items()
               for module in (ROOT / "replay_proxy" / package).glob("**/*.py" if package else "*.py")
               if module.stem not in ("__init__", "__main__") and f"`{module.stem}`" not in row
               and f"`{module.name}`" not in row]
    assert unnamed == []
