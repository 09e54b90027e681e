"""Every benchmark of scripts/bench/ that needs no real vLLM runs to its end at its smallest size, printing its
ratios to the floor it measures in the same run: a bench broken by a change of the product is caught here, not
on the day its figures are wanted (three were: a column added to the layout, a helper's new argument, a floor's
file refused as no recording). Nothing here is a figure's judge: tests never assert on how fast this machine is.
busy.py runs in tests/recorder; verdicts.py and false_alarms.py replay against real engines."""

import subprocess
import sys

import pytest

from tests.helpers import ROOT

BENCHES = {
    "writer.py": (["--frames", "1000", "--rounds", "1"], "the floor's"),
    "redact.py": (["--requests", "40", "--prompt", "64", "--shared", "32", "--outputs", "4", "--rounds", "1"],
                  "the unredacted copy"),
    "replay.py": (["--requests", "60", "--rate", "200"], "requests/s"),
    "forward.py": (["--round-trips", "100", "--pipelined", "300", "--rate", "500", "--rate-seconds", "0.3",
                    "--rounds", "1", "--busy-rate", "100"], "recording beside the minimal recorder"),
    "fleet.py": (["--days", "1", "--hosts", "1", "--proxies", "1", "--files", "2"], "the floor's"),
}


@pytest.mark.parametrize("bench", BENCHES)
def test_a_bench_runs_to_its_end_and_prints_its_ratios(bench, tmp_path):
    arguments, ratio = BENCHES[bench]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / bench), *arguments], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ratio in done.stdout, done.stdout[-3000:]


def test_the_cut_bench_makes_its_recording_and_cuts_it(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "cut.py"), "--db", str(tmp_path / "r.db"),
                           "--total", "200", "--outputs", "4", "--requests", "20"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "replay-proxy cut:" in done.stdout and "the cut is" in done.stdout
