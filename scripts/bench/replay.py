"""How fast and how faithfully `replay --against engine` sends, against the sim engine.

Records a sim session of N requests arriving at a steady rate (sim peers
in-process, through the recording relay), then replays it twice against a
sim engine process: `--pace fast` (requests issued per second, from first
send to last) and `--pace original` (how late each send went out against
its recorded schedule, p50/p99). Targets (issue 4): >= 5,000 requests/s;
pacing error p99 <= 2 ms.

    .venv/bin/python scripts/bench/replay.py [--requests 5000] [--rate 500]
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.net.relay import Relay  # noqa: E402
from replay_proxy.processes import Child, free_port  # noqa: E402
from replay_proxy.replay.play_frontend import FrontendPlayer  # noqa: E402
from replay_proxy.replay.player import ReplayOptions  # noqa: E402
from replay_proxy.sim.engine import SimEngine  # noqa: E402
from replay_proxy.sim.frontend import SimFrontend  # noqa: E402
from replay_proxy.recorder import OnFull, Recorder, SessionInfo  # noqa: E402
from replay_proxy.store.session import load_session  # noqa: E402


async def record(db: Path, requests: int, rate: float) -> None:
    recorder = Recorder(db, SessionInfo(name="bench"), on_full=OnFull.BLOCK)
    async with trio.open_nursery() as nursery:
        frontend = SimFrontend()
        upstream = await nursery.start(frontend.run)
        relay = Relay("tcp://127.0.0.1:0", upstream, recorder)
        nursery.start_soon(relay.run)
        await relay.listening.wait()
        nursery.start_soon(SimEngine(relay.listen, step_s=0.001).run)
        await frontend.ready.wait()
        start = trio.current_time()
        for k in range(requests):
            await trio.sleep_until(start + k / rate)
            await frontend.add(f"b{k}", [k % 50, 7], max_tokens=2, temperature=0.0)
        await frontend.wait_for(lambda: len(frontend.finish_reasons) == requests)
        nursery.cancel_scope.cancel()
    recorder.close()


class Nothing:
    def frame(self, event) -> None:
        pass

    def engine_lost(self, loss) -> None:
        pass


def replay(db: Path, pace: str, logs: Path):
    """The replay loop alone (no recording of the replay): what the issue's targets are about."""
    port = free_port()
    listen = f"tcp://127.0.0.1:{port}"
    engine = Child([sys.executable, "-m", "replay_proxy", "sim", "engine", "--handshake", listen],
                   logs / f"engine-{pace}.log")
    try:
        player = FrontendPlayer(load_session(db, "bench"), listen, Nothing(),
                                ReplayOptions(pace=pace, ready_timeout_s=30, finish_timeout_s=60))
        return trio.run(player.run)
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=500.0, help="recorded arrival rate, requests/s")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    db = logs / "bench.db"
    trio.run(record, db, args.requests, args.rate)
    fast = replay(db, "fast", logs)
    paced = replay(db, "original", logs)
    errors = sorted(paced.pacing_errors_ms)
    rate = fast.sent / fast.send_seconds
    print(f"fast:     {fast.sent} requests in {fast.send_seconds:.3f} s = {rate:,.0f} requests/s "
          f"(target >= 5,000: {'met' if rate >= 5000 else 'MISSED'}); {fast.finished} finished")
    p50, p99 = statistics.median(errors), errors[int(len(errors) * 0.99)]
    print(f"original: pacing error p50 {p50:.3f} ms, p99 {p99:.3f} ms, max {errors[-1]:.3f} ms "
          f"(target p99 <= 2 ms: {'met' if p99 <= 2 else 'MISSED'}); {paced.finished} finished")


if __name__ == "__main__":
    main()
