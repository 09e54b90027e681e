"""A busy engine through ``replay-proxy record``: live decoding, stop time, memory, disk, exact counts.

A minimal frontend and engine (plain pyzmq, each its own process, the real
0.32.0 handshake) talk through ``replay-proxy record``: once ready, the
engine pushes EngineCoreOutputs shaped like a 0.32.0 engine's steps
(``--outputs`` per-request outputs of one token, with scheduler stats) at
``--rate`` frames a second against one clock, and the frontend sends one ADD
per step. Its requests never finish, their ids cycling; with ``--finishing``,
each request has an id of its own and runs for ``--outputs`` steps, one
starting and one finishing in every step, as continuous batching does (what
a rotation waits for: the previous file closes once its requests finish).
While it runs, the newest frame in ``frames`` is compared with the clock
twice a second (how far decoding is behind the wire) and the writer's
resident memory is sampled. Then SIGINT, timed until the proxy exits, and
every count is checked against what the peers sent.

    .venv/bin/python scripts/bench/busy.py [--rate 2000] [--outputs 32] [--seconds 600] [--json]
    .venv/bin/python scripts/bench/busy.py --frames 200000 --outputs 4 --rate 20000   # the suite's soak
    .venv/bin/python scripts/bench/busy.py --seconds 60 --redact-key redaction.key   # record --redact-key
    .venv/bin/python scripts/bench/busy.py --seconds 60 --sample-requests 0.25      # record --sample-requests
    .venv/bin/python scripts/bench/busy.py --seconds 1800 --rate 1000 --rotate-mb 256 --keep 4   # rotating
    .venv/bin/python scripts/bench/busy.py --seconds 60 --rotate-every 10s --against-plain   # rotating, vs plain
    .venv/bin/python scripts/bench/busy.py --seconds 60 --rotate-every 10s --against-plain --finishing

Prints one JSON object (on one line with --json: what the soak test reads). With
``--redact-key`` or ``--sample-requests`` (or rotation with ``--against-plain``),
two runs: the floor (the same, plain), then with the options, and that run's lag,
stop time and recording CPU as ratios to the floor's (under the options' names:
``redacted``, ``sampled``, ``rotated``, joined by ``+``); redacting, also the
redactor's CPU over its own run's writer's (``redactor_per_writer_cpu``). Each run also
gives the CPU seconds per million frames of the proxy (forwarding), its writer
and its redactor, read from /proc, and the cores each took at that rate: a
process that needs less than one core keeps up live on a host that gives it
one, whatever the lag on a machine whose cores the peers share.

The file's size against the wire's: ``db_mb`` and ``wal_mb`` at the end against
``wire_mb``, and ``live_disk_to_wire_max``, the most the recording took on disk
while recording for the wire bytes that had crossed by then (sampled with the
lag, from a tenth of the run on), and ``live_max_at``, when in the run (0 to 1).
With ``--parquet``, the recording is exported too: ``parquet_mb``, what
``replay-proxy export`` writes of it.

Rotating (``--rotate-mb``, ``--rotate-every``, ``--keep``), the session's figures
are summed over the files left, the proxy's own totals are in ``summary`` (its
JSON log's last line), and the disk the files took is sampled with the lag
(``disk_mb_max``); the lag is read from the newest file.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.processes import Child, free_port  # noqa: E402
from replay_proxy.wire.encode import encode, struct_value  # noqa: E402
from replay_proxy.wire.handshake import engine_identity  # noqa: E402
from replay_proxy.wire.registry import load_schema  # noqa: E402

SCHEMA = load_schema("0.32.0")
IDENTITY = engine_identity(0)
DISTINCT_STEPS = 64  # the engine cycles through this many encoded steps
REQUEST_IDS = 4096  # the ADDs cycle through this many request ids; the steps name the first DISTINCT_STEPS x outputs
VOCAB = 1000  # the token ids the peers send are below it


def socket(ctx: zmq.Context, kind: int, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0)):
        sock.setsockopt(option, value)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def step(k: int, outputs: int, finishing: bool = False) -> bytes:
    """Step ``k``: each request's one token. Finishing, its outputs are those of requests k + outputs - 1
    down to k, the last one's ending (finish reason length)."""
    stats = {"num_running_reqs": outputs, "num_waiting_reqs": 0, "step_counter": k, "current_wave": 0,
             "kv_cache_usage": 0.25, "prefix_cache_stats": {"reset": False, "requests": 0, "queries": 0, "hits": 0}}
    named = [{"request_id": request_id(k + outputs - 1 - i), "new_token_ids": [100 + (k + i) % 800],
              "finish_reason": 1 if i == outputs - 1 else None} if finishing else
             {"request_id": request_id(k * outputs + i), "new_token_ids": [100 + (k + i) % 800]}
             for i in range(outputs)]
    return encode(struct_value(SCHEMA, "EngineCoreOutputs", {
        "engine_index": 0, "timestamp": 1000.0 + k / 100, "scheduler_stats": stats,
        "outputs": [struct_value(SCHEMA, "EngineCoreOutput", output) for output in named]}))


