"""scripts/matrix_diff.py: two matrix databases cell by cell, on the committed one and an edited copy."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import sqlite_utils

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "compatibility.db"
CELL = ("vllm-rs:0.30.0", "0.32.0")


def diff(before: Path, after: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "matrix_diff.py"), str(before), str(after)],
                          capture_output=True, text=True, timeout=60)


def edited(tmp_path: Path, edit) -> Path:
    """A copy of the committed matrix whose vllm-rs:0.30.0 x 0.32.0 cell ``edit(cell, db)`` changed."""
    after = tmp_path / "after.db"
    shutil.copy(COMMITTED, after)
    db = sqlite_utils.Database(after)
    cell = json.loads(db["matrix_cells"].get(CELL)["cell"])
    edit(cell, db)
    db["matrix_cells"].update(CELL, {"cell": json.dumps(cell)})
    return after


def test_a_run_with_the_same_verdicts_and_evidence_does_not_differ_whatever_its_messages_say(tmp_path):
    def other_messages(cell, db):
        for evidence in cell["observed"]["evidence"]:
            evidence["message"] += " (another port, another path)"

    done = diff(COMMITTED, edited(tmp_path, other_messages))
    assert (done.returncode, done.stdout.splitlines()[-1]) == (0, "225 cells in both, 0 differ")


def test_a_cell_whose_evidence_or_verdict_changed_is_named_and_fails(tmp_path):
    def another_rule_and_verdict(cell, db):
        next(e for e in cell["observed"]["evidence"] if e["verdict"] == "breaks")["rule"] = "another_rule"
        db["matrix_cells"].update(("vllm:0.27.0", "0.27.0"), {"verdict": "breaks"})

    done = diff(COMMITTED, edited(tmp_path, another_rule_and_verdict))
    assert done.returncode == 1
    assert done.stdout.count("\n  before ") == 2 and "vllm-rs:0.30.0 x engine 0.32.0:" in done.stdout
    assert done.stdout.splitlines()[-1] == "225 cells in both, 2 differ"


def test_each_observed_cell_of_the_committed_matrix_comes_from_recordings_of_its_own_releases():
    """vllm:0.32.0's pooling cells once came from the 0.31.0 frontend's recording (it sent the same): evidence of
    another release, though 0.32.0's own was committed."""
    others = []
    for row in sqlite_utils.Database(COMMITTED).query("SELECT frontend, engine, cell FROM matrix_cells"):
        frontend = row["frontend"].replace(":", "-")
        for evidence in (json.loads(row["cell"]).get("observed") or {}).get("evidence", []):
            source = evidence.get("source") or ""
            leg = source.removeprefix("replays/").split("/")[0]
            own = (leg.startswith(f"{frontend}-") and leg.endswith(f"-to-engine-{row['engine']}")
                   if evidence["direction"] == "to_engine" else
                   leg.startswith(f"engine-{row['engine']}-") and leg.endswith(f"-to-{frontend}"))
            if source and not own:
                others.append((row["frontend"], row["engine"], source))
    assert others == []

