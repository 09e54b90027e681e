"""Verdicts on a real client's traffic against real engines: the same build passes, injected regressions fail.

The sessions are recordings/vllm-0.32.0-bench-serve.db and its -flat twin (``vllm bench serve``, 4 users at a
time: 20 requests sampled with temperature and top-p alone, 10 greedy, 8 seeded with stop tokens and min_tokens;
nearly all of them ran batched), served by the trained tiny model (peaked distributions) and by the random one
(flat). Each replay plays one against a real 0.32.0 engine serving its model that loads scripts/inject (a vLLM
general plugin, on its PYTHONPATH), after one run of the same engine without a regression (``--noise-runs 1``).
How often each tier finds each kind, over many replays, is scripts/bench/verdicts.py's to measure; here, one
replay of each case the gate must get right.
"""

import json
import subprocess
import sys

import pytest

from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.store.copy import redact_database
from tests.real import peers

pytestmark = pytest.mark.real_vllm

TRAINED = peers.RECORDINGS / "vllm-0.32.0-bench-serve.db"
FLAT = peers.RECORDINGS / "vllm-0.32.0-bench-serve-flat.db"


def replay(tmp_path, kind: str, recording=TRAINED) -> tuple[int, dict]:
    """`replay-proxy replay` of the session against an engine injecting ``kind``: exit code and report."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    port = peers.free_port()
    model = peers.MODEL if recording == FLAT else peers.TRAINED
    result = subprocess.run(
        [sys.executable, "-m", "replay_proxy", "replay", "--db", str(recording), "--session", "bench-serve",
         "--against", "engine", "--listen", f"tcp://127.0.0.1:{port}",
         "--engine-cmd", peers.injected_engine_command(port, kind, model=model), "--noise-runs", "1",
         "--baseline-cmd", peers.injected_engine_command(port, model=model),
         "--vocab-size", str(json.loads((model / "config.json").read_text())["vocab_size"]),
         "--ready-timeout", str(peers.READY_TIMEOUT_S), "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=3 * peers.REPLAY_S)
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


def test_the_same_build_on_batched_sampled_traffic_passes_with_every_request_judged_by_every_tier(tmp_path):
    code, report = replay(tmp_path, "")
    assert code == 0 and regressions(report) == {}, regressions(report)
    verdicts = report["verdicts"]
    assert len(verdicts) == 38 and all(v["passed"] for v in verdicts)
    # Every request where both builds saw the same context (its prompt, at least), the greedy and seeded ones by
    # their tokens too (exact, or at a divergence if batched), and every one by scoring and the invariants.
    judged = [{j["tier"] for j in v["judged"]} for v in verdicts]
    assert all({"same_context", "scored", "invariants"} <= tiers for tiers in judged), judged
    assert sum(bool(tiers & {"exact", "first_divergence"}) for tiers in judged) >= 18, judged
    codes = {f["code"] for f in report["findings"]}
    assert {"scoring_same", "sampled_same", "timing_not_judged"} <= codes, codes


def test_logits_scaled_before_the_sampler_fail_the_gate_on_a_flat_model_with_one_baseline_run(tmp_path):
    """Every greedy token and every prompt logprob as it was (scoring sees nothing). On the flat model no one
    position moves past one baseline run's tolerance (0.1 to 0.2 nats, measured), but every request's moved
    alike where both builds saw the same context, sampled ones included: the session's shift shows it."""
    code, report = replay(tmp_path, "sampler-scaled", FLAT)
    found = regressions(report)
    assert code == 4 and "context_shift" in found.get("same_context", set()), found
    assert "scores_diverge" not in found.get("scored", set()), found


def test_a_sampler_that_ignores_top_p_fails_the_gate(tmp_path):
    """Top-p alone, no top-k: the sampled tokens' ranks put some outside the nucleus."""
    code, report = replay(tmp_path, "top-p-ignored")
    found = regressions(report)
    assert code == 4 and found.keys() & {"invariants", "sampled"}, found
    assert not found.keys() & {"exact", "scored", "same_context"}, found


def test_a_redacted_copy_is_judged_by_teacher_forced_scoring_alike(tmp_path):
    """Pseudonymous tokens score the same way on both builds: a numerics shift that leaves every greedy token
    as it was is found in the redacted session as in the plain one (scripts/bench/verdicts.py)."""
    key = tmp_path / "redaction.key"
    key.write_bytes(b"verdicts-test-key-0123456789")
    redacted = tmp_path / "redacted.db"
    vocab = json.loads((peers.TRAINED / "config.json").read_text())["vocab_size"]
    redact_database(TRAINED, redacted, Redaction(RedactionSettings(str(key), vocab)))
    code, report = replay(tmp_path / "replay", "numerics-slight", redacted)
    found = regressions(report)
    assert code == 4 and "scoring_kl" in found.get("scored", set()), found
    assert any(f["code"] == "redacted_recording" for f in report["findings"])
