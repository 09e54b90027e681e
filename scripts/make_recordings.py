"""Remake the real recordings in recordings/ with our own recorder.

Each is one session of the HTTP workload in tests/real/workload.py through
`replay-proxy record`, between a real frontend and a headless vLLM engine
(installed by scripts/setup-vllm.sh). Run from the repo root:
    .venv/bin/python scripts/make_recordings.py                # 0.32.0: Python and Rust frontends
    .venv/bin/python scripts/make_recordings.py --release 0.29.0 --release 0.30.0
    .venv/bin/python scripts/make_recordings.py --vllm-rs 0.25.0
    .venv/bin/python scripts/make_recordings.py --kind lora --release 0.31.0 --release 0.32.0
    .venv/bin/python scripts/make_recordings.py --shapes --release 0.30.0
`--staging` records vllm-0.32.0-staging.db: 30 users of a staging day
(tests/real/workload.py: staging) between the Python frontend and a 0.32.0
engine, the session the real shrink test cuts down. `--bench-serve` records
vllm-0.32.0-bench-serve.db: a real client's traffic (`vllm bench serve`, 4 users
at a time, sampled with top-p alone, greedy, and seeded with stop tokens:
tests/real/workload.py bench_serve) between the Python frontend and a 0.32.0
engine serving the trained tiny model, and vllm-0.32.0-bench-serve-flat.db, the
same serving the random one: the sessions whose verdicts
scripts/bench/verdicts.py measures. The second form records a
release's own Python frontend and engine
(vllm-X-python.db; install the release first: scripts/setup-vllm.sh X). The
third records a release's Rust frontend (vllm-X-vllm-rs.db) with the engine of
the same release, or of the nearest installed one where that cannot run here
(0.22.0 to 0.26.0, 0.33.0), or with the sim engine of its release where no
installed engine reads its requests (0.34.0): the compatibility matrix replays
what each frontend sends against every engine.
`--smg` records smg-1.13.0.db: a third-party frontend (smg, its EngineCore
mode) with a 0.32.0 engine, the session named `--frontend smg==1.13.0`, the
workload every client is compared on (tests/real/workload.py: clients).
`--kind lora` (or pooling) records that kind's workload (tests/real/workload.py:
lora, pooling) instead, the frontend and engine serving it, into
vllm-X-python-lora.db (-pooling.db): the matrix judges each kind of request from
its own recordings.
`--shapes` records, for each --release, the shapes of request that are not
matrix kinds (docs/matrix.md says why): vllm-X-python-varied.db (structured
outputs in each form, prompt embeds, a three-turn chat: tests/real/workload.py
varied, both peers with --enable-prompt-embeds) and vllm-X-python-fan-out.db
(beam search, n=2, ngram speculative decoding: fan_out).
"""

import argparse
import functools
import sqlite3
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from replay_proxy.matrix import KINDS  # noqa: E402
from replay_proxy.peers import SERVING, SMG, SMG_READY, engine_installed, handshake_port  # noqa: E402
from replay_proxy.matrix.release import reads_requests  # noqa: E402
from replay_proxy.store.migrate import migrate  # noqa: E402
from replay_proxy.wire.registry import shipped_releases  # noqa: E402
from tests.real import peers, workload  # noqa: E402

# A real client's session on each shape of model: the trained one's peaked distributions, the random one's flat.
BENCH_SERVE = {"vllm-0.32.0-bench-serve.db": peers.TRAINED, "vllm-0.32.0-bench-serve-flat.db": peers.MODEL}
RECORDINGS = {
    "vllm-0.32.0-python.db": ("python-frontend", peers.python_frontend),
    "vllm-0.32.0-vllm-rs.db": ("vllm-rs-frontend", peers.rust_frontend),
}


def compact(db: Path) -> None:
    """Vacuumed, as ``replay-proxy migrate`` leaves a file: no free pages, nothing in the write-ahead log; still in
    WAL mode, so opening it writes nothing."""
    migrate(db)


def record(name: str, session: str, frontend, release: str = "0.32.0", work=None,
           serving=peers.NO_KIND, engine_flags: tuple[str, ...] = (), sim: bool = False, model=peers.MODEL,
           **pair) -> Path:
    db = ROOT / "recordings" / name
    db.unlink(missing_ok=True)
    logs = Path(tempfile.mkdtemp(prefix=f"recording-{session}-"))
    try:
        seen = peers.run_pair(logs, frontend, db, session, engine_release=release, work=work,
                              engine_flags=engine_flags, serving=serving, sim=sim, model=model, **pair)
    except peers.ChildError as exc:  # a pair that breaks is recorded as far as it got: that is the fact
        seen = f"the pair broke: {str(exc).splitlines()[0]}"
    compact(db)
    print(f"{name}: {seen}")
    return db


