"""Remake the real recordings in recordings/ with our own recorder.

Each is one session of the HTTP workload in tests/real/workload.py through
`replay-proxy record`, between a real frontend and a headless vLLM 0.32.0
engine (installed by scripts/setup-vllm.sh). Run from the repo root:
    .venv/bin/python scripts/make_recordings.py
"""

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


def main() -> None:
    if not peers.installed():
        sys.exit("real vLLM peers missing: run scripts/setup-vllm.sh first")
    for name, (session, frontend) in RECORDINGS.items():
        db = ROOT / "recordings" / name
        db.unlink(missing_ok=True)
        logs = Path(tempfile.mkdtemp(prefix=f"recording-{session}-"))
        seen = peers.run_pair(logs, frontend, db, session)
        print(f"{name}: {seen}")
        # The replay tests need a client-side abort in each recording (workload.py says why it can miss).
        aborts = sqlite3.connect(db).execute("SELECT COUNT(*) FROM aborts").fetchone()[0]
        if aborts != 1:
            sys.exit(f"{name}: {aborts} ABORTs recorded, not 1: run again")


if __name__ == "__main__":
    main()
