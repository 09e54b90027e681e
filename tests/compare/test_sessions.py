"""Session comparison on recorded sim sessions: each drift knob gives its finding, and only it."""

import pytest
import trio

from replay_proxy.compare.findings import Severity, exit_code
from replay_proxy.compare.report import Comparison, build_report
from replay_proxy.compare.rules import load_rules
from replay_proxy.errors import ExitCode
from replay_proxy.sim.drift import EngineDrift, FrontendDrift
from replay_proxy.store.session import load_session
from tests.helpers import RecordedSession

RULES = load_rules()


async def record(nursery, db, name, overlapping=(), **drift):
    session = await RecordedSession(nursery, db, name=name, **drift).start()
    frontend = session.frontend
    for k in range(6):  # one at a time, like the real-vLLM workload, but those overlapping the next
        await frontend.add(f"r{k}", [3, 4, 5 + k], max_tokens=4 + k, temperature=0.0, seed=k if k % 2 else None)
        if k in overlapping:
            continue
        with trio.move_on_after(2):  # a drifted peer may never answer
            await frontend.wait_for(lambda k=k: f"r{k}" in frontend.finish_reasons)
    call = await frontend.utility("get_supported_tasks")
    await frontend.wait_for(lambda: call in frontend.utility_results)
    session.recorder.close()
    return load_session(db, name)


async def diff(db, overlapping_in_candidate=(), **drift):
    async with trio.open_nursery() as nursery:
        baseline = await record(nursery, db, "baseline")
        candidate = await record(nursery, db, "candidate", overlapping_in_candidate, **drift)
        nursery.cancel_scope.cancel()
    report = build_report(Comparison(title="diff", baseline=baseline, candidate=candidate), RULES)
    return [f for f in report.findings if f.severity >= Severity.WARNING and f.category != "performance"], report


async def test_same_build_gives_no_findings(db_path):
    with trio.fail_after(30):
        significant, report = await diff(db_path)
    findings = report.findings
    assert significant == []
    assert exit_code([f for f in findings if f.category != "performance"]) is ExitCode.OK


@pytest.mark.parametrize("drift, expected", [
    (dict(engine_drift=EngineDrift(drop_registration_key="block_size")),
     [("registration_key_missing", "EngineCoreReadyResponse", "block_size", None, Severity.BREAKING)]),
    (dict(engine_drift=EngineDrift(insert_output_field=5)),
     [("field_inserted", "EngineCoreOutput", "finish_reason", 5, Severity.BREAKING)]),
    (dict(engine_drift=EngineDrift(append_outputs_field=True)),
     [("array_longer", "EngineCoreOutputs", None, 9, Severity.BREAKING)]),
    (dict(engine_drift=EngineDrift(finish_reason="stop")),
     [("finish_reason_changed", None, None, None, Severity.REGRESSION)] * 6),
    (dict(frontend_drift=FrontendDrift(add_sampling_key="temperature_v2")),
     [("sampling_key_unknown", "SamplingParams", "temperature_v2", None, Severity.WARNING)]),
])
async def test_each_drift_knob_gives_exactly_its_finding(db_path, drift, expected):
    with trio.fail_after(30):
        significant, _ = await diff(db_path, **drift)
    category = "behaviour" if expected[0][0] == "finish_reason_changed" else "schema"
    assert sorted((f.code, f.struct, f.field, f.position, f.severity) for f in significant
                  if f.category == category) == sorted(expected)


async def test_an_inserted_output_field_is_misread_downstream(db_path):
    with trio.fail_after(30):
        significant, _ = await diff(db_path, engine_drift=EngineDrift(insert_output_field=5))
    # A 0.32.0 reader takes the inserted 0 for finish_reason STOP: every request "ends" at its first token.
    assert sum(f.code == "finish_reason_changed" and f.candidate == "stop" for f in significant) == 6


async def test_changed_tokens_are_a_behaviour_regression_with_the_divergence_point(db_path):
    with trio.fail_after(30):
        significant, report = await diff(db_path, engine_drift=EngineDrift(token_offset=1))
        findings = report.findings
    mismatches = [f for f in significant if f.code == "token_mismatch"]
    assert len(mismatches) == 6 and all(f.position == 0 and f.severity == Severity.REGRESSION for f in mismatches)
    assert exit_code(findings) is ExitCode.BEHAVIOUR


async def test_changed_tokens_of_requests_the_candidate_ran_batched_are_only_warnings(db_path):
    # Each ran alone when recorded; a slower candidate ran r1 and r2 beside each other.
    with trio.fail_after(30):
        significant, _ = await diff(db_path, overlapping_in_candidate={1}, engine_drift=EngineDrift(token_offset=1))
    severity = {f.request_id: f.severity for f in significant if f.code == "token_mismatch"}
    assert severity == {f"r{k}": Severity.WARNING if k in (1, 2) else Severity.REGRESSION for k in range(6)}


async def test_a_renamed_sampling_key_shows_both_sides(db_path):
    with trio.fail_after(30):
        renamed = FrontendDrift(rename_sampling_key=("max_tokens", "max_tokenz"))
        _, report = await diff(db_path, frontend_drift=renamed)
        findings = report.findings
    codes = {(f.code, f.field) for f in findings}
    assert ("sampling_key_unknown", "max_tokenz") in codes
    # the engine no longer sees max_tokens: every request runs to its default length instead,
    # and no longer matches its baseline request
    assert sum(f.code == "request_unmatched" for f in findings) == 6


async def test_an_inserted_request_field_is_found_and_its_requests_never_run(db_path):
    with trio.fail_after(60):
        significant, _ = await diff(db_path, frontend_drift=FrontendDrift(insert_request_field=10))
    schema = [(f.code, f.struct, f.field, f.position) for f in significant if f.category == "schema"]
    assert schema == [("field_inserted", "EngineCoreRequest", "prompt_is_token_ids", 10)]
    # The engine's decoder rejects every ADD (client_index is now None): no request produces tokens.
    assert sum(f.code == "token_mismatch" and f.candidate == [] for f in significant) == 6


@pytest.mark.parametrize("key, breaks", [("block_size", ("python-frontend", "rust-frontend")),
                                         ("dp_stats_address", ("python-frontend",))])
async def test_a_missing_registration_key_breaks_the_frontends_whose_own_layout_requires_it(db_path, key, breaks):
    """Both of 0.32.0's frontends require block_size; vllm-rs 0.32.0 declares dp_stats_address an Option."""
    with trio.fail_after(30):
        significant, report = await diff(db_path, engine_drift=EngineDrift(drop_registration_key=key))
    [missing] = [f for f in significant if f.code == "registration_key_missing"]
    assert (missing.field, missing.severity, missing.breaks) == (key, Severity.BREAKING, breaks)
    # Side by side, the registrations as sent: the key the candidate lacks is shown missing, beside the baseline's.
    sides = report.schemas["EngineCoreReadyResponse"]
    [(had, lacks)] = [(a, b) for a, b in zip(sides["baseline"], sides["candidate"]) if a != b]
    assert had.startswith(f"{key}: ") and lacks == f"{key}: (missing)"
