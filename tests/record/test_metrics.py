"""``record --metrics`` and ``--log-format json``, as an operator's tools see them: over HTTP, from a
real Prometheus server (Debian's package, which scripts/test.sh installs), and as JSON lines. Every figure
must be the session's own: what the ``sessions`` row says at the end."""

import contextlib
import json
import shutil
import signal
import sqlite3
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from replay_proxy.processes import Child, free_port
from tests.helpers import CLI

WAIT_S = 60  # every wait here is bounded by this


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def until(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value, of a /metrics page."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


@contextlib.contextmanager
def recorded_traffic(tmp_path, requests: int = 6):
    """A recording proxy with --metrics and JSON logs between a sim frontend serving HTTP and a sim engine,
    after ``requests`` completions: (the proxy, the engine, the metrics URL, the database)."""
    db = tmp_path / "r.db"
    upstream, listen, api = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    proxy = Child([*CLI, "record", "--listen", listen, "--upstream", upstream, "--db", str(db), "--session", "s",
                   "--metrics", "127.0.0.1:0", "--log-format", "json", "--status-every", "1"], tmp_path / "proxy.log")
    peers = []
    try:
        proxy.wait_for_log('"event":"listening"', timeout=WAIT_S)
        port = json.loads(proxy.log_lines()[0])["metrics_port"]
        peers.append(Child([*CLI, "sim", "frontend", "--handshake", upstream, "--http-port", str(api)],
                           tmp_path / "frontend.log"))
        engine = Child([*CLI, "sim", "engine", "--handshake", listen], tmp_path / "engine.log")
        peers.append(engine)
        until(lambda: get(f"http://127.0.0.1:{api}/v1/models")[0] == 200 if _listening(api) else None,
              "the sim frontend serves")
        for k in range(requests):
            request = urllib.request.Request(
                f"http://127.0.0.1:{api}/v1/completions", headers={"Content-Type": "application/json"},
                data=json.dumps({"model": "m", "prompt": [1, 2, k], "max_tokens": 4}).encode())
            with urllib.request.urlopen(request, timeout=WAIT_S) as reply:
                assert reply.status == 200
        yield proxy, engine, f"http://127.0.0.1:{port}", db
    finally:
        for peer in reversed(peers):
            peer.stop(timeout=20)
        proxy.stop(timeout=30)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def session_row(db) -> dict:
    connection = sqlite3.connect(db)
    connection.row_factory = sqlite3.Row
    return dict(connection.execute("SELECT * FROM sessions").fetchone())


def test_metrics_healthz_and_json_log_say_what_the_session_row_says(tmp_path):
    with recorded_traffic(tmp_path) as (proxy, engine, metrics, db):
        assert get(f"{metrics}/healthz") == (200, "ok\n")
        # Once the traffic is in (the tap counts within 50 ms), the counters stand still.
        page = until(lambda: (s := samples(get(f"{metrics}/metrics")[1]))["replay_proxy_frames_recorded_total"]
                     == s["replay_proxy_frames_seen_total"] > 0 and s, "every frame recorded")
        assert page['replay_proxy_engines{state="connected"}'] == 1
        assert page['replay_proxy_build_info{version="0.1.0",vllm_version="0.32.0"}'] == 1
        assert page['replay_proxy_bytes_total{channel="output",direction="to_frontend"}'] > 0
        assert page["replay_proxy_queue_frames"] == page["replay_proxy_decode_errors_total"] == 0
        engine.stop(timeout=20, sig=signal.SIGKILL)  # a lost engine: by its PID
        code, reason = until(lambda: (r := get(f"{metrics}/healthz"))[0] == 503 and r, "503 once the engine is lost")
        assert "1 engine(s) dead or lost" in reason
        last = samples(get(f"{metrics}/metrics")[1])
        assert last['replay_proxy_engines{state="dead"}'] == 1
        until(lambda: '"event":"status"' in proxy.log_tail(5), "a status line, a second after the last event")
    row = session_row(db)
    assert row["status"] == "complete"
    assert last["replay_proxy_frames_seen_total"] == row["frames_seen"]
    assert last["replay_proxy_frames_recorded_total"] == row["frames_recorded"]
    assert sum(v for k, v in last.items() if k.startswith("replay_proxy_bytes_total")) == row["bytes_seen"]
    assert sum(v for k, v in last.items() if k.startswith("replay_proxy_frames_dropped_total")) == 0
    # stderr, not a terminal, is JSON lines: one per event, and a status line every --status-every.
    lines = [json.loads(line) for line in proxy.log_lines()]
    events = [line["event"] for line in lines]
    assert events[0] == "listening" and events[-1] == "session_end" and "status" in events
    assert events.index("engine_connected") < events.index("engine_lost")
    assert (lines[-1]["frames_seen"], lines[-1]["status"]) == (row["frames_seen"], "complete")


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="Prometheus is not installed (scripts/test.sh installs Debian's package)")
def test_a_real_prometheus_scrapes_the_session_counts(tmp_path):
    prometheus_port = free_port()
    with recorded_traffic(tmp_path) as (proxy, engine, metrics, db):
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({"scrape_configs": [{  # (JSON is YAML)
            "job_name": "replay-proxy", "scrape_interval": "1s", "scrape_timeout": "1s",
            "static_configs": [{"targets": [metrics.removeprefix("http://")]}]}]}))
        server = Child(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prometheus_port}"], tmp_path / "prometheus.log")
        try:
            api = f"http://127.0.0.1:{prometheus_port}/api/v1/query?query="
            engine.stop(timeout=20, sig=signal.SIGKILL)
            until(lambda: get(f"{metrics}/healthz")[0] == 503, "503 once the engine is lost")
            lost_at = time.time()

            def scraped(series: str):
                """Prometheus's value of ``series``, once it has a sample scraped after the engine was lost."""
                query = urllib.parse.quote(f"{series} and timestamp({series}) > {lost_at + 1}")
                code, body = get(api + query) if _listening(prometheus_port) else (0, "")
                result = json.loads(body)["data"]["result"] if code == 200 else []
                return result and float(result[0]["value"][1])

            seen = until(lambda: scraped("replay_proxy_frames_seen_total"), "a scrape after the engine was lost")
            assert until(lambda: scraped('replay_proxy_engines{state="dead"}'), "the dead engine, scraped") == 1
            assert until(lambda: scraped("up"), "the target up") == 1
        finally:
            server.stop(timeout=20)
    assert seen == session_row(db)["frames_seen"] > 0  # the session's final count


def test_a_metrics_port_in_use_is_one_line_and_exit_1(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*CLI, "record", "--listen", f"tcp://127.0.0.1:{free_port()}", "--upstream",
                                 f"tcp://127.0.0.1:{free_port()}", "--db", str(tmp_path / "r.db"),
                                 "--metrics", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr.count("\n")) == (1, 1), result.stderr
    assert f"--metrics 127.0.0.1:{port}: Address already in use" in result.stderr
