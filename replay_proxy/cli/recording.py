"""The recording and what reads it: ``record``, ``sessions``, ``decode``, ``export``, ``query``,
``datasette-metadata``."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import trio
import typer

from replay_proxy.cli.common import app, check_address, check_frontend, check_host_port, err, fail, out
from replay_proxy.errors import ExitCode
from replay_proxy.store import queries
from replay_proxy.record.status import LogFormat
from replay_proxy.recorder import OnFull
from replay_proxy.store.tables import read_recording

if TYPE_CHECKING:  # (the commands import what they use when they run: -h stays quick)
    from replay_proxy.redact.settings import RedactionSettings

# record -h's sections (the options not in one are the recording's own)
LINK, REDACTION = "The link", "Redaction (docs/redaction.md)"
SAMPLING_AND_FILES, MONITORING = "Sampling, rotation and retention", "Monitoring"


@app.command()
def record(
    listen: Annotated[str, typer.Option(rich_help_panel=LINK, callback=check_address,
        help="Handshake address the engines dial (their --data-parallel-address/--data-parallel-rpc-port).")],
    upstream: Annotated[str, typer.Option(rich_help_panel=LINK, callback=check_address,
        help="The frontend's real handshake address.")],
    db: Annotated[Path, typer.Option(help="SQLite file to record into (created if missing); it may hold strftime "
                                          "fields (staging-%Y%m%d-%H%M%S.db), filled in as each file is begun.")],
    session: Annotated[str | None, typer.Option(help="Session name (default: record-DATE-TIME).")] = None,
    instance: Annotated[str | None, typer.Option(
        help="This proxy's name among its host's, kept with the host's name in each session and a partition of "
             "export's dataset (default: the --listen port, or the ipc socket's file name).")] = None,
    on_full: Annotated[OnFull, typer.Option(
        help="When the recorder queue is full: 'drop' counts the frame as dropped from the recording "
             "(it is still forwarded); 'block' waits, lossless at the cost of latency.")] = OnFull.DROP,
    record_coordinator: Annotated[bool, typer.Option(rich_help_panel=LINK,
        help="Also relay and record the engines' DP-coordinator channels (subscription, READY, waves, stats); "
             "by default engines talk to the coordinator directly.")] = False,
    max_db_mb: Annotated[float | None, typer.Option(min=1,
        help="Stop recording (never forwarding) once the database file reaches this size; what does not "
             "fit is counted as dropped, as on a full disk.")] = None,
    frontend_release: Annotated[str | None, typer.Option(rich_help_panel=LINK,
        metavar="RELEASE",
        help="The vLLM release of the frontend (Python or vllm-rs), which no handshake names: its frames are "
             "decoded with it. By default it is found from its first request.")] = None,
    frontend: Annotated[str | None, typer.Option(rich_help_panel=LINK, callback=check_frontend,
        metavar="NAME==VERSION",
        help="Which frontend this is (smg==1.13.0, vllm-rs==0.32.0), kept with the session: no handshake or "
             "request names it. vllm==X and vllm-rs==X also set --frontend-release X.")] = None,
    fail_on_drift: Annotated[bool, typer.Option(rich_help_panel=LINK,
        help="Exit 3 at the end if any frame disagreed with the schema of the release its engine announced "
             "(the drift alarms, in the drift_alarms table).")] = False,
    redact_key: Annotated[Path | None, typer.Option(rich_help_panel=REDACTION,
        help="Redact every frame with the key in this file before anything is written (forwarding is untouched); "
             "see README: Redaction.")] = None,
    redact_policy: Annotated[Path | None, typer.Option(rich_help_panel=REDACTION,
        help="--redact-key: a JSON redaction policy laid over the shipped one.")] = None,
    vocab_size: Annotated[int | None, typer.Option(rich_help_panel=REDACTION,
        min=2, help="--redact-key: the model's vocabulary size (vocab_size in its config.json).")] = None,
    sample_requests: Annotated[float | None, typer.Option(rich_help_panel=SAMPLING_AND_FILES,
        metavar="F",
        help="Record only a keyed sample of the requests (0 < F <= 1): a request's ADD, outputs and ABORT, or none "
             "of them, decided by a hash of its id, alike on every engine, API server and proxy given the same "
             "--sample-seed. Handshakes, utility calls and stats are always recorded.")] = None,
    sample_seed: Annotated[str, typer.Option(
        rich_help_panel=SAMPLING_AND_FILES, help="--sample-requests: the key of its hash.")] = "0",
    rotate_mb: Annotated[float | None, typer.Option(rich_help_panel=SAMPLING_AND_FILES,
        min=1, help="Begin the next file once this one reaches this size (each file stands alone; see "
                    "docs/operations.md). SIGHUP begins it at once.")] = None,
    rotate_every: Annotated[str | None, typer.Option(rich_help_panel=SAMPLING_AND_FILES,
        metavar="DURATION", help="Begin the next file on every multiple of this since the epoch (UTC): 30m, 1h "
                                 "(on the hour), 1d.")] = None,
    keep: Annotated[int | None, typer.Option(rich_help_panel=SAMPLING_AND_FILES,
        min=1, help="Delete this run's oldest closed files beyond this many (the one being written counts).")] = None,
    max_total_gb: Annotated[float | None, typer.Option(rich_help_panel=SAMPLING_AND_FILES,
        min=0.001, help="Delete this run's oldest closed files while they and the current one exceed this.")] = None,
    metrics: Annotated[str | None, typer.Option(rich_help_panel=MONITORING,
        callback=check_host_port, metavar="HOST:PORT",
        help="Serve /metrics (Prometheus) and /healthz (200, or 503 with the reason once an engine is lost or "
             "the writer is dead) here; port 0 takes a free one. See docs/operations.md.")] = None,
    log_format: Annotated[LogFormat, typer.Option(rich_help_panel=MONITORING,
        help="How stderr is written when it is not a terminal: text lines, or JSON lines for a log collector "
             "(one every --status-every seconds and one per event).")] = LogFormat.TEXT,
    status_every: Annotated[float, typer.Option(rich_help_panel=MONITORING,
        min=0.5, help="When stderr is not a terminal: seconds between status lines.")] = 10.0,
) -> None:
    """Relay a vLLM frontend and its engines, recording every frame.

    Stops on Ctrl-C or SIGTERM, flushes the recording and marks the session complete.

    Example: replay-proxy record --listen tcp://127.0.0.1:29560 --upstream tcp://127.0.0.1:29550
    --db recordings/staging.db
    """
    from replay_proxy.record import record as run_record
    from replay_proxy.record.status import StatusLog
    from replay_proxy.recorder.rotation import RotationSettings, first_file
    from replay_proxy.store.sample import RequestSample
    from replay_proxy.wire.registry import shipped_releases

    name = session or datetime.datetime.now().strftime("record-%Y%m%d-%H%M%S")
    redaction = redaction_settings(redact_key, redact_policy, vocab_size, "--redact-key") if redact_key else None
    if sample_requests is not None and not 0 < sample_requests <= 1:
        raise fail(f"--sample-requests {sample_requests:g}: a fraction of the requests, 0 < F <= 1", ExitCode.USAGE)
    sample = RequestSample(sample_requests, sample_seed) if sample_requests is not None else None
    rotation = None
    if rotate_mb or rotate_every or keep or max_total_gb or "%" in str(db):
        rotation = RotationSettings(str(db), rotate_bytes=int(rotate_mb * 2**20) if rotate_mb else None,
                                    every_s=duration_s(rotate_every, "--rotate-every") if rotate_every else None,
                                    keep=keep, max_total_bytes=int(max_total_gb * 1e9) if max_total_gb else None)
        db = first_file(str(db))
    frontend_name, _, frontend_version = (frontend or "").partition("==")
    option = f"--frontend-release {frontend_release}"
    if frontend_name in ("vllm", "vllm-rs") and frontend_release is None and frontend_version:
        frontend_release, option = frontend_version, f"--frontend {frontend}"
    if frontend_release is not None and frontend_release not in shipped_releases():
        raise fail(f"{option}: no schema for it (known: "
                   f"{', '.join(shipped_releases())}; replay-proxy schema extract --release adds one)", ExitCode.USAGE)
    log = StatusLog(err, log_format, status_every)
    try:
        recorder, stats = trio.run(lambda: run_record(listen, upstream, db, session=name, on_full=on_full,
                                                      record_coordinator=record_coordinator, max_db_mb=max_db_mb,
                                                      redaction=redaction, sample=sample, rotation=rotation,
                                                      metrics=metrics, frontend_release=frontend_release,
                                                      instance=instance, frontend_name=frontend_name or None,
                                                      frontend_version=frontend_version or None, log=log))
    except OSError as exc:  # (a ReplayProxyError is cli.run's to say)
        raise fail(str(exc)) from None
    so_far = "" if stats.final else f" so far ({stats.queue_depth_frames:,} still being written)"
    sampled = f"{stats.frames_sampled_out:,} sampled out, " if sample else ""
    log.event("session_end", f"session {name!r} (id {recorder.session_id}) {recorder.status}: "
                             f"{stats.frames_recorded:,} of {stats.frames_seen:,} frames recorded{so_far}, "
                             f"{sampled}{stats.frames_dropped:,} dropped -> {recorder.db_path}", stats,
              session=name, session_id=recorder.session_id, status=recorder.status, final=stats.final)
    if stats.frames_undecoded:
        log.event("undecoded", f"{stats.frames_undecoded:,} frames are kept but not decoded yet: "
                               f"replay-proxy decode --db {db} --session {name}")
    if recorder.status not in ("complete", "finishing"):
        raise fail(f"the recording is {recorder.status}: {stats.error or 'see the sessions table'}")
    if stats.drift_alarms:
        log.event("drift_alarms", f"{stats.drift_alarms} drift alarm(s): "
                                  f"replay-proxy query --db {db} --preset drift")
        if fail_on_drift:
            raise typer.Exit(int(ExitCode.SCHEMA_BREAKING))


def duration_s(text: str, option: str) -> float:
    """``90s``, ``30m``, ``1h``, ``1d`` (or bare seconds) in seconds; anything else is a usage error."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        seconds = float(number) * units[unit]
    except ValueError:
        seconds = 0
    if not seconds > 0:
        raise fail(f"{option} {text!r}: a duration such as 30m, 1h or 1d", ExitCode.USAGE)
    return seconds


