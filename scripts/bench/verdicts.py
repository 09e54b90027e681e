"""How often each verdict tier finds a real regression, and how often one flags an identical build.

The sessions are a real client's traffic (``vllm bench serve``, 4 users at a
time: sampled with temperature and top-p alone, no top-k and no seed, as
OpenAI-style clients sample; greedy; seeded with stop tokens), recorded by
``replay-proxy record`` between the Python frontend and a 0.32.0 engine, one
per model: ``trained`` (recordings/vllm-0.32.0-bench-serve.db, the tiny
model trained on text: peaked distributions, as a real model's) and ``flat``
(vllm-0.32.0-bench-serve-flat.db, the random one: nearly uniform). Each
replay plays its session against a real 0.32.0 engine serving that model
and loading scripts/inject, a vLLM general plugin, injecting one kind of
regression (``same``: none, the same build loaded the same way), with the
plain engine as the baseline build (``--noise-runs N``: baseline and
candidate runs interleaved). For each model and kind, per tier, the share of
replays in which that tier reported a regression, and the gate's share (a
non-zero exit code). ``--beside`` runs a second replay of the same kind at
the same time on the same cores (a shared, noisy CI runner). ``--cost``
replays the same build with and without judging (no logprobs and no
scoring, ``rules: judging.top_logprobs 0``) and prints the wall times.
``--into FOLDER`` keeps the replays there
and counts those it already holds instead of replaying them again, so that a
long measurement (20 replays a kind) can be made a few hours at a time;
``--tally FILE`` (JSON lines, a line a finished replay: model, kind, run,
how it was made, what it found, the commit that judged it) does the same across machines: a replay the
file holds is counted, not made again, and the file is small enough to
commit (docs/verdicts-bench.jsonl is this project's).
``--judge-again FOLDER`` replays nothing: it judges the replays an earlier
run kept in FOLDER again, with whatever ``replay_proxy`` is first on the
path (``PYTHONPATH=OLD_CHECKOUT`` for an older build's verdicts on the very
same replays), ``--unseeded`` on the requests without a seed alone (what
OpenAI-style clients send).

    .venv/bin/python scripts/bench/verdicts.py [--runs 3] [--models trained flat] [--kinds same stop-ignored]
        [--noise-runs 1] [--beside] [--cost] [--into FOLDER] [--tally FILE] [--judge-again FOLDER [--unseeded]]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # after PYTHONPATH: --judge-again judges with the replay_proxy found there first

from replay_proxy.peers import cache_dir  # noqa: E402
from replay_proxy.processes import free_port  # noqa: E402
from replay_proxy.store.tables import read_recording  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts" / "inject"))
from replay_proxy_inject import KINDS  # noqa: E402

MODELS = {"trained": (cache_dir() / "tiny-trained", ROOT / "recordings" / "vllm-0.32.0-bench-serve.db"),
          "flat": (cache_dir() / "tiny-model", ROOT / "recordings" / "vllm-0.32.0-bench-serve-flat.db")}
SESSION = "bench-serve"
TIERS = ("exact", "first_divergence", "same_context", "scored", "invariants", "sampled", "other behaviour",
         "performance", "gate")
UNTIMED = "untimed"  # a replay whose timing was not judged: a run the machine did not give whole


def frequent_token(db: Path) -> int:
    """The token the recorded session generated most often: the vocabulary slot ``vocab-slot`` breaks."""
    counts = collections.Counter()
    with contextlib.closing(read_recording(db)) as connection:
        for (tokens,) in connection.execute("SELECT new_token_ids FROM outputs WHERE new_token_ids IS NOT NULL"):
            counts.update(json.loads(tokens))
    return counts.most_common(1)[0][0]


def found_in(findings: list[dict], exit_code: int) -> set[str]:
    """The tiers (and other categories) that reported a regression in a report's findings, and ``gate``."""
    found = set()
    for f in findings:
        if f["severity"] not in ("regression", "breaking"):
            continue
        if f["category"] == "behaviour":
            found.add(f.get("tier") if f.get("tier") in TIERS else "other behaviour")
        else:
            found.add(f["category"])
    if exit_code:
        found.add("gate")
    if any(f["code"] == "timing_not_judged" and "other processes" in f["message"] for f in findings):
        found.add(UNTIMED)
    return found


