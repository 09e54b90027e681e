"""How often a replay against an identical engine reports a performance regression, and what it finds at +10%.

One recording of a paced sim workload (sim engine steps of 20 ms with a
seeded spread, as in tests/replay/test_performance_replay_sim.py), then
``--repeats`` replays (each ``replay-proxy replay`` in a process of its own), each against a sim engine
with the recorded step time,
with ``--noise-runs`` runs of the same interleaved (``replay --noise-runs``:
baseline, candidate, candidate, baseline). Each repeat counts as a false
alarm if its exit code is not 0. ``--beside`` runs two replays at a time on
the same cores, as a shared CI runner would. Then, alone, the same with the engine's
steps 10% longer, where a regression whose interval holds 10% is the answer.

    .venv/bin/python scripts/bench/false_alarms.py [--repeats 40] [--requests 100] [--noise-runs 2] [--beside]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.processes import free_port  # noqa: E402
from tests.replay import paced  # noqa: E402


def replay(recorded: Path, folder: Path, fraction: float, noise_runs: int) -> tuple[dict, int, bool]:
    """One replay, as ``replay-proxy replay`` in a process of its own (so that a replay beside it is another
    process to it, as a neighbour on a CI runner is): its performance findings by field, its exit code, and
    whether its timing went unjudged for a busy machine."""
    listen = f"tcp://127.0.0.1:{free_port()}"
    subprocess.run([sys.executable, "-m", "replay_proxy", "replay", "--db", str(recorded), "--session", "paced",
                    "--against", "engine", "--listen", listen, "--pace", "original", "--ready-timeout", "30",
                    "--finish-timeout", "30", "--report-dir", str(folder), "--quiet",
                    "--engine-cmd", shlex.join(paced.engine_argv(listen, fraction)),
                    "--noise-runs", str(noise_runs), "--baseline-cmd", shlex.join(paced.engine_argv(listen))],
                   capture_output=True, timeout=1800)
    report = json.loads((folder / "report.json").read_text())
    timing = {f["field"]: f for f in report["findings"] if f["category"] == "performance"}
    untimed = any(f["code"] == "timing_not_judged" and "other processes" in f["message"] for f in timing.values())
    return timing, report["exit_code"], untimed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--noise-runs", type=int, default=2)
    parser.add_argument("--beside", action="store_true", help="two replays at a time on the same cores")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-false-alarms-"))
    recorded = paced.record_paced(folder, args.requests)
    alarms = untimed = 0
    with concurrent.futures.ThreadPoolExecutor(2 if args.beside else 1) as pool:
        runs = [pool.submit(replay, recorded, Path(tempfile.mkdtemp(dir=folder)), 0.0, args.noise_runs)
                for _ in range(args.repeats)]
        for k, run in enumerate(runs):
            found, code, busy = run.result()
            regressed = sorted(field for field, f in found.items() if f["severity"] == "regression")
            alarms += code != 0
            untimed += busy
            print(f"repeat {k + 1}: exit {code}" + (f", regression in {', '.join(regressed)}" if regressed else "")
                  + (", timing not judged (a busy machine)" if busy else ""), flush=True)
    print(f"\nidentical engines: a non-zero exit in {alarms} of {args.repeats} repeats ({args.requests} requests "
          f"each, --noise-runs {args.noise_runs}{', two at a time' if args.beside else ''}); timing not judged "
          f"in {untimed} (other processes took more than max_other_cpu of a run)")
    slow, _, _ = replay(recorded, Path(tempfile.mkdtemp(dir=folder)), 0.10, args.noise_runs)  # alone
    for field in ("itl_ms.p50", "itl_ms.p90", "e2e_ms.p50", "ttft_ms.p50"):
        print(f"steps +10% (alone): {slow[field]['message'] if field in slow else 'not judged'}")


if __name__ == "__main__":
    main()