def redaction_settings(key: Path, policy: Path | None, vocab_size: int | None, option: str) -> RedactionSettings:
    """The redaction options, checked: a key or policy file that cannot be used is an input error (exit 1)."""
    from replay_proxy.redact.settings import Redaction, RedactionSettings

    if vocab_size is None:
        raise fail(f"{option} needs --vocab-size: no release's handshake carries the vocabulary size "
                   f"(it is vocab_size in the model's config.json)", ExitCode.USAGE)
    settings = RedactionSettings(str(key), vocab_size, str(policy) if policy else None)
    Redaction(settings)
    return settings


@app.command()
def redact(
    db: Annotated[Path, typer.Option(help="The recording to redact (it is only read).")],
    out: Annotated[Path, typer.Option(help="The new SQLite file for the redacted copies (must not exist).")],
    key_file: Annotated[Path, typer.Option(help="The redaction key: a file of 16 bytes or more.")],
    vocab_size: Annotated[int, typer.Option(
        min=2, help="The model's vocabulary size (vocab_size in its config.json): a recording with a token id "
                    "this large or larger is refused.")],
    session: Annotated[list[str] | None, typer.Option(help="A session to redact: name or id (repeatable; "
                                                           "default: every session).")] = None,
    policy: Annotated[Path | None, typer.Option(help="A JSON redaction policy laid over the shipped one.")] = None,
) -> None:
    """Write redacted copies of a recording's sessions into a new file, safe to hand to CI.

    Token ids are pseudonymized with a keyed, prefix-preserving mapping (lengths and shared prefixes
    stay); ids and names are keyed hashes; stop strings, schemas and transfer parameters are dropped;
    tensors become keyed noise; anything the policy does not name is blanked (README: Redaction).

    Example: replay-proxy redact --db staging.db --out ci.db --key-file redaction.key --vocab-size 512
    """
    from replay_proxy.redact.settings import Redaction
    from replay_proxy.store.copy import redact_database

    if out.resolve() == db.resolve():
        raise fail("--out is --db: redact writes a new file, never in place", ExitCode.USAGE)
    redaction = Redaction(redaction_settings(key_file, policy, vocab_size, "redact"))
    copied = redact_database(db, out, redaction, session)
    for name, session_id, frames in copied:
        err.print(f"session {name!r}: {frames:,} frames redacted -> {out} (id {session_id})")
    err.print(f"key {redaction.key.fingerprint}, policy {redaction.policy.digest}")