def judge_again(replay_db: Path, model: str, unseeded: bool) -> set[str]:
    """The tiers that report a regression when the kept replay in ``replay_db`` (the recording, the baseline
    run, the candidate run) is judged by this ``replay_proxy``, as the replay judged it (timing aside)."""
    import msgspec

    from replay_proxy.compare.findings import exit_code, report_json
    from replay_proxy.compare import report as reporting
    from replay_proxy.compare.rules import load_rules
    from replay_proxy.store.session import load_session
    from replay_proxy.wire.messages import Side

    rules = load_rules()
    if "vocab_size" in rules.judging.__struct_fields__:  # (an older build's rules have none)
        vocab_size = json.loads((MODELS[model][0] / "config.json").read_text())["vocab_size"]
        rules = msgspec.structs.replace(rules, judging=msgspec.structs.replace(rules.judging, vocab_size=vocab_size))
    with contextlib.closing(read_recording(replay_db)) as connection:  # (the newest of each: see ``replay``)
        names = [name for (name,) in connection.execute("SELECT name FROM sessions ORDER BY id")]
    runs = [names[0], [n for n in names if "-noise-" in n][-1], [n for n in names if "-replay-" in n][-1]]
    sessions = [load_session(replay_db, name) for name in runs]
    if unseeded:
        sessions = [msgspec.structs.replace(s, requests=[r for r in s.requests if r.params.get("seed") is None])
                    for s in sessions]
    recording, baseline, candidate = sessions
    if hasattr(reporting, "Comparison"):
        report = reporting.build_report(reporting.Comparison(
            title="replay", baseline=recording, candidate=candidate, baseline_runs=(baseline,),
            replayed=reporting.Replayed(Side.ENGINE, asked_logprobs=True)), rules)
    else:  # an older build's (--judge-again with PYTHONPATH=OLD_CHECKOUT)
        report = reporting.build_report("replay", recording, candidate, rules, [baseline], replayed_noise=True,
                                        asked_logprobs=True)
    return found_in(json.loads(report_json(report))["findings"], int(exit_code(report.findings)))


