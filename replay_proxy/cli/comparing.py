"""Comparing builds: ``diff``, ``replay``, and the release schemas (``schema extract | diff | history``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from replay_proxy.cli.common import (JSON_HELP, VOCAB_SIZE_HELP, app, check_address, check_http, err, fail,
                                     finish_report, out, rules_option, schema_app)
from replay_proxy.errors import ExitCode, ReplayProxyError
from replay_proxy.replay.text import PromptForm
from replay_proxy.wire.messages import Side

REPORT_DIR_HELP = "Write report.json, junit.xml, report.html here."
PEER, JUDGING = "The peer under test", "Judging"  # replay -h's sections
Pace = Annotated[str, typer.Option(
    help="'original' recorded timing, 'fast' as fast as accepted, or a speed-up factor like 2.")]


@app.command()
def diff(
    db: Annotated[Path, typer.Option(help="Recording database of the candidate (and of the baseline, by default).")],
    baseline: Annotated[str, typer.Option(help="Baseline session: name or id.")],
    candidate: Annotated[str, typer.Option(help="Candidate session: name or id.")],
    baseline_db: Annotated[Path | None, typer.Option(help="The baseline's database, if another one.")] = None,
    noise: Annotated[list[str] | None, typer.Option(
        help="Another run of the baseline build (repeatable): what varies between them is noise, not regression.")]
        = None,
    candidate_noise: Annotated[list[str] | None, typer.Option(
        help="Another run of the candidate build, in --db (repeatable): timing is judged with two runs or more a "
             "side, none of them a recording, as replay judges it.")] = None,
    rules: Annotated[Path | None, typer.Option(help="JSON noise rules and thresholds to apply over the defaults.")]
        = None,
    vocab_size: Annotated[int | None, typer.Option(min=2, help=VOCAB_SIZE_HELP)] = None,
    report_dir: Annotated[Path | None, typer.Option(help=REPORT_DIR_HELP)] = None,
    show_info: Annotated[bool, typer.Option("--all", help="Also list informational findings.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Compare two recorded sessions: schema, behaviour and performance findings.

    Exit code 0 when nothing regressed; 3, 4, 5 for schema-breaking, behaviour and
    performance regressions (docs/comparing.md).

    Example: replay-proxy diff --db recordings/vllm-0.32.0-vllm-rs.db --baseline-db
    recordings/vllm-0.32.0-python.db --baseline python-frontend --candidate vllm-rs-frontend
    """
    from replay_proxy.compare.report import diff_sessions

    noise_rules = rules_option(rules, vocab_size)
    report = diff_sessions(baseline_db or db, baseline, db, candidate, noise_rules, noise or [], candidate_noise or [])
    finish_report(report, report_dir, show_info, as_json)


