"""Replay a real recording against fresh real engines: the same release twice, then an older one.

The recording (recordings/vllm-0.32.0-python.db) was made by our recorder
between the Python frontend and a headless vLLM 0.32.0 engine.
"""

import json
import subprocess
import sys

import pytest
import sqlite_utils

from replay_proxy.compare.rules import load_rules
from tests.real import peers

pytestmark = pytest.mark.real_vllm


def significant(report, *categories):
    return [f for f in report["findings"]
            if f["category"] in categories and f["severity"] in ("breaking", "regression")]


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    """One replay, four real engine starts: the 0.31.0 candidate twice, between two replays of 0.32.0, the
    baseline build (counterbalanced), the first of which judges the candidate's behaviour; timing pools each
    build's runs. Sessions: 1 the recording, 2 and 5 the 0.32.0 replays, 3 and 4 the 0.31.0 ones."""
    tmp_path, port = tmp_path_factory.mktemp("replay-engine"), peers.free_port()
    # The suite's other worker shares the machine: every run is timed whatever else ran meanwhile (what is
    # tested is how timing is stated; the refusal of a disturbed run: tests/compare/test_performance.py).
    timed = tmp_path / "timed.json"
    timed.write_text(json.dumps({"performance": {"max_other_cpu": 1.0}}))
    result, report = peers.replay_cli(tmp_path, "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
                                      "--engine-cmd", peers.engine_command(port, "0.31.0"), "--noise-runs", "2",
                                      "--baseline-cmd", peers.engine_command(port, "0.32.0"), "--rules", str(timed))
    db = sqlite_utils.Database(tmp_path / "replay.db")
    names = {row["id"]: row["name"] for row in db["sessions"].rows}
    return tmp_path, result, report, db, names


def test_same_release_gives_the_same_tokens_and_abort_point(replayed):
    tmp_path, _, report, db, names = replayed
    assert significant(report, "replay") == [], report["findings"]  # every replay ran
    # The first 0.32.0 replay against the recording, as `diff` judges them.
    same = diff(tmp_path, names[1], names[2])
    assert significant(same, "schema", "behaviour") == []
    # The ABORT went at the recorded progress, however fast this machine's engine is.
    landed = {row["session_id"]: row["tokens_before_abort"] for row in db.query(
        "SELECT session_id, tokens_before_abort FROM abort_progress")}
    assert abs(landed[1] - landed[2]) <= load_rules().abort_progress_tolerance_tokens
    [landing] = [f for f in same["findings"] if f.get("message_kind") == "ABORT"]
    assert (landing["code"], landing["baseline"], landing["candidate"]) == ("abort_landed", landed[1], landed[2])


def test_an_older_engine_release_shows_its_real_differences_over_the_noise_floor(replayed):
    tmp_path, _, report, db, names = replayed
    assert [(s["mode"], s["vllm_version"]) for s in db["sessions"].rows] == [
        ("record", "0.32.0"), ("replay", "0.32.0"), ("replay", "0.31.0"), ("replay", "0.31.0"), ("replay", "0.32.0")]
    assert report["noise"] == [f"{names[2]} (#2)", f"{names[5]} (#5)"]
    codes = {(f["code"], f.get("struct"), f.get("position")) for f in report["findings"]}
    # 0.32.0 added EngineCoreOutputs.weight_version at position 8; a 0.31.0 engine sends 8 elements.
    assert ("array_shorter", "EngineCoreOutputs", 8) in codes
    print("\n".join(f"{f['severity']} {f['code']} {f['message']}" for f in report["findings"]))
    # Latency is compared with the two 0.32.0 replays pooled, not with the recording, as `diff` judges the same
    # runs a side (the baseline build's two, the candidate's two): the very same samples and estimate.
    timing = {f["field"]: f for f in report["findings"] if f["category"] == "performance"}
    assert timing["timing_baseline"]["message"].startswith("latency is compared with 2 run(s) of the baseline")
    pooled = performance(diff(tmp_path, names[2], names[3], "--noise", names[5], "--candidate-noise", names[4]))
    assert timing["ttft_ms.p50"]["change"] == pooled["ttft_ms.p50"]["change"]
    # One run a side, or a recording, is not timed by diff either.
    assert list(performance(diff(tmp_path, names[2], names[5]))) == ["timing"]


def diff(tmp_path, baseline, candidate, *more):
    """`replay-proxy diff` of two sessions of the replayed database (``more``: its other options): its report."""
    folder = tmp_path / "-".join([candidate, *more]).replace(" ", "_")
    run = subprocess.run([sys.executable, "-m", "replay_proxy", "diff", "--db", str(tmp_path / "replay.db"),
                          "--baseline", baseline, "--candidate", candidate, *more, "--report-dir", str(folder)],
                         capture_output=True, text=True, timeout=120)
    print(run.stdout)
    return json.loads((folder / "report.json").read_text())


def performance(report):
    """A report's performance findings, by field."""
    return {f["field"]: f for f in report["findings"] if f["category"] == "performance"}


def assert_stated(finding, threshold=0.05):
    """A latency finding says its change and interval, and its verdict is the one they give: worse beyond
    the threshold is a regression, better beyond it an improvement (each also past an absolute floor,
    rules.json), else no change, with the smallest change the sample could show."""
    change, code, message = finding["change"], finding["code"], finding["message"]
    assert f"{change['relative']:+.1%} (95% CI {change['low']:+.1%} to {change['high']:+.1%}" in message, message
    if code.endswith("_regression"):
        assert change["low"] > threshold, message
    elif code.endswith("_improvement"):
        assert change["high"] < -threshold, message
    else:
        assert code.endswith("_no_change"), message
        assert f"the smallest change this sample could show is {change['minimum_detectable']:.1%}" in message
        assert change["minimum_detectable"] > threshold


def test_latency_findings_state_their_size_no_change_and_what_could_have_been_seen(replayed):
    """Each timing change stated with its interval and the smallest change the sample could show, judged
    against the two 0.32.0 replays (pooled, and their difference the run-to-run variation: on this machine
    engine processes differ by up to half in TTFT). Then the recording against a replay, stated the same way."""
    tmp_path, result, report, _, names = replayed
    # Timing is not held to "no regression" here: with one run of variation, the noise is estimated from a
    # single difference, and real engine processes on these two cores differ by more than that often shows
    # (seen in CI: inter-token p90 1.86 -> 3.19 ms between two runs of the same engine). How often a
    # same-release replay reports a regression is measured over many repeats in
    # scripts/bench/false_alarms.py, not asserted on one.
    assert result.returncode == report["exit_code"], result.stdout + result.stderr
    timing = performance(report)
    print("\n".join(f["message"] for f in timing.values()))
    # Each states its size, its interval and the smallest change it could have shown, whatever its verdict
    # (seen locally: TTFT p50 6.46 -> 20.2 ms between two processes of one engine, so no verdict is held).
    for field in ("ttft_ms.p50", "e2e_ms.p50"):
        assert_stated(timing[field])
        assert timing[field]["change"]["noise_runs"] == 1
    # Inter-token gaps: their verdict is not asserted either; a replay process starved of the CPU on this
    # 2-core machine also reads a burst of outputs at once (seen once: gaps of 0.04 ms, an "improvement").
    assert timing["itl_ms.p50"]["change"]["samples"][0] > 10
    # The recording against a replay: its peers shared the machine with the live frontend, so diff does not
    # time it (as replay does not), and says why.
    [timing] = performance(diff(tmp_path, names[1], names[2])).values()
    assert timing["code"] == "timing_not_judged" and "a recording, whose peers shared the machine" in \
        timing["message"], timing["message"]