def record_shapes(release: str) -> None:
    """``release``'s varied and fan-out sessions (see the module's docstring), each pair started with the flags
    its workload needs."""
    embeds, _ = workload.prompt_embeds(release)
    for name, work, flags in (("varied", functools.partial(workload.varied, embeds=embeds), workload.PROMPT_EMBEDS),
                              ("fan-out", workload.fan_out, workload.NGRAM)):
        record(f"vllm-{release}-python-{name}.db", "python-frontend",
               functools.partial(peers.python_frontend, release=release, flags=flags), release, work=work,
               engine_flags=flags)


def nearest_engine(release: str) -> str:
    """The installed engine release closest to ``release`` (the newer of two as close)."""
    order = shipped_releases()
    installed = [r for r in order if engine_installed(r)]
    return min(installed, key=lambda r: (abs(order.index(r) - order.index(release)), -order.index(r)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", action="append", default=[],
                        help="record this release's Python frontend and engine instead")
    parser.add_argument("--vllm-rs", action="append", default=[],
                        help="record this release's Rust frontend with the nearest installed engine instead")
    parser.add_argument("--staging", action="store_true",
                        help="record the 30-request staging session (vllm-0.32.0-staging.db) instead")
    parser.add_argument("--bench-serve", action="store_true",
                        help="record a real client's session (vllm-0.32.0-bench-serve.db) instead")
    parser.add_argument("--smg", action="store_true",
                        help=f"record smg {SMG} with a 0.32.0 engine (smg-{SMG}.db) instead")
    parser.add_argument("--kind", choices=list(KINDS), default="completion",
                        help="with --release: the kind of request whose workload is recorded")
    parser.add_argument("--shapes", action="store_true",
                        help="with --release: record the shapes of request that are not matrix kinds instead")
    args = parser.parse_args()
    if not peers.installed():
        sys.exit("real vLLM peers missing: run scripts/setup-vllm.sh first")
    if args.smg:
        record(f"smg-{SMG}.db", "smg-frontend", peers.smg_frontend, work=workload.clients,
               upstream=handshake_port(peers.SMG_FRONTEND), proxy_flags=("--frontend", f"smg=={SMG}"),
               ready_path=SMG_READY)
        return
    if args.staging:
        record("vllm-0.32.0-staging.db", "staging", peers.python_frontend, work=workload.staging)
        return
    if args.bench_serve:
        for name, model in BENCH_SERVE.items():
            record(name, "bench-serve", functools.partial(peers.python_frontend, model=model),
                   work=functools.partial(workload.bench_serve, model=model), model=model)
        return
    for release in args.release:
        if not (peers.CACHE / f"vllm-{release}" / ".complete").exists():
            sys.exit(f"vLLM {release} is not installed: run scripts/setup-vllm.sh {release}")
        if args.shapes:
            record_shapes(release)
            continue
        if args.kind != "completion":
            serving = SERVING[args.kind]
            record(f"vllm-{release}-python{KINDS[args.kind]}.db", "python-frontend",
                   functools.partial(peers.python_frontend, release=release, serving=serving),
                   release, work=getattr(workload, args.kind), serving=serving)
            continue
        record(f"vllm-{release}-python.db", "python-frontend",
               functools.partial(peers.python_frontend, release=release), release)
    for release in args.vllm_rs:
        # A frontend whose requests no installed engine reads (0.34.0's prompt arrays) is recorded with the sim
        # engine of its release: what it sends is the recording's point (the matrix replays it).
        sim = not reads_requests(nearest_engine(release), release)
        record(f"vllm-{release}-vllm-rs.db", "vllm-rs-frontend",
               functools.partial(peers.rust_frontend, version=release), release if sim else nearest_engine(release),
               sim=sim)
    if args.release or args.vllm_rs:
        return
    for name, (session, frontend) in RECORDINGS.items():
        db = record(name, session, frontend)
        # The replay tests need a client-side abort in each recording (workload.py says why it can miss).
        aborts = sqlite3.connect(db).execute("SELECT COUNT(*) FROM aborts").fetchone()[0]
        if aborts != 1:
            sys.exit(f"{name}: {aborts} ABORTs recorded, not 1: run again")


if __name__ == "__main__":
    main()
