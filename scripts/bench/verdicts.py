"""How often each verdict tier finds a real regression, and how often one flags an identical build.

The session is recordings/vllm-0.32.0-bench-serve.db: a real client's traffic
(``vllm bench serve``, 4 users at a time: sampled, greedy, and seeded with
stop tokens), recorded by ``replay-proxy record`` between the Python frontend
and a 0.32.0 engine serving the peaked tiny model. Each replay plays it
against a real 0.32.0 engine that loads scripts/inject, a vLLM general plugin,
injecting one kind of regression (``same``: none, the same build loaded the
same way), with the plain engine as the baseline build (``--noise-runs N``:
baseline and candidate runs interleaved). For each kind, per tier, the share
of replays in which that tier reported a regression, and the gate's share
(a non-zero exit code). ``--beside`` runs a second replay of the same kind at
the same time on the same cores (a shared, noisy CI runner).
``--cost`` replays the same build with and without judging (no logprobs and
no scoring, ``rules: judging.top_logprobs 0``) and prints the wall times.

    .venv/bin/python scripts/bench/verdicts.py [--runs 3] [--kinds same stop-ignored] [--noise-runs 1]
        [--beside] [--cost]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.processes import free_port  # noqa: E402
from tests.real.peers import PEAKED, injected_engine_command  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts" / "inject"))
from replay_proxy_inject import KINDS  # noqa: E402

RECORDING = ROOT / "recordings" / "vllm-0.32.0-bench-serve.db"
SESSION = "bench-serve"
TIERS = ("exact", "first_divergence", "scored", "invariants", "sampled", "other behaviour", "performance", "gate")
UNTIMED = "untimed"  # a replay whose timing was not judged: a run the machine did not give whole


def frequent_token(db: Path) -> int:
    """The token the recorded session generated most often: the vocabulary slot ``vocab-slot`` breaks."""
    counts = collections.Counter()
    for (tokens,) in sqlite3.connect(db).execute("SELECT new_token_ids FROM outputs WHERE new_token_ids IS NOT NULL"):
        counts.update(json.loads(tokens))
    return counts.most_common(1)[0][0]


def replay(kind: str, slot: int, noise_runs: int, folder: Path, judging: bool = True) -> tuple[set[str], float]:
    """One replay of the session against ``kind``, as ``replay-proxy replay`` in a process of its own (so that a
    replay beside it is another process to it, as a neighbour on a CI runner is): the tiers that reported a
    regression, and its wall time."""
    folder.mkdir(parents=True)
    port = free_port()
    rules = []
    if not judging:
        off = folder / "judging-off.json"
        off.write_text(json.dumps({"judging": {"top_logprobs": 0}}))
        rules = ["--rules", str(off)]
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "replay_proxy", "replay", "--db", str(RECORDING), "--session", SESSION,
                    "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                    "--engine-cmd", injected_engine_command(port, "" if kind == "same" else kind, slot),
                    "--noise-runs", str(noise_runs), "--baseline-cmd", injected_engine_command(port, "", slot),
                    "--ready-timeout", "600", "--report-dir", str(folder), *rules],
                   capture_output=True, timeout=3600)
    took = time.monotonic() - start
    report = json.loads((folder / "report.json").read_text())
    found = set()
    for f in report["findings"]:
        if f["severity"] not in ("regression", "breaking"):
            continue
        if f["category"] == "behaviour":
            found.add(f.get("tier") if f.get("tier") in TIERS else "other behaviour")
        else:
            found.add(f["category"])
    if report["exit_code"]:
        found.add("gate")
    if any(f["code"] == "timing_not_judged" and "other processes" in f["message"] for f in report["findings"]):
        found.add(UNTIMED)
    (folder / "found.json").write_text(json.dumps(sorted(found)))
    return found, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="replays per kind")
    parser.add_argument("--kinds", nargs="+", default=["same", *KINDS], choices=["same", *KINDS])
    parser.add_argument("--noise-runs", type=int, default=1)
    parser.add_argument("--beside", action="store_true", help="two replays at a time on the same cores")
    parser.add_argument("--cost", action="store_true", help="only the wall time with and without judging")
    args = parser.parse_args()
    if not (PEAKED / ".complete").exists():
        sys.exit("the peaked tiny model is missing: run scripts/setup-vllm.sh first")
    slot = frequent_token(RECORDING)
    folder = Path(tempfile.mkdtemp(prefix="bench-verdicts-"))
    print(f"{RECORDING.name}: replays in {folder}; vocab-slot breaks token {slot}", flush=True)
    if args.cost:
        for judging in (False, True, False, True):
            _, took = replay("same", slot, args.noise_runs, folder / f"cost-{judging}-{time.monotonic_ns()}", judging)
            print(f"judging {'on ' if judging else 'off'}: {took:.1f} s (--noise-runs {args.noise_runs})", flush=True)
        return
    counts: dict[str, collections.Counter] = {}
    for kind in args.kinds:
        counts[kind] = collections.Counter()
        jobs = [(kind, run) for run in range(args.runs)]
        with concurrent.futures.ThreadPoolExecutor(2 if args.beside else 1) as pool:
            futures = {pool.submit(replay, kind, slot, args.noise_runs, folder / f"{kind}-{run}"): run
                       for kind, run in jobs}
            for future in concurrent.futures.as_completed(futures):
                found, took = future.result()
                counts[kind].update(found)
                print(f"{kind} run {futures[future] + 1}: {', '.join(sorted(found)) or 'nothing'} ({took:.0f} s)",
                      flush=True)
    print(f"\nshare of {args.runs} replay(s) per kind in which each tier reported a regression "
          f"(--noise-runs {args.noise_runs}{', two at a time' if args.beside else ''}):")
    width = max(map(len, TIERS)) + 1
    print("kind".ljust(22) + "".join(t.rjust(width) for t in (*TIERS, UNTIMED)))
    for kind, found in counts.items():
        print(kind.ljust(22) + "".join(f"{found[t]}/{args.runs}".rjust(width) for t in (*TIERS, UNTIMED)))
    print(f"({UNTIMED}: timing not judged, another process having taken more than max_other_cpu of a run)")


if __name__ == "__main__":
    main()
