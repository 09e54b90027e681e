"""The compatibility matrix observed by real peers: cells composed of two replays, the same cells as
live pairs through the recorder, can-i-deploy --verify, and bisect over real releases.

Every release here is one scripts/setup-vllm.sh installs (engines 0.28.0, 0.31.0, 0.32.0; the Rust
frontends of the readers' pins), so the suite installs nothing on demand; the product's on-demand
install is the same code as the set-up's (scripts/setup-vllm.sh --engines-only), under a lock.
"""

import json
import os
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
READY = ("--ready-timeout", str(peers.READY_TIMEOUT_S))  # each replay's, as for every real peer of the suite
# (frontend, engine, verdict, what the real reader said): one break per direction of reading, one that works.
CELLS = [("vllm-rs:0.30.0", "0.32.0", "breaks", "EngineCoreOutputs: array had incorrect length"),
         ("vllm:0.31.0", "0.28.0", "breaks", "missing required field `supports_lora`"),
         ("vllm-rs:0.32.0", "0.31.0", "works", None)]
KEPT = "vllm-rs:0.31.0@0.31.0"  # observed too: its engine replay and vllm-rs:0.32.0's share one engine


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """The cells observed as two CI runners would (--shard 1/2 and 2/2, one after the other here), merged: the
    tests below hold the merged matrix to what one run gives (the verdicts pinned in CELLS are one run's)."""
    out = tmp_path_factory.mktemp("matrix")
    for i in (1, 2):
        result = subprocess.run(
            [*CLI, "matrix", "--frontends", "vllm-rs:0.30.0..0.32.0,vllm:0.31.0", "--engines", "0.28.0,0.31.0,0.32.0",
             *(a for f, e, _, _ in CELLS for a in ("--observe", f"{f}@{e}")), "--observe", KEPT, "--shard", f"{i}/2",
             "--report-dir", str(out / f"shard-{i}"), *READY], capture_output=True, text=True,
            timeout=3 * peers.REPLAY_S)
        assert result.returncode == 0, result.stdout + result.stderr
    shards = [json.loads((out / f"shard-{i}" / "matrix.json").read_text()) for i in (1, 2)]
    assert [sum(c["observed"] is not None for c in cells) for cells in shards] == [2, 2]  # (0.31.0's two in one)
    result = subprocess.run([*CLI, "merge", str(out / "shard-1"), str(out / "shard-2"), "--db", str(out / "matrix.db"),
                             "--report-dir", str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    return out, {(c["frontend"], c["engine"]): c for c in json.loads((out / "matrix.json").read_text())}


@pytest.mark.parametrize("frontend, engine, verdict, said", CELLS)
def test_observed_cells_agree_with_their_predictions(observed, frontend, engine, verdict, said):
    _, cells = observed
    cell = cells[(frontend, engine)]
    assert (cell["observed"]["verdict"], cell["predicted"]["verdict"], cell["agrees"]) == (verdict, verdict, True)
    messages = " ".join(e["message"] for e in cell["observed"]["evidence"])
    assert said is None or said in messages, messages
    assert len(cells) == 12 and sum(c["observed"] is not None for c in cells.values()) == 4


def test_the_replays_to_one_engine_release_share_one_engine_kept_between_them(observed):
    out, cells = observed
    assert cells[("vllm-rs:0.31.0", "0.31.0")]["observed"]["verdict"] == "works"
    logs = {r: (out / "replays" / f"vllm-rs-{r}-to-engine-0.31.0" / "engine.log") for r in ("0.31.0", "0.32.0")}
    kept = {r: log.read_text().splitlines()[0] for r, log in logs.items()
            if log.read_text().startswith("# engine under test (pid")}
    [(release, first_line)] = kept.items()  # the other replay started the engine, and left it running
    started_by = logs["0.32.0" if release == "0.31.0" else "0.31.0"]
    # (the path the shard that ran both wrote it at: merge copies the replays, not what their logs say)
    assert first_line.endswith(f"kept; its whole log: {out / 'shard-1' / started_by.relative_to(out)}")
    assert "Initializing a V1 LLM engine" in started_by.read_text()


def test_a_peer_not_ready_within_the_ready_timeout_makes_the_cell_unknown_never_breaks(tmp_path):
    result = subprocess.run([*CLI, "matrix", "--frontends", "vllm-rs:0.32.0", "--engines", "0.31.0", "--observe",
                             "vllm-rs:0.32.0@0.31.0", "--ready-timeout", "1", "--report-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=peers.REPLAY_S)
    assert result.returncode == 0, result.stdout + result.stderr
    [cell] = json.loads((tmp_path / "matrix.json").read_text())
    # The engine (ready in 25 s at best) was not ready in 1 s: that leg is unknown and says why. The Rust
    # frontend is up in about a second: its leg works, or on a busy machine is unknown too; neither breaks.
    evidence = {e["direction"]: e for e in cell["observed"]["evidence"]}
    assert (cell["observed"]["verdict"], evidence["to_engine"]["rule"]) == ("unknown", "peer_not_reached")
    assert evidence["to_engine"]["message"].startswith("the engine side was not ready after 1 s")
    assert evidence["to_frontend"]["verdict"] in ("works", "unknown")


def live_pair(tmp_path, frontend: str, engine: str) -> tuple[str, dict]:
    """The cell as a live pair through `replay-proxy record`: its verdict from what the HTTP clients saw."""
    build = Frontend(*frontend.split(":"))
    real.ready_frontend(build)
    real.ready_engine(engine)

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
    # For completions (the observation replays their workload): the cell's LoRA requests break, as
    # predicted from the LoRA recordings and seen live by test_lora_vllm.py.
    verified = subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm==0.31.0", "--engine", "vllm==0.32.0",
                               "--db", str(db), "--uses", "completion", "--verify", *READY], capture_output=True,
                              text=True, timeout=2 * peers.REPLAY_S)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "vllm:0.31.0 with engine 0.32.0: works (verified now: observed by real peers)" in verified.stdout
    row = sqlite_utils.Database(db)["matrix_cells"].get(("vllm:0.31.0", "0.32.0"))
    assert (row["observed"], row["agrees"], json.loads(row["by_kind"])) == (
        "works", 1, {"completion": "works", "lora": "breaks", "pooling": "works"})


def cache_whose_model(tmp_path, spoil) -> dict:
    """The environment of a peer cache holding the installed venvs and binaries (links) and a copy of the
    tiny model, which ``spoil(folder)`` spoils: a peer's own trouble, nothing to do with the link."""
    cache = tmp_path / "cache"
    (cache / "bin").mkdir(parents=True)
    for release in ("0.31.0", "0.32.0"):
        (cache / f"vllm-{release}").symlink_to(real.venv(release))
    for binary in (real.cache_dir() / "bin").glob("vllm-rs-*"):
        (cache / "bin" / binary.name).symlink_to(binary)
    shutil.copytree(real.model(), cache / "tiny-model")
    spoil(cache / "tiny-model")
    return {**os.environ, "REPLAY_PROXY_CACHE": str(cache)}


def verify(env, report_dir) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "can-i-deploy", "--frontend", "vllm==0.31.0", "--engine", "vllm==0.32.0", "--verify",
                           "--uses", "completion", "--report-dir", str(report_dir), *READY], capture_output=True,
                          text=True, timeout=2 * peers.REPLAY_S, env=env)


