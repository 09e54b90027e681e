"""The layout's rules (pyproject.toml, [tool.importlinter]) hold, and would catch an import that breaks them."""

import os
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
    shutil.copytree(ROOT / "replay_proxy", tmp_path / "replay_proxy", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    wire = tmp_path / "replay_proxy" / "wire" / "encode.py"
    wire.write_text(wire.read_text() + "\nfrom replay_proxy.store import tables  # noqa: E402\n")  # the wire, up
    cli = tmp_path / "replay_proxy" / "cli" / "common.py"
    cli.write_text(cli.read_text() + "\nfrom replay_proxy.store import rows  # noqa: E402\n")  # the writer's own
    result = lint_imports(tmp_path)
    assert result.returncode == 1
    assert "Data flows one way, from the wire up BROKEN" in result.stdout
    assert "replay_proxy.wire.encode -> replay_proxy.store.tables" in result.stdout
    assert "The recorder's processes, protocol and rows are its own BROKEN" in result.stdout
