"""Remake the real recordings in recordings/ with our own recorder.

Each is one session of the HTTP workload in tests/real/workload.py through
`replay-proxy record`, between a real frontend and a headless vLLM engine
(installed by scripts/setup-vllm.sh). Run from the repo root:
    .venv/bin/python scripts/make_recordings.py                # 0.32.0: Python and Rust frontends
    .venv/bin/python scripts/make_recordings.py --release 0.29.0 --release 0.30.0
The second form records a release's own Python frontend and engine
(vllm-X-python.db; install the release first: scripts/setup-vllm.sh X).
"""

import argparse
import functools
import sqlite3
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.real import peers  # noqa: E402

RECORDINGS = {
    "vllm-0.32.0-python.db": ("python-frontend", peers.python_frontend),
    "vllm-0.32.0-vllm-rs.db": ("vllm-rs-frontend", peers.rust_frontend),
}


def compact(db: Path) -> None:
    """4 KB pages for a file this small (16 KB pages, made for busy engines, are mostly slack here);
    still in WAL mode, so opening it writes nothing."""
    connection = sqlite3.connect(db)
    connection.execute("PRAGMA journal_mode=DELETE")
    connection.execute("PRAGMA page_size=4096")
    connection.execute("VACUUM")
    connection.execute("PRAGMA journal_mode=WAL")
    connection.close()


def record(name: str, session: str, frontend, release: str = "0.32.0") -> Path:
    db = ROOT / "recordings" / name
    db.unlink(missing_ok=True)
    logs = Path(tempfile.mkdtemp(prefix=f"recording-{session}-"))
    seen = peers.run_pair(logs, frontend, db, session, engine_release=release)
    compact(db)
    print(f"{name}: {seen}")
    return db


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", action="append", default=[],
                        help="record this release's Python frontend and engine instead")
    args = parser.parse_args()
    if not peers.installed():
        sys.exit("real vLLM peers missing: run scripts/setup-vllm.sh first")
    for release in args.release:
        if not (peers.CACHE / f"vllm-{release}" / ".complete").exists():
            sys.exit(f"vLLM {release} is not installed: run scripts/setup-vllm.sh {release}")
        record(f"vllm-{release}-python.db", "python-frontend",
               functools.partial(peers.python_frontend, release=release), release)
    if args.release:
        return
    for name, (session, frontend) in RECORDINGS.items():
        db = record(name, session, frontend)
        # The replay tests need a client-side abort in each recording (workload.py says why it can miss).
        aborts = sqlite3.connect(db).execute("SELECT COUNT(*) FROM aborts").fetchone()[0]
        if aborts != 1:
            sys.exit(f"{name}: {aborts} ABORTs recorded, not 1: run again")


if __name__ == "__main__":
    main()
