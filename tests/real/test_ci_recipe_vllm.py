"""docs/ci.md's GitHub Actions workflow, its steps run as a script against real peers.

The YAML is read from the document itself; each ``run:`` step with an ``id``
runs in bash with the job's ``env:`` (``${{ github.workspace }}`` is a
temporary folder), in order, stopping at the first that fails, as a runner
does. The ``build`` step is the one this machine cannot do (it builds vLLM
from source): the cached 0.28.0 release's venv stands in for the engine it
would build, a real engine whose registration a 0.32.0 frontend rejects.
"""

import hashlib
import os
import re
import shutil
import sqlite3
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from replay_proxy import peers
from replay_proxy.processes import free_port
from replay_proxy.releases import cache_dir

pytestmark = pytest.mark.real_vllm
ROOT = Path(__file__).resolve().parents[2]


def workflow(name: str = "engine-frontend link") -> dict:
    """One of docs/ci.md's GitHub Actions workflows, by its name (its Buildkite pipeline has none)."""
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "ci.md").read_text(), re.S)]
    [chosen] = [b for b in blocks if b.get("name") == name]
    return chosen


def run_job(workspace: Path, **overrides: str) -> dict[str, subprocess.CompletedProcess]:
    job = workflow()["jobs"]["replay"]
    env = {k: str(v).replace("${{ github.workspace }}", str(workspace)) for k, v in job["env"].items()}
    env.update(REPLAY_PROXY=str(ROOT), REPLAY_PROXY_CACHE=str(cache_dir()), **overrides)
    env = {**os.environ, **env, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    results = {}
    for step in job["steps"]:
        if "run" not in step or step.get("id") == "build":
            continue
        results[step["id"]] = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=workspace, env=env,
                                             capture_output=True, text=True, timeout=1200)
        if results[step["id"]].returncode != 0:
            break
    return results


def test_the_recipe_asks_can_i_deploy_then_fails_the_job_on_a_real_regression(tmp_path):
    peers.install_engine("0.28.0")  # what the build step would have built
    recording = ROOT / workflow()["jobs"]["replay"]["env"]["RECORDING"]
    committed = hashlib.sha256(recording.read_bytes()).hexdigest()
    # A port of its own: the recipe's fixed one is taken when a second suite runs this test beside it (seen).
    results = run_job(tmp_path, ENGINE_VLLM=str(peers.vllm_program("0.28.0")), ENGINE_RELEASE="0.28.0",
                      FRONTEND="vllm==0.27.0", ENGINE_PORT=str(free_port()))
    assert list(results) == ["install", "can-i-deploy", "replay"]
    deploy = results["can-i-deploy"]
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    assert "vllm:0.27.0 with engine 0.28.0: works (predicted: not observed yet)" in deploy.stdout
    replay = results["replay"]
    # The staging recording's 0.32.0 frontend requires registration keys a 0.28.0 engine does not send.
    assert replay.returncode == 3, replay.stdout + replay.stderr
    assert "supports_lora" in replay.stdout
    # What the upload step publishes is there, and the replay's JUnit names the failing check.
    upload = next(s for s in workflow()["jobs"]["replay"]["steps"] if "upload-artifact" in s.get("uses", ""))
    paths = upload["with"]["path"].split()
    assert all((tmp_path / p).is_file() for p in paths), [p for p in paths if not (tmp_path / p).is_file()]
    failures = ET.parse(tmp_path / "reports/replay/junit.xml").getroot().iter("failure")
    assert any("supports_lora" in (f.get("message") or "") + (f.text or "") for f in failures)
    # The tracked recording is as committed; the replay is in the report folder, beside its session.
    assert hashlib.sha256(recording.read_bytes()).hexdigest() == committed
    modes = sqlite3.connect(tmp_path / "reports/replay/replay.db").execute("SELECT mode FROM sessions").fetchall()
    assert modes == [("record",), ("replay",)]


def test_the_scheduled_job_finds_whether_pypi_has_a_release_the_matrix_lacks(tmp_path):
    """Its `newest` step, run as the job runs it (the `add-release` step it gates is
    tests/real/test_add_release_vllm.py)."""
    from replay_proxy.wire.registry import shipped_releases

    [step] = [s for s in workflow("a new vLLM release")["jobs"]["add-release"]["steps"] if s.get("id") == "newest"]
    output = tmp_path / "github_output"
    env = {**os.environ, "GITHUB_OUTPUT": str(output), "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-e", "-c", step["run"]], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = dict(line.split("=", 1) for line in output.read_text().splitlines())
    assert said["release"] and (said.get("new") == "true") == (said["release"] not in shipped_releases())


def test_the_pull_request_job_fails_a_checkout_whose_two_languages_drifted(tmp_path):
    """Its `drift` step, run on a checkout made of 0.34.0's own sources (its classes, fetched with its wheel, and
    its Rust protocol, from its sdist), first as released, then with a field added to the Rust registration."""
    from replay_proxy.releases import message_classes, rust_protocol

    [step] = [s for s in workflow("vllm two languages")["jobs"]["drift"]["steps"] if s.get("id") == "drift"]
    checkout = tmp_path / "vllm"
    protocol = checkout / "rust" / "src" / "engine-core-client" / "src" / "protocol"
    shutil.copytree(rust_protocol("0.34.0"), protocol, ignore=shutil.ignore_patterns(".complete"))
    (checkout / "vllm").symlink_to(message_classes("0.34.0") / "vllm")
    env = {**os.environ, "REPLAY_PROXY_CACHE": str(cache_dir()), "COLUMNS": "200",
           "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    run = lambda: subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=tmp_path, env=env,  # noqa: E731
                                 capture_output=True, text=True, timeout=600)
    released = run()
    assert released.returncode == 0, released.stdout[-2000:] + released.stderr[-2000:]
    handshake = protocol / "handshake.rs"
    anchor = "    pub enable_expert_parallel: bool,\n"
    handshake.write_text(handshake.read_text().replace(anchor, anchor + "    pub weights_digest: String,\n", 1))
    drifted = run()
    assert drifted.returncode == 3 and "EngineCoreReadyResponse.weights_digest" in drifted.stdout, drifted.stdout
    assert (tmp_path / "reports" / "drift" / "junit.xml").exists()