@app.command()
def cut(
    db: Annotated[Path, typer.Option(help="The recording to cut from (it is only read).")],
    session: Annotated[str, typer.Option(help="The session to cut: name or id.")],
    out: Annotated[Path, typer.Option(help="The new SQLite file for the cut (must not exist).")],
    requests: Annotated[list[str] | None, typer.Option(
        "--requests", help="A request to keep, by id (repeatable).")] = None,
    where: Annotated[str | None, typer.Option(
        help="Keep the requests this SQL condition over the requests table holds for, "
             "e.g. \"max_tokens > 100 AND temperature = 0\".")] = None,
    from_s: Annotated[float | None, typer.Option("--from", help="Keep requests added this many seconds "
                                                               "into the session or later.")] = None,
    to_s: Annotated[float | None, typer.Option("--to", help="... and before this many.")] = None,
    sample: Annotated[int | None, typer.Option(min=1, help="Then keep this many at random, stratified by finish "
                                                           "reason and greedy / seeded / random sampling.")] = None,
    seed: Annotated[int, typer.Option(help="The sample's seed.")] = 0,
    name: Annotated[str | None, typer.Option(help="The cut session's name (default: the source's, \"(cut)\").")]
    = None,
) -> None:
    """Write some requests of a session, with everything a replay of them needs, into a new file.

    Kept: every handshake, registration and READY, the start-up utility calls and those in the window,
    the chosen requests' ADDs, ABORTs and outputs (each EngineCoreOutputs rebuilt with only theirs).

    Example: replay-proxy cut --db staging.db --session staging --out ci.db --sample 200 --seed 1
    """
    from replay_proxy.store.cut import CutError, Selection, cut_database

    if out.resolve() == db.resolve():
        raise fail("--out is --db: cut writes a new file", ExitCode.USAGE)
    selection = Selection(requests=requests or None, where=where, from_s=from_s, to_s=to_s, sample=sample,
                          seed=seed)
    try:
        session_id, kept, frames = cut_database(db, out, session, selection, name)
    except CutError as exc:  # the selection options themselves
        raise fail(str(exc), ExitCode.USAGE) from None
    made = next(s["name"] for s in queries.list_sessions(out) if s["id"] == session_id)
    err.print(f"session {made!r}: {kept:,} requests of {session!r}, {frames:,} frames -> {out} (id {session_id})")


