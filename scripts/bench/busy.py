"""A busy engine through ``replay-proxy record``: live decoding, stop time, memory, disk, exact counts.

A minimal frontend and engine (plain pyzmq, each its own process, the real
0.32.0 handshake) talk through ``replay-proxy record``: once ready, the
engine pushes EngineCoreOutputs shaped like a 0.32.0 engine's steps
(``--outputs`` per-request outputs of one token, with scheduler stats) at
``--rate`` frames a second against one clock, and the frontend sends one ADD
per step. While it runs, the newest frame in ``frames`` is compared with the
clock twice a second (how far decoding is behind the wire) and the writer's
resident memory is sampled. Then SIGINT, timed until the proxy exits, and
every count is checked against what the peers sent.

    .venv/bin/python scripts/bench/busy.py [--rate 2000] [--outputs 32] [--seconds 600] [--json]
    .venv/bin/python scripts/bench/busy.py --frames 200000 --outputs 4 --rate 20000   # the suite's soak
    .venv/bin/python scripts/bench/busy.py --seconds 60 --redact-key redaction.key   # record --redact-key

Prints one JSON object (on one line with --json: what the soak test reads). With
``--redact-key``, two runs: the floor (the same, not redacted), then redacting,
and the redacted run's lag and stop time as ratios to the floor's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sqlite3
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
from replay_proxy.wire.schema import load_schema  # noqa: E402

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


def step(k: int, outputs: int) -> bytes:
    stats = {"num_running_reqs": outputs, "num_waiting_reqs": 0, "step_counter": k, "current_wave": 0,
             "kv_cache_usage": 0.25, "prefix_cache_stats": {"reset": False, "requests": 0, "queries": 0, "hits": 0}}
    return encode(struct_value(SCHEMA, "EngineCoreOutputs", {
        "engine_index": 0, "timestamp": 1000.0 + k / 100, "scheduler_stats": stats,
        "outputs": [struct_value(SCHEMA, "EngineCoreOutput", {
            "request_id": request_id(k * outputs + i), "new_token_ids": [100 + (k + i) % 800]})
            for i in range(outputs)]}))


def request_id(n: int) -> str:
    return f"cmpl-{n % REQUEST_IDS:032x}-0"


def paced(rate: float, count: int):
    """0, 1, ... count-1, each at its time on one clock (no drift from sleeping after each)."""
    start = time.perf_counter()
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield i


def frontend(handshake_port: int, steps: int, rate: float) -> None:
    """Bind like vLLM's frontend, answer the handshake, send an ADD per step, count outputs; print JSON."""
    ctx = zmq.Context()
    inputs, outputs, handshake = socket(ctx, zmq.ROUTER), socket(ctx, zmq.PULL), socket(ctx, zmq.ROUTER)
    addresses = {"inputs": [f"tcp://127.0.0.1:{free_port()}"], "outputs": [f"tcp://127.0.0.1:{free_port()}"],
                 "coordinator_input": None, "coordinator_output": None, "frontend_stats_publish_address": None}
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
    received = 0
    for i in paced(rate, steps):
        inputs.send_multipart([IDENTITY, b"\x00", adds[i % REQUEST_IDS]])
        while outputs.poll(0):
            outputs.recv_multipart()
            received += 1
    deadline = time.monotonic() + 60
    while received < steps and time.monotonic() < deadline:
        if outputs.poll(100):
            outputs.recv_multipart()
            received += 1
    print(json.dumps({"adds_sent": steps, "outputs_received": received}), flush=True)
    ctx.destroy()


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


def engine(handshake_address: str, steps: int, rate: float, per_step: int) -> None:
    """Handshake like a headless engine, then push ``steps`` steps at ``rate``, reading the ADDs."""
    inputs, outputs = engine_handshake(zmq.Context(), handshake_address)
    frames = [step(k, per_step) for k in range(DISTINCT_STEPS)]
    # Like a real engine, it sends outputs only of requests it has been sent: it steps once the ADDs of
    # the requests its steps name have come (the frontend's first, about a second of them).
    for _ in range(min(steps, DISTINCT_STEPS * per_step)):
        if not inputs.poll(60_000):
            sys.exit("engine: no ADD from the frontend within 60 s")
        inputs.recv_multipart()
    for i in paced(rate, steps):
        outputs.send(frames[i % DISTINCT_STEPS])
        while inputs.poll(0):
            inputs.recv_multipart()
    time.sleep(30)  # until stopped: an engine that exits would be a lost engine


def child_pid(proxy_pid: int, module: str) -> int | None:
    """The proxy's child process running ``module`` (its writer, its redactor)."""
    children = Path(f"/proc/{proxy_pid}/task/{proxy_pid}/children")
    for pid in children.read_text().split() if children.exists() else []:
        if module in Path(f"/proc/{pid}/cmdline").read_text():
            return int(pid)
    return None


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=2000, help="engine steps (output frames) a second")
    parser.add_argument("--outputs", type=int, default=32, help="per-request outputs in each step")
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--frames", type=int, help="steps in all (instead of --seconds)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--on-full", choices=["drop", "block"], default="drop", help="record's --on-full")
    parser.add_argument("--db", type=Path, help="record into this file and keep it (default: a temporary one)")
    parser.add_argument("--redact-key", type=Path, help="record's --redact-key: redact every frame as it is written")
    args = parser.parse_args()
    if args.redact_key is None:
        result = run(args, None)
    else:  # the floor first: the same run, not redacted
        floor, redacted = run(args, None), run(args, args.redact_key)
        result = {"floor": floor, "redacted": redacted, **{
            f"{figure}_ratio": round(redacted[figure] / floor[figure], 2) if floor[figure] else None
            for figure in ("decode_lag_ms_p50", "decode_lag_ms_max", "stop_s")}}
    print(json.dumps(result, indent=None if args.json else 1))


