"""How often a replay against an identical engine reports a performance regression, and what it finds at +10%.

One recording of a paced sim workload (sim engine steps of 20 ms with a
seeded spread, as in tests/replay/test_performance_replay_sim.py), then
``--repeats`` replays, each against a sim engine with the recorded step time,
with ``--noise-runs`` runs of the same interleaved (``replay --noise-runs``:
baseline, candidate, candidate, baseline). Each repeat counts as a false
alarm if its exit code is not 0. ``--beside`` runs two replays at a time on
the same cores, as a shared CI runner would. Then the same with the engine's
steps 10% longer, where a regression whose interval holds 10% is the answer.

    .venv/bin/python scripts/bench/false_alarms.py [--repeats 40] [--requests 100] [--noise-runs 2] [--beside]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.compare.findings import Severity, exit_code  # noqa: E402
from replay_proxy.processes import free_port  # noqa: E402
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions  # noqa: E402
from replay_proxy.replay.run import replay_session  # noqa: E402
from replay_proxy.wire.messages import Side  # noqa: E402
from tests.replay import test_performance_replay_sim as paced  # noqa: E402


def replay(recorded: Path, folder: Path, fraction: float, noise_runs: int) -> tuple[dict, int]:
    """One replay: its performance findings by field, and its exit code."""
    db = folder / "replay.db"
    shutil.copy(recorded, db)
    listen = f"tcp://127.0.0.1:{free_port()}"
    peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=shlex.join(paced.engine_argv(listen, fraction)))
    options = ReplayOptions(pace="original", ready_timeout_s=30, finish_timeout_s=30, report_dir=folder,
                            noise_runs=noise_runs, baseline_command=shlex.join(paced.engine_argv(listen)))
    report, _ = replay_session(db, "paced", peer, options)
    return {f.field: f for f in report.findings if f.category == "performance"}, int(exit_code(report.findings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--noise-runs", type=int, default=2)
    parser.add_argument("--beside", action="store_true", help="two replays at a time on the same cores")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-false-alarms-"))
    recorded = paced.record_paced(folder, args.requests)
    alarms = 0
    with concurrent.futures.ThreadPoolExecutor(2 if args.beside else 1) as pool:
        runs = [pool.submit(replay, recorded, Path(tempfile.mkdtemp(dir=folder)), 0.0, args.noise_runs)
                for _ in range(args.repeats)]
        for k, run in enumerate(runs):
            found, code = run.result()
            regressed = sorted(f.field for f in found.values() if f.severity is Severity.REGRESSION)
            alarms += code != 0
            print(f"repeat {k + 1}: exit {code}" + (f", regression in {', '.join(regressed)}" if regressed else ""),
                  flush=True)
    slow, _ = replay(recorded, Path(tempfile.mkdtemp(dir=folder)), 0.10, args.noise_runs)
    print(f"\nidentical engines: a non-zero exit in {alarms} of {args.repeats} repeats ({args.requests} requests "
          f"each, --noise-runs {args.noise_runs}{', two at a time' if args.beside else ''})")
    for field in ("itl_ms.p50", "itl_ms.p90", "e2e_ms.p50", "ttft_ms.p50"):
        print(f"steps +10%: {slow[field].message}")


if __name__ == "__main__":
    main()
