"""The command line: options in, one library call, output rendered. Nothing else."""

from __future__ import annotations

import csv
import datetime
import json
import signal
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import trio
import typer
import zmq
from rich.console import Console
from rich.table import Table
from rich.text import Text

from replay_proxy import __version__
from replay_proxy.errors import ExitCode, ReplayProxyError, leaf
from replay_proxy.replay import Against
from replay_proxy.store import queries
from replay_proxy.store.recorder import OnFull

app = typer.Typer(
    help="Record and replay the ZeroMQ link between vLLM frontends and engines.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
schema_app = typer.Typer(help="Per-release wire schemas.", no_args_is_help=True)
app.add_typer(schema_app, name="schema")
sim_app = typer.Typer(help="Protocol-faithful fake peers, to try the proxy without vLLM.", no_args_is_help=True)
app.add_typer(sim_app, name="sim")
peers_app = typer.Typer(help="Real vLLM peers, fetched from pip into the cache ($REPLAY_PROXY_CACHE).",
                        no_args_is_help=True)
app.add_typer(peers_app, name="peers")
out = Console(width=None if sys.stdout.isatty() else 200)  # query results are wide: do not fold at 80
err = Console(stderr=True, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        out.print(f"replay-proxy {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Show the version and exit.")] = False,
) -> None:
    """Record and replay the ZeroMQ link between vLLM frontends and engines."""


def fail(message: str, code: ExitCode = ExitCode.ERROR) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(int(code))


def finish_report(report, report_dir: Path | None, show_info: bool = False) -> NoReturn:
    """The ending of every command that produces a report: summary, report files, exit code."""
    from replay_proxy.compare.findings import exit_code
    from replay_proxy.report.render import print_summary, write_reports

    print_summary(report, out, show_info)
    if report_dir is not None:
        for path in write_reports(report, report_dir):
            err.print(f"wrote {path}")
    raise typer.Exit(int(exit_code(report.findings)))


def check_address(value: str) -> str:
    if not value.startswith(("tcp://", "ipc://")):
        raise typer.BadParameter(f"{value!r} is not a ZMQ address: use tcp://HOST:PORT or ipc:///PATH")
    if value.startswith("tcp://") and not value.rsplit(":", 1)[-1].isdigit():
        raise typer.BadParameter(f"{value!r} has no port: use tcp://HOST:PORT")
    return value


@app.command()
def record(
    listen: Annotated[str, typer.Option(callback=check_address,
        help="Handshake address the engines dial (their --data-parallel-address/--data-parallel-rpc-port).")],
    upstream: Annotated[str, typer.Option(callback=check_address,
        help="The frontend's real handshake address.")],
    db: Annotated[Path, typer.Option(help="SQLite file to record into (created if missing).")],
    session: Annotated[str | None, typer.Option(help="Session name (default: record-DATE-TIME).")] = None,
    on_full: Annotated[OnFull, typer.Option(
        help="When the recorder queue is full: 'drop' counts the frame as dropped from the recording "
             "(it is still forwarded); 'block' waits, lossless at the cost of latency.")] = OnFull.DROP,
    record_coordinator: Annotated[bool, typer.Option(
        help="Also relay and record the engines' DP-coordinator channels (subscription, READY, waves, stats); "
             "by default engines talk to the coordinator directly.")] = False,
    max_db_mb: Annotated[float | None, typer.Option(min=1,
        help="Stop recording (never forwarding) once the database file reaches this size; what does not "
             "fit is counted as dropped, as on a full disk.")] = None,
    fail_on_drift: Annotated[bool, typer.Option(
        help="Exit 3 at the end if any frame disagreed with the schema of the release its engine announced "
             "(the drift alarms, in the drift_alarms table).")] = False,
) -> None:
    """Relay a vLLM frontend and its engines, recording every frame.

    Stops on Ctrl-C or SIGTERM, flushes the recording and marks the session complete.

    Example: replay-proxy record --listen tcp://127.0.0.1:29560 --upstream tcp://127.0.0.1:29550 --db recordings/staging.db
    """
    from replay_proxy.record import record as run_record, status_line

    name = session or datetime.datetime.now().strftime("record-%Y%m%d-%H%M%S")
    try:
        recorder, stats = trio.run(lambda: run_record(listen, upstream, db, session=name, on_full=on_full,
                                                      record_coordinator=record_coordinator, max_db_mb=max_db_mb,
                                                      console=err))
    except (ReplayProxyError, OSError) as exc:
        raise fail(str(exc)) from None
    err.print(status_line(stats, 0))
    so_far = "" if stats.final else f" so far ({stats.queue_depth_frames:,} still being written)"
    err.print(f"session {name!r} (id {recorder.session_id}) {recorder.status}: {stats.frames_recorded:,} of "
              f"{stats.frames_seen:,} frames recorded{so_far}, {stats.frames_dropped:,} dropped -> {db}")
    if stats.frames_undecoded:
        err.print(f"{stats.frames_undecoded:,} frames are kept but not decoded yet: "
                  f"replay-proxy decode --db {db} --session {name}")
    if recorder.status not in ("complete", "finishing"):
        raise fail(f"the recording is {recorder.status}: {stats.error or 'see the sessions table'}")
    if stats.drift_alarms:
        err.print(f"{stats.drift_alarms} drift alarm(s): replay-proxy query --db {db} --preset drift")
        if fail_on_drift:
            raise typer.Exit(int(ExitCode.SCHEMA_BREAKING))