def run(args: argparse.Namespace, redact_key: Path | None) -> dict:
    """One run of ``record`` between the busy peers (redacting with ``redact_key``): its figures."""
    steps = args.frames or int(args.rate * args.seconds)
    logs = Path(tempfile.mkdtemp(prefix="bench-busy-"))
    db = args.db or logs / "busy.db"
    if db.exists():  # --db with --redact-key: the floor's run made it
        db = db.with_name(f"{db.stem}-redacted{db.suffix}")
    upstream, listen = free_port(), free_port()
    me = [sys.executable, __file__]
    front = Child([*me, "frontend", str(upstream), str(steps), str(args.rate)], logs / "frontend.log",
                  name="busy frontend")
    proxy = Child([sys.executable, "-m", "replay_proxy", "record", "--listen", f"tcp://127.0.0.1:{listen}",
                   "--upstream", f"tcp://127.0.0.1:{upstream}", "--db", str(db), "--session", "busy",
                   "--on-full", args.on_full,
                   *(["--redact-key", str(redact_key), "--vocab-size", str(VOCAB)] if redact_key else [])],
                  logs / "proxy.log", name="replay-proxy record")
    children = [front, proxy]
    try:
        proxy.wait_for_log("listening on", timeout=60)
        children.append(Child([*me, "engine", f"tcp://127.0.0.1:{listen}", str(steps), str(args.rate),
                               str(args.outputs)], logs / "engine.log", name="busy engine"))
        writer, redactor = (child_pid(proxy.process.pid, f"replay_proxy.store.{m}") for m in ("writer", "redactor"))
        lags_ms, memory_mb, redactor_mb = [], [], []
        connection = sqlite3.connect(db, timeout=30)
        deadline = time.monotonic() + steps / args.rate + 600
        while front.running() and time.monotonic() < deadline:
            time.sleep(0.5)
            newest = connection.execute(  # by the primary key: the measurement must not load the machine
                "SELECT ts_ns FROM frames WHERE session_id = 1 ORDER BY seq DESC LIMIT 1").fetchone()
            if newest is not None:
                lags_ms.append((time.time_ns() - newest[0]) / 1e6)
            if writer is not None and Path(f"/proc/{writer}").exists():
                memory_mb.append(resident_mb(writer))
            if redactor is not None and Path(f"/proc/{redactor}").exists():
                redactor_mb.append(resident_mb(redactor))
        peers = json.loads(front.log_path.read_text().strip().splitlines()[-1])
        stop_started = time.monotonic()
        proxy.process.send_signal(signal.SIGINT)
        code = proxy.process.wait(60)
        stop_s = time.monotonic() - stop_started
        while writer is not None and Path(f"/proc/{writer}").exists() and time.monotonic() < stop_started + 300:
            time.sleep(0.2)  # a writer still finishing in the background ends the session itself
        session = dict(zip(("seen", "recorded", "dropped", "undecoded", "status", "bytes"), connection.execute(
            "SELECT frames_seen, frames_recorded, frames_dropped, frames_undecoded, status, bytes_seen "
            "FROM sessions").fetchone()))
        counted = dict(zip(("frames", "outputs", "requests", "undecoded"), connection.execute(
            "SELECT (SELECT COUNT(*) FROM frames), (SELECT COUNT(*) FROM output_rows), (SELECT COUNT(*) FROM requests), "
            "(SELECT COALESCE(SUM(frames), 0) FROM undecoded)").fetchone()))
        connection.close()
        db_bytes = db.stat().st_size
        wal = db.with_name(db.name + "-wal")
        wal_bytes = wal.stat().st_size if wal.exists() else 0
    finally:
        for child in reversed(children):
            child.stop(timeout=10)
    # Steps and ADDs, plus HELLO, INIT, READY and the registration.
    result = {"steps": steps, "outputs_per_step": args.outputs, "rate": args.rate, "peers": peers,
              "expected_frames": 2 * steps + 4, "proxy_exit": code, "stop_s": round(stop_s, 2),
              "session": session, "in_tables": counted, "db_mb": round(db_bytes / 2**20, 1), "wal_mb": round(wal_bytes / 2**20, 1),
              "wire_mb": round(session["bytes"] / 2**20, 1) if session["bytes"] else None,
              "decode_lag_ms_max": round(max(lags_ms), 1) if lags_ms else None,
              "decode_lag_ms_p50": round(sorted(lags_ms)[len(lags_ms) // 2], 1) if lags_ms else None,
              "writer_rss_mb_max": round(max(memory_mb), 1) if memory_mb else None,
              **({"redactor_rss_mb_max": round(max(redactor_mb), 1)} if redactor_mb else {})}
    shutil.rmtree(logs, ignore_errors=True)
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "frontend":
        frontend(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "engine":
        engine(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
