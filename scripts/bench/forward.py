"""Forwarding cost of the proxy, side by side in one run.

Ten ways between the same frontend and engine peers (each peer in its own
process, plain pyzmq, the real handshake): direct; libzmq's own C forwarder
(``zmq.proxy``, the floor: the extra process hop alone); the same with every
message also copied out of the forwarding path and drained by C, or by a
Python thread, and nothing more (the floors of getting frames out); the same
with the copies recorded live by the minimal pipeline (``floor.py``) in a
process of its own, idle and busy (the floors of any recorder that decodes
as traffic flows); replay-proxy relaying without recording; replay-proxy
recording to SQLite; the same with ``--metrics`` and a scraper reading
``/metrics`` every ``--scrape-every`` seconds, as Prometheus would (its cost
is printed against recording without it); and recording while the engine
also pushes ``--busy-rate`` busy steps a second (32 outputs each), so the
writer decodes at full load while round trips are timed. For each:
round-trip latency (frontend ROUTER -> engine DEALER, engine PUSH ->
frontend PULL) p50/p99, pipelined throughput, and a paced run at a fixed
rate of 600-byte outputs whose dropped frames are counted. For the
recording cases and their floor recorders, also the CPU seconds per million
frames of the forwarding process and of the recording one (read from /proc,
start-up left out): the ratio that holds on any machine, whatever the
latency on one whose cores the peers share.

    .venv/bin/python scripts/bench/forward.py [--round-trips 5000] [--rate 10000] [--rounds 3]
        [--busy-rate 2000] [--scrape-every 1] [--skip direct] [--skip drain] [--skip recorder] [--skip relay]
        [--skip scraped] [--skip busy]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.processes import Child, free_port  # noqa: E402
from replay_proxy.wire.encode import encode, struct_value  # noqa: E402
from replay_proxy.wire.handshake import engine_identity  # noqa: E402
from replay_proxy.wire.registry import load_schema  # noqa: E402
from scripts.bench.busy import child_pid, engine_handshake, read_cpu, step as busy_step  # noqa: E402
from scripts.bench.floor import MinimalPipeline  # noqa: E402

IDENTITY = engine_identity(0)
BUSY = "recording, writer busy"  # replay-proxy recording while a busy engine's steps keep its writer decoding
SCRAPED = "recording, scraped"  # replay-proxy recording with --metrics, read by a scraper as Prometheus would
FLOOR_RECORDER, FLOOR_RECORDER_BUSY = "zmq.proxy + minimal recorder", "zmq.proxy + minimal recorder, busy"
# The C forwarder alone, and with each message also copied out and drained or recorded (see c_forwarder).
FLOORS = {"zmq.proxy (C)": "", "zmq.proxy + C drain": "c", "zmq.proxy + Python drain": "python",
          FLOOR_RECORDER: "record", FLOOR_RECORDER_BUSY: "record"}
# What each recording case is held to besides zmq.proxy: the floor recorder under the same load.
RECORDER_FLOORS = {"replay-proxy recording": FLOOR_RECORDER, BUSY: FLOOR_RECORDER_BUSY}
BUSY_CASES = {BUSY, FLOOR_RECORDER_BUSY}
SCHEMA = load_schema("0.32.0")
REQUEST = [b"\x00", encode(struct_value(SCHEMA, "EngineCoreRequest", {
    "request_id": "bench-0000", "prompt_token_ids": list(range(40)), "mm_features": None,
    "sampling_params": {"temperature": 0.0, "max_tokens": 16}, "pooling_params": None, "arrival_time": 1.0,
    "lora_request": None, "cache_salt": None, "data_parallel_rank": None}))]
OUTPUT = [encode(struct_value(SCHEMA, "EngineCoreOutputs", {
    "timestamp": 1.0, "outputs": [{"request_id": "bench-0000", "new_token_ids": list(range(200, 390))}]}))]


def socket(ctx: zmq.Context, kind: int, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    return sock


def frontend(ports: str, init_inputs: str | None, init_outputs: str | None, round_trips: int,
             pipelined: int, rate: int, rate_seconds: float) -> None:
    """Bind like vLLM's frontend, answer the handshake, then measure; print JSON.

    ``ports``: handshake,inputs,outputs. ``init_*``: addresses to hand the
    engine instead of our own (the C forwarder's).
    """
    handshake_port, input_port, output_port = ports.split(",")
    ctx = zmq.Context()
    inputs, outputs, handshake = socket(ctx, zmq.ROUTER), socket(ctx, zmq.PULL), socket(ctx, zmq.ROUTER)
    inputs.bind(f"tcp://127.0.0.1:{input_port}")
    outputs.bind(f"tcp://127.0.0.1:{output_port}")
    handshake.bind(f"tcp://127.0.0.1:{handshake_port}")
    addresses = {"inputs": [init_inputs or f"tcp://127.0.0.1:{input_port}"],
                 "outputs": [init_outputs or f"tcp://127.0.0.1:{output_port}"],
                 "coordinator_input": None, "coordinator_output": None, "frontend_stats_publish_address": None}
    identity, _hello = handshake.recv_multipart()
    handshake.send_multipart([identity, encode({"addresses": addresses, "parallel_config": {}})])
    inputs.recv_multipart()  # registration
    handshake.recv_multipart()  # READY
    send = lambda: inputs.send_multipart([IDENTITY, *REQUEST])  # noqa: E731

    def reply() -> None:  # the answer to a request; a busy engine's other steps are passed over
        while outputs.recv_multipart() != OUTPUT:
            pass

    for _ in range(500):  # warm-up
        send()
        reply()
    rtts = []
    for _ in range(round_trips):
        t0 = time.perf_counter_ns()
        send()
        reply()
        rtts.append((time.perf_counter_ns() - t0) / 1000)
    window = 64
    t0 = time.perf_counter()
    for _ in range(window):
        send()
    for i in range(pipelined):
        reply()
        if i + window < pipelined:
            send()
    throughput = pipelined / (time.perf_counter() - t0)
    sent = received = 0
    total = int(rate * rate_seconds)
    start = time.perf_counter()
    while sent < total:  # paced against one clock: no drift from sleeping after each send
        due = start + sent / rate
        while received < sent and outputs.poll(0):
            received += outputs.recv_multipart() == OUTPUT
        if time.perf_counter() >= due:
            send()
            sent += 1
    deadline = time.monotonic() + 10
    while received < sent and time.monotonic() < deadline:
        if outputs.poll(100):
            received += outputs.recv_multipart() == OUTPUT
    rtts.sort()
    print(json.dumps({"p50_us": statistics.median(rtts), "p99_us": rtts[int(len(rtts) * 0.99)],
                      "throughput": throughput, "paced_sent": sent, "paced_received": received}))
    ctx.destroy()


def engine(handshake_address: str, busy_rate: float = 0) -> None:
    """Handshake like a headless engine, then answer every request with one 600-byte output; with
    ``busy_rate``, also push that many busy engine steps a second (32 outputs each, ``busy.py``'s)."""
    inputs, outputs = engine_handshake(zmq.Context(), handshake_address)
    steps = [busy_step(k, 32) for k in range(64)] if busy_rate else []
    start, sent = time.perf_counter(), 0
    while True:
        if not steps:
            inputs.recv_multipart()
            outputs.send_multipart(OUTPUT)
            continue
        due = start + sent / busy_rate
        if inputs.poll(max(0, int((due - time.perf_counter()) * 1000))):
            inputs.recv_multipart()
            outputs.send_multipart(OUTPUT)
        if time.perf_counter() >= due:
            outputs.send(steps[sent % len(steps)])
            sent += 1


def c_forwarder(frontend_inputs: str, frontend_outputs: str, port_in: int, port_out: int, drain: str,
                recorder: str) -> None:
    """libzmq's zmq.proxy for both directions (DEALER<->DEALER for inputs, PULL->PUSH for outputs).

    ``drain`` "c" or "python": each proxy also copies every message to a capture socket, emptied by
    a C loop that discards (into a PUB nobody subscribes to) or by a Python thread that only receives.
    These are floors for any recorder: getting each frame out of the forwarding path, and no more.
    ``drain`` "record": the copies go to ``recorder``, the minimal recorder's process (see floor_recorder).
    """
    ctx = zmq.Context()
    captures = [None, None]
    if drain == "record":
        captures = [socket(ctx, zmq.PUSH), socket(ctx, zmq.PUSH)]
        for capture in captures:
            capture.connect(recorder)
    elif drain:
        sink = socket(ctx, zmq.PULL)
        sink.bind("inproc://capture")
        captures = [socket(ctx, zmq.PUSH), socket(ctx, zmq.PUSH)]
        for capture in captures:
            capture.connect("inproc://capture")
        if drain == "c":
            threading.Thread(target=zmq.proxy, args=(sink, socket(ctx, zmq.PUB)), daemon=True).start()
        else:
            threading.Thread(target=lambda: [sink.recv_multipart(copy=False) for _ in iter(int, 1)],
                             daemon=True).start()
    up_in, down_in = socket(ctx, zmq.DEALER, IDENTITY), socket(ctx, zmq.DEALER)
    up_in.connect(frontend_inputs)
    down_in.bind(f"tcp://127.0.0.1:{port_in}")
    down_out, up_out = socket(ctx, zmq.PULL), socket(ctx, zmq.PUSH)
    down_out.bind(f"tcp://127.0.0.1:{port_out}")
    up_out.connect(frontend_outputs)
    threading.Thread(target=zmq.proxy, args=(down_out, up_out, captures[0]), daemon=True).start()
    zmq.proxy(up_in, down_in, captures[1])


def floor_recorder(address: str, db: str) -> None:
    """The floor of a recorder that decodes live, in its own process as replay-proxy's writer is: take
    what the copies socket holds, at least every 50 ms, and write it with the minimal pipeline (every
    frame's bytes, every output row)."""
    sink = socket(zmq.Context(), zmq.PULL)
    sink.bind(address)
    pipeline = MinimalPipeline(Path(db), frames=True)
    seq = 0
    while True:
        sink.poll(50)
        messages = []
        while len(messages) < 2000:
            try:
                parts = sink.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            seq += 1
            messages.append((seq, parts))
        if messages:
            pipeline.write(messages)


def relay(listen: str, upstream: str) -> None:
    """replay-proxy's relay with an observer that does nothing: the cost of relaying alone."""
    import trio

    from replay_proxy.net.relay import Relay

    class Nothing:
        capture, capture_hwm = None, 0

        def frame(self, frame) -> None:
            pass

        def engine_lost(self, loss) -> None:
            pass

        def relay_stopped(self, last_seq) -> None:
            pass

    trio.run(Relay(listen, upstream, Nothing()).run)


def run_case(name: str, logs: Path, args: argparse.Namespace) -> dict:
    me = [sys.executable, __file__]
    ports = [free_port() for _ in range(3)]  # the frontend's handshake, inputs, outputs
    upstream = f"tcp://127.0.0.1:{ports[0]}"
    children: list[Child] = []
    init_inputs = init_outputs = ""
    dial = upstream
    db = logs / (re.sub(r"\W+", "-", name) + ".db")  # each case its own: a floor's file is no recording
    scraping = threading.Event()  # set: the scraper stops
    try:
        if name.startswith("zmq.proxy"):
            port_in, port_out = free_port(), free_port()
            init_inputs, init_outputs = f"tcp://127.0.0.1:{port_in}", f"tcp://127.0.0.1:{port_out}"
            recorder = f"tcp://127.0.0.1:{free_port()}"
            if FLOORS[name] == "record":
                db.unlink(missing_ok=True)
                children.append(Child([*me, "floor-recorder", recorder, str(db)], logs / "floor-recorder.log",
                                      name="floor recorder"))
            children.append(Child([*me, "c-forwarder", f"tcp://127.0.0.1:{ports[1]}", f"tcp://127.0.0.1:{ports[2]}",
                                   str(port_in), str(port_out), FLOORS[name], recorder], logs / "c-forwarder.log",
                                  name=name))
        elif name != "direct":
            dial = f"tcp://127.0.0.1:{free_port()}"
            if name == "replay-proxy relay":
                argv = [*me, "relay", dial, upstream]
            else:
                argv = [sys.executable, "-m", "replay_proxy", "record", "--listen", dial, "--upstream", upstream,
                        "--db", str(db), "--session", "bench"]
                if name == SCRAPED:
                    metrics = f"127.0.0.1:{free_port()}"
                    argv += ["--metrics", metrics]
                    scraper = threading.Thread(target=scrape, args=(f"http://{metrics}/metrics", args.scrape_every,
                                                                     scraping), daemon=True)
            children.append(Child(argv, logs / f"{name}.log", name=name))
            if name != "replay-proxy relay":
                children[-1].wait_for_log("listening on", timeout=60)  # its writer started
            if name == SCRAPED:
                scraper.start()
        front = subprocess.Popen([*me, "frontend", ",".join(map(str, ports)), init_inputs, init_outputs,
                                  str(args.round_trips), str(args.pipelined), str(args.rate), str(args.rate_seconds)],
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
        # The forwarding and the recording process of the cases held to each other on CPU per frame.
        if name in RECORDER_FLOORS:
            measured = {"forwarding": children[-1].process.pid,
                        "recording": child_pid(children[-1].process.pid, "replay_proxy.recorder.writer_loop")}
        elif name in RECORDER_FLOORS.values():
            measured = {"forwarding": children[-1].process.pid, "recording": children[0].process.pid}
        else:
            measured = {}
        started_cpu = settled_cpu(measured)
        busy = str(args.busy_rate) if name in BUSY_CASES else "0"
        engine_peer = Child([*me, "engine", dial, busy], logs / f"engine-{name}.log", name="engine")
        children.append(engine_peer)
        try:
            out, _ = front.communicate(timeout=180)
        finally:
            if front.poll() is None:
                front.kill()
        result = json.loads(out)
        engine_peer.stop(timeout=20)  # no more frames: the recorder writes out what it holds, then idles
        cpu = {k: v - started_cpu[k] for k, v in settled_cpu(measured).items() if k in started_cpu}
        if measured and cpu.keys() != measured.keys():
            print(f"  {name}: no CPU figure for {sorted(measured.keys() - cpu.keys())} (process not found or gone)",
                  file=sys.stderr)
    finally:
        scraping.set()
        for child in reversed(children):
            child.stop(timeout=180)  # the recording proxy first writes out its queue
    if name in ("replay-proxy recording", SCRAPED, BUSY):
        row = sqlite3_row(db)
        result["dropped"] = row["frames_dropped"]
        result["recorded"] = row["frames_recorded"]
    if cpu:
        frames = result["recorded"] if "recorded" in result else floor_frames(db)
        result |= {f"{k}_cpu_s_per_million_frames": seconds / frames * 1e6 for k, seconds in cpu.items()}
    return result


def settled_cpu(processes: dict[str, int | None], timeout_s: float = 60) -> dict[str, float]:
    """The CPU seconds of each process once all of them are idle (start-up done, queues written out): less
    than 10 ms of CPU between two reads 0.3 s apart, or what they have at ``timeout_s``."""
    last, deadline = read_cpu(processes), time.monotonic() + timeout_s
    while processes and time.monotonic() < deadline:
        time.sleep(0.3)
        now = read_cpu(processes)
        if sum(now.values()) - sum(last.values()) < 0.01:
            return now
        last = now
    return last


def floor_frames(db: Path) -> int:
    """The frames the floor recorder wrote: every one the C forwarder passed on."""
    import sqlite3

    connection = sqlite3.connect(db)
    count = connection.execute("SELECT COUNT(*) FROM frames").fetchone()[0]
    connection.close()
    return count


def scrape(url: str, every_s: float, stop: threading.Event) -> None:
    """Read ``url`` every ``every_s`` seconds until ``stop``: what a Prometheus server does."""
    while not stop.wait(every_s):
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                reply.read()
        except OSError:
            if not stop.is_set():  # (else the proxy was stopped while this scrape was on its way)
                raise


def sqlite3_row(db: Path) -> dict:
    import sqlite3

    connection = sqlite3.connect(db)
    connection.row_factory = sqlite3.Row
    row = dict(connection.execute("SELECT * FROM sessions ORDER BY id DESC LIMIT 1").fetchone())
    connection.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round-trips", type=int, default=5000)
    parser.add_argument("--pipelined", type=int, default=20000)
    parser.add_argument("--rate", type=int, default=10000, help="messages/s in the paced run")
    parser.add_argument("--rate-seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--busy-rate", type=float, default=2000,
                        help="busy engine steps a second (32 outputs each) in the last case, for the writer to decode")
    parser.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes of /metrics")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["direct", "drain", "recorder", "relay", "scraped", "busy"],
                        help="leave a case out (the C floor and the recording proxy always run)")
    args = parser.parse_args()
    cases = [name for name in ["direct", *FLOORS, "replay-proxy relay", "replay-proxy recording", SCRAPED, BUSY]
             if name.split()[-1] not in args.skip]
    runs: dict[str, list[dict]] = {name: [] for name in cases}
    # (its recordings take a gigabyte or more a run: removed at the end, as every run leaves them behind)
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as scratch:
        for round_ in range(args.rounds):  # interleaved, so drift in the machine's load hits every case alike
            for name in cases:
                runs[name].append(run_case(name, Path(scratch), args))
                print(f"  round {round_ + 1}: measured {name}", file=sys.stderr)
    # A figure a round could not take (a process gone before its CPU was read) is left out of that one median.
    results = {name: {k: statistics.median(r[k] for r in rs if k in r) for k in {k for r in rs for k in r}}
               for name, rs in runs.items()}
    floor = results["zmq.proxy (C)"]
    print(f"\nmedians of {args.rounds} rounds; {args.round_trips} round trips, {args.pipelined} pipelined, "
          f"{args.rate} msg/s for {args.rate_seconds:g} s paced; ratios to zmq.proxy (C)")
    print(f"\n{'case':<24} {'p50 us':>8} {'p99 us':>8} {'msg/s':>9} {'p50/C':>6} {'p99/C':>6} {'tput/C':>6}  paced")
    for name, r in results.items():
        paced = f"{r['paced_received']:.0f}/{r['paced_sent']:.0f}"
        if "dropped" in r:
            paced += f", {r['dropped']:.0f} dropped, {r['recorded']:.0f} recorded"
        print(f"{name:<24} {r['p50_us']:>8.0f} {r['p99_us']:>8.0f} {r['throughput']:>9.0f} "
              f"{r['p50_us'] / floor['p50_us']:>6.2f} {r['p99_us'] / floor['p99_us']:>6.2f} "
              f"{r['throughput'] / floor['throughput']:>6.2f}  {paced}")
    print("\nrecording beside the minimal recorder under the same load, and scraped beside not "
          "(p50, p99, throughput ratios; for the recorders, CPU seconds per million frames of forwarding and "
          "of recording, and their ratios):")
    for name, floor_name in [*RECORDER_FLOORS.items(), (SCRAPED, "replay-proxy recording")]:
        if name in results and floor_name in results:
            r, f = results[name], results[floor_name]
            cpu = "".join(f"  {k} {r[c]:.0f} s vs {f[c]:.0f} s ({r[c] / f[c]:.2f})"
                          for k in ("forwarding", "recording") for c in [f"{k}_cpu_s_per_million_frames"]
                          if c in f and c in r)
            print(f"{name:<24} {r['p50_us'] / f['p50_us']:>6.2f} {r['p99_us'] / f['p99_us']:>6.2f} "
                  f"{r['throughput'] / f['throughput']:>6.2f}{cpu}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("frontend", "engine", "c-forwarder", "floor-recorder", "relay"):
        role, rest = sys.argv[1], sys.argv[2:]
        if role == "frontend":
            ports, ins, outs, n, p, rate, seconds = rest
            frontend(ports, ins or None, outs or None, int(n), int(p), int(rate), float(seconds))
        elif role == "engine":
            engine(rest[0], float(rest[1]))
        elif role == "relay":
            relay(*rest)
        elif role == "floor-recorder":
            floor_recorder(*rest)
        else:
            c_forwarder(rest[0], rest[1], int(rest[2]), int(rest[3]), rest[4], rest[5])
    else:
        main()