@app.command()
def sessions(
    db: Annotated[Path, typer.Option(help="Recording database.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the sessions in a recording.

    Example: replay-proxy sessions --db recordings/demo.db
    """
    try:
        rows = queries.list_sessions(db)
    except ReplayProxyError as exc:
        raise fail(str(exc)) from None
    render(rows, "json" if as_json else "table", title=f"sessions in {db}")


@app.command()
def decode(
    db: Annotated[Path, typer.Option(help="Recording database.")],
    session: Annotated[str | None, typer.Option(help="Session name or id (default: every session).")] = None,
) -> None:
    """Decode the frames a recording kept but did not decode yet (a writer stopped at high load keeps them).

    Example: replay-proxy decode --db recordings/staging.db
    """
    from replay_proxy.store.writer import finish_decoding

    try:
        rows = queries.list_sessions(db)
        if session is not None:
            rows = [queries.find_session(queries.open_existing(db), session)]
        for row in rows:
            if row["frames_undecoded"] and row["status"] == "recording":
                err.print(f"session {row['name']!r} is still recording: its writer decodes it")
            elif row["frames_undecoded"]:
                decoded = finish_decoding(str(db), row["id"])
                err.print(f"session {row['name']!r}: decoded {decoded:,} frames")
    except ReplayProxyError as exc:
        raise fail(str(exc)) from None


@app.command()
def export(
    db: Annotated[Path, typer.Option(help="Recording database.")],
    parquet: Annotated[Path, typer.Option(help="Folder to write into: DIR/TABLE/session=NAME/FILE-ID.parquet.")],
    session: Annotated[str | None, typer.Option(help="Session name or id (default: every session).")] = None,
) -> None:
    """Write each table of each session as Parquet, partitioned by session, for DuckDB, Spark or pandas.

    Example: replay-proxy export --db recordings/staging.db --parquet lake/
    """
    from replay_proxy.store.export import export_parquet

    try:
        files = export_parquet(db, parquet, session)
    except ReplayProxyError as exc:
        raise fail(str(exc)) from None
    err.print(f"wrote {len(files)} Parquet files under {parquet}")


@app.command()
def query(
    db: Annotated[Path, typer.Option(help="Recording database.")],
    sql: Annotated[str | None, typer.Argument(help="SQL to run (or use --preset).")] = None,
    preset: Annotated[str | None, typer.Option(
        help=f"A named query: {', '.join(queries.PRESETS)}.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
) -> None:
    """Run SQL (or a named preset) over a recording and print the result.

    Example: replay-proxy query --db recordings/demo.db "SELECT request_id, ttft_ms FROM request_timeline"
    """
    if (sql is None) == (preset is None):
        raise fail("give either SQL or --preset NAME", ExitCode.USAGE)
    if preset is not None and preset not in queries.PRESETS:
        raise fail(f"no preset {preset!r}; presets: {', '.join(queries.PRESETS)}", ExitCode.USAGE)
    try:
        rows = queries.run_query(db, queries.PRESETS[preset] if preset else sql)
        partly = [s for s in queries.list_sessions(db) if s["frames_undecoded"]]
    except ReplayProxyError as exc:
        raise fail(str(exc)) from None
    render(rows, "json" if as_json else "csv" if as_csv else "table")
    for s in partly:
        err.print(f"note: {s['frames_undecoded']:,} frames of session {s['name']!r} are not decoded yet, so not "
                  f"in these tables: replay-proxy decode --db {db}")


@app.command("datasette-metadata")
def datasette_metadata(
    databases: Annotated[list[Path], typer.Argument(help="The recording databases Datasette will serve.")],
) -> None:
    """Print Datasette metadata whose canned queries are the query presets.

    Example: replay-proxy datasette-metadata recordings/*.db > metadata.json && datasette recordings/*.db -m metadata.json
    """
    sys.stdout.write(json.dumps(queries.datasette_metadata(databases), indent=1) + "\n")


def render(rows: list[dict[str, Any]], form: Literal["table", "json", "csv"], title: str | None = None) -> None:
    if form == "json":
        sys.stdout.write(json.dumps(rows, indent=1, default=_bytes_hex) + "\n")
    elif form == "csv":
        if rows:
            writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: _bytes_hex(v) if isinstance(v, bytes) else v for k, v in r.items()}
                             for r in rows)
    else:
        table = Table(title=title)
        for column in (rows[0] if rows else {}):
            table.add_column(column, overflow="fold")
        for row in rows:  # Text, not str: a cell like [null] is data, not rich markup
            table.add_row(*(Text("" if v is None else _bytes_hex(v) if isinstance(v, bytes) else str(v))
                            for v in row.values()))
        out.print(table)
        out.print(f"{len(rows)} row{'s' if len(rows) != 1 else ''}", style="dim")


def _bytes_hex(value: Any) -> str:
    if isinstance(value, bytes):
        return value.hex() if len(value) <= 64 else f"<{len(value)} bytes>"
    raise TypeError(type(value).__name__)


@schema_app.command("extract")
def schema_extract(
    release: Annotated[str | None, typer.Option(
        help="A release pip has: its wheel is fetched (cached) and its classes read; written to the package's "
             "schemas/RELEASE.json unless --out says otherwise.")] = None,
    python: Annotated[Path | None, typer.Option(help="Python interpreter of a vLLM installation.")] = None,
    vllm_src: Annotated[Path | None, typer.Option(
        help="With --python: a folder holding a vllm/ package to import instead (a source tree).")] = None,
    output: Annotated[Path | None, typer.Option("--out", help="Write here (- for stdout).")] = None,
) -> None:
    """Extract a release's wire schema from vLLM's own classes.

    Example: replay-proxy schema extract --release 0.33.0

    Example: replay-proxy schema extract --python ~/vllm/.venv/bin/python --vllm-src ~/vllm --out -
    """
    from replay_proxy import releases

    if (release is None) == (python is None):
        raise fail("give either --release or --python", ExitCode.USAGE)
    if vllm_src is not None and python is None:
        raise fail("--vllm-src goes with --python", ExitCode.USAGE)
    try:
        schema = releases.extract_release(release) if release else releases.extract_schema(python, vllm_src)
    except releases.ReleaseError as exc:
        raise fail(str(exc)) from None
    if output is None and release:
        from replay_proxy.wire import schema as wire_schema

        output = Path(wire_schema.__file__).parent / "schemas" / f"{release}.json"
    if output is None or str(output) == "-":
        sys.stdout.write(schema.decode())
    else:
        output.write_bytes(schema)
        err.print(f"wrote {output}")


@peers_app.command("fetch")
def peers_fetch(
    vllm_rs: Annotated[list[str], typer.Option("--vllm-rs", help="A release whose Rust frontend to fetch.")],
) -> None:
    """Fetch peers into the cache once (bounded downloads) and print where each is.

    Example: replay-proxy peers fetch --vllm-rs 0.29.0 --vllm-rs 0.33.0
    """
    from replay_proxy import releases

    for release in vllm_rs:
        try:
            out.print(releases.vllm_rs(release))
        except releases.ReleaseError as exc:
            raise fail(str(exc)) from None


@schema_app.command("diff")
def schema_diff(
    old: Annotated[str, typer.Argument(help="The older release, e.g. 0.31.0.")],
    new: Annotated[str, typer.Argument(help="The newer release, e.g. 0.32.0.")],
    report_dir: Annotated[Path | None, typer.Option(help="Write report.json, junit.xml, report.html here.")] = None,
    show_info: Annotated[bool, typer.Option("--all", help="Also list compatible changes.")] = False,
) -> None:
    """What breaks between two shipped release schemas, and for which decoder.

    Exit code 3 if any change breaks a real decoder (README: Exit codes).

    Example: replay-proxy schema diff 0.31.0 0.32.0
    """
    from replay_proxy.compare.report import schema_report
    from replay_proxy.wire.schema import load_schema, shipped_releases

    for release in (old, new):
        if release not in shipped_releases():
            raise fail(f"no shipped schema for {release!r}; shipped: {', '.join(shipped_releases())}", ExitCode.USAGE)
    finish_report(schema_report(load_schema(old), load_schema(new)), report_dir, show_info)


@schema_app.command("history")
def schema_history(
    struct: Annotated[str, typer.Argument(help="A struct, e.g. EngineCoreOutput.")],
    field: Annotated[str | None, typer.Argument(help="Only this field.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
) -> None:
    """Each field's first and last release, and every change of position, type or default between,
    across all shipped schemas.

    Example: replay-proxy schema history EngineCoreOutput num_nans_in_logits
    """
    import msgspec

    from replay_proxy.compare.schema_history import struct_history
    from replay_proxy.wire.schema import load_schema, shipped_releases

    schemas = [load_schema(r) for r in shipped_releases()]
    try:
        history = struct_history(schemas, struct, field)
    except KeyError as exc:
        known = sorted({n for s in schemas for n in s.structs})
        raise fail(f"no {exc.args[0]} in any shipped schema" + ("" if field else f"; structs: {', '.join(known)}"),
                   ExitCode.USAGE) from None
    if as_json:
        sys.stdout.write(msgspec.json.format(msgspec.json.encode(history)).decode() + "\n")
        return
    table = Table(title=f"{struct} across {shipped_releases()[0]} .. {shipped_releases()[-1]}")
    for column in ("field", "first", "last", "position", "type", "changes"):
        table.add_column(column)
    for h in history:
        changes = "; ".join(f"{c.release}: {c.what} {c.before!r} -> {c.after!r}" for c in h.changes)
        table.add_row(h.field, h.first, h.last, "" if h.position is None else str(h.position), h.type, changes)
    out.print(table)


@app.command()
def diff(
    db: Annotated[Path, typer.Option(help="Recording database of the candidate (and of the baseline, by default).")],
    baseline: Annotated[str, typer.Option(help="Baseline session: name or id.")],
    candidate: Annotated[str, typer.Option(help="Candidate session: name or id.")],
    baseline_db: Annotated[Path | None, typer.Option(help="The baseline's database, if another one.")] = None,
    noise: Annotated[list[str] | None, typer.Option(
        help="Another run of the baseline build (repeatable): what varies between them is noise, not regression.")]
        = None,
    rules: Annotated[Path | None, typer.Option(help="JSON noise rules and thresholds to apply over the defaults.")]
        = None,
    report_dir: Annotated[Path | None, typer.Option(help="Write report.json, junit.xml, report.html here.")] = None,
    show_info: Annotated[bool, typer.Option("--all", help="Also list informational findings.")] = False,
) -> None:
    """Compare two recorded sessions: schema, behaviour and performance findings.

    Exit code 0 when nothing regressed; 3, 4, 5 for schema-breaking, behaviour and
    performance regressions (README: Exit codes).

    Example: replay-proxy diff --db recordings/vllm-0.32.0-vllm-rs.db --baseline-db recordings/vllm-0.32.0-python.db --baseline python-frontend --candidate vllm-rs-frontend
    """
    from replay_proxy.compare.report import build_report
    from replay_proxy.compare.rules import load_rules
    from replay_proxy.store.session import load_session

    try:
        noise_rules = load_rules(rules)
        base_db = baseline_db or db
        report = build_report("diff", load_session(base_db, baseline), load_session(db, candidate), noise_rules,
                              [load_session(base_db, n) for n in noise or []])
    except ReplayProxyError as exc:
        raise fail(str(exc)) from None
    finish_report(report, report_dir, show_info)


@app.command()
def replay(
    db: Annotated[Path, typer.Option(help="Recording database; the replay is recorded into it too.")],
    session: Annotated[str, typer.Option(help="The recorded session to replay: name or id.")],
    against: Annotated[Against, typer.Option(
        help="What is new: 'engine' (the proxy plays the frontend) or 'frontend' (it plays the engines).")],
    listen: Annotated[str | None, typer.Option(callback=lambda v: v and check_address(v),
        help="--against engine: the handshake address the engine dials.")] = None,
    upstream: Annotated[str | None, typer.Option(callback=lambda v: v and check_address(v),
        help="--against frontend: the frontend's handshake address.")] = None,
    http: Annotated[str | None, typer.Option(help="--against frontend: its HTTP API, e.g. http://127.0.0.1:8000.")]
        = None,
    engine_cmd: Annotated[str | None, typer.Option(
        help="Start the engine under test with this command (own process group, stopped at the end, log kept).")]
        = None,
    frontend_cmd: Annotated[str | None, typer.Option(help="Start the frontend under test with this command.")]
        = None,
    pace: Annotated[str, typer.Option(
        help="'original' recorded timing, 'fast' as fast as accepted, or a speed-up factor like 2.")] = "original",
    ready_timeout: Annotated[float, typer.Option(help="Seconds to wait for the target to be ready.")] = 300.0,
    finish_timeout: Annotated[float, typer.Option(help="Seconds to wait for outstanding requests.")] = 120.0,
    rules: Annotated[Path | None, typer.Option(help="JSON noise rules over the defaults.")] = None,
    noise_runs: Annotated[int, typer.Option(min=0, help=(
        "First replay the session this many times against --baseline-cmd: what varies between "
        "those runs of one build is the noise floor, not reported as regression."))] = 0,
    baseline_cmd: Annotated[str | None, typer.Option(
        help="--noise-runs: start the baseline build (the one the recording was made with) with this command.")]
        = None,
    report_dir: Annotated[Path | None, typer.Option(help="Write report.json, junit.xml, report.html here.")] = None,
) -> None:
    """Replay a recorded session against a new engine or frontend build and report what changed.

    Exit code 0 when nothing regressed; 3, 4, 5 for schema-breaking, behaviour and
    performance regressions; 6 when the replay could not run (README: Exit codes).

    Example: replay-proxy replay --db recordings/vllm-0.32.0-python.db --session python-frontend --against engine --listen tcp://127.0.0.1:29560
    """
    from replay_proxy.replay.run import replay_session

    if against is Against.ENGINE:
        if listen is None:
            raise fail("--against engine needs --listen (the handshake address the engine dials)", ExitCode.USAGE)
        address, command = listen, engine_cmd
    else:
        if upstream is None or http is None:
            raise fail("--against frontend needs --upstream (its handshake) and --http (its API)", ExitCode.USAGE)
        address, command = upstream, frontend_cmd
    if noise_runs and not baseline_cmd:
        raise fail("--noise-runs needs --baseline-cmd (the build the recording was made with)", ExitCode.USAGE)
    err.print(f"replaying {session!r} against the {against} at {address}")
    try:
        report, outcome = replay_session(db, session, against, address, http=http, command=command, pace=pace,
                                         ready_timeout=ready_timeout, finish_timeout=finish_timeout,
                                         rules_path=rules, logs=report_dir, console=err, noise_runs=noise_runs,
                                         baseline_command=baseline_cmd)
    except ReplayProxyError as exc:
        raise fail(str(exc)) from None
    if outcome is not None:
        err.print(outcome.summary)
    finish_report(report, report_dir)


DEFAULT_FRONTENDS = "vllm-rs:0.22.0..0.33.0,vllm:0.27.0..0.32.0"
DEFAULT_ENGINES = "0.27.0..0.32.0"


@app.command()
def matrix(
    frontends: Annotated[str, typer.Option(help="Frontend builds: vllm-rs:RANGE (Rust) and vllm:RANGE (Python), "
                                                "a range A..B over the shipped releases.")] = DEFAULT_FRONTENDS,
    engines: Annotated[str, typer.Option(help="Engine releases, A..B or a comma list.")] = DEFAULT_ENGINES,
    predict_only: Annotated[bool, typer.Option("--predict-only", help="Predict every cell, run nothing.")] = False,
    observe: Annotated[list[str] | None, typer.Option(
        help="Observe only this cell (FRONTEND@ENGINE, e.g. vllm-rs:0.30.0@0.31.0); repeatable. "
             "Default: every cell.")] = None,
    db: Annotated[Path | None, typer.Option(help="Keep the cells in this matrix database (can-i-deploy reads it).")]
        = None,
    report_dir: Annotated[Path | None, typer.Option(
        help="Write matrix.json, junit.xml (a testcase per cell), matrix.html (heat map) and matrix.md here.")] = None,
    recordings: Annotated[Path | None, typer.Option(help="The recordings of what each release sends.")] = None,
) -> None:
    """Which frontend release works with which engine release: every cell predicted from the schemas
    and the readers' rules, and observed by replaying real peers (README: The compatibility matrix).

    Example: replay-proxy matrix --engines 0.30.0..0.32.0 --predict-only --report-dir matrix/
    """
    import time

    from replay_proxy.matrix import MatrixError, RECORDINGS, frontends_in, parse_build, releases_in
    from replay_proxy.matrix import database
    from replay_proxy.matrix.run import build
    from replay_proxy.report.matrix import print_table, write_reports

    started = time.monotonic()
    try:
        builds, releases = frontends_in(frontends), releases_in(engines)
        chosen = {(parse_build(f), releases_in(e)[0]) for f, _, e in (c.partition("@") for c in observe or [])}
    except MatrixError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    wanted = False if predict_only else (lambda f, e: (f, e) in chosen) if chosen else True
    cells = build(builds, releases, observe=wanted, recordings=recordings or RECORDINGS,
                  progress=lambda line: err.print(line, highlight=False))
    print_table(cells, out)
    seconds = time.monotonic() - started
    disagree = [c for c in cells if c.agrees is False]
    for cell in disagree:
        err.print(f"[yellow]observed {cell.observed.verdict.value}, predicted {cell.predicted.verdict.value}:[/] "
                  f"{cell.frontend} x engine {cell.engine}", highlight=False)
    err.print(f"{len(cells)} cells, {sum(c.observed is not None for c in cells)} observed, {len(disagree)} "
              f"disagreeing with their prediction, in {seconds:.0f} s")
    if db is not None:
        database.save(db, cells, "replay-proxy matrix " + " ".join(sys.argv[2:]), seconds)
    if report_dir is not None:
        for path in write_reports(cells, report_dir):
            err.print(f"wrote {path}")


@app.command("can-i-deploy")
def can_i_deploy(
    frontend: Annotated[str, typer.Option(help="The frontend to ship: vllm-rs==X (Rust) or vllm==X (Python).")],
    engine: Annotated[str, typer.Option(help="The engine to run it with: vllm==Y.")],
    db: Annotated[Path | None, typer.Option(help="The matrix database (replay-proxy matrix --db).")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Observe the cell now with real peers.")] = False,
    current_frontend: Annotated[str | None, typer.Option(
        help="The frontend running now, for the upgrade order (default: the older release of the two).")] = None,
    current_engine: Annotated[str | None, typer.Option(help="The engine running now: vllm==Y.")] = None,
    recordings: Annotated[Path | None, typer.Option(help="The recordings of what each release sends.")] = None,
) -> None:
    """Will this frontend work with that engine, and in which order to upgrade?

    Exit code 0 works, 3 breaks, 4 degraded, 6 unknown. Answers from the matrix database where the
    cell was observed, from the prediction otherwise, and says which.

    Example: replay-proxy can-i-deploy --frontend vllm-rs==0.31.0 --engine vllm==0.30.0 --db matrix.db
    """
    from replay_proxy.matrix import MatrixError, RECORDINGS, engine_release, parse_build
    from replay_proxy.matrix.deploy import can_i_deploy as answer
    from replay_proxy.report.matrix import RICH, evidence_line

    try:
        build, release = parse_build(frontend), engine_release(engine)
        current = None
        if current_frontend or current_engine:
            current = (parse_build(current_frontend or frontend), engine_release(current_engine or engine))
    except MatrixError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    result = answer(build, release, db, verify=verify, current=current, recordings=recordings or RECORDINGS)
    verdict = result.cell.verdict
    out.print(f"{build} with engine {release}: [{RICH[verdict]}]{verdict.value}[/] ({result.source})")
    reasons: dict[tuple, list] = {}  # the reasons for the verdict, one line per kind (a failure per request is one)
    for evidence in (result.cell.observed or result.cell.predicted).evidence:
        if evidence.verdict is verdict:
            reasons.setdefault((evidence.direction, evidence.rule, evidence.struct, evidence.field), []).append(evidence)
    for same in reasons.values():
        more = f" (and {len(same) - 1} more like it)" if len(same) > 1 else ""
        out.print(f"  {evidence_line(same[0])}{more}", highlight=False, markup=False)
    for line in result.upgrade:
        out.print(line, highlight=False)
    raise typer.Exit(int(verdict.exit_code))


@app.command()
def bisect(
    db: Annotated[Path, typer.Option(help="The recording database.")],
    session: Annotated[str, typer.Option(help="The recorded session to replay: name or id.")],
    against: Annotated[Against, typer.Option(help="Which side changes across the releases.")],
    releases: Annotated[str, typer.Option(help="The range to search, A..B (oldest first).")],
    frontend_kind: Annotated[str, typer.Option(help="--against frontend: vllm-rs or vllm.")] = "vllm-rs",
) -> None:
    """Name the first release of a range whose replay of a session regresses against the recording.

    Each release it needs is installed on demand and replayed in bisection order.
    Exit code 0 when no release of the range regresses, else the deciding replay's (3, 4 or 6).

    Example: replay-proxy bisect --db recordings/vllm-0.28.0-python.db --session python-frontend --against frontend --frontend-kind vllm --releases 0.28.0..0.32.0
    """
    from replay_proxy.matrix import MatrixError, releases_in
    from replay_proxy.matrix.deploy import bisect as search

    if frontend_kind not in ("vllm-rs", "vllm"):
        raise fail("--frontend-kind is vllm-rs or vllm", ExitCode.USAGE)
    try:
        releases_in(releases)
    except MatrixError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    if not db.is_file():
        raise fail(f"no recording database at {db}")
    try:
        first, tried = search(db, session, str(against), releases, frontend_kind=frontend_kind,
                              progress=lambda line: err.print(line, highlight=False))
    except MatrixError as exc:
        raise fail(str(exc)) from None
    tried_text = ", ".join(t.release for t in tried)
    if first is None:
        out.print(f"no release of {releases} regresses (tried {tried_text})")
        return
    decided = next(t for t in tried if t.release == first)
    out.print(f"first regressing release: {first}: {decided.reason}", highlight=False)
    out.print(f"tried, in order: {tried_text}", highlight=False)
    raise typer.Exit(decided.exit_code if decided.exit_code in (3, 4, 6) else int(ExitCode.REPLAY_FAILED))


@sim_app.command("frontend")
def sim_frontend(
    handshake: Annotated[str, typer.Option(callback=check_address, help="Handshake address to bind.")],
    engines: Annotated[int, typer.Option(min=1, help="Engines to wait for.")] = 1,
    api_servers: Annotated[int, typer.Option(min=1, help="Input/output socket pairs (API servers).")] = 1,
    requests: Annotated[int, typer.Option(min=0, help="Requests in the workload.")] = 20,
    http_port: Annotated[int | None, typer.Option(
        help="Instead of running the workload, serve an OpenAI-style API on this port until SIGTERM or Ctrl-C.")]
        = None,
    drift: Annotated[str | None, typer.Option(
        help='Drift knobs as JSON, e.g. \'{"require_registration_key": "x"}\' (see sim/drift.py).')] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 60.0,
) -> None:
    """Run a fake frontend: wait for the engines, then run a small workload, or serve HTTP.

    Example: replay-proxy sim frontend --handshake tcp://127.0.0.1:29550 --engines 2
    """
    from replay_proxy.sim.api import serve_api
    from replay_proxy.sim.drift import FrontendDrift
    from replay_proxy.sim.frontend import SimFrontend
    from replay_proxy.sim.workload import run_workload

    frontend = SimFrontend(handshake, engines=engines, api_servers=api_servers, drift=parse_drift(drift, FrontendDrift))

    async def serve() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(frontend.run)
                await frontend.ready.wait()  # like vLLM: the API comes up once the engines are ready
                port = await nursery.start(serve_api, frontend, http_port)
                err.print(f"sim frontend: serving http://127.0.0.1:{port}")
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    async def workload() -> None:
        with trio.move_on_after(timeout) as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(frontend.run)
                await frontend.ready.wait()
                await run_workload(frontend, requests)
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            raise fail(f"sim frontend: workload not done after {timeout:g} s", ExitCode.REPLAY_FAILED)
        tokens = sum(len(t) for t in frontend.tokens.values())
        err.print(f"sim frontend: {len(frontend.finish_reasons)} requests finished, {tokens} tokens, "
                  f"{len(frontend.utility_results)} utility results")

    trio.run(workload if http_port is None else serve)


@sim_app.command("engine")
def sim_engine(
    handshake: Annotated[str, typer.Option(callback=check_address, help="Handshake address to dial.")],
    index: Annotated[int, typer.Option(min=0, help="Engine index (data-parallel rank).")] = 0,
    release: Annotated[str, typer.Option(help="vLLM release whose schema this engine speaks.")] = "0.32.0",
    step_ms: Annotated[float, typer.Option(min=0.1, help="One engine step (a token for each running request).")]
        = 2.0,
    step_spread: Annotated[float, typer.Option(min=0.0, help=(
        "Spread of step times: each is --step-ms times a lognormal of this sigma (seeded by --index)."))] = 0.0,
    drift: Annotated[str | None, typer.Option(
        help='Drift knobs as JSON, e.g. \'{"drop_registration_key": "block_size"}\' (see sim/drift.py).')] = None,
) -> None:
    """Run a fake engine until SIGTERM or Ctrl-C.

    Example: replay-proxy sim engine --handshake tcp://127.0.0.1:29560 --index 0
    """
    from replay_proxy.sim.drift import EngineDrift
    from replay_proxy.sim.engine import SimEngine

    knobs = parse_drift(drift, EngineDrift)

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(SimEngine(handshake, index, release=release, drift=knobs,
                                             step_s=step_ms / 1000, step_spread=step_spread).run)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)


def parse_drift(text: str | None, knobs: type):
    """``--drift`` JSON as the sim peer's knobs; a bad value is a usage error."""
    import msgspec

    try:
        return msgspec.json.decode(text, type=knobs) if text else knobs()
    except msgspec.DecodeError as exc:
        raise fail(f"--drift: {exc}", ExitCode.USAGE) from None


def run() -> None:
    """The console script: click's errors as one line, Ctrl-C and SIGTERM as exit code 130.

    SIGTERM is turned into SIGINT so that it unwinds like Ctrl-C (trio raises it at a
    safe point): cleanup runs, a replay's peer under test is stopped. `record` handles
    both signals itself and exits 0 once its recording is complete.
    """
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    try:
        code = app(standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort):
        code = ExitCode.INTERRUPTED
    except BaseExceptionGroup as group:  # from a trio nursery: say what went wrong, in one line
        error = leaf(group)
        if not isinstance(error, (ReplayProxyError, OSError, zmq.ZMQError)):
            raise
        err.print(f"[bold red]error:[/] {error}", highlight=False)
        code = ExitCode.ERROR
    except typer.TyperException as exc:  # click's usage errors, as vendored by typer
        ctx = getattr(exc, "ctx", None)
        hint = f" (see {ctx.command_path} -h)" if ctx is not None else ""
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        err.print(f"[bold red]error:[/] {message}{hint}", highlight=False)
        code = getattr(exc, "exit_code", ExitCode.USAGE)
    sys.exit(code if isinstance(code, int) else 0)
