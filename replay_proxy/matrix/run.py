"""``replay-proxy matrix``: predict every cell, observe those asked for, keep them in the matrix database."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import msgspec

from replay_proxy.clock import utc_now
from replay_proxy.matrix import Cell, Frontend, RECORDINGS, database, frontends_in, parse_build, releases_in
from replay_proxy.matrix.observe import EngineBatch, Leg, batched_legs, judge, legs_of
from replay_proxy.matrix.predict import predict
from replay_proxy.matrix.shard import ShardPlan, merge_shards, name, planned, share
from replay_proxy.replay.shard import Shard
from replay_proxy.peers import READY_S
from replay_proxy.processes import threaded

# Replays at once. Most of a replay is waiting at the recorded pace (a Rust frontend's: about 1 s of CPU in
# 12), so four keep two cores busy; an engine's start (15-40 s, most of it CPU) is once per batch.
WORKERS = 4


def build(frontends: list[Frontend], engines: list[str], *, observe: bool | Callable[[Frontend, str], bool] = True,
          recordings: Path = RECORDINGS, report_dir: Path | None = None, workers: int = WORKERS,
          ready_s: float = READY_S, kinds: list[str] | None = None,
          progress: Callable[[str], None] = lambda line: None) -> list[Cell]:
    """A cell per frontend x engine, predicted; observed too where ``observe`` says (all, or a predicate), for
    ``kinds`` of request (default: every kind recorded), each replay waiting ``ready_s`` for its peer, and kept
    under ``report_dir``/replays/ (the evidence names it from there), else in a folder removed at the end."""
    cells = [Cell(str(f), e, predict(f, e, recordings)) for f in frontends for e in engines]
    wanted = [(f, e) for f in frontends for e in engines if (observe(f, e) if callable(observe) else observe)]
    if not wanted:
        return cells
    if report_dir is not None:
        _observe(cells, wanted, recordings, report_dir, True, workers, ready_s, kinds, progress)
    else:
        with tempfile.TemporaryDirectory(prefix="replay-proxy-matrix-") as scratch:
            _observe(cells, wanted, recordings, Path(scratch), False, workers, ready_s, kinds, progress)
    return cells


def _observe(cells: list[Cell], wanted: list[tuple[Frontend, str]], recordings: Path, folder: Path, keep: bool,
             workers: int, ready_s: float, kinds: list[str] | None, progress: Callable[[str], None]) -> None:
    workdir = folder / "replays"
    legs = legs_of(wanted, recordings, folder, ready_s, kinds, keep=keep)
    unique = list({id(leg): leg for by_kind in legs.values() if by_kind for pair in by_kind.values()
                   for leg in pair}.values())
    work = batched_legs(unique)
    batches = sum(isinstance(w, EngineBatch) for w in work)
    progress(f"observing {len(wanted)} cells with {len(unique)} replays ({workers} at a time, {batches} batches "
             f"against a kept engine), work in {workdir}" + ("" if keep else " (removed at the end)"))
    started = time.monotonic()

    def show(leg: Leg) -> None:
        progress(f"  {time.monotonic() - started:6.0f} s  {leg.recording[0].name} -> {leg.peer}: "
                 f"{leg.result.verdict.value} ({leg.result.seconds:.0f} s)")

    def run(unit: Leg | EngineBatch) -> None:
        if isinstance(unit, EngineBatch):
            unit.run(show)
        else:
            unit.run()
            show(unit)

    threaded(run, work, workers)
    by_cell = {(c.frontend, c.engine): c for c in cells}
    now = utc_now("seconds")
    for (frontend, engine), pair in legs.items():
        if pair is None:  # no recording of one side: nothing to replay, its prediction says why
            continue
        cell = by_cell[(str(frontend), engine)]
        cell.observed, cell.observed_at = judge(pair), now


class MatrixRun(msgspec.Struct):
    cells: list[Cell]
    seconds: float
    shard: ShardPlan | None = None  # a shard's: which, and what the whole run observes

    @property
    def disagreeing(self) -> list[Cell]:
        """Observed otherwise than predicted: a defect of the readers' rules."""
        return [c for c in self.cells if c.agrees is False]


def run(frontends: str, engines: str, *, predict_only: bool = False, observe: list[str] = (),
        recordings: Path = RECORDINGS, db: Path | None = None, report_dir: Path | None = None,
        ready_s: float = READY_S, shard: Shard | None = None, command: str = "replay-proxy matrix",
        progress: Callable[[str], None] = lambda line: None) -> MatrixRun:
    """``replay-proxy matrix``: the cells of ``frontends`` x ``engines`` (their specs, as ``frontends_in`` and
    ``releases_in`` read them), predicted, and observed unless ``predict_only``: every cell, or only the
    ``observe`` ones (``FRONTEND@ENGINE``), or of those only ``shard``'s share (``matrix/shard.py``), each
    replay's report, log and database kept under ``report_dir``/replays/ (default: not kept); the cells kept in
    ``db`` if given. Bad specs raise ``MatrixError``."""
    started = time.monotonic()
    if db is not None:
        database.writable(db)
    builds, releases = frontends_in(frontends), releases_in(engines)
    chosen = {(parse_build(f), releases_in(e)[0]) for f, _, e in (c.partition("@") for c in observe)}
    plan = [] if predict_only else planned([(f, e) for f in builds for e in releases if not chosen or (f, e) in chosen])
    mine = set(plan if shard is None else share(plan, shard))
    cells = build(builds, releases, observe=lambda f, e: (f, e) in mine, recordings=recordings,
                  report_dir=report_dir, ready_s=ready_s, progress=progress)
    seconds = time.monotonic() - started
    if db is not None:
        database.save(db, cells, command, seconds)
    return MatrixRun(cells, seconds, None if shard is None else ShardPlan(shard, [name(c) for c in plan], seconds))


def merge(folders: list[Path], report_dir: Path, *, db: Path | None = None,
          command: str = "replay-proxy merge") -> MatrixRun:
    """The run whose shards wrote ``folders`` (``merge_shards``), its replays copied under ``report_dir``; its
    cells kept in ``db`` if given, as the run would have kept them."""
    if db is not None:
        database.writable(db)
    cells, seconds = merge_shards(folders, report_dir)
    if db is not None:
        database.save(db, cells, command, seconds)
    return MatrixRun(cells, seconds)
