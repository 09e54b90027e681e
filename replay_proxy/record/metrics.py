"""``record --metrics HOST:PORT``: ``/metrics`` in Prometheus's text format, and ``/healthz``.

Served by a thread of the proxy's own. A scrape reads the recorder's statistics, the same counters as
the status line, the summary and the ``sessions`` row, and counts nothing itself: forwarding, in the C
loop that holds no GIL, never waits for it. Names follow Prometheus's rules (``_total`` counters, base
units) and vLLM's own ``/metrics``; no label takes a request id.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from replay_proxy import __version__
from replay_proxy.errors import ReplayProxyError
from replay_proxy.recorder import RecorderStats
from replay_proxy.recorder.rotation import database_bytes
from replay_proxy.store.counts import writer_counts_help

Snapshot = Callable[[], tuple[RecorderStats, int]]  # the statistics, and how many engines have connected


class MetricsError(ReplayProxyError):
    """The metrics server could not listen where it was asked to."""


def health(stats: RecorderStats) -> str | None:
    """Why the proxy is unhealthy, or None: an engine is dead or lost, or the writer is gone."""
    reasons = []
    if stats.engines_dead:
        reasons.append(f"{stats.engines_dead} engine(s) dead or lost")
    if stats.writer_lost:
        reasons.append(stats.writer_lost)
    return "; ".join(reasons) or None


class Collector:
    """The recorder's statistics as Prometheus metrics, read at each scrape."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats, engines = self.snapshot()

        def counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            return CounterMetricFamily(f"replay_proxy_{name}", doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"replay_proxy_{name}", doc, value=value)

        yield counter("frames_seen_total", "Frames forwarded, and so seen by the recorder.", stats.frames_seen)
        for name, about in writer_counts_help().items():  # every count the writer keeps, each by its field's name
            metric = about.metric or (name if about.gauge else f"{name}_total")
            yield (gauge if about.gauge else counter)(metric, about.text, getattr(stats, name))
        dropped = CounterMetricFamily("replay_proxy_frames_dropped_total",
                                      "Frames forwarded but never to be in the recording, by reason.",
                                      labels=["reason"])
        for reason, frames in stats.frames_dropped_by_reason.items():
            dropped.add_metric([reason], frames)
        yield dropped
        link_bytes = CounterMetricFamily("replay_proxy_bytes_total", "Payload bytes forwarded, by link.",
                                         labels=["channel", "direction"])
        for (channel, direction), count in sorted(stats.bytes_by_link.items()):
            link_bytes.add_metric([channel, direction], count)
        yield link_bytes
        yield gauge("queue_frames", "Frames on their way to the database.", stats.queue_depth_frames)
        yield gauge("decode_lag_seconds", "While frames wait to be decoded: how long ago the newest decoded "
                                          "one crossed the proxy.", stats.decode_lag_s)
        yield gauge("db_bytes", "The file being written, and its write-ahead log.",
                    database_bytes(Path(stats.db_path)) if stats.db_path else 0)
        yield counter("rotations_total", "Files begun after the first (--rotate-mb, --rotate-every, SIGHUP).",
                      stats.rotations)
        yield counter("rotations_failed_total", "Rotations that failed (no space, no permission), tried again later.",
                      stats.rotations_failed)
        states = GaugeMetricFamily("replay_proxy_engines", "Engines that connected, by state.", labels=["state"])
        states.add_metric(["connected"], max(0, engines - stats.engines_dead))
        states.add_metric(["dead"], stats.engines_dead)
        yield states
        info = GaugeMetricFamily("replay_proxy_build_info", "This proxy's version, and the engines' vLLM's.",
                                 labels=["version", "vllm_version"])
        info.add_metric([__version__, stats.vllm_version or ""], 1)
        yield info


class MetricsServer:
    """``/metrics`` and ``/healthz`` on ``host:port`` (0: any free port; ``port`` says which), in a thread."""

    def __init__(self, address: str, snapshot: Snapshot):
        host, _, port = address.rpartition(":")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collector(snapshot))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # (the http.server hook's name)
                path = self.path.split("?")[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    reason = health(snapshot()[0])
                    self._reply(503 if reason else 200, f"{reason or 'ok'}\n".encode())
                else:
                    self._reply(404, b"/metrics or /healthz\n")

            def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # a scrape a second is no news for stderr
                pass

        try:
            self._server = http.server.ThreadingHTTPServer((host.strip("[]") or "0.0.0.0", int(port)), Handler)
        except OSError as exc:
            raise MetricsError(f"--metrics {address}: {exc.strerror or exc}") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="metrics")
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
