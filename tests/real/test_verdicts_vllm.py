"""Verdicts on a real client's traffic against real engines: the same build passes, injected regressions fail.

The session is recordings/vllm-0.32.0-bench-serve.db (``vllm bench serve``, 4 users at a time: 16 sampled
requests at temperature 0.8 with top-p and top-k, 12 greedy, 8 seeded with stop tokens and min_tokens; nearly
all of them ran batched). Each replay plays it against a real 0.32.0 engine serving the peaked tiny model
that loads scripts/inject (a vLLM general plugin, on its PYTHONPATH), after one run of the same engine without
a regression (``--noise-runs 1``). How often each tier finds each kind, over many replays, is
scripts/bench/verdicts.py's to measure; here, one replay of each case the gate must get right.
"""

import json
import subprocess
import sys

import pytest

from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.store.copy import redact_database
from tests.real import peers

pytestmark = pytest.mark.real_vllm

RECORDING = peers.RECORDINGS / "vllm-0.32.0-bench-serve.db"


def replay(tmp_path, kind: str, recording=RECORDING) -> tuple[int, dict]:
    """`replay-proxy replay` of the session against an engine injecting ``kind``: exit code and report."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = peers.free_port()
    result = subprocess.run(
        [sys.executable, "-m", "replay_proxy", "replay", "--db", str(recording), "--session", "bench-serve",
         "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
         "--engine-cmd", peers.injected_engine_command(port, kind), "--noise-runs", "1",
         "--baseline-cmd", peers.injected_engine_command(port), "--ready-timeout", str(peers.READY_TIMEOUT_S),
         "--report-dir", str(tmp_path)], capture_output=True, text=True, timeout=3 * peers.REPLAY_S)
    report = json.loads((tmp_path / "report.json").read_text())
    print(result.stdout[-3000:], result.stderr[-2000:])
    return result.returncode, report


def regressions(report) -> dict[str, set[str]]:
    """The behaviour regressions, by tier: their codes."""
    found: dict[str, set[str]] = {}
    for f in report["findings"]:
        if f["category"] == "behaviour" and f["severity"] == "regression":
            found.setdefault(f.get("tier"), set()).add(f["code"])
    return found


def test_the_same_build_on_batched_sampled_traffic_passes_with_every_request_judged(tmp_path):
    code, report = replay(tmp_path, "")
    assert code == 0 and regressions(report) == {}, regressions(report)
    verdicts = report["verdicts"]
    assert len(verdicts) == 36 and all(v["passed"] for v in verdicts)
    tiers = {v["tier"] for v in verdicts}
    # The greedy and seeded requests by their tokens (exact, or at a divergence if batched), the sampled ones
    # by teacher-forced scoring: each the strongest evidence it allows.
    assert "scored" in tiers and tiers & {"exact", "first_divergence"}, tiers
    codes = {f["code"] for f in report["findings"]}
    assert {"scoring_same", "sampled_same", "timing_not_judged"} <= codes, codes


def test_a_sampler_that_ignores_temperature_fails_the_gate(tmp_path):
    """Greedy requests stay greedy and scoring is untouched: only what the sampled requests sampled shows it."""
    code, report = replay(tmp_path, "temperature-ignored")
    found = regressions(report)
    assert code == 4 and found.keys() & {"invariants", "sampled"}, found
    assert not found.keys() & {"exact", "scored"}, found


def test_a_redacted_copy_is_judged_by_teacher_forced_scoring_alike(tmp_path):
    """Pseudonymous tokens score the same way on both builds: a numerics shift that leaves every greedy token
    as it was is found in the redacted session as in the plain one (scripts/bench/verdicts.py)."""
    key = tmp_path / "redaction.key"
    key.write_bytes(b"verdicts-test-key-0123456789")
    redacted = tmp_path / "redacted.db"
    vocab = json.loads((peers.PEAKED / "config.json").read_text())["vocab_size"]
    redact_database(RECORDING, redacted, Redaction(RedactionSettings(str(key), vocab)))
    code, report = replay(tmp_path / "replay", "numerics-slight", redacted)
    found = regressions(report)
    assert code == 4 and "scoring_kl" in found.get("scored", set()), found
    assert any(f["code"] == "redacted_recording" for f in report["findings"])
