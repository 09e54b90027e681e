"""The command line, acted on as a user does; checked through the database."""

import hashlib
import io
import json
import os
import re
import shlex
import subprocess

import click
import msgspec
import pytest
import sqlite_utils
import trio
import typer
from click.testing import CliRunner
from rich.console import Console

from replay_proxy.cli import app
from replay_proxy.processes import Child, free_port
from replay_proxy.sim.drift import EngineDrift
from replay_proxy.sim.engine import SimEngine
from replay_proxy.sim.frontend import SimFrontend
from replay_proxy.sim.workload import run_workload
from tests.helpers import CLI, ROOT, cli


async def test_sigterm_flushes_the_recording_and_exits_0(tmp_path):
    db = tmp_path / "r.db"
    upstream, listen = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proxy = Child([*CLI, "record", "--listen", listen, "--upstream", upstream, "--db", str(db), "--session", "s"],
                  tmp_path / "proxy.log")
    try:
        proxy.wait_for_log("listening on", timeout=30)
        frontend = SimFrontend(upstream, engines=2, api_servers=2)
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(frontend.run)
                for index in range(2):
                    nursery.start_soon(SimEngine(listen, index).run)
                await frontend.ready.wait()
                await run_workload(frontend, requests=40)
                nursery.cancel_scope.cancel()
    finally:
        code = proxy.stop(timeout=30)  # SIGTERM to the whole process group, writer included
    assert code == 0, proxy.log_tail()
    session = sqlite_utils.Database(db)["sessions"].get(1)
    assert session["status"] == "complete"
    assert session["frames_seen"] == session["frames_recorded"] > 0
    assert session["frames_dropped"] == 0
    sent_to_engines = 41 + 2 * 2 * 2 + 1  # requests incl. the long one, utility calls, one abort
    rows = sqlite_utils.Database(db).execute(
        "SELECT COUNT(*) FROM frames WHERE channel = 'input' AND direction = 'to_engine'").fetchone()[0]
    assert rows == sent_to_engines
    assert "complete: " in proxy.log_tail(1)
    assert "drift" not in proxy.log_tail(100)  # same-release traffic: no alarm
    assert sqlite_utils.Database(db)["drift_alarms"].count == 0


async def test_a_drifted_engine_raises_a_drift_alarm_while_recording_and_fail_on_drift_exits_3(tmp_path):
    db = tmp_path / "r.db"
    upstream, listen = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proxy = Child([*CLI, "record", "--listen", listen, "--upstream", upstream, "--db", str(db), "--session", "s",
                   "--fail-on-drift"], tmp_path / "proxy.log")
    try:
        proxy.wait_for_log("listening on", timeout=30)
        frontend = SimFrontend(upstream)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                await nursery.start(frontend.run)
                nursery.start_soon(SimEngine(listen, 0, drift=EngineDrift(append_outputs_field=True)).run)
                await frontend.ready.wait()
                await run_workload(frontend, requests=5)
                # On the status line while the traffic flows, before any stop.
                await trio.to_thread.run_sync(lambda: proxy.wait_for_log("drift alarm", timeout=30))
                nursery.cancel_scope.cancel()
    finally:
        code = proxy.stop(timeout=30)
    log = proxy.log_tail(100)
    assert code == 3, log
    assert "EngineCoreOutputs position 9: extra position" in log and "against the 0.32.0 schema" in log
    [alarm] = sqlite_utils.Database(db)["drift_alarms"].rows
    assert (alarm["struct"], alarm["issue"], alarm["position"], alarm["announced"]) == (
        "EngineCoreOutputs", "extra_position", 9, "0.32.0")
    assert alarm["kind"] in ("OUTPUTS", "UTILITY_OUTPUT")  # the first frame the drifted engine sent after READY
    preset = cli("query", "--db", str(db), "--json", "--preset", "drift")
    assert '"struct": "EngineCoreOutputs"' in preset.stdout and '"frames_flagged": ' in preset.stdout