def test_verify_with_a_file_missing_is_unknown_before_any_replay(tmp_path):
    result = verify(cache_whose_model(tmp_path, lambda model: (model / "tokenizer.json").unlink()), tmp_path / "r")
    assert result.returncode == 6, result.stdout + result.stderr
    first = result.stdout.splitlines()[0]
    assert first == "vllm:0.31.0 with engine 0.32.0: unknown (verified now: observed by real peers)", result.stdout
    assert f"missing {tmp_path / 'cache' / 'tiny-model' / 'tokenizer.json'}" in result.stdout
    assert not list((tmp_path / "r").glob("replays/*/report.json"))  # no peer was started: no replay ran


def test_verify_with_a_peer_that_cannot_run_is_unknown_with_its_reason_and_evidence_to_follow(tmp_path):
    result = verify(cache_whose_model(tmp_path, lambda model: (model / "config.json").write_text("{ not json")),
                    tmp_path / "r")
    assert result.returncode == 6, result.stdout + result.stderr
    assert result.stdout.splitlines()[0].endswith(": unknown (verified now: observed by real peers)"), result.stdout
    # Both peers really ran and failed on the model; what they said is quoted, and the reports are kept.
    assert result.stdout.count("its log says: OSError: It looks like the config file at") == 2, result.stdout
    # The evidence names them from the report folder chosen, wherever that folder is later read.
    reports = sorted((tmp_path / "r").glob("replays/*/report.json"))
    assert len(reports) == 2 and all(f"(source: {path.relative_to(tmp_path / 'r')})" in result.stdout
                                     for path in reports)
    assert "breaks" not in result.stdout


def test_bisect_names_the_first_rust_frontend_that_rejects_an_older_engines_registration(tmp_path):
    # Rust frontends, whose replays take seconds (a Python frontend's start takes about 25 s of CPU): the same
    # search, the same break in the other reader (a registration key older engines do not send).
    db = tmp_path / "engine-0.27.0.db"
    shutil.copy(peers.RECORDINGS / "vllm-0.27.0-vllm-rs.db", db)
    result = subprocess.run([*CLI, "bisect", "--db", str(db), "--session", "vllm-rs-frontend", "--against", "frontend",
                             "--frontend-kind", "vllm-rs", "--releases", "0.27.0,0.30.0,0.31.0", *READY],
                            capture_output=True, text=True, timeout=3 * peers.REPLAY_S)
    assert result.returncode == 3, result.stdout + result.stderr  # the deciding replay: F's reader rejected it
    # The newest first, then halving: 0.27.0 reads its own engine, 0.30.0 is the first of these that does not.
    assert "first regressing release: 0.30.0: breaking reader_rejected" in result.stdout
    assert "missing field `supports_lora`" in result.stdout
    assert "tried, in order: 0.31.0, 0.27.0, 0.30.0" in result.stdout