def request_id(n: int, cycling: bool = True) -> str:
    return f"cmpl-{n % REQUEST_IDS if cycling else n:032x}-0"


class Renamed:
    """Frames encoded once, sent with other request ids: every id is as long (msgpack's framing holds), so
    each is written over its place in a copy of the frame."""

    def __init__(self, frames: list[bytes]):
        self.frames = frames
        self.places = [[m.start() for m in re.finditer(rb"cmpl-[0-9a-f]{32}-0", f)] for f in frames]

    def frame(self, k: int, first: int) -> bytearray:
        """Frame ``k`` (cycling) naming requests ``first``, ``first`` - 1, ... in the order it names them."""
        frame = bytearray(self.frames[k % len(self.frames)])
        for j, at in enumerate(self.places[k % len(self.frames)]):
            frame[at:at + ID_LENGTH] = request_id(first - j, cycling=False).encode()
        return frame


ID_LENGTH = len(request_id(0))


def paced(rate: float, count: int):
    """0, 1, ... count-1, each at its time on one clock (no drift from sleeping after each)."""
    start = time.perf_counter()
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield i


def frontend(handshake_port: int, steps: int, rate: float, finishing: bool) -> None:
    """Bind like vLLM's frontend, answer the handshake, send an ADD per step (finishing: of request n at step
    n), count outputs; print JSON."""
    ctx = zmq.Context()
    inputs, outputs, handshake = socket(ctx, zmq.ROUTER), socket(ctx, zmq.PULL), socket(ctx, zmq.ROUTER)
    addresses = {"inputs": [f"tcp://127.0.0.1:{free_port()}"], "outputs": [f"tcp://127.0.0.1:{free_port()}"],
                 "coordinator_input": None, "coordinator_output": None, "frontend_stats_publish_address": None}
    inputs.setsockopt(zmq.LINGER, 60_000)  # its last ADDs may still be queued when it exits: deliver them
    inputs.bind(addresses["inputs"][0])
    outputs.bind(addresses["outputs"][0])
    handshake.bind(f"tcp://127.0.0.1:{handshake_port}")
    identity, _hello = handshake.recv_multipart()
    handshake.send_multipart([identity, encode({"addresses": addresses, "parallel_config": {}})])
    inputs.recv_multipart()  # registration
    handshake.recv_multipart()  # READY
    # Encoded once, as the engine's steps are: the peers stand for processes that would have cores of their own.
    adds = [encode(struct_value(SCHEMA, "EngineCoreRequest", {
        "request_id": request_id(i), "prompt_token_ids": [1, 2, 3], "mm_features": None,
        "sampling_params": {"temperature": 0.0, "max_tokens": 16}, "pooling_params": None,
        "arrival_time": 1.0, "lora_request": None, "cache_salt": None, "data_parallel_rank": None}))
        for i in range(min(steps, REQUEST_IDS))]
    renamed = Renamed(adds[:1])
    received = 0
    for i in paced(rate, steps):
        inputs.send_multipart([IDENTITY, b"\x00", renamed.frame(0, i) if finishing else adds[i % REQUEST_IDS]])
        while outputs.poll(0):
            outputs.recv_multipart()
            received += 1
    received = drain(outputs, received, steps)
    print(json.dumps({"adds_sent": steps, "outputs_received": received}), flush=True)
    ctx.destroy()


