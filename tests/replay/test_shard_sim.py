"""The sessions of several recordings replayed in one run, and in three shards merged: the same verdict."""

import collections
import json
import subprocess
import sys

import pytest
import trio

from replay_proxy.processes import free_port
from tests.helpers import engines_command
from tests.replay.sim_sessions import record_baseline

CLI = [sys.executable, "-m", "replay_proxy"]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """Three proxies' recordings, each of a session named "baseline"."""
    folder = tmp_path_factory.mktemp("recorded")
    made = [folder / f"{proxy}.db" for proxy in ("a", "b", "c")]
    for db in made:
        trio.run(record_baseline, db, 1, 1)
    return made


def replay(recordings, report_dir, *extra):
    """``replay`` of every recorded session of ``recordings`` against sim engines that shift every token."""
    listen = f"tcp://127.0.0.1:{free_port()}"
    return subprocess.run([*CLI, "replay", *(a for db in recordings for a in ("--db", str(db))), "--against",
                           "engine", "--listen", listen, "--engine-cmd",
                           engines_command(listen, {"token_offset": 1}), "--pace", "fast", "--ready-timeout", "20",
                           "--finish-timeout", "10", "--report-dir", str(report_dir), "-q", *extra],
                          capture_output=True, text=True, timeout=300)


def verdict(report_dir):
    """What a report decides: its exit code, its findings and each request's judgement, without the names of
    the runs (their times differ from run to run)."""
    report = json.loads((report_dir / "report.json").read_text())
    return (report["exit_code"], sorted((f["category"], f["severity"], f["code"], f.get("request_id") or "",
                                         f.get("field") or "") for f in report["findings"]),
            [(v["request_id"], v["tier"], v["passed"]) for v in report["verdicts"]])


def test_three_shards_merged_give_the_unsharded_runs_verdict(recordings, tmp_path):
    whole = replay(recordings, tmp_path / "whole")
    assert whole.returncode == 4, whole.stderr  # every token shifted: a behaviour regression
    code, findings, verdicts = verdict(tmp_path / "whole")
    # Each session's requests, named with the session's place in the plan; all but the aborted one failed.
    failed = collections.Counter(v[0].split("/")[0] for v in verdicts if not v[2])
    assert failed == {"001-baseline": 8, "002-baseline": 8, "003-baseline": 8} and len(verdicts) == 27
    for k in (1, 2, 3):  # each session's replay in a folder of its own, with its own reports
        assert (tmp_path / "whole" / "replays" / f"{k:03d}-baseline" / "report.json").exists()
    shards = [tmp_path / f"shard-{i}" for i in (1, 2, 3)]
    for i, shard in enumerate(shards, 1):
        done = replay(recordings, shard, "--shard", f"{i}/3")
        assert done.returncode == 4, done.stderr
        assert [p.name for p in (shard / "replays").iterdir()] == [f"{i:03d}-baseline"]
    merged = subprocess.run([*CLI, "merge", *map(str, shards), "--report-dir", str(tmp_path / "merged")],
                            capture_output=True, text=True, timeout=60)
    assert merged.returncode == code, merged.stderr
    assert verdict(tmp_path / "merged") == (code, findings, verdicts)
    assert sorted(p.name for p in (tmp_path / "merged" / "replays").iterdir()) == [
        "001-baseline", "002-baseline", "003-baseline"]
    # A shard missing, or given twice, is refused in a line, and nothing is written.
    for given, says in (([shards[0], shards[2]], "shard(s) 2/3 missing"), ([shards[0], shards[0]], "twice")):
        refused = subprocess.run([*CLI, "merge", *map(str, given), "--report-dir", str(tmp_path / "refused")],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and says in refused.stderr and "Traceback" not in refused.stderr
        assert not (tmp_path / "refused").exists()


def test_several_sessions_need_a_report_folder(recordings, tmp_path):
    done = subprocess.run([*CLI, "replay", "--db", str(recordings[0]), "--db", str(recordings[1]), "--against",
                           "engine", "--listen", "tcp://127.0.0.1:1"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "give --report-dir" in done.stderr and "Traceback" not in done.stderr