@pytest.mark.parametrize("args, message", [
    (["record", "--listen", "localhost:1", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db"], "not a ZMQ address"),
    (["record", "--listen", "tcp://127.0.0.1", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db"], "has no port"),
    (["record", "--listen", "tcp://127.0.0.1:1"], "Missing option '--upstream'"),
    (["record", "--listen", "tcp://127.0.0.1:99999", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db"],
     "port 99999 is not 0-65535"),  # (libzmq would listen on 99999 - 65536)
    (["record", "--listen", "tcp://no-such-host.invalid:1", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db"],
     "neither a host this machine resolves nor one of its network interfaces"),
    (["record", "--listen", "tcp://127.0.0.1:1", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db",
      "--metrics", "9464"], "is not HOST:PORT"),
    (["record", "--listen", "tcp://127.0.0.1:1", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db",
      "--sample-requests", "0"], "0 < F <= 1"),
    (["record", "--listen", "tcp://127.0.0.1:1", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db",
      "--frontend", "smg=="], "is not NAME==VERSION"),
    (["record", "--listen", "tcp://127.0.0.1:1", "--upstream", "tcp://127.0.0.1:2", "--db", "x.db",
      "--frontend", "vllm==9.9.9"], "--frontend vllm==9.9.9: no schema for it"),
    (["query", "--db", "x.db"], "give either SQL or --preset"),
    (["query", "--db", "x.db", "--json", "--csv", "SELECT 1"], "--json or --csv, not both"),
    (["replay", "--db", "x.db", "--session", "s", "--against", "frontend", "--upstream", "tcp://127.0.0.1:1",
      "--http", "http://no-such-host.invalid:80"], "'http://no-such-host.invalid:80': no-such-host.invalid is"),
    (["replay", "--db", "x.db", "--session", "s", "--against", "frontend", "--upstream", "tcp://127.0.0.1:1",
      "--http", "127.0.0.1:80"], "is not an HTTP address"),
    (["replay", "--db", "x.db", "--session", "s", "--against", "engine", "--listen", "tcp://127.0.0.1:1",
      "--noise-runs", "2"], "--noise-runs needs --baseline-cmd"),
    (["nonsense"], "No such command"),
])
def test_bad_arguments_get_one_line_and_exit_2(args, message, tmp_path):
    result = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert "Traceback" not in result.stderr


# Every command that reads a recording, with what it needs besides (its bad --db: tests/test_bad_inputs.py).
READS_A_RECORDING = {
    "sessions": [], "query": ["SELECT 1"], "cut": ["--session", "demo", "--out", "cut.db"],
    "redact": ["--out", "redacted.db", "--key-file", "key", "--vocab-size", "100"],
    "export": ["--parquet", "out"], "diff": ["--baseline", "demo", "--candidate", "demo"],
    "replay": ["--session", "demo", "--against", "engine", "--listen", "tcp://127.0.0.1:1", "--engine-cmd", "true"],
    "shrink": ["--session", "demo", "--out", "shrunk", "--against", "engine", "--engine-cmd", "true {port}"],
}
@pytest.mark.parametrize("command", ["cut", "diff", "replay", "export"])
def test_an_unknown_session_is_one_line_and_exit_1(tmp_path, command):
    db = tmp_path / "demo.db"
    db.write_bytes((ROOT / "recordings" / "demo.db").read_bytes())
    args = [a.replace("demo", "nope") if a == "demo" else a for a in READS_A_RECORDING[command]]
    args += ["--session", "nope"] if command == "export" else []
    result = subprocess.run([*CLI, command, "--db", str(db), *args], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] and "nope" in result.stderr


@pytest.mark.parametrize("option, content, says", [
    ("--rules", None, "rules"), ("--rules", b"{not json", "rules"), ("--key-file", None, "key")])
def test_a_rules_or_key_file_that_cannot_be_used_is_an_input_error_too(tmp_path, option, content, says):
    db = tmp_path / "demo.db"
    db.write_bytes((ROOT / "recordings" / "demo.db").read_bytes())
    given = tmp_path / "given"
    if content is not None:
        given.write_bytes(content)
    command = (["diff", "--db", str(db), "--baseline", "demo", "--candidate", "demo", "--rules", str(given)]
               if option == "--rules" else
               ["redact", "--db", str(db), "--out", str(tmp_path / "r.db"), "--key-file", str(given),
                "--vocab-size", "100"])
    result = subprocess.run([*CLI, *command], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (result.returncode, result.stderr.count("\n")) == (1, 1), result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr


def test_query_sql_json_csv_and_presets_over_the_demo_recording():
    db = str(ROOT / "recordings" / "demo.db")
    as_json = cli("query", "--db", db, "--json", "SELECT COUNT(*) AS n FROM requests")
    assert as_json.returncode == 0 and '"n": 21' in as_json.stdout
    as_csv = cli("query", "--db", db, "--csv", "SELECT kind FROM frames WHERE seq = 1")
    assert as_csv.stdout.split() == ["kind", "HELLO"]
    bad_sql = cli("query", "--db", db, "SELECT nope FROM frames")
    assert bad_sql.returncode == 1 and "no such column: nope" in bad_sql.stderr
    from replay_proxy.store.queries import PRESETS
    for preset in PRESETS:
        assert cli("query", "--db", db, "--preset", preset).returncode == 0, preset


def test_query_never_changes_a_recording_unless_told(tmp_path):
    db = tmp_path / "demo.db"
    db.write_bytes((ROOT / "recordings" / "demo.db").read_bytes())
    before = db.read_bytes()
    rename = "UPDATE sessions SET name = 'renamed' RETURNING id"
    refused = cli("query", "--db", str(db), rename)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "give --write" in refused.stderr
    assert db.read_bytes() == before  # not a byte changed (the file is in the current layout: nothing to add)
    changed = cli("query", "--db", str(db), "--write", "--json", rename)
    assert changed.returncode == 0 and '"id": 1' in changed.stdout
    assert sqlite_utils.Database(db)["sessions"].get(1)["name"] == "renamed"


def test_every_command_has_help_and_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    listing = cli("--help").stdout
    commands = re.findall(r"^  ([\w-]+)\s{2,}", listing.split("Commands:")[1], re.M)
    assert {"record", "sessions", "query", "schema", "sim", "can-i-deploy"} <= set(commands)
    for command in commands:
        assert cli(command, "--help").returncode == 0
        assert f"replay-proxy {command}" in readme, command


def commands(command: click.Command, path: tuple[str, ...] = ()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from commands(sub, (*path, name))


@pytest.mark.parametrize("path, command", list(commands(typer.main.get_command(app))), ids=lambda p: " ".join(p)
                         if isinstance(p, tuple) else "")
def test_every_help_is_readable_at_80_columns_with_every_option_name_whole(path, command):
    shown = CliRunner().invoke(typer.main.get_command(app), [*path, "-h"], env={"COLUMNS": "80"}, terminal_width=80,
                               prog_name="replay-proxy")
    assert shown.exit_code == 0, shown.output
    lines = shown.output.splitlines()
    assert [line for line in lines if len(line) > 80] == []
    names = [name for param in command.params for name in (*param.opts, *param.secondary_opts) if name[0] == "-"]
    assert [name for name in names if not re.search(rf"(^|[\s,/]){re.escape(name)}([\s,]|$)", shown.output, re.M)] == []


def test_the_main_tables_read_whole_at_80_columns():
    """A diff's findings and performance estimates, and the sessions table: every metric, column and code whole,
    no line past 80 columns."""
    from replay_proxy.compare.performance import performance_findings
    from replay_proxy.compare.report import diff_sessions
    from replay_proxy.compare.rules import load_rules
    from replay_proxy.store.session import load_session, match_requests
    from replay_proxy.report.render import print_summary
    from replay_proxy.report.tables import print_rows
    from replay_proxy.store.queries import list_sessions

    recordings = ROOT / "recordings"
    report = diff_sessions(recordings / "vllm-0.32.0-python.db", "python-frontend",
                           recordings / "vllm-0.32.0-vllm-rs.db", "vllm-rs-frontend", load_rules())
    # (two recordings: their timing is not judged, so the estimates of the same two sessions are added to show)
    before, after = (load_session(recordings / f"vllm-0.32.0-{name}.db", f"{name}-frontend")
                     for name in ("python", "vllm-rs"))
    report = msgspec.structs.replace(report, findings=[
        *report.findings, *performance_findings(before, after, match_requests(before, after, []), load_rules())])
    console = Console(width=80, record=True, file=io.StringIO())
    print_summary(report, console)
    sessions = list_sessions(recordings / "demo.db")
    print_rows(sessions, "table", console, title="sessions")
    shown = console.export_text()
    assert [line for line in shown.splitlines() if len(line) > 80] == []
    metrics = {f.field for f in report.findings if f.change is not None}
    assert {"e2e_ms.p50", "ttft_ms.p50", "itl_ms.p90"} <= metrics
    words = set(re.findall(r"[\w.]+", shown))
    assert metrics | {f.code for f in report.findings if f.severity > 0} | set(sessions[0]) <= words


@pytest.mark.parametrize("command, code", [
    (["schema", "diff", "0.31.0", "0.32.0"], 3),
    (["schema", "drift", "--release", "0.23.0"], 3),
    (["diff", "--db", str(ROOT / "recordings" / "vllm-0.32.0-vllm-rs.db"), "--candidate", "vllm-rs-frontend",
      "--baseline-db", str(ROOT / "recordings" / "vllm-0.32.0-python.db"), "--baseline", "python-frontend"], None),
])
def test_json_is_the_reports_document_alone_on_stdout(command, code):
    result = cli(*command, "--json")
    document = json.loads(result.stdout)  # nothing else on stdout
    assert result.returncode == document["exit_code"] == (code if code is not None else result.returncode)
    assert {"title", "findings", "exit_code"} <= document.keys() and document["findings"]


def test_a_replay_leaves_its_recording_untouched_prints_json_alone_and_says_each_run_unless_quiet(tmp_path):
    recording = ROOT / "recordings" / "demo.db"
    before = hashlib.sha256(recording.read_bytes()).hexdigest()
    listen = f"tcp://127.0.0.1:{free_port()}"
    engines = " & ".join(shlex.join([*CLI, "sim", "engine", "--handshake", listen, "--index", str(i)]) for i in (0, 1))
    replay = [*CLI, "replay", "--db", str(recording), "--session", "demo", "--against", "engine", "--listen", listen,
              "--engine-cmd", f"bash -c {shlex.quote(engines + ' & wait')}", "--pace", "fast"]
    result = subprocess.run([*replay, "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    document = json.loads(result.stdout)
    assert document["exit_code"] == result.returncode and document["title"] == "replay against engine"
    out = tmp_path / "replay-demo.db"  # the default --out, in the folder it ran in
    assert document["recorded_in"] == "replay-demo.db"
    progress = result.stderr.splitlines()  # a line a run as it starts, and what it replayed
    assert progress[:2] == [f"replaying 'demo' against the engine at {listen}, recorded into replay-demo.db",
                            "run 1 of 1: the build under test"]
    assert progress[2].startswith("  replayed 21 recorded requests: 21 sent, ")
    scratch = tmp_path / "tmp"  # the replay's own temporary folder (the peers' logs) is gone at its end
    scratch.mkdir()
    quiet = subprocess.run([*replay, "--quiet"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                           env={**os.environ, "TMPDIR": str(scratch)})
    assert quiet.returncode == result.returncode and "run 1 of 1" not in quiet.stderr
    assert [p.name for p in scratch.iterdir() if p.name.startswith("replay-proxy-replay-")] == []
    # The recording is as it was; its session, copied once, and both replays of it are in the --out file.
    assert hashlib.sha256(recording.read_bytes()).hexdigest() == before
    sessions = [(r["id"], r["mode"], r["baseline_session_id"]) for r in sqlite_utils.Database(out)["sessions"].rows]
    assert sessions == [(1, "record", None), (2, "replay", 1), (3, "replay", 1)]


def test_piped_output_is_as_wide_as_columns_says():
    shown = subprocess.run([*CLI, "sessions", "--db", str(ROOT / "recordings" / "demo.db")], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "COLUMNS": "60"})
    assert shown.returncode == 0 and max(map(len, shown.stdout.splitlines())) == 60
