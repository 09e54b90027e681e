"""How often a replay against an identical engine reports a performance regression, and what it finds at +10%.

One recording of a paced sim workload (sim engine steps of 20 ms with a
seeded spread, as in tests/replay/test_performance_replay_sim.py), then
``--repeats`` replays, each against a sim engine with the recorded step time,
after one noise run against the same (the noise run is the timing baseline,
as ``replay --noise-runs`` makes it). Each repeat counts as a false alarm if
any performance finding is a regression. Then the same with the engine's
steps 10% longer, where a regression whose interval holds 10% is the answer.

    .venv/bin/python scripts/bench/false_alarms.py [--repeats 40] [--requests 100]
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.compare.findings import Severity  # noqa: E402
from replay_proxy.processes import free_port  # noqa: E402
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions  # noqa: E402
from replay_proxy.replay.run import replay_session  # noqa: E402
from replay_proxy.wire.messages import Side  # noqa: E402
from tests.replay import test_performance_replay_sim as paced  # noqa: E402


def replay(recorded: Path, folder: Path, fraction: float) -> dict:
    db = folder / "replay.db"
    shutil.copy(recorded, db)
    listen = f"tcp://127.0.0.1:{free_port()}"
    peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=shlex.join(paced.engine_argv(listen, fraction)))
    options = ReplayOptions(pace="original", ready_timeout_s=30, finish_timeout_s=30, report_dir=folder,
                            noise_runs=1, baseline_command=shlex.join(paced.engine_argv(listen)))
    report, _ = replay_session(db, "paced", peer, options)
    return {f.field: f for f in report.findings if f.category == "performance"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-false-alarms-"))
    recorded = paced.record_paced(folder, args.requests)
    alarms = []
    for k in range(args.repeats):
        found = replay(recorded, Path(tempfile.mkdtemp(dir=folder)), 0.0)
        regressed = sorted(f.field for f in found.values() if f.severity is Severity.REGRESSION)
        alarms.append(regressed)
        print(f"repeat {k + 1}: {'regression in ' + ', '.join(regressed) if regressed else 'no regression'}",
              flush=True)
    slow = replay(recorded, Path(tempfile.mkdtemp(dir=folder)), 0.10)
    print(f"\nidentical engines: a regression in {sum(bool(a) for a in alarms)} of {args.repeats} repeats "
          f"({args.requests} requests each)")
    for field in ("itl_ms.p50", "itl_ms.p90", "e2e_ms.p50", "ttft_ms.p50"):
        print(f"steps +10%: {slow[field].message}")


if __name__ == "__main__":
    main()
