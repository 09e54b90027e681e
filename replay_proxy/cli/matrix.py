"""Which releases work together: ``matrix`` (and ``merge`` of its shards), ``can-i-deploy``, ``bisect``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import msgspec
import typer

from replay_proxy.cli.common import app, err, fail, finish_report, out
from replay_proxy.errors import ExitCode
from replay_proxy.peers import READY_S
from replay_proxy.wire.messages import Side

DEFAULT_FRONTENDS = "vllm-rs:0.22.0..0.34.0,vllm:0.27.0..0.34.0"
DEFAULT_ENGINES = "0.27.0..0.34.0"
RECORDINGS_HELP = "The recordings of what each release sends (default: the project's recordings/)."
ReadyTimeout = Annotated[float, typer.Option(
    help="Seconds each replay waits for its real peer to be ready (more on a busy machine).")]


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
        help="Write matrix.json, junit.xml (a testcase per cell), matrix.html (heat map) and matrix.md here, and "
             "keep each replay (its report, the peer's log, its database) under replays/.")] = None,
    recordings: Annotated[Path | None, typer.Option(help=RECORDINGS_HELP)] = None,
    ready_timeout: ReadyTimeout = READY_S,
    shard: Annotated[str | None, typer.Option(
        help="Observe only the I-th of N equal shares of the cells (I/N), for N CI runners; every shard "
             "predicts every cell. `replay-proxy merge` makes their --report-dir folders one matrix.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print matrix.json's document on stdout, not the table.")]
        = False,
) -> None:
    """Which frontend release works with which engine release: every cell predicted from the schemas
    and the readers' rules, and observed by replaying real peers (docs/matrix.md).

    Example: replay-proxy matrix --engines 0.30.0..0.32.0 --predict-only --report-dir matrix/
    """
    from replay_proxy.matrix import RECORDINGS, MatrixError
    from replay_proxy.matrix.run import run
    from replay_proxy.replay.shard import SHARD_JSON, ShardError, parse_shard
    from replay_proxy.report.matrix import matrix_json, print_run, write_reports

    try:
        part = None if shard is None else parse_shard(shard)
        if part is not None and (report_dir is None or db is not None):
            raise MatrixError("--shard writes its share to --report-dir, for merge (which takes --db)")
        done = run(frontends, engines, predict_only=predict_only, observe=observe or [],
                   recordings=recordings or RECORDINGS, db=db, report_dir=report_dir,
                   ready_s=ready_timeout, shard=part,
                   command="replay-proxy matrix " + " ".join(sys.argv[2:]),
                   progress=lambda line: err.print(line, highlight=False))
    except (MatrixError, ShardError) as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    if as_json:
        sys.stdout.buffer.write(matrix_json(done.cells) + b"\n")
    print_run(done, err if as_json else out, err)
    if report_dir is not None:
        for path in write_reports(done.cells, report_dir):
            err.print(f"wrote {path}")
    if done.shard is not None and report_dir is not None:
        (report_dir / SHARD_JSON).write_bytes(msgspec.json.format(msgspec.json.encode(done.shard)))
        err.print(f"wrote {report_dir / SHARD_JSON}")


@app.command()
def merge(
    shards: Annotated[list[Path], typer.Argument(
        help="Each shard's --report-dir (matrix or replay --shard I/N), once.")],
    report_dir: Annotated[Path, typer.Option(help="Write the merged matrix.json, junit.xml, matrix.html and "
                                                  "matrix.md here, with the replays their evidence names (a "
                                                  "replay's: report.json, junit.xml, report.html and each "
                                                  "session's folder).")],
    db: Annotated[Path | None, typer.Option(help="Keep the merged cells in this matrix database.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print matrix.json's document on stdout, not the table.")]
        = False,
) -> None:
    """Merge the shards of one matrix run (or one replay), each on a runner of its own, into what one run
    would give: the same cells, verdicts, findings, reports and exit code (docs/ci.md: Sharded across runners).

    Example: replay-proxy merge shard-1/ shard-2/ shard-3/ --report-dir matrix/ --db matrix.db
    """
    from replay_proxy.matrix import MatrixError
    from replay_proxy.matrix.run import merge as merge_run
    from replay_proxy.replay.shard import ShardError, holds_replay_shard, merge_replays
    from replay_proxy.report.matrix import matrix_json, print_run, write_reports

    if holds_replay_shard(shards[0]):
        if db is not None:
            raise fail("--db keeps a matrix's cells: a replay's shards merge into --report-dir alone", ExitCode.USAGE)
        try:
            report = merge_replays(shards, report_dir)
        except ShardError as exc:
            raise fail(str(exc)) from None
        finish_report(report, report_dir, as_json=as_json)

    try:
        done = merge_run(shards, report_dir, db=db, command="replay-proxy merge " + " ".join(sys.argv[2:]))
    except MatrixError as exc:
        raise fail(str(exc)) from None
    if as_json:
        sys.stdout.buffer.write(matrix_json(done.cells) + b"\n")
    print_run(done, err if as_json else out, err)
    for path in write_reports(done.cells, report_dir):
        err.print(f"wrote {path}")


@app.command("add-release")
def add_release(
    release: Annotated[str, typer.Argument(help="A vLLM release pip has, e.g. 0.35.0.")],
    engines: Annotated[str | None, typer.Option(
        help="Observe its Rust frontend against these engine releases (A..B or a comma list; installed on "
             "demand). Default: the engines installed.")] = None,
    db: Annotated[Path | None, typer.Option(help="Keep its cells in this matrix database.")] = None,
    report_dir: Annotated[Path | None, typer.Option(
        help="Keep the peers' logs and each replay here (default: a temporary folder).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    ready_timeout: ReadyTimeout = READY_S,
) -> None:
    """Make a release known on the day it ships: its schema, what changed, what its Rust frontend sends,
    and where that works.

    Extracts its schema from its own classes into the added releases' folder (every command reads it
    from then on), prints the changes since the release before it, records its vllm-rs serving a small
    workload, says which of those messages its own schema cannot read, and observes its cells against
    the engines (docs/matrix.md: A release on its day). Exit 0 when every message was read, 3 when some
    were not.

    Example: replay-proxy add-release 0.35.0 --db matrix.db
    """
    from replay_proxy.matrix import MatrixError, releases_in
    from replay_proxy.matrix.release import add_release as add

    try:
        chosen = None if engines is None else releases_in(engines)
        added = add(release, engines=chosen, db=db, workdir=report_dir, ready_s=ready_timeout,
                    say=lambda line: err.print(line, markup=False, highlight=False))
    except MatrixError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    if as_json:
        out.print_json(msgspec.json.encode(added).decode())
    else:
        for cell in added.cells:
            out.print(f"{cell.frontend} x engine {cell.engine}: {cell.verdict.value}", highlight=False)
    raise typer.Exit(int(ExitCode.SCHEMA_BREAKING if added.unread else ExitCode.OK))


@app.command("can-i-deploy")
def can_i_deploy(
    frontend: Annotated[str, typer.Option(help="The frontend to ship: vllm-rs==X (Rust) or vllm==X (Python).")],
    engine: Annotated[str, typer.Option(help="The engine to run it with: vllm==Y.")],
    db: Annotated[Path | None, typer.Option(help="The matrix database (replay-proxy matrix --db).")] = None,
    uses: Annotated[str | None, typer.Option(
        help="The kinds of request the deployment uses, a comma list of completion, lora and pooling "
             "(default: every kind judged for the cell).")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Observe the cell now with real peers.")] = False,
    current_frontend: Annotated[str | None, typer.Option(
        help="The frontend running now, for the upgrade order (default: the older release of the two).")] = None,
    current_engine: Annotated[str | None, typer.Option(help="The engine running now: vllm==Y.")] = None,
    recordings: Annotated[Path | None, typer.Option(help=RECORDINGS_HELP)] = None,
    report_dir: Annotated[Path | None, typer.Option(
        help="--verify: keep each replay (its report, the peer's log, its database) under replays/ here, "
             "where the evidence points (default: not kept).")] = None,
    ready_timeout: ReadyTimeout = READY_S,
    as_json: Annotated[bool, typer.Option("--json", help=(
        "Print the answer as a JSON document (verdict, exit code, each kind's source and evidence, upgrade "
        "order) on stdout."))] = False,
) -> None:
    """Will this frontend work with that engine, and in which order to upgrade?

    Exit code 0 works, 3 breaks, 4 degraded, 6 unknown, for the kinds of request asked about. Answers
    each kind from the matrix database where the cell was observed for it, from the prediction otherwise,
    and says which. With --verify it installs what the cell needs and observes it now; a peer that cannot
    run makes the cell unknown, never breaks.

    Example: replay-proxy can-i-deploy --frontend vllm==0.32.0 --engine vllm==0.31.0 --uses lora
    """
    from replay_proxy.matrix import RECORDINGS, MatrixError, engine_release, kinds_in, parse_build
    from replay_proxy.matrix.deploy import can_i_deploy as answer
    from replay_proxy.report.matrix import answer_json, print_answer

    try:
        build, release = parse_build(frontend), engine_release(engine)
        kinds = kinds_in(uses) if uses is not None else None
        current = None
        if current_frontend or current_engine:
            current = (parse_build(current_frontend or frontend), engine_release(current_engine or engine))
    except MatrixError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    result = answer(build, release, db, uses=kinds, verify=verify, current=current,
                    recordings=recordings or RECORDINGS, report_dir=report_dir, ready_s=ready_timeout)
    if as_json:
        sys.stdout.buffer.write(answer_json(result) + b"\n")
    else:
        print_answer(result, out)
    raise typer.Exit(int(result.verdict.exit_code))


@app.command()
def readers(
    db: Annotated[Path, typer.Option(help="The recording database.")],
    session: Annotated[str, typer.Option(help="The recorded session: name or id.")],
    engines: Annotated[str | None, typer.Option(
        help="The engine releases the exit code judges, A..B or a comma list (default: the release the "
             "session's own engines announced).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reading as a JSON document on stdout.")] = False,
) -> None:
    """Which engine releases read what a session's frontend sent: for each shipped release, whether its engine
    reads every request, the fields it fills with a default because the frontend left them out, what it does not
    read as sent; the release layouts the requests match exactly, and floats the frontend rounded to float32.
    For a frontend that is no vLLM release (record --frontend smg==1.13.0) as for one that is.

    Exit code 0 when every release of --engines reads it, 3 when one rejects it, 4 when one runs it without
    doing all it asks.

    Example: replay-proxy readers --db recordings/smg-1.13.0.db --session smg --engines 0.31.0..0.34.0
    """
    from replay_proxy.matrix import MatrixError, releases_in
    from replay_proxy.matrix.sent import read_sent
    from replay_proxy.report.matrix import print_sent

    try:
        judged = releases_in(engines) if engines is not None else None
    except MatrixError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    reading = read_sent(db, session, judged)
    if as_json:
        sys.stdout.buffer.write(msgspec.json.encode(reading) + b"\n")
    else:
        print_sent(reading, out)
    raise typer.Exit(int(reading.verdict.exit_code))


@app.command()
def bisect(
    db: Annotated[Path, typer.Option(help="The recording database.")],
    session: Annotated[str, typer.Option(help="The recorded session to replay: name or id.")],
    against: Annotated[Side, typer.Option(help="The side that changes across the releases.")],
    releases: Annotated[str, typer.Option(help="The range to search, A..B (oldest first).")],
    frontend_kind: Annotated[str, typer.Option(help="--against frontend: vllm-rs or vllm.")] = "vllm-rs",
    ready_timeout: ReadyTimeout = READY_S,
) -> None:
    """Name the first release of a range whose replay of a session regresses against the recording.

    Each release it needs is installed on demand and replayed in bisection order.
    Exit code 0 when no release of the range regresses, else the deciding replay's (3, 4 or 6).

    Example: replay-proxy bisect --db recordings/vllm-0.28.0-python.db --session python-frontend --against frontend
    --frontend-kind vllm --releases 0.28.0..0.32.0
    """
    from replay_proxy.matrix import MatrixError, releases_in
    from replay_proxy.matrix.deploy import bisect as search

    if frontend_kind not in ("vllm-rs", "vllm"):
        raise fail("--frontend-kind is vllm-rs or vllm", ExitCode.USAGE)
    try:
        releases_in(releases)
    except MatrixError as exc:
        raise fail(str(exc), ExitCode.USAGE) from None
    first, tried = search(db, session, against, releases, frontend_kind=frontend_kind, ready_s=ready_timeout,
                          progress=lambda line: err.print(line, highlight=False))
    tried_text = ", ".join(t.release for t in tried)
    if first is None:
        out.print(f"no release of {releases} regresses (tried {tried_text})")
        return
    decided = next(t for t in tried if t.release == first)
    out.print(f"first regressing release: {first}: {decided.reason}", highlight=False)
    out.print(f"tried, in order: {tried_text}", highlight=False)
    raise typer.Exit(decided.exit_code if decided.exit_code in (3, 4, 6) else int(ExitCode.REPLAY_FAILED))
