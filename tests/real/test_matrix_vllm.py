"""The compatibility matrix observed by real peers: cells composed of two replays, the same cells as
live pairs through the recorder, can-i-deploy --verify, and bisect over a real range.

Releases not in scripts/setup-vllm.sh's defaults (0.28.0, 0.29.0) are installed
on demand by the product itself, as a user's matrix run would.
"""

import json
import shutil
import subprocess
import sys

import pytest
import sqlite_utils

from replay_proxy import peers as real
from replay_proxy.matrix import Frontend
from tests.real import peers

pytestmark = pytest.mark.real_vllm
CLI = [sys.executable, "-m", "replay_proxy"]
# (frontend, engine, verdict, what the real reader said): one break per direction of reading, one that works.
CELLS = [("vllm-rs:0.30.0", "0.32.0", "breaks", "EngineCoreOutputs: array had incorrect length"),
         ("vllm:0.29.0", "0.28.0", "breaks", "missing required field `supports_lora`"),
         ("vllm-rs:0.32.0", "0.31.0", "works", None)]


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    result = subprocess.run(
        [*CLI, "matrix", "--frontends", "vllm-rs:0.30.0,vllm-rs:0.32.0,vllm:0.29.0", "--engines", "0.28.0,0.31.0,0.32.0",
         *(a for f, e, _, _ in CELLS for a in ("--observe", f"{f}@{e}")), "--db", str(out / "matrix.db"),
         "--report-dir", str(out)], capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, {(c["frontend"], c["engine"]): c for c in json.loads((out / "matrix.json").read_text())}


@pytest.mark.parametrize("frontend, engine, verdict, said", CELLS)
def test_observed_cells_agree_with_their_predictions(observed, frontend, engine, verdict, said):
    _, cells = observed
    cell = cells[(frontend, engine)]
    assert (cell["observed"]["verdict"], cell["predicted"]["verdict"], cell["agrees"]) == (verdict, verdict, True)
    messages = " ".join(e["message"] for e in cell["observed"]["evidence"])
    assert said is None or said in messages, messages
    assert len(cells) == 9 and sum(c["observed"] is not None for c in cells.values()) == 3


def live_pair(tmp_path, frontend: str, engine: str) -> tuple[str, dict]:
    """The cell as a live pair through `replay-proxy record`: its verdict from what the HTTP clients saw."""
    build = Frontend(*frontend.split(":"))
    real.install_frontend(build)
    real.install_engine(engine)

    def start(logs, http, rpc):
        return peers.real_child(real.frontend_argv(build, http, rpc), logs / "frontend.log", frontend)

    try:
        seen = peers.run_pair(tmp_path, start, tmp_path / "live.db", "live", engine_release=engine)
    except peers.ChildError as exc:  # the frontend exited: it rejected the engine
        return "breaks", {"error": str(exc)}
    failed = {k: v for k, v in seen.items() if isinstance(v, str) and v.startswith("HTTP")}
    return ("breaks" if failed else "works"), seen


@pytest.mark.parametrize("frontend, engine, verdict, said", CELLS)
def test_a_live_pair_through_the_recorder_gives_the_composed_verdict(observed, tmp_path, frontend, engine, verdict,
                                                                      said):
    live, seen = live_pair(tmp_path, frontend, engine)
    assert live == verdict, seen
    if said is not None:  # the same reader error, in the live frontend's log or its HTTP answers
        logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))
        assert said in logs + json.dumps(seen), seen


def test_can_i_deploy_answers_from_the_observation_and_verifies_a_cell_now(observed, tmp_path):
    out, _ = observed
    db = tmp_path / "matrix.db"
    shutil.copy(out / "matrix.db", db)
    known = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm-rs==0.30.0", "--engine", "vllm==0.32.0",
                            "--db", str(db)], capture_output=True, text=True, timeout=60)
    assert known.returncode == 3 and "(observed 20" in known.stdout, known.stdout
    assert "array had incorrect length" in known.stdout
    verified = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm==0.31.0", "--engine", "vllm==0.32.0",
                               "--db", str(db), "--verify"], capture_output=True, text=True, timeout=900)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "vllm:0.31.0 with engine 0.32.0: works (verified now: observed by real peers)" in verified.stdout
    row = sqlite_utils.Database(db)["matrix_cells"].get(("vllm:0.31.0", "0.32.0"))
    assert (row["observed"], row["predicted"], row["agrees"]) == ("works", "works", 1)


def test_bisect_names_the_first_python_frontend_that_rejects_an_older_engines_registration(tmp_path):
    db = tmp_path / "engine-0.28.0.db"
    shutil.copy(peers.RECORDINGS / "vllm-0.28.0-python.db", db)
    result = subprocess.run([*CLI, "bisect", "--db", str(db), "--session", "python-frontend", "--against", "frontend",
                             "--frontend-kind", "vllm", "--releases", "0.28.0..0.32.0"],
                            capture_output=True, text=True, timeout=2400)
    assert result.returncode == 6, result.stdout + result.stderr  # the deciding replay could not run: F exited
    assert "first regressing release: 0.29.0: regression replay_failed" in result.stdout
    assert "supports_lora" in result.stdout
    assert "tried, in order: 0.32.0, 0.29.0, 0.28.0" in result.stdout