@app.command()
def sessions(
    db: Annotated[Path, typer.Option(help="Recording database.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the sessions in a recording.

    Example: replay-proxy sessions --db recordings/demo.db
    """
    from replay_proxy.report.tables import print_rows

    rows = queries.list_sessions(db)
    print_rows(rows, "json" if as_json else "table", out, title=f"sessions in {db}")


@app.command()
def decode(
    db: Annotated[Path, typer.Option(help="Recording database.")],
    session: Annotated[str | None, typer.Option(help="Session name or id (default: every session).")] = None,
) -> None:
    """Decode the frames a recording kept but did not decode yet (a writer stopped at high load keeps them).

    Example: replay-proxy decode --db recordings/staging.db
    """
    from replay_proxy.store.session import decode_kept

    for name, decoded in decode_kept(db, session):
        err.print(f"session {name!r} is still recording: its writer decodes it" if decoded is None
                  else f"session {name!r}: decoded {decoded:,} frames")


@app.command()
def migrate(
    db: Annotated[Path, typer.Option(help="Recording database, rewritten in place.")],
) -> None:
    """Bring a recording made by an older release to this release's layout, in place, and compact it (its
    frames' bytes compressed across frames). Reading never needs it: an older file is read as it is.

    Example: replay-proxy migrate --db recordings/staging.db
    """
    from replay_proxy.store.migrate import migrate as migrate_file

    before, after = migrate_file(db)
    err.print(f"{db}: {before:,} bytes before, {after:,} after ({after / before:.2f}x)")


@app.command()
def export(
    db: Annotated[list[Path], typer.Option(help="Recording database; again for more (a fleet's, a rotation's).")],
    parquet: Annotated[Path, typer.Option(
        help="Dataset folder to add to: DIR/TABLE/day=DAY/host=HOST/instance=INSTANCE/RECORDING.parquet "
             "(docs/database.md).")],
    session: Annotated[str | None, typer.Option(help="Session name or id (default: every session).")] = None,
) -> None:
    """Add each table of each session to a Parquet dataset partitioned by day and proxy, which DuckDB, Spark or
    pandas read in place.

    Example: replay-proxy export --db staging-20261207-0000.db --db staging-20261207-0100.db --parquet lake/
    """
    from replay_proxy.store.export import export_parquet
    from replay_proxy.store.tables import read_recording

    for one in db:  # every file read before any is exported: a bad one adds nothing to the dataset
        read_recording(one).close()
    files = [path for one in db for path in export_parquet(one, parquet, session)]
    err.print(f"wrote {len(files)} Parquet files under {parquet}")


@app.command()
def query(
    db: Annotated[Path, typer.Option(help="Recording database.")],
    sql: Annotated[str | None, typer.Argument(help="SQL to run (or use --preset).")] = None,
    preset: Annotated[str | None, typer.Option(
        help=f"A named query: {', '.join(queries.PRESETS)}.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV.")] = False,
    write: Annotated[bool, typer.Option("--write", help="Let the SQL change the recording (it is read-only "
                                                       "otherwise).")] = False,
) -> None:
    """Run SQL (or a named preset) over a recording and print the result; the recording is opened
    read-only unless --write.

    Example: replay-proxy query --db recordings/demo.db "SELECT request_id, ttft_ms FROM request_timeline"
    """
    from replay_proxy.report.tables import print_rows

    if (sql is None) == (preset is None):
        raise fail("give either SQL or --preset NAME", ExitCode.USAGE)
    if as_json and as_csv:
        raise fail("--json or --csv, not both", ExitCode.USAGE)
    if preset is not None and preset not in queries.PRESETS:
        raise fail(f"no preset {preset!r}; presets: {', '.join(queries.PRESETS)}", ExitCode.USAGE)
    rows = queries.run_query(db, queries.PRESETS[preset] if preset else sql, write=write)
    partly = [s for s in queries.list_sessions(db) if s["frames_undecoded"]]
    print_rows(rows, "json" if as_json else "csv" if as_csv else "table", out)
    for s in partly:
        err.print(f"note: {s['frames_undecoded']:,} frames of session {s['name']!r} are not decoded yet, so not "
                  f"in these tables: replay-proxy decode --db {db}")


@app.command("datasette-metadata")
def datasette_metadata(
    databases: Annotated[list[Path], typer.Argument(help="The recording databases Datasette will serve.")],
) -> None:
    """Print Datasette metadata whose canned queries are the query presets.

    Example: replay-proxy datasette-metadata recordings/*.db > metadata.json && datasette recordings/*.db
    -m metadata.json
    """
    for database in databases:  # (each one Datasette will open)
        read_recording(database).close()
    sys.stdout.write(json.dumps(queries.datasette_metadata(databases), indent=1) + "\n")
