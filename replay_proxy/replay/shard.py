"""The replay of many sessions, of one recording or many, split across CI runners (``replay --shard I/N``), and
its shards merged (``merge``) into the report one run would give.

The sessions are planned in the order given (each recording's recorded
sessions, or the one named, in id order) and cut into N runs of equal length;
a shard replays its run, each session into a folder of its own under the
report folder (``replays/NNN-NAME/``: the replay's database, the peers' logs,
its reports), and writes the combined report (``compare.report.combine``)
beside them, and ``shard.json``: which shard of how many, the whole plan, its
wall time, and each of its sessions' report. ``merge_replays`` takes each
shard's folder once, checks that they are every shard of one plan, and
combines their sessions' reports in the plan's order: the findings, verdicts
and exit code of the unsharded run. The matrix shards its cells with the same
``Shard`` (matrix/shard.py).
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from replay_proxy.compare.findings import Report
from replay_proxy.compare.report import combine
from replay_proxy.errors import ReplayProxyError
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import replay_session
from replay_proxy.store.copy import copy_session
from replay_proxy.store.queries import list_sessions

SHARD_JSON = "shard.json"
REPLAYS = "replays"  # each session's folder, under the report folder


class ShardError(ReplayProxyError):
    pass


class Shard(msgspec.Struct, frozen=True):
    index: int  # 1 to count
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``I/N`` with 1 <= I <= N."""
    match = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if match is None or not 1 <= int(match[1]) <= int(match[2]):
        raise ShardError(f"--shard takes I/N, the I-th of N shards (1 <= I <= N), not {text!r}")
    return Shard(int(match[1]), int(match[2]))


T = TypeVar("T")


def cut(plan: list[T], shard: Shard) -> list[T]:
    """Shard ``shard``'s run of ``plan``: the I-th of N runs of equal length (one longer than another at most)."""
    return plan[(shard.index - 1) * len(plan) // shard.count:shard.index * len(plan) // shard.count]


class SessionReplay(msgspec.Struct, frozen=True):
    label: str  # NNN-NAME: its place in the plan and its session's name, its folder under replays/
    report: Report


def folder(report_dir: Path, label: str) -> Path:
    """Where a session's replay (``SessionReplay.label``) keeps its database, its peers' logs and its reports."""
    return report_dir / REPLAYS / label


class ReplayShard(msgspec.Struct, frozen=True):
    """shard.json of a replay shard."""

    shard: Shard
    title: str  # the whole run's report's
    plan: list[str]  # every session the whole run replays, RECORDING:SESSION, in order
    seconds: float  # this shard's wall time
    replays: list[SessionReplay]


def planned(recordings: list[Path], session: str | None) -> list[tuple[Path, str]]:
    """The sessions a run replays: ``session`` of each recording, else each one's recorded sessions (not the
    replays an earlier run recorded beside them)."""
    if session is not None:
        return [(db, session) for db in recordings]
    return [(db, str(row["name"])) for db in recordings for row in list_sessions(db) if row["mode"] == "record"]


def replay_sessions(plan: list[tuple[Path, str]], shard: Shard | None, peer: PeerUnderTest, options: ReplayOptions,
                    report_dir: Path, progress: Callable[[str], None]) -> tuple[Report, list[SessionReplay]]:
    """Replay this shard's sessions of ``plan`` (all of them without a shard), each in its own folder under
    ``report_dir`` (``folder``); their combined report and each one's, and with a shard its shard.json (the
    module's docstring)."""
    started = time.monotonic()
    title = f"replay of {len(plan)} sessions against the {peer.side}"
    labels = [f"{k:03d}-" + re.sub(r"[^\w.-]", "_", name) for k, (_, name) in enumerate(plan, 1)]
    mine = cut(list(zip(labels, plan)), shard) if shard is not None else list(zip(labels, plan))
    replays = []
    for label, (db, session) in mine:
        where = folder(report_dir, label)
        progress(f"session {label[:3]} of {len(plan)}: {session!r} of {db}")
        out = where / "replay.db"
        report, _ = replay_session(out, copy_session(db, session, out), peer,
                                   msgspec.structs.replace(options, report_dir=where))
        replays.append(SessionReplay(label, report))
    if shard is not None:
        written = ReplayShard(shard, title, [f"{db}:{session}" for db, session in plan], time.monotonic() - started,
                              replays)
        report_dir.mkdir(parents=True, exist_ok=True)
        (report_dir / SHARD_JSON).write_bytes(msgspec.json.encode(written))
    return combine(title + (f", shard {shard}" if shard else ""), [(r.label, r.report) for r in replays]), replays


def merge_replays(folders: list[Path], into: Path) -> Report:
    """The report of the run whose shards wrote ``folders``; their sessions' folders copied under ``into``.
    ShardError if they are not every shard of one run, each once."""
    shards: dict[int, tuple[ReplayShard, Path]] = {}
    for there in folders:
        try:
            shard = msgspec.json.decode((there / SHARD_JSON).read_bytes(), type=ReplayShard)
        except (OSError, msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise ShardError(f"{there} holds no shard of a replay (replay --shard I/N --report-dir): {exc}") from None
        if shard.shard.index in shards:
            raise ShardError(f"shard {shard.shard} twice: {shards[shard.shard.index][1]} and {there}")
        shards[shard.shard.index] = shard, there
    first, first_folder = shards[min(shards)]
    for shard, there in shards.values():
        if (shard.shard.count, shard.plan) != (first.shard.count, first.plan):
            raise ShardError(f"{there} and {first_folder} are shards of different replays")
    missing = sorted(set(range(1, first.shard.count + 1)) - set(shards))
    if missing:
        raise ShardError(f"shard(s) {', '.join(f'{i}/{first.shard.count}' for i in missing)} missing: their "
                         f"sessions are not replayed")
    replays = sorted((r for shard, _ in shards.values() for r in shard.replays), key=lambda r: r.label)
    for shard, there in shards.values():  # (once every check has passed: a refused merge writes nothing)
        for replay in shard.replays:
            if there.resolve() != into.resolve():
                shutil.copytree(folder(there, replay.label), folder(into, replay.label), dirs_exist_ok=True)
    return combine(first.title, [(r.label, r.report) for r in replays])


def holds_replay_shard(there: Path) -> bool:
    """Whether ``there`` is a replay shard's report folder (a matrix shard's shard.json has no replays)."""
    try:
        return "replays" in msgspec.json.decode((there / SHARD_JSON).read_bytes())
    except (OSError, msgspec.DecodeError):
        return False
