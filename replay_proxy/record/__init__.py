"""``replay-proxy record``: relay a frontend and its engines, recording everything."""

from __future__ import annotations

import signal
from pathlib import Path

import trio

from replay_proxy.net.relay import Relay
from replay_proxy.record.metrics import MetricsServer
from replay_proxy.record.status import StatusLog
from replay_proxy.redact.settings import RedactionSettings
from replay_proxy.recorder import OnFull, Recorder, RecorderStats, SessionInfo
from replay_proxy.recorder.rotation import RotationSettings
from replay_proxy.store.sample import RequestSample


async def record(listen: str, upstream: str, db: Path, *, session: str,
                 on_full: OnFull = OnFull.DROP, record_coordinator: bool = False, max_db_mb: float | None = None,
                 redaction: RedactionSettings | None = None, sample: RequestSample | None = None,
                 rotation: RotationSettings | None = None, metrics: str | None = None,
                 frontend_release: str | None = None, instance: str | None = None,
                 frontend_name: str | None = None, frontend_version: str | None = None, log: StatusLog
                 ) -> tuple[Recorder, RecorderStats]:
    """Relay and record until SIGINT/SIGTERM (or SIGHUP, when not rotating: a hangup); return the finished
    recorder and its final statistics. Rotating, SIGHUP begins the next file. With ``metrics`` (HOST:PORT),
    serve ``/metrics`` and ``/healthz`` there meanwhile. ``instance`` names this proxy among its host's (default:
    ``default_instance``); ``frontend_name`` and ``frontend_version`` say which frontend it is."""
    info = SessionInfo(name=session, listen=listen, upstream=upstream, frontend_release=frontend_release,
                       frontend_source="given" if frontend_release else None,
                       proxy_instance=instance or default_instance(listen), frontend_name=frontend_name,
                       frontend_version=frontend_version)
    recorder = Recorder(db, info, on_full=on_full,
                        max_db_bytes=int(max_db_mb * 2**20) if max_db_mb else None, redaction=redaction,
                        sample=sample, rotation=rotation)
    relay = Relay(listen, upstream, recorder, record_coordinator=record_coordinator)
    status, error, server = "complete", None, None
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(relay.run)
                await relay.listening.wait()
                if metrics is not None:
                    server = MetricsServer(metrics, lambda: (recorder.statistics(), len(relay.engines)))
                served = f", metrics at http://{metrics.rpartition(':')[0]}:{server.port}/metrics" if server else ""
                log.event("listening", f"listening on {relay.listen}, frontend at {upstream}, "
                                       f"session {session!r} -> {db}{served}",
                          listen=relay.listen, upstream=upstream, session=session, db=str(db),
                          metrics_port=server.port if server else None)
                nursery.start_soon(log.run, recorder, relay)
                async for received in signals:
                    if received != signal.SIGHUP or rotation is None:
                        break
                    log.event("rotate", "SIGHUP: beginning the next file")
                    recorder.rotate()
                nursery.cancel_scope.cancel()
    except BaseException as exc:
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        stats = recorder.close(status, error)
        if server is not None:  # last: a scrape while the session ends still gets an answer
            server.close()
    return recorder, stats


def default_instance(listen: str) -> str:
    """A proxy's name among its host's where none is given: its handshake port (``tcp://HOST:PORT``), as
    Prometheus names an instance, or its socket's file name (``ipc://PATH``)."""
    return listen.rsplit(":", 1)[-1] if listen.startswith("tcp://") else Path(listen.split("://", 1)[-1]).name