def drain(sock: zmq.Socket, received: int, expected: int, timeout_s: float = 60) -> int:
    """Receive from ``sock`` until ``expected`` messages in all or ``timeout_s``; the count received."""
    deadline = time.monotonic() + timeout_s
    while received < expected and time.monotonic() < deadline:
        if sock.poll(100):
            sock.recv_multipart()
            received += 1
    return received


def engine_handshake(ctx: zmq.Context, handshake_address: str) -> tuple[zmq.Socket, zmq.Socket]:
    """Handshake like a headless 0.32.0 engine; return its input and output sockets."""
    handshake = socket(ctx, zmq.DEALER, IDENTITY)
    handshake.connect(handshake_address)
    handshake.send(encode({"status": "HELLO", "local": False, "headless": True}))
    addresses = msgspec.msgpack.decode(handshake.recv())["addresses"]
    inputs, outputs = socket(ctx, zmq.DEALER, IDENTITY), socket(ctx, zmq.PUSH)
    inputs.connect(addresses["inputs"][0])
    outputs.connect(addresses["outputs"][0])
    inputs.send(encode({"status": "READY", "local": False, "headless": True, "vllm_version": "0.32.0",
                        "data_parallel_size": 1, "max_model_len": 256, "block_size": 16, "num_gpu_blocks": 100}))
    handshake.send(encode({"status": "READY", "local": False, "headless": True}))
    return inputs, outputs


def engine(handshake_address: str, steps: int, rate: float, per_step: int, finishing: bool) -> None:
    """Handshake like a headless engine, then push ``steps`` steps at ``rate``, reading the ADDs."""
    inputs, outputs = engine_handshake(zmq.Context(), handshake_address)
    frames = [step(k, per_step, finishing) for k in range(DISTINCT_STEPS)]
    renamed = Renamed(frames)
    # Like a real engine, it sends outputs only of requests it has been sent: it steps once the ADDs of
    # the requests its steps name have come (the frontend's first, about a second of them).
    received = 0
    for _ in range(min(steps, DISTINCT_STEPS * per_step)):
        if not inputs.poll(60_000):
            sys.exit("engine: no ADD from the frontend within 60 s")
        inputs.recv_multipart()
        received += 1
    for i in paced(rate, steps):
        outputs.send(renamed.frame(i, i + per_step - 1) if finishing else frames[i % DISTINCT_STEPS])
        while inputs.poll(0):
            inputs.recv_multipart()
            received += 1
    # Every ADD the frontend sent has crossed the proxy once it is here: only then may the proxy be stopped.
    received = drain(inputs, received, steps)
    print(json.dumps({"adds_received": received}), flush=True)
    time.sleep(30)  # until stopped: an engine that exits would be a lost engine


def child_pid(proxy_pid: int, module: str) -> int | None:
    """The proxy's child process running ``module`` (its writer, its redactor)."""
    children = Path(f"/proc/{proxy_pid}/task/{proxy_pid}/children")
    for pid in children.read_text().split() if children.exists() else []:
        if module in Path(f"/proc/{pid}/cmdline").read_text():
            return int(pid)
    return None


def cpu_s(pid: int) -> float | None:
    """The CPU seconds (user and system) process ``pid`` has used so far; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def read_cpu(processes: dict[str, int | None]) -> dict[str, float]:
    """The CPU seconds of each process still running, by name."""
    return {name: seconds for name, pid in processes.items() if pid is not None
            for seconds in [cpu_s(pid)] if seconds is not None}


def finished(path: Path) -> sqlite3.Connection:
    """A file whose writer has ended, for reading. In exclusive locking mode, which SQLite reads a write-ahead
    log in without a shared-memory file: that needs room, which a full disk does not have."""
    connection = sqlite3.connect(path)
    connection.execute("PRAGMA locking_mode=EXCLUSIVE")
    return connection


def _bytes(path: Path) -> int:
    """A file's size, or 0 if it is gone (rotation deletes files while they are counted)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def run_files(db: Path) -> list[Path]:
    """The files of a run: ``db``, and the files it rotated into (``db-1``, ``db-2`` ...) still there."""
    return sorted((p for p in db.parent.glob(f"{db.stem}*{db.suffix}") if p.stem == db.stem or
                   p.stem.removeprefix(f"{db.stem}-").isdigit()), key=lambda p: (len(p.name), p.name))


