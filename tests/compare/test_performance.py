"""Performance findings on hand-built sessions, with and without a noise floor."""

from pathlib import Path

from replay_proxy.compare.performance import performance_findings
from replay_proxy.compare.rules import load_rules
from replay_proxy.store.session import Request, Session
from replay_proxy.wire.schema import load_schema

RULES = load_rules()
MS = 1_000_000


def session(ttft_ms: float, step_ms: float, name: str = "s", gap_ms: float = 1000) -> Session:
    requests = []
    for k in range(20):
        start = int(k * gap_ms * MS)
        times = [start + int(ttft_ms * MS) + int(i * step_ms * MS) for i in range(5)]
        requests.append(Request(
            seq=k, request_id=f"r{k}", engine_index=0, prompt=[k], params={"temperature": 0.0},
            tokens=[1] * 5, finish_reason="length", added_ns=start, first_token_ns=times[0], last_ns=times[-1],
            abort_progress=None, output_times=times, logprobs=[]))
    return Session(db_path=Path("unused.db"), id=1, name=name, schema=load_schema("0.32.0"), init=None, engines=[0],
                   handshake=[], inputs=[], outputs=[], registrations=[], requests=requests, utility=[])


def codes(findings):
    return sorted({f.code for f in findings})


def test_slower_first_token_and_steps_are_regressions():
    findings = performance_findings(session(20, 10), session(60, 30), RULES)
    # Requests a second apart: the session's token rate is set by their pacing, not by latency.
    assert codes(findings) == ["e2e_regression", "itl_regression", "ttft_regression"]
    ttft = next(f for f in findings if f.field == "ttft_ms.p50")
    assert (ttft.baseline, ttft.candidate) == (20.0, 60.0)


def test_small_changes_and_tiny_absolute_deltas_are_not():
    assert performance_findings(session(20, 10), session(24, 11), RULES) == []
    # 3x slower, but by under a millisecond: below min_delta_ms
    assert performance_findings(session(0.2, 0.1), session(0.6, 0.3), RULES) == []


def test_a_noise_floor_raises_what_counts_as_regression():
    baseline, candidate = session(20, 10), session(40, 10)
    assert "ttft_regression" in codes(performance_findings(baseline, candidate, RULES))
    # Another run of the same build was just as slow: that much variation is noise.
    noisy_repeat = session(38, 10)
    assert "ttft_regression" not in codes(performance_findings(baseline, candidate, RULES, [noisy_repeat]))


def test_back_to_back_requests_show_a_throughput_regression():
    findings = performance_findings(session(20, 10, gap_ms=60), session(60, 30, gap_ms=140), RULES)
    assert "throughput_regression" in codes(findings)
