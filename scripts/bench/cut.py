"""``replay-proxy cut`` of ``--requests`` requests out of a long busy recording: time and memory.

The recording is made once into ``--db`` (if that file does not exist) by
the recorder's own writer, in the shape of ``scripts/bench/redact.py``'s:
``--total`` distinct requests, 32 running a step, each ``--outputs`` tokens
long (a ten-minute busy engine at 2,000 steps a second of 32 outputs is
about 600,000 such requests of 64 tokens: 38M output rows). (``busy.py``'s
own recording cycles 4,096 request ids, each reused for the whole session,
so 500 of its ids are a quarter of it: not a cut of 500 requests.) The cut
(``--sample``, stratified) runs as its own process, timed as a whole, its
peak resident memory read from the kernel. The floor, in the same run:
reading the same frames' bytes with one SELECT, nothing decoded or written.

    .venv/bin/python scripts/bench/cut.py --db /tmp/cut-bench.db [--total 600000] [--requests 500]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.store.raw import frame_bytes  # noqa: E402
from scripts.bench.redact import frames, written  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, required=True, help="the recording (made if missing)")
    parser.add_argument("--total", type=int, default=600_000, help="its requests, if it is made")
    parser.add_argument("--outputs", type=int, default=64, help="each request's output tokens, one a step")
    parser.add_argument("--requests", type=int, default=500, help="how many the cut keeps")
    args = parser.parse_args()
    if not args.db.exists():  # in a process of its own: the peak memory read below is the cut's alone
        subprocess.run([sys.executable, __file__, "make", str(args.db), str(args.total), str(args.outputs)], check=True)
    with sqlite3.connect(args.db) as db:
        output_rows = db.execute("SELECT SUM(json_array_length(outputs)) FROM frame_outputs").fetchone()[0]
    with tempfile.TemporaryDirectory(prefix="bench-cut-") as folder:
        out = Path(folder) / "cut.db"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "replay_proxy", "cut", "--db", str(args.db), "--session", "staging",
                        "--out", str(out), "--sample", str(args.requests), "--seed", "1"], check=True)
        cut_s = time.perf_counter() - started
        peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child's: the cut
        with sqlite3.connect(out) as cut:
            kept = cut.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
            seqs = [seq for (seq,) in cut.execute("SELECT seq FROM frames")]
        started = time.perf_counter()
        with contextlib.closing(sqlite3.connect(args.db)) as db:
            read = sum(len(part) for frame in frame_bytes(db, 1, set(seqs)) for part in frame.parts)
        floor_s = time.perf_counter() - started
    print(f"{args.db.name}: {output_rows:,} output rows; cut of {kept} requests ({len(seqs):,} frames)")
    print(f"replay-proxy cut: {cut_s:.1f} s (target <= 60 s), peak {peak_mb:.0f} MB resident (target <= 256 MB)")
    print(f"floor, reading those frames ({read / 2**20:.1f} MB): {floor_s:.2f} s; the cut is {cut_s / floor_s:.1f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["make"]:
        db, total, outputs = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        written(db, frames(argparse.Namespace(requests=total, prompt=64, shared=32, outputs=outputs))).finish()
    else:
        main()
