"""Performance findings on hand-built sessions: effect sizes with intervals, false alarms, detectable effects.

Sessions are drawn from seeded lognormal latencies (skewed, as real ones
are), so every figure here is exact for its seed and nothing depends on
this machine's speed.
"""

import random
from pathlib import Path

import msgspec

from replay_proxy.compare.findings import Severity
from replay_proxy.compare.performance import performance_findings, timing_findings
from replay_proxy.compare.rules import load_rules
from replay_proxy.store.session import Request, Session, match_requests
from replay_proxy.wire.registry import load_schema

RULES = load_rules()
MS = 1_000_000


def session(seed: int, factor: float = 1.0, requests: int = 200, tokens: int = 8, name: str = "s",
            gap_ms: float = 100, stalled: int = 0) -> Session:
    """``requests`` greedy requests, one every ``gap_ms``: TTFT about 20 ms and gaps about 10 ms, times ``factor``.

    Request k costs what its prompt costs in every session (a lognormal of its own, as a longer
    prompt would), times this run's noise: the part that pairing by request takes out."""
    rng = random.Random(seed)
    made = []
    for k in range(requests):
        start = int(k * gap_ms * MS)
        prompt_cost = random.Random(k).lognormvariate(0, 0.4)
        ttft = 20 * factor * prompt_cost * rng.lognormvariate(0, 0.1)
        times = [start + int(ttft * MS)]
        for _ in range(tokens - 1):
            times.append(times[-1] + int(10 * factor * rng.lognormvariate(0, 0.1) * MS))
        made.append(Request(
            seq=k, request_id=f"{name}-{k}", engine_index=0, prompt=[k], params={"temperature": 0.0},
            tokens=[1] * tokens, finish_reason="length", added_ns=start, first_token_ns=times[0], last_ns=times[-1],
            abort_progress=None, output_times=_read_after_stall(times) if k < stalled else times,
            engine_times_ns=times))
    return Session(db_path=Path("unused.db"), id=seed, name=name, schema=load_schema("0.32.0"), init=None,
                   engines=[0], handshake=[], inputs=[], outputs=[], registrations=[], requests=made, utility=[])


