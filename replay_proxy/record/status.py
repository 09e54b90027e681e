"""What ``record`` tells its operator on stderr: a live status line on a terminal; otherwise a line every
``--status-every`` seconds and one at once for each event (an engine connected or lost, a drift alarm, a
recording error), as text or as JSON lines for a log collector. Every figure is the recorder's statistics,
the counts the summary, the ``sessions`` row and ``/metrics`` read too."""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING, TextIO

import msgspec
import trio
from rich.console import Console
from rich.live import Live
from rich.text import Text

from replay_proxy.clock import utc_now
from replay_proxy.store.counts import WriterCounts

if TYPE_CHECKING:
    from replay_proxy.net.relay import Relay
    from replay_proxy.recorder import Recorder, RecorderStats

LIVE_EVERY_S = 0.25  # the terminal's status line, and how often events are looked for


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"  # one JSON object a line: {"ts": ..., "event": ..., "message": ..., the counts}


def status_line(stats: RecorderStats, engines: int) -> Text:
    line = Text()
    line.append("recording ", style="bold")
    line.append(f"engines {engines}  frames {stats.frames_seen:,}  "
                f"{stats.bytes_seen / 1e6:,.2f} MB  requests {stats.requests:,}  "
                f"queue {stats.queue_depth_frames:,}  ")
    if stats.frames_sampled_out:
        line.append(f"sampled out {stats.frames_sampled_out:,}  ")
    line.append(f"dropped {stats.frames_dropped:,}", style="bold red" if stats.frames_dropped else "")
    if stats.frames_undecoded:
        line.append(f"  undecoded {stats.frames_undecoded:,}")
    if stats.engines_dead:
        line.append(f"  engines dead {stats.engines_dead}", style="bold red")
    if stats.error:
        line.append(f"  {stats.error}", style="bold red")
    if stats.drift:
        line.append(f"  {stats.drift_alarms} drift alarm{'s' if stats.drift_alarms > 1 else ''}, newest: "
                    f"{stats.drift}", style="bold yellow")
    return line


def status_record(stats: RecorderStats, engines: int | None) -> dict[str, object]:
    """The counts of a JSON log line (``engines``: connected so far, where known): every count the writer keeps
    by its field's name (``WriterCounts``), and the tap's, the queue's and the rotation's."""
    return {**({} if engines is None else {"engines": engines}),
            **{name: getattr(stats, name) for name in WriterCounts.__struct_fields__},
            "frames_seen": stats.frames_seen, "frames_dropped": stats.frames_dropped,
            "frames_dropped_by_reason": stats.frames_dropped_by_reason, "queue_frames": stats.queue_depth_frames,
            "decode_lag_s": round(stats.decode_lag_s, 3), "bytes_seen": stats.bytes_seen, "error": stats.error,
            "db": stats.db_path, "rotations": stats.rotations, "rotations_failed": stats.rotations_failed,
            "files_deleted": stats.files_deleted}


def events(before: RecorderStats, after: RecorderStats, engines_before: int, engines: int) -> list[tuple[str, str]]:
    """(event, message) for what changed between two looks at the statistics."""
    found = []
    if engines > engines_before:
        found.append(("engine_connected", f"{engines} engine(s) connected"))
    if after.engines_dead > before.engines_dead:
        found.append(("engine_lost", f"{after.engines_dead} engine(s) dead or lost"))
    if after.drift_alarms > before.drift_alarms:
        found.append(("drift_alarm", after.drift or "drift alarm"))
    if after.rotations > before.rotations:
        found.append(("rotated", f"now recording into {after.db_path}"))
    if after.rotations_failed > before.rotations_failed:
        found.append(("rotation_failed", after.error or "a rotation failed"))
    if after.error and after.error != before.error:
        found.append(("recording_error", after.error))
    return found


class StatusLog:
    """Where ``record`` says what happens: a terminal's live line, or text or JSON log lines."""

    def __init__(self, console: Console, log_format: LogFormat = LogFormat.TEXT, every_s: float = 10.0,
                 stream: TextIO | None = None):
        self.console, self.format, self.every_s = console, LogFormat(log_format), every_s
        self.stream = stream or sys.stderr

    @property
    def live(self) -> bool:
        return self.format is LogFormat.TEXT and self.console.is_terminal

    def event(self, event: str, message: str, stats: RecorderStats | None = None, engines: int | None = None,
              **fields: object) -> None:
        """One event: a JSON line with the counts, or as text the status line, then the message."""
        if self.format is LogFormat.JSON:
            record = {"time": utc_now(), "event": event, "message": message, **fields}
            if stats is not None:
                record.update(status_record(stats, engines))
            self.stream.write(msgspec.json.encode(record).decode() + "\n")
            self.stream.flush()
            return
        if stats is not None:
            self.console.print(status_line(stats, engines or 0))
        if message:
            self.console.print(message)

    async def run(self, recorder: Recorder, relay: Relay) -> None:
        """Until cancelled: the live line, or a status line every ``every_s`` and one per event."""
        if self.live:
            with Live(console=self.console, refresh_per_second=4, transient=True) as live:
                while True:
                    live.update(status_line(recorder.statistics(), len(relay.engines)))
                    await trio.sleep(LIVE_EVERY_S)
        before, engines_before, shown = recorder.statistics(), 0, trio.current_time()
        while True:
            await trio.sleep(LIVE_EVERY_S)
            stats, engines = recorder.statistics(), len(relay.engines)
            for event, message in events(before, stats, engines_before, engines):
                self.event(event, message, stats, engines)
                shown = trio.current_time()
            if trio.current_time() - shown >= self.every_s:
                self.event("status", "", stats, engines)
                shown = trio.current_time()
            before, engines_before = stats, engines