@app.command()
def replay(
    db: Annotated[list[Path], typer.Option(help="The recording (it is only read); again for more.")],
    against: Annotated[Side, typer.Option(
        help="The side under test: 'engine' (the proxy plays the recorded frontend) or 'frontend' (it plays "
             "the recorded engines).")],
    session: Annotated[str | None, typer.Option(help=(
        "The recorded session to replay: name or id (default: every recorded session of each --db, one after "
        "another, each in its own folder under --report-dir)."))] = None,
    listen: Annotated[str | None, typer.Option(rich_help_panel=PEER, callback=check_address,
        help="--against engine: the handshake address the engine dials.")] = None,
    upstream: Annotated[str | None, typer.Option(rich_help_panel=PEER, callback=check_address,
        help="--against frontend: the frontend's handshake address.")] = None,
    http: Annotated[str | None, typer.Option(rich_help_panel=PEER, callback=check_http,
        help="--against frontend: its HTTP API, e.g. http://127.0.0.1:8000.")] = None,
    engine_cmd: Annotated[str | None, typer.Option(rich_help_panel=PEER,
        help="Start the engine under test with this command (own process group, stopped at the end, log kept).")]
        = None,
    frontend_cmd: Annotated[str | None, typer.Option(
        rich_help_panel=PEER, help="Start the frontend under test with this command.")] = None,
    prompts: Annotated[PromptForm, typer.Option(rich_help_panel=PEER, help=(
        "--against frontend: send each recorded prompt as token ids, as text (detokenized with the model's "
        "tokenizer: for a frontend that takes no token ids, such as smg), or auto: token ids until the frontend "
        "rejects one for its prompt, text from then on."))] = PromptForm.AUTO,
    tokenizer: Annotated[Path | None, typer.Option(rich_help_panel=PEER, help=(
        "Prompts as text: the model's tokenizer.json, or its folder (default: the model the frontend serves, "
        "where that is a folder here)."))] = None,
    pace: Pace = "original",
    ready_timeout: Annotated[float, typer.Option(
        rich_help_panel=PEER, help="Seconds to wait for the target to be ready.")] = 300.0,
    finish_timeout: Annotated[float, typer.Option(
        rich_help_panel=PEER, help="Seconds to wait for outstanding requests.")] = 120.0,
    rules: Annotated[Path | None, typer.Option(
        rich_help_panel=JUDGING, help="JSON noise rules over the defaults.")] = None,
    vocab_size: Annotated[int | None, typer.Option(rich_help_panel=JUDGING, min=2, help=VOCAB_SIZE_HELP)] = None,
    noise_runs: Annotated[int, typer.Option(rich_help_panel=JUDGING, min=0, help=(
        "Replay the session this many times against --baseline-cmd and as many against the build under "
        "test, interleaved: what varies between the baseline's runs is the noise floor, not regression. "
        "Scoring needs 1, a timing verdict 2 or more."))] = 0,
    baseline_cmd: Annotated[str | None, typer.Option(rich_help_panel=JUDGING,
        help="--noise-runs: start the baseline build (the one the recording was made with) with this command.")]
        = None,
    hold_lengths: Annotated[bool, typer.Option(rich_help_panel=JUDGING, help=(
        "--against engine: each request asks for exactly its recorded number of output tokens, so the "
        "replay's load has the recorded shape even when its tokens differ (a redacted recording)."))] = False,
    report_dir: Annotated[Path | None, typer.Option(help=REPORT_DIR_HELP)] = None,
    out_db: Annotated[Path | None, typer.Option("--out", help=(
        "Record the replay here, beside a copy of the session (default: replay.db in --report-dir, else "
        "replay-SESSION.db here); an earlier replay's file takes more. --out equal to --db records into the "
        "recording itself."))] = None,
    shard: Annotated[str | None, typer.Option(help=(
        "Replay only the I-th of N equal runs of the sessions (I/N), for N CI runners; `replay-proxy merge` makes "
        "their --report-dir folders the report one run would give."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress on stderr: only errors and the result.")]
        = False,
) -> None:
    """Replay a recorded session (or several) against a new engine or frontend build and report what changed.

    Exit code 0 when nothing regressed; 3, 4, 5 for schema-breaking, behaviour and
    performance regressions; 6 when the replay could not run (docs/replay.md).

    Example: replay-proxy replay --db recordings/vllm-0.32.0-python.db --session python-frontend --against engine
    --listen tcp://127.0.0.1:29560
    """
    from replay_proxy.replay.player import PeerUnderTest, ReplayError, ReplayOptions
    from replay_proxy.replay.run import replay_session
    from replay_proxy.replay.shard import ShardError, folder, parse_shard, planned, replay_sessions
    from replay_proxy.report.render import write_reports
    from replay_proxy.store.copy import copy_session

    if against is Side.ENGINE and listen is None:
        raise fail("--against engine needs --listen (the handshake address the engine dials)", ExitCode.USAGE)
    if against is Side.FRONTEND and (upstream is None or http is None):
        raise fail("--against frontend needs --upstream (its handshake) and --http (its API)", ExitCode.USAGE)
    if noise_runs and not baseline_cmd:
        raise fail("--noise-runs needs --baseline-cmd (the build the recording was made with)", ExitCode.USAGE)
    if tokenizer is not None:  # (read when a frontend first refuses a token-id prompt: said now, not then)
        from replay_proxy.replay.text import Texts

        Texts(tokenizer)
    if hold_lengths and against is not Side.ENGINE:
        raise fail("--hold-lengths is for --against engine (a frontend asks for what its clients ask)",
                   ExitCode.USAGE)
    peer = PeerUnderTest(side=against, address=listen if against is Side.ENGINE else upstream, http=http,
                         command=engine_cmd if against is Side.ENGINE else frontend_cmd)
    try:
        options = ReplayOptions(pace=pace, ready_timeout_s=ready_timeout, finish_timeout_s=finish_timeout,
                                rules=rules_option(rules, vocab_size), noise_runs=noise_runs,
                                baseline_command=baseline_cmd, report_dir=report_dir, hold_lengths=hold_lengths,
                                prompts=prompts, tokenizer=tokenizer)
    except ReplayError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    if shard is None and len(db) == 1 and session is not None:
        if out_db is None:
            out_db = report_dir / "replay.db" if report_dir else Path("replay-" + re.sub(r"[^\w.-]", "_", session)
                                                                      + ".db")
        if out_db.resolve() != db[0].resolve():
            session = copy_session(db[0], session, out_db)
        if not quiet:
            err.print(f"replaying {session!r} against the {against} at {peer.address}, recorded into {out_db}",
                      highlight=False)
        report, _ = replay_session(out_db, session, peer, options, console=None if quiet else err)
        finish_report(report, report_dir, as_json=as_json)
    if report_dir is None or out_db is not None:
        raise fail("several sessions (or --shard) replay each into a folder of its own: give --report-dir, not --out",
                   ExitCode.USAGE)
    try:
        part = parse_shard(shard) if shard else None
    except ShardError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    plan = planned(db, session)
    if not plan:
        raise fail(f"no recorded session in {', '.join(map(str, db))}")
    report, replays = replay_sessions(plan, part, peer, options, report_dir, progress=(lambda _: None) if quiet
                                      else lambda line: err.print(line, highlight=False))
    for one in replays:
        write_reports(one.report, folder(report_dir, one.label))
    finish_report(report, report_dir, as_json=as_json)


@app.command()
def shrink(
    db: Annotated[Path, typer.Option(help="The recording (it is only read).")],
    session: Annotated[str, typer.Option(help="The session to shrink: name or id.")],
    out: Annotated[Path, typer.Option(help="A folder for shrunk.db (the smallest session found) and shrink.json.")],
    against: Annotated[Side, typer.Option(help="The side under test, as for replay.")],
    engine_cmd: Annotated[str | None, typer.Option(help=(
        "--against engine: the engine's command, with {port} where its handshake port goes (a free one "
        "for each replay)."))] = None,
    frontend_cmd: Annotated[str | None, typer.Option(help=(
        "--against frontend: the frontend's command, with {http} and {rpc} where its ports go."))] = None,
    finding: Annotated[str | None, typer.Option(help=(
        "The finding to keep, as CODE or CODE:STRUCT.FIELD (default: the worst of the whole session's "
        "replay)."))] = None,
    max_replays: Annotated[int, typer.Option(min=1, help="Replays at most, the whole session's included.")] = 64,
    jobs: Annotated[int, typer.Option(min=1, help="Candidates replayed side by side.")] = 1,
    pace: Pace = "original",
    ready_timeout: Annotated[float, typer.Option(help="Seconds each replay waits for its peer.")] = 300.0,
    finish_timeout: Annotated[float, typer.Option(help="Seconds each replay waits for outstanding requests.")]
        = 120.0,
) -> None:
    """Cut a session down to the requests a finding needs (delta debugging over its requests).

    The whole session is replayed first: if the finding is not there, exit 1. Then each candidate, a
    cut of some requests, is replayed in its own process against a fresh peer.

    Example: replay-proxy shrink --db staging.db --session staging --out shrunk --against engine --engine-cmd
    "vllm serve ... --data-parallel-rpc-port {port}"
    """
    from replay_proxy.replay.player import pace_factor
    from replay_proxy.replay.shrink import Peer, shrink as shrink_session

    command = engine_cmd if against is Side.ENGINE else frontend_cmd
    holes = ("{port}",) if against is Side.ENGINE else ("{http}", "{rpc}")
    if command is None or not all(hole in command for hole in holes):
        option = "--engine-cmd" if against is Side.ENGINE else "--frontend-cmd"
        raise fail(f"--against {against} needs {option} with {' and '.join(holes)} in it", ExitCode.USAGE)
    try:
        pace_factor(pace)
    except ReplayProxyError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    peer = Peer(against=against, command=command, pace=pace, ready_timeout_s=ready_timeout,
                finish_timeout_s=finish_timeout)
    summary = shrink_session(db, session, out, peer, finding=finding, max_replays=max_replays, jobs=jobs,
                             progress=lambda line: err.print(f"shrink: {line}", highlight=False))
    before, after = summary["requests"]["before"], summary["requests"]["after"]
    err.print(f"{summary['finding']['code']}: {before:,} -> {after:,} requests in {summary['replays']} replays"
              f"{'' if summary['minimal'] else ' (--max-replays ran out: not minimal)'}: {out / 'shrunk.db'}")


@schema_app.command("extract")
def schema_extract(
    release: Annotated[str | None, typer.Option(
        help="A release pip has: its wheel is fetched (cached) and its classes read; written to the package's "
             "schemas/RELEASE.json unless --out says otherwise.")] = None,
    python: Annotated[Path | None, typer.Option(help="Python interpreter of a vLLM installation.")] = None,
    vllm_src: Annotated[Path | None, typer.Option(
        help="With --python: a folder holding a vllm/ package to import instead (a source tree).")] = None,
    rust: Annotated[bool, typer.Option(
        "--rust", help="With --release: the Rust frontend's schema instead, read from the release's sdist "
                       "(rust_schemas/RELEASE.json).")] = False,
    rust_src: Annotated[Path | None, typer.Option(
        help="The Rust frontend's schema of a source tree (a vLLM checkout, or its protocol folder).")] = None,
    output: Annotated[Path | None, typer.Option("--out", help="Write here (- for stdout).")] = None,
) -> None:
    """Extract a release's wire schema from vLLM's own classes, or its Rust frontend's from its source.

    Example: replay-proxy schema extract --release 0.33.0

    Example: replay-proxy schema extract --release 0.34.0 --rust

    Example: replay-proxy schema extract --python ~/vllm/.venv/bin/python --vllm-src ~/vllm --out -
    """
    from replay_proxy import releases
    from replay_proxy.wire.rust import encode_rust_schema, read_protocol
    from replay_proxy.wire.registry import rust_schema_path, shipped_path

    if sum(x is not None for x in (release, python, rust_src)) != 1:
        raise fail("give one of --release, --python, --rust-src", ExitCode.USAGE)
    if vllm_src is not None and python is None:
        raise fail("--vllm-src goes with --python", ExitCode.USAGE)
    if rust and release is None:
        raise fail("--rust goes with --release (a source tree: --rust-src)", ExitCode.USAGE)
    if rust_src is not None:
        schema = encode_rust_schema(read_protocol(rust_src, "source"))
    elif rust:
        schema = encode_rust_schema(read_protocol(releases.rust_protocol(release), release))
    else:
        schema = releases.extract_release(release) if release else releases.extract_schema(python, vllm_src)
    output = output or (None if release is None else rust_schema_path(release) if rust else shipped_path(release))
    if output is None or str(output) == "-":
        sys.stdout.write(schema.decode())
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(schema)
        err.print(f"wrote {output}")


@schema_app.command("drift")
def schema_drift(
    release: Annotated[str | None, typer.Option(
        help="The release whose two languages are compared, e.g. 0.32.0.")] = None,
    rust_src: Annotated[Path | None, typer.Option(
        help="Read the Rust side from this source tree (a vLLM checkout or branch) instead of the release's.")]
        = None,
    schema: Annotated[Path | None, typer.Option(
        help="With --rust-src: the Python side from this schema file (what `schema extract --python ... "
             "--vllm-src CHECKOUT` writes) instead of a release's.")] = None,
    report_dir: Annotated[Path | None, typer.Option(help=REPORT_DIR_HELP)] = None,
    show_info: Annotated[bool, typer.Option("--all", help="Also list differences that break no reader.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Drift between the two languages inside one release: Python's classes against vllm-rs's structs.

    Each difference with its consequence on the wire: which reader rejects what, what is filled with a
    default, what loses precision. Exit code 3 when a reader on the link rejects (docs/comparing.md).

    Example: replay-proxy schema drift --release 0.32.0

    Example: replay-proxy schema drift --release 0.34.0 --rust-src ~/vllm

    Example: replay-proxy schema drift --schema checkout.json --rust-src ~/vllm
    """
    import msgspec

    from replay_proxy import releases
    from replay_proxy.compare.report import drift_report
    from replay_proxy.wire.rust import read_protocol
    from replay_proxy.wire.registry import load_rust_schema, load_schema, shipped_releases
    from replay_proxy.wire.schema import Schema

    if (release is None) == (schema is None) or (schema is not None and rust_src is None):
        raise fail("give --release, or --schema with --rust-src (a checkout's two sides)", ExitCode.USAGE)
    if release is not None and release not in shipped_releases():
        raise fail(f"no schema for {release!r}; shipped: {', '.join(shipped_releases())} (add one: "
                   f"replay-proxy add-release {release})", ExitCode.USAGE)
    if rust_src is not None and not rust_src.is_dir():
        raise fail(f"--rust-src {rust_src} is not a folder", ExitCode.USAGE)
    try:
        python = load_schema(release) if release else msgspec.json.decode(schema.read_bytes(), type=Schema)
        rust = (read_protocol(rust_src, f"source {rust_src}") if rust_src is not None
                else load_rust_schema(release) or read_protocol(releases.rust_protocol(release), release))
    except (OSError, msgspec.DecodeError) as exc:
        raise fail(f"--schema {schema}: {exc}") from None
    finish_report(drift_report(python, rust, rules_option(None)), report_dir, show_info, as_json)


@schema_app.command("diff")
def schema_diff(
    old: Annotated[str, typer.Argument(help="The older release, e.g. 0.31.0.")],
    new: Annotated[str, typer.Argument(help="The newer release, e.g. 0.32.0.")],
    report_dir: Annotated[Path | None, typer.Option(help=REPORT_DIR_HELP)] = None,
    show_info: Annotated[bool, typer.Option("--all", help="Also list compatible changes.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """What breaks between two shipped release schemas, and for which decoder.

    Exit code 3 if any change breaks a real decoder (docs/comparing.md).

    Example: replay-proxy schema diff 0.31.0 0.32.0
    """
    from replay_proxy.compare.report import schema_report
    from replay_proxy.wire.registry import load_schema, shipped_releases

    for release in (old, new):
        if release not in shipped_releases():
            raise fail(f"no shipped schema for {release!r}; shipped: {', '.join(shipped_releases())}", ExitCode.USAGE)
    finish_report(schema_report(load_schema(old), load_schema(new)), report_dir, show_info, as_json)


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
    from replay_proxy.compare.schema_history import struct_history
    from replay_proxy.report.tables import print_history
    from replay_proxy.wire.registry import load_schema, shipped_releases

    schemas = [load_schema(r) for r in shipped_releases()]
    try:
        history = struct_history(schemas, struct, field)
    except KeyError as exc:
        known = sorted({n for s in schemas for n in s.structs})
        raise fail(f"no {exc.args[0]} in any shipped schema" + ("" if field else f"; structs: {', '.join(known)}"),
                   ExitCode.USAGE) from None
    print_history(history, f"{struct} across {schemas[0].release} .. {schemas[-1].release}", out, as_json=as_json)
