"""``replay-proxy record``: relay a frontend and its engines, recording everything."""

from __future__ import annotations

import signal
from pathlib import Path

import trio
from rich.console import Console
from rich.live import Live
from rich.text import Text

from replay_proxy.net.relay import Relay
from replay_proxy.redact.settings import RedactionSettings
from replay_proxy.store.recorder import OnFull, Recorder, RecorderStats, SessionInfo

STATUS_EVERY_S = 0.25
PLAIN_STATUS_EVERY_S = 10.0  # when stderr is not a terminal: a log line now and then


def status_line(stats: RecorderStats, engines: int) -> Text:
    line = Text()
    line.append("recording ", style="bold")
    line.append(f"engines {engines}  frames {stats.frames_seen:,}  "
                f"{stats.bytes_seen / 1e6:,.2f} MB  requests {stats.requests:,}  "
                f"queue {stats.queue_depth_frames:,}  ")
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


async def record(listen: str, upstream: str, db: Path, *, session: str,
                 on_full: OnFull = OnFull.DROP, record_coordinator: bool = False, max_db_mb: float | None = None,
                 redaction: RedactionSettings | None = None,
                 console: Console | None = None) -> tuple[Recorder, RecorderStats]:
    """Relay and record until SIGINT/SIGTERM; return the finished recorder and its final statistics."""
    console = console or Console(stderr=True)
    recorder = Recorder(db, SessionInfo(name=session, listen=listen, upstream=upstream), on_full=on_full,
                        max_db_bytes=int(max_db_mb * 2**20) if max_db_mb else None, redaction=redaction)
    relay = Relay(listen, upstream, recorder, record_coordinator=record_coordinator)
    status, error = "complete", None
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay.run)
                await relay.listening.wait()
                console.print(f"listening on [bold]{relay.listen}[/], frontend at [bold]{upstream}[/], "
                              f"session {session!r} -> {db}")
                nursery.start_soon(_show_status, console, recorder, relay)
                async for _ in signals:
                    break
                nursery.cancel_scope.cancel()
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        stats = recorder.close(status, error)
    return recorder, stats


async def _show_status(console: Console, recorder: Recorder, relay: Relay) -> None:
    if not console.is_terminal:  # a log line now and then, and one at once for each new drift alarm
        shown, alarms = trio.current_time(), 0
        while True:
            await trio.sleep(STATUS_EVERY_S)
            stats = recorder.statistics()
            if stats.drift_alarms > alarms or trio.current_time() - shown >= PLAIN_STATUS_EVERY_S:
                console.print(status_line(stats, len(relay.engines)))
                shown, alarms = trio.current_time(), stats.drift_alarms
    with Live(console=console, refresh_per_second=4, transient=True) as live:
        while True:
            live.update(status_line(recorder.statistics(), len(relay.engines)))
            await trio.sleep(STATUS_EVERY_S)