def _read_after_stall(times: list[int]) -> list[int]:
    """Arrival times of outputs a starved reader took at once, after the last was made: 0.02 ms apart."""
    return [times[0], *(times[-1] + i * MS // 50 for i in range(len(times) - 1))]


def findings(baseline, candidate, noise=()):
    matching = match_requests(baseline, candidate, RULES.match_sampling_keys)
    return {f.field: f for f in performance_findings(baseline, candidate, matching, RULES, list(noise))}


def test_a_ten_percent_slowdown_is_a_regression_whose_interval_holds_ten_percent():
    found = findings(session(1), session(2, factor=1.10))
    for field in ("itl_ms.p50", "itl_ms.p90", "e2e_ms.p50"):
        change = found[field].change
        assert found[field].code.endswith("_regression") and found[field].severity is Severity.REGRESSION, field
        assert change.low <= 0.10 <= change.high and change.low > RULES.performance.min_relative_change, field
        assert change.paired and change.samples[0] == change.samples[1]
    # TTFT varies more with the prompt: its interval holds the 10% too, it is only wider.
    assert found["ttft_ms.p50"].change.low <= 0.10 <= found["ttft_ms.p50"].change.high
    # Requests 100 ms apart: the session's token rate is set by their pacing, not by their latency.
    assert found["throughput_tokens_s"].code == "throughput_no_change"


def test_back_to_back_requests_show_a_throughput_regression():
    found = findings(session(13, gap_ms=60), session(14, factor=1.5, gap_ms=90))
    assert found["throughput_tokens_s"].code == "throughput_regression"
    assert found["throughput_tokens_s"].change.high < -0.05


def test_identical_builds_raise_a_regression_in_at_most_one_repeat_in_ten():
    alarms = sum(any(f.severity is Severity.REGRESSION for f in findings(session(2 * k), session(2 * k + 1)).values())
                 for k in range(40))
    assert alarms <= 4, alarms


def test_an_improvement_is_reported_as_one():
    found = findings(session(3), session(4, factor=0.8))
    assert found["ttft_ms.p50"].code == "ttft_improvement" and found["ttft_ms.p50"].severity is Severity.INFO
    assert found["ttft_ms.p50"].change.high < -0.05
    assert found["itl_ms.p90"].code == "itl_improvement"


def test_no_change_states_the_smallest_change_the_sample_could_show():
    small, large = (findings(session(5, requests=n), session(6, requests=n)) for n in (12, 400))
    for found in (small, large):
        assert found["ttft_ms.p50"].code == "ttft_no_change"
        assert "the smallest change this sample could show is" in found["ttft_ms.p50"].message
    # Fewer requests, wider interval: a larger effect could hide in them.
    assert small["ttft_ms.p50"].change.minimum_detectable > large["ttft_ms.p50"].change.minimum_detectable > 0.05
    assert "ttft_ms.p90" in small and "ttft_ms.p90" not in findings(session(5, requests=6), session(6, requests=6))


def test_noise_runs_that_differ_as_much_widen_the_interval_past_a_regression():
    baseline, candidate = session(7), session(8, factor=1.08)
    assert findings(baseline, candidate)["itl_ms.p50"].code == "itl_regression"
    # Two more runs of the baseline build came out 8% and 7% slower: that much is this machine.
    noisy = findings(baseline, candidate, [session(9, factor=1.08, name="n1"), session(10, factor=0.93, name="n2")])
    assert noisy["itl_ms.p50"].code == "itl_no_change" and noisy["itl_ms.p50"].change.noise_runs == 2


def test_tiny_absolute_changes_are_not_regressions():
    def scaled(seed, factor):  # sub-millisecond latencies, tripled: below every absolute floor
        s = session(seed, factor)
        for r in s.requests:
            r.first_token_ns = r.added_ns + (r.first_token_ns - r.added_ns) // 1000
            r.output_times = [r.first_token_ns + (t - r.output_times[0]) // 1000 for t in r.output_times]
            r.engine_times_ns, r.last_ns = r.output_times, r.output_times[-1]
        return s
    found = findings(scaled(11, 1.0), scaled(12, 3.0))
    assert not [f for f in found.values() if f.field != "throughput_tokens_s" and f.severity is Severity.REGRESSION]


def test_inter_token_gaps_are_the_engines_so_a_reader_that_reads_a_backlog_at_once_changes_nothing():
    # Three in four requests of the baseline read in one burst (their arrival gaps 0.02 ms, not 10).
    baseline = session(1, stalled=150)
    found = findings(baseline, session(2))
    assert found["itl_ms.p50"].code == "itl_no_change", found["itl_ms.p50"].message
    assert 9 < found["itl_ms.p50"].baseline < 11
    # The same outputs without the engine's stamps, timed as they arrived: the burst reads as much faster.
    unstamped = msgspec.structs.replace(baseline, requests=[
        msgspec.structs.replace(r, engine_times_ns=None) for r in baseline.requests])
    by_arrival = findings(unstamped, session(2))["itl_ms.p50"]
    assert by_arrival.code == "itl_regression" and by_arrival.baseline < 1, by_arrival.message


def interleaved(baseline_factors, candidate_factors):
    """Findings of a replay whose baseline build and candidate ran interleaved, each run slowed by its factor
    (load that came and went), both sides pooled."""
    noise = [session(20 + i, factor=f, name=f"b{i}") for i, f in enumerate(baseline_factors)]
    candidate, *candidate_runs = [session(30 + i, factor=f, name=f"c{i}") for i, f in enumerate(candidate_factors)]
    findings = timing_findings(session(10), candidate, None, noise, candidate_runs, True, RULES.match_sampling_keys,
                               RULES, {})
    assert findings[-1].code == "timing_baseline", findings[-1]
    return {f.field: f for f in findings}


def test_load_that_falls_on_one_candidate_run_is_not_a_regression_and_a_slower_build_is():
    # One of the candidate's two runs shared the machine with other work (30% slower); the other did not.
    transient = interleaved([1.0, 1.02], [1.3, 1.0])["itl_ms.p50"]
    assert transient.code == "itl_no_change" and "within the runs' spread" in transient.message, transient.message
    slower = interleaved([1.0, 1.02], [1.3, 1.28])["itl_ms.p50"]
    assert slower.code == "itl_regression", slower.message


def test_a_run_the_machine_did_not_give_whole_is_not_timed():
    """Other processes took 60% of the machine's CPU during a candidate run (a neighbour's engine starting):
    no timing verdict, said so, rather than a slower build measured."""
    from replay_proxy.compare.report import Comparison, Replayed, build_report
    from replay_proxy.wire.messages import Side

    recording, runs = session(40, name="rec"), [session(41, name="b1"), session(42, name="b2")]
    slower = session(43, factor=1.5, name="c1")
    def replay(other_cpu):
        return build_report(Comparison(title="replay", baseline=recording, candidate=slower, baseline_runs=tuple(runs),
                                       replayed=Replayed(Side.ENGINE), other_cpu=other_cpu), RULES)

    quiet = replay({"c1 (#43)": 0.05, "b1 (#41)": 0.02})
    assert {f.code for f in quiet.findings if f.severity is Severity.REGRESSION} >= {"itl_regression"}
    busy = replay({"c1 (#43)": 0.6, "b1 (#41)": 0.02})
    [said] = [f for f in busy.findings if f.category == "performance"]
    assert said.code == "timing_not_judged" and "60% of the machine's CPU during c1 (#43)" in said.message


def replayed(run: Session) -> Session:
    return msgspec.structs.replace(run, replayed=True)


def test_a_diff_judges_timing_as_a_replay_does_with_two_replays_a_side_and_never_against_a_recording():
    def diff(baseline, candidate, noise=(), candidate_runs=()):
        return {f.field: f for f in timing_findings(baseline, candidate, match_requests(
            baseline, candidate, RULES.match_sampling_keys), list(noise), list(candidate_runs), False,
            RULES.match_sampling_keys, RULES, {})}

    slower = session(2, factor=1.3, name="c")
    against_recording = diff(session(1), replayed(slower))  # once 7 regressions, one interval degenerate
    assert list(against_recording) == ["timing"] and "s (#1): a recording" in against_recording["timing"].message
    one_run_a_side = diff(replayed(session(1)), replayed(slower))
    assert list(one_run_a_side) == ["timing"] and "one run a side" in one_run_a_side["timing"].message
    judged = diff(replayed(session(1)), replayed(slower), [replayed(session(3, name="b2"))],
                  [replayed(session(4, factor=1.3, name="c2"))])
    assert judged["itl_ms.p50"].code == "itl_regression"
    assert judged["itl_ms.p50"].change.low < judged["itl_ms.p50"].change.high  # (not a degenerate interval)