def live_ratio(db: Path, recorded_bytes: list[tuple[int, int]]) -> dict[str, float] | None:
    """The most the recording took on disk (its file and write-ahead log, not the room kept for its end) for the
    wire bytes that had crossed by then, from a tenth of the run on (before, the log's few MB are most of it), and
    when in the run (0 to 1) that was."""
    if len(recorded_bytes) < 10:
        return None
    with contextlib.closing(sqlite3.connect(db)) as connection:
        ratios = [(size / crossed, k / len(recorded_bytes))
                  for k, (when, size) in enumerate(recorded_bytes) if k >= len(recorded_bytes) // 10
                  for (crossed,) in [connection.execute("SELECT SUM(nbytes) FROM frames WHERE ts_ns <= ?",
                                                        [when]).fetchone()] if crossed]
    if not ratios:
        return None
    most, at = max(ratios)
    return {"live_disk_to_wire_max": round(most, 3), "live_max_at": round(at, 2)}


def parquet_bytes(db: Path) -> int:
    """What ``export`` writes of the recording: its Parquet files' bytes."""
    with tempfile.TemporaryDirectory() as lake:
        subprocess.run([sys.executable, "-m", "replay_proxy", "export", "--db", str(db), "--parquet", lake],
                       check=True, capture_output=True, cwd=ROOT)
        return sum(p.stat().st_size for p in Path(lake).rglob("*.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2000, help="engine steps (output frames) a second")
    parser.add_argument("--outputs", type=int, default=32, help="per-request outputs in each step")
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--frames", type=int, help="steps in all (instead of --seconds)")
    parser.add_argument("--finishing", action="store_true",
                        help="each request its own id, finishing after --outputs steps (one ends in each step)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--parquet", action="store_true", help="also export the recording: its Parquet's size")
    parser.add_argument("--on-full", choices=["drop", "block"], default="drop", help="record's --on-full")
    parser.add_argument("--db", type=Path, help="record into this file and keep it (default: a temporary one)")
    parser.add_argument("--redact-key", type=Path, help="record's --redact-key: redact every frame as it is written")
    parser.add_argument("--sample-requests", type=float, help="record's --sample-requests: record a keyed sample")
    parser.add_argument("--rotate-mb", type=float, help="record's --rotate-mb")
    parser.add_argument("--rotate-every", help="record's --rotate-every")
    parser.add_argument("--keep", type=int, help="record's --keep")
    parser.add_argument("--max-total-gb", type=float, help="record's --max-total-gb")
    parser.add_argument("--against-plain", action="store_true",
                        help="rotating, first run plain as the floor (as --redact-key and --sample-requests do)")
    args = parser.parse_args()
    rotation = [arg for name in ("rotate_mb", "rotate_every", "keep", "max_total_gb") if getattr(args, name) is not None
                for arg in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    if args.against_plain and not rotation:
        parser.error("--against-plain compares a rotating run with a plain one: give --rotate-mb or --rotate-every")
    option = (["--redact-key", str(args.redact_key), "--vocab-size", str(VOCAB)] if args.redact_key else []) + (
        ["--sample-requests", str(args.sample_requests)] if args.sample_requests else []) + rotation
    if not (args.redact_key or args.sample_requests or args.against_plain):
        result = run(args, option)
    else:  # the floor first: the same run, plain
        name = "+".join(name for name, on in (("redacted", args.redact_key), ("sampled", args.sample_requests),
                                               ("rotated", rotation)) if on)
        floor, measured = run(args, []), run(args, option)
        recording_cpu = {name: sum(v for k, v in run["cpu_s_per_million_frames"].items() if k != "proxy")
                         for name, run in (("floor", floor), (name, measured))}
        result = {"floor": floor, name: measured, **{
            f"{figure}_ratio": round(measured[figure] / floor[figure], 2) if floor[figure] else None
            for figure in ("decode_lag_ms_p50", "decode_lag_ms_max", "stop_s")},
            # the recorder's own CPU off the forwarding path (writer, and redactor), with the option against plain
            "recording_cpu_ratio": round(recording_cpu[name] / recording_cpu["floor"], 2)
            if recording_cpu["floor"] else None,
            # The redactor against the writer of its own run: this ratio does not move with the machine's
            # speed between the two runs, which recording_cpu_ratio does (1 + this, with the writer's own
            # CPU unchanged by redacting).
            **({"redactor_per_writer_cpu": round(measured["cpu_s_per_million_frames"]["redactor"]
                                                 / measured["cpu_s_per_million_frames"]["writer"], 2)}
               if "redactor" in measured["cpu_s_per_million_frames"] else {})}
    print(json.dumps(result, indent=None if args.json else 1))


def run(args: argparse.Namespace, option: list[str]) -> dict:
    """One run of ``record`` between the busy peers, with ``option`` (record's arguments): its figures."""
    steps = args.frames or int(args.rate * args.seconds)
    rotating = "--rotate-mb" in option or "--rotate-every" in option
    logs = Path(tempfile.mkdtemp(prefix="bench-busy-"))
    db = args.db or logs / "busy.db"
    if db.exists():  # --db with an option: the floor's run made it
        db = db.with_name(f"{db.stem}-{option[0].strip('-')}{db.suffix}")
    upstream, listen = free_port(), free_port()
    me = [sys.executable, __file__]
    front = Child([*me, "frontend", str(upstream), str(steps), str(args.rate), str(int(args.finishing))],
                  logs / "frontend.log",
                  name="busy frontend")
    proxy = Child([sys.executable, "-m", "replay_proxy", "record", "--listen", f"tcp://127.0.0.1:{listen}",
                   "--upstream", f"tcp://127.0.0.1:{upstream}", "--db", str(db), "--session", "busy",
                   "--on-full", args.on_full, "--log-format", "json", *option],
                  logs / "proxy.log", name="replay-proxy record")
    children = [front, proxy]
    try:
        proxy.wait_for_log('"event":"listening"', timeout=60)
        children.append(Child([*me, "engine", f"tcp://127.0.0.1:{listen}", str(steps), str(args.rate),
                               str(args.outputs), str(int(args.finishing))], logs / "engine.log", name="busy engine"))
        writer, redactor = (child_pid(proxy.process.pid, f"replay_proxy.recorder.{m}")
                            for m in ("writer_loop", "redactor"))
        # Each process's CPU from here (its start-up done), read last just before it exits: what it takes per
        # frame holds on any machine.
        processes = {"proxy": proxy.process.pid, "writer": writer, "redactor": redactor}
        started_cpu, cpu = read_cpu(processes), {}
        lags_ms, memory_mb, redactor_mb, disk_mb = [], [], [], []
        recorded_bytes: list[tuple[int, int]] = []  # (when, the recording's bytes on disk then)
        deadline = time.monotonic() + steps / args.rate + 600
        while front.running() and time.monotonic() < deadline:
            time.sleep(0.5)
            files = run_files(db)
            disk_mb.append(sum(map(_bytes, db.parent.glob(f"{db.stem}*"))) / 2**20)
            recorded_bytes.append((time.time_ns(), sum(_bytes(f) for f in db.parent.glob(f"{db.stem}*")
                                                      if not f.name.endswith(".reserve"))))
            newest = []  # of the two files written last (a file just begun holds only copies of the start)
            for path in sorted(files, key=lambda f: f.stat().st_mtime)[-2:]:
                try:
                    with contextlib.closing(sqlite3.connect(path, timeout=30)) as connection:
                        newest += connection.execute(  # by the primary key: the measurement must not load the machine
                            "SELECT ts_ns FROM frames ORDER BY session_id DESC, seq DESC LIMIT 1").fetchall()
                except (sqlite3.Error, OSError):  # a full disk leaves no room for a reader's shared memory file
                    pass
            if newest:
                lags_ms.append((time.time_ns() - max(ts for (ts,) in newest)) / 1e6)
            if writer is not None and Path(f"/proc/{writer}").exists():
                memory_mb.append(resident_mb(writer))
            if redactor is not None and Path(f"/proc/{redactor}").exists():
                redactor_mb.append(resident_mb(redactor))
            cpu.update(read_cpu(processes))
        engine = children[-1]
        engine.wait_for_log('"adds_received"', timeout=90)
        peers = {**json.loads(front.log_path.read_text().strip().splitlines()[-1]),
                 **json.loads(engine.log_path.read_text().strip().splitlines()[-1])}
        stop_started = time.monotonic()
        proxy.process.send_signal(signal.SIGINT)
        while proxy.running() and time.monotonic() < stop_started + 60:
            cpu.update(read_cpu(processes))
            time.sleep(0.05)
        code = proxy.process.wait(60)
        stop_s = time.monotonic() - stop_started
        while writer is not None and Path(f"/proc/{writer}").exists() and time.monotonic() < stop_started + 300:
            cpu.update(read_cpu(processes))
            time.sleep(0.05)  # a writer still finishing in the background ends the session itself
        files = run_files(db)
        session, counted, statuses, db_bytes, wal_bytes = {}, {}, set(), 0, 0
        for path in files:  # summed over the files (one, unless rotating)
            with contextlib.closing(finished(path)) as connection:
                row = connection.execute(
                    "SELECT frames_seen, frames_recorded, COALESCE(frames_sampled_out, 0), frames_dropped, "
                    "frames_undecoded, bytes_seen, status FROM sessions").fetchone()
                tables = connection.execute(
                    "SELECT (SELECT COUNT(*) FROM frames), (SELECT COALESCE(SUM(json_array_length(outputs)), 0) FROM "
                    "frame_outputs), (SELECT COUNT(*) FROM "
                    "requests), (SELECT COALESCE(SUM(frames), 0) FROM undecoded)").fetchone()
            for name, value in zip(("seen", "recorded", "sampled_out", "dropped", "undecoded", "bytes"), row):
                session[name] = session.get(name, 0) + (value or 0)
            statuses.add(row[-1])
            for name, value in zip(("frames", "outputs", "requests", "undecoded"), tables):
                counted[name] = counted.get(name, 0) + value
            db_bytes += path.stat().st_size
            wal = path.with_name(path.name + "-wal")
            wal_bytes += wal.stat().st_size if wal.exists() else 0
        session["status"] = statuses.pop() if len(statuses) == 1 else sorted(statuses)
        summary = next((json.loads(line) for line in reversed(proxy.log_lines()) if '"event":"session_end"' in line),
                       {})
    finally:
        for child in reversed(children):
            child.stop(timeout=10)
    # Steps and ADDs, plus HELLO, INIT, READY and the registration.
    result = {"steps": steps, "outputs_per_step": args.outputs, "finishing": args.finishing, "rate": args.rate,
              "peers": peers,
              "expected_frames": 2 * steps + 4, "proxy_exit": code, "stop_s": round(stop_s, 2),
              "session": session, "in_tables": counted, "files": len(files),
              "summary": {k: summary.get(k) for k in ("frames_seen", "frames_recorded", "frames_sampled_out",
                                                      "frames_dropped", "rotations", "rotations_failed",
                                                      "files_deleted")},
              **({"disk_mb_max": round(max(disk_mb), 1)} if rotating and disk_mb else {}),
              **({} if rotating else live_ratio(db, recorded_bytes) or {}),
              **({"parquet_mb": round(parquet_bytes(db) / 2**20, 1)} if args.parquet and not rotating else {}),
              "db_mb": round(db_bytes / 2**20, 1), "wal_mb": round(wal_bytes / 2**20, 1),
              "wire_mb": round(session["bytes"] / 2**20, 1) if session["bytes"] else None,
              "decode_lag_ms_max": round(max(lags_ms), 1) if lags_ms else None,
              "decode_lag_ms_p50": round(sorted(lags_ms)[len(lags_ms) // 2], 1) if lags_ms else None,
              # CPU per million frames that crossed (steps and ADDs), and the cores that is at this rate
              "cpu_s_per_million_frames": {name: round((seconds - started_cpu[name]) / (2 * steps) * 1e6, 1)
                                           for name, seconds in cpu.items()},
              "cores_at_this_rate": {name: round((seconds - started_cpu[name]) / (steps / args.rate), 2)
                                     for name, seconds in cpu.items()},
              "writer_rss_mb_max": round(max(memory_mb), 1) if memory_mb else None,
              **({"redactor_rss_mb_max": round(max(redactor_mb), 1)} if redactor_mb else {})}
    shutil.rmtree(logs, ignore_errors=True)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "frontend":
        frontend(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1")
    elif len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1")
    else:
        main()