def replay(model: str, kind: str, noise_runs: int, folder: Path, judging: bool = True) -> tuple[set[str], float]:
    """One replay of ``model``'s session against ``kind``, as ``replay-proxy replay`` in a process of its own (so
    that a replay beside it is another process to it, as a neighbour on a CI runner is): the tiers that reported
    a regression, and its wall time."""
    from tests.real.peers import injected_engine_command

    shutil.rmtree(folder, ignore_errors=True)  # a replay stopped half-way is made again, from nothing
    folder.mkdir(parents=True)
    model_dir, recording = MODELS[model]
    slot = frequent_token(recording)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    port = free_port()
    rules = []
    if not judging:
        off = folder / "judging-off.json"
        off.write_text(json.dumps({"judging": {"top_logprobs": 0}}))
        rules = ["--rules", str(off)]
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "replay_proxy", "replay", "--db", str(recording), "--session", SESSION,
                    "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                    "--engine-cmd", injected_engine_command(port, "" if kind == "same" else kind, slot, model_dir),
                    "--noise-runs", str(noise_runs),
                    "--baseline-cmd", injected_engine_command(port, "", slot, model_dir),
                    "--vocab-size", str(vocab_size), "--ready-timeout", "600", "--report-dir", str(folder), *rules],
                   capture_output=True, timeout=3600)
    took = time.monotonic() - start
    report = json.loads((folder / "report.json").read_text())
    found = found_in(report["findings"], report["exit_code"])
    (folder / "found.json").write_text(json.dumps(sorted(found)))
    return found, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="replays per model and kind")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--kinds", nargs="+", default=["same", *KINDS], choices=["same", *KINDS])
    parser.add_argument("--noise-runs", type=int, default=1)
    parser.add_argument("--beside", action="store_true", help="two replays at a time on the same cores")
    parser.add_argument("--cost", action="store_true", help="only the wall time with and without judging")
    parser.add_argument("--into", type=Path, metavar="FOLDER", help="keep the replays here; count those it holds")
    parser.add_argument("--tally", type=Path, metavar="FILE", help="a line a finished replay; count those it holds")
    parser.add_argument("--judge-again", type=Path, metavar="FOLDER", help="judge an earlier run's replays again")
    parser.add_argument("--unseeded", action="store_true", help="with --judge-again: the unseeded requests alone")
    args = parser.parse_args()
    if args.judge_again:
        counts, runs = collections.defaultdict(collections.Counter), collections.Counter()
        for replayed in sorted(args.judge_again.glob("*/replay.db")):
            model, kind = replayed.parent.name.split("-", 1)[0], replayed.parent.name.split("-", 1)[1].rsplit("-", 1)[0]
            counts[model, kind].update(judge_again(replayed, model, args.unseeded))
            runs[model, kind] += 1
        alone = ", unseeded requests alone" if args.unseeded else ""
        print_table(counts, runs, f"{args.judge_again} judged again{alone}")
        return
    for model in args.models:
        if not (MODELS[model][0] / ".complete").exists():
            sys.exit(f"the {model} tiny model is missing: run scripts/setup-vllm.sh first")
    folder = args.into or Path(tempfile.mkdtemp(prefix="bench-verdicts-"))
    how = {"noise_runs": args.noise_runs, "beside": args.beside}
    if (folder / "bench.json").exists() and json.loads((folder / "bench.json").read_text()) != how:
        sys.exit(f"{folder} holds replays made with {(folder / 'bench.json').read_text()}, not {json.dumps(how)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(how))
    print(f"replays in {folder}", flush=True)
    if args.cost:
        for model in args.models:
            for judging in (False, True, False, True):
                run = folder / f"cost-{model}-{judging}-{time.monotonic_ns()}"
                _, took = replay(model, "same", args.noise_runs, run, judging)
                print(f"{model}, judging {'on ' if judging else 'off'}: {took:.1f} s (--noise-runs {args.noise_runs})",
                      flush=True)
        return
    tallied = {(t["model"], t["kind"], t["run"]): t["found"] for t in map(json.loads, _lines(args.tally))
               if {k: t[k] for k in how} == how}
    build = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    counts: dict[tuple[str, str], collections.Counter] = {}
    for model in args.models:
        for kind in args.kinds:
            counts[model, kind] = collections.Counter()
            runs = {run: folder / f"{model}-{kind}-{run}" for run in range(args.runs)}
            for run, kept in runs.items():
                if (model, kind, run) in tallied:
                    counts[model, kind].update(tallied[model, kind, run])
                elif (kept / "found.json").exists():
                    counts[model, kind].update(json.loads((kept / "found.json").read_text()))
            with concurrent.futures.ThreadPoolExecutor(2 if args.beside else 1) as pool:
                futures = {pool.submit(replay, model, kind, args.noise_runs, kept): run for run, kept in runs.items()
                           if (model, kind, run) not in tallied and not (kept / "found.json").exists()}
                for future in concurrent.futures.as_completed(futures):
                    found, took = future.result()
                    counts[model, kind].update(found)
                    print(f"{model} {kind} run {futures[future] + 1}: {', '.join(sorted(found)) or 'nothing'} "
                          f"({took:.0f} s)", flush=True)
                    if args.tally is not None:
                        with args.tally.open("a") as tally:
                            tally.write(json.dumps({"model": model, "kind": kind, "run": futures[future], **how,
                                                    "found": sorted(found), "seconds": round(took), "build": build})
                                        + "\n")
    print_table(counts, collections.Counter({key: args.runs for key in counts}),
                f"--noise-runs {args.noise_runs}{', two at a time' if args.beside else ''}")


def _lines(path: Path | None) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path and path.exists() else []


def print_table(counts: dict[tuple[str, str], collections.Counter], runs: collections.Counter, how: str) -> None:
    print(f"\nshare of replays per model and kind in which each tier reported a regression ({how}):")
    width = max(map(len, TIERS)) + 1
    print("model".ljust(8) + "kind".ljust(20) + "".join(t.rjust(width) for t in (*TIERS, UNTIMED)))
    for (model, kind), found in counts.items():
        print(model.ljust(8) + kind.ljust(20) + "".join(f"{found[t]}/{runs[model, kind]}".rjust(width)
                                                         for t in (*TIERS, UNTIMED)))
    print(f"({UNTIMED}: timing not judged, another process having taken more than max_other_cpu of a run)")


if __name__ == "__main__":
    main()
