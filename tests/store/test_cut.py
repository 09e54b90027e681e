"""`replay-proxy cut`: the chosen requests and all they need, from a sim session and from a real recording."""

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import sqlite_utils
import trio

from replay_proxy.compare.findings import Severity
from replay_proxy.store.cut import CutError, Selection, cut_database
from replay_proxy.store.raw import frames_with_bytes
from tests.replay.sim_sessions import record_baseline, replay_baseline

REAL = Path(__file__).parents[2] / "recordings" / "vllm-0.32.0-python.db"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The engine-replay session: r0..r7 (three alone, five batched), 'long' aborted, a utility call."""
    db = tmp_path_factory.mktemp("cut") / "baseline.db"
    trio.run(record_baseline, db, 1, 1)
    return db


def frames(db, session_id=1):
    return [(r["seq"], r["kind"], r["parts"])
            for r in frames_with_bytes(sqlite3.connect(db), "session_id = ?", [session_id])]


def outputs_by_request(db, session_id=1):
    rows = sqlite3.connect(db).execute(
        "SELECT request_id, seq, new_token_ids, finish_reason FROM outputs WHERE session_id = ? ORDER BY seq, "
        "position", [session_id]).fetchall()
    by_request = {}
    for rid, seq, tokens, finish in rows:
        by_request.setdefault(rid, []).append((seq, tokens, finish))
    return by_request


def test_a_cut_keeps_the_chosen_requests_their_outputs_and_every_handshake(tmp_path, recorded):
    out = tmp_path / "cut.db"
    session_id, kept, _ = cut_database(recorded, out, "baseline", Selection(requests=["r1", "r5", "long"]))
    assert kept == 3
    requests = [r for (r,) in sqlite3.connect(out).execute("SELECT request_id FROM requests ORDER BY seq")]
    assert requests == ["r1", "r5", "long"]
    source, cut = outputs_by_request(recorded), outputs_by_request(out, session_id)
    assert cut == {rid: source[rid] for rid in ("r1", "r5", "long")}  # every output, at its recorded seq
    kinds = [kind for _, kind, _ in frames(out, session_id)]
    assert {"HELLO", "INIT", "READY", "REGISTRATION", "UTILITY", "UTILITY_OUTPUT", "ABORT"} <= set(kinds)
    # A frame that lost nothing keeps its bytes; one that lost outputs holds only the chosen ones.
    source_raw = {seq: raw for seq, _, raw in frames(recorded)}
    untouched = [seq for seq, kind, raw in frames(out, session_id) if raw == source_raw[seq]]
    assert {seq for seq, kind, _ in frames(out, session_id) if kind != "OUTPUTS"} <= set(untouched)
    row = sqlite_utils.Database(out)["sessions"].get(session_id)
    assert row["name"] == "baseline (cut)" and row["status"] == "complete"
    cut_from = json.loads(row["cut_from"])
    assert (cut_from["session"], cut_from["selection"], cut_from["requests"]) == (
        "baseline", {"requests": ["r1", "r5", "long"]}, 3)
    assert cut_from["source"].startswith("sha256:") and len(cut_from["source"]) == 71


def test_a_cut_of_a_cut_is_the_direct_cut(tmp_path, recorded):
    wide, narrow, direct = tmp_path / "wide.db", tmp_path / "narrow.db", tmp_path / "direct.db"
    cut_database(recorded, wide, "baseline", Selection(where="max_tokens >= 6"), name="wide")
    cut_database(wide, narrow, "wide", Selection(requests=["r4", "r6"]), name="cut")
    cut_database(recorded, direct, "baseline", Selection(requests=["r4", "r6"]), name="cut")
    assert frames(narrow) == frames(direct) and outputs_by_request(narrow) == outputs_by_request(direct)


def test_a_cut_replays_against_a_faithful_engine_with_nothing_found(tmp_path, recorded):
    db = tmp_path / "cut.db"
    cut_database(recorded, db, "baseline", Selection(requests=["r0", "r3", "r7", "long"]), name="baseline")
    report, outcome, _ = replay_baseline(tmp_path, db)
    assert [f for f in report.findings if f.severity >= Severity.WARNING and f.category != "performance"] == []
    assert (outcome.sent, outcome.requests, outcome.finished) == (6, 4, 3)  # and its ABORT and utility call


def test_a_sample_is_seeded_and_keeps_every_kind(tmp_path, recorded):
    # 'long' is the one request the frontend aborted: its own stratum (no finish), so a sample of two keeps it.
    chosen = [cut_database(recorded, tmp_path / f"{seed}-{i}.db", "baseline", Selection(sample=2, seed=seed))[1:]
              for seed in (1, 2) for i in range(2)]
    assert chosen[0] == chosen[1] and chosen[2] == chosen[3]  # the same seed, the same cut
    for seed in (1, 2):
        requests = {r for (r,) in sqlite3.connect(tmp_path / f"{seed}-0.db").execute("SELECT request_id FROM requests")}
        assert len(requests) == 2 and "long" in requests
    cut_database(recorded, tmp_path / "one.db", "baseline", Selection(sample=1))  # fewer than the strata: rarest
    assert sqlite3.connect(tmp_path / "one.db").execute("SELECT request_id FROM requests").fetchall() == [("long",)]


def test_a_window_keeps_the_requests_added_in_it(tmp_path, recorded):
    connection = sqlite3.connect(recorded)
    start = connection.execute("SELECT MIN(ts_ns) FROM frames").fetchone()[0]
    added = dict(connection.execute("SELECT request_id, (ts_ns - ?) / 1e9 FROM requests", [start]))
    low, high = added["r1"], added["r3"]
    cut_database(recorded, tmp_path / "window.db", "baseline", Selection(from_s=low, to_s=high))
    kept = {r for (r,) in sqlite3.connect(tmp_path / "window.db").execute("SELECT request_id FROM requests")}
    assert kept == {rid for rid, at in added.items() if low <= at < high} and "r1" in kept and "r3" not in kept


def test_a_real_recording_cut_to_one_request_keeps_its_frames_as_they_were(tmp_path):
    source = tmp_path / "source.db"
    shutil.copy(REAL, source)  # (opening a recording may add columns: never the shipped file)
    [rid] = [r for (r,) in sqlite3.connect(source).execute("SELECT request_id FROM requests WHERE max_tokens = 8")]
    session_id, kept, _ = cut_database(source, tmp_path / "one.db", "python-frontend", Selection(requests=[rid]))
    assert outputs_by_request(tmp_path / "one.db", session_id) == {rid: outputs_by_request(source)[rid]}
    assert sqlite3.connect(tmp_path / "one.db").execute(
        "SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL").fetchone()[0] == 0


@pytest.mark.parametrize("options, message, code", [  # 2: the selection options; 1: a session not there
    (["--where", "max_tokens = = 6"], "syntax error", 2),
    (["--where", "no_such_column = 1"], "no such column", 2),
    (["--requests", "nobody"], "no request nobody", 2),
    (["--from", "5", "--to", "1"], "chooses no request", 2),
    (["--session", "nothing"], "no session nothing", 1),
])
def test_a_selection_that_cannot_be_made_is_one_line_and_its_code(tmp_path, recorded, options, message, code):
    session = [] if "--session" in options else ["--session", "baseline"]
    result = subprocess.run([sys.executable, "-m", "replay_proxy", "cut", "--db", str(recorded), *session,
                             "--out", str(tmp_path / "out.db"), *options], capture_output=True, text=True, timeout=60)
    assert result.returncode == code and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_cut_refuses_to_write_over_a_file(tmp_path, recorded):
    out = tmp_path / "taken.db"
    out.write_bytes(b"something")
    with pytest.raises(Exception, match="exists"):
        cut_database(recorded, out, "baseline", Selection(requests=["r1"]))
    with pytest.raises(CutError):
        cut_database(recorded, tmp_path / "none.db", "baseline", Selection(where="max_tokens > 10000"))


def diff(candidate, baseline, report):
    result = subprocess.run([sys.executable, "-m", "replay_proxy", "diff", "--db", str(candidate), "--baseline-db",
                             str(baseline), "--baseline", "baseline", "--candidate", "cut", "--report-dir",
                             str(report)], capture_output=True, text=True, timeout=120)
    findings = json.loads((report / "report.json").read_text())["findings"]
    return result, {f["code"]: f for f in findings if f["category"] != "performance"}


@pytest.mark.parametrize("selection", [Selection(requests=["r1", "r5", "long"]), Selection(where="max_tokens >= 6"),
                                       Selection(sample=3, seed=4)])
def test_diff_of_a_cut_against_its_source_reports_nothing_over_the_chosen_requests(tmp_path, recorded, selection):
    cut = tmp_path / "cut.db"
    cut_database(recorded, cut, "baseline", selection, name="cut")
    result, findings = diff(cut, recorded, tmp_path / "of-source")
    assert result.returncode == 0, result.stdout + result.stderr
    assert [code for code, f in findings.items() if f["severity"] != "info"] == []
    kept = sqlite3.connect(cut).execute("SELECT COUNT(*) FROM requests").fetchone()[0]
    assert f"compared over the {kept} requests it keeps" in findings["cut_of_baseline"]["message"]
    # Another file that only looks like the source (same name, same session, one value changed) is not it: the
    # requests the cut left out are then missing, as in any diff.
    other = tmp_path / "other" / recorded.name
    other.parent.mkdir()
    shutil.copy(recorded, other)
    changed = sqlite_utils.Database(other)
    changed["sessions"].update(1, {"status": "failed"})
    changed.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # into the file itself, whose bytes the digest is of
    result, findings = diff(cut, other, tmp_path / "of-other")
    assert result.returncode == 4 and "request_unmatched" in findings and "cut_of_baseline" not in findings
