"""Report assembly: two loaded sessions in, one ``Report`` out (``diff`` and both replays);
and the report of two release schemas (``schema diff``)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from replay_proxy.compare.behaviour import behaviour_findings
from replay_proxy.compare.findings import Finding, Report, Severity
from replay_proxy.compare.performance import LATENCIES, latency_samples, performance_findings
from replay_proxy.compare.rules import Rules
from replay_proxy.compare.sampling import sampling_findings
from replay_proxy.compare.schema import observed_shapes, schema_findings
from replay_proxy.compare.schema_diff import diff_schemas
from replay_proxy.store.cut import source_digest
from replay_proxy.store.session import Session, decode_and_load, match_requests
from replay_proxy.wire.schema import Schema, schema_lines

HELD_KEYS = frozenset({"max_tokens", "min_tokens"})  # what ``replay --hold-lengths`` sets in every ADD


def build_report(title: str, baseline: Session, candidate: Session, rules: Rules,
                 noise: list[Session] = (), frontend_under_test: bool = False, replayed_noise: bool = False,
                 held_lengths: bool = False) -> Report:
    """The one place where two sessions become a report.

    ``noise``: more runs of the baseline build. ``replayed_noise``: they are replays, like the candidate,
    while the baseline is a recording made under other conditions (the real peers sharing the machine):
    their first run is then the baseline for timing, and the others measure run-to-run variation.
    ``held_lengths``: the candidate's requests (and the noise runs') asked for their recorded lengths
    (``replay --hold-lengths``), so max_tokens and min_tokens are theirs, not the recording's.

    A redacted recording's tokens are pseudonyms an engine never produces: against an engine, behaviour
    is judged against the baseline build's replay of it (the first noise run), or not at all.
    """
    held = HELD_KEYS if held_lengths else frozenset()
    keys = [k for k in rules.match_sampling_keys if k not in held]
    matching = match_requests(baseline, candidate, keys)
    shapes = observed_shapes(baseline), observed_shapes(candidate)
    timing, variation = (noise[0], noise[1:]) if replayed_noise and noise else (baseline, noise)
    timing_matching = matching if timing is baseline else match_requests(timing, candidate, keys)
    judged, judged_noise, judged_matching = baseline, noise, matching
    pseudonyms = baseline.redacted and not frontend_under_test
    if pseudonyms and noise:
        judged, judged_noise, judged_matching = noise[0], noise[1:], match_requests(noise[0], candidate, keys)
    findings = [*schema_findings(baseline, candidate, shapes, rules),
                *sampling_findings(matching.pairs, candidate, rules, held),
                *(behaviour_findings(judged, candidate, judged_matching, rules, judged_noise, frontend_under_test)
                  if judged is not baseline or not pseudonyms else []),
                *performance_findings(timing, candidate, timing_matching, rules, variation)]
    if pseudonyms:
        findings.append(Finding("behaviour", Severity.INFO, "redacted_recording", (
            f"the recording is redacted: the engine was sent pseudonymized tokens, so tokens, finish reasons and "
            f"utility results are judged against {judged.label}, the baseline build replayed with them"
            if judged is not baseline else
            "the recording is redacted: the engine was sent pseudonymized tokens, so tokens, finish reasons and "
            "utility results are not judged (--noise-runs with --baseline-cmd judges them against the baseline "
            "build)"), field="redacted_recording"))
    if held:
        findings.append(Finding("behaviour", Severity.INFO, "lengths_held",
                                "each request asked for its recorded number of tokens (--hold-lengths)",
                                field="lengths_held"))
    if timing is not baseline:
        findings.append(Finding("performance", Severity.INFO, "timing_baseline",
                                f"latency is compared with {timing.label}, the baseline build replayed as the "
                                f"candidate was, not with the recording", field="timing_baseline"))
    a, b = latency_samples(timing), latency_samples(candidate)
    return Report(
        title=title, baseline=baseline.label, candidate=candidate.label, findings=findings,
        samples={m: {"baseline": a[m], "candidate": b[m]} for m in ("ttft_ms", "itl_ms") if a[m] or b[m]},
        schemas=_side_by_side(baseline.schema, candidate.schema, findings), noise=[n.label for n in noise],
        performance_threshold=rules.performance.min_relative_change,
        checks=([f"schema:{s}" for s in sorted(shapes[0])] + ["schema:EngineCoreReadyResponse"]
                + [f"behaviour:{r.request_id}" for r in baseline.requests]
                + [f"performance:{m}.p{p}" for m in LATENCIES for p in rules.percentiles]
                + ["performance:throughput_tokens_s"]))


def diff_sessions(baseline_db: Path, baseline: str, candidate_db: Path, candidate: str, rules: Rules,
                  noise: list[str] = ()) -> Report:
    """``replay-proxy diff``: two recorded sessions, and ``noise``, more runs of the baseline build (sessions
    of the baseline's database). A candidate cut from the baseline (``replay-proxy cut``) is compared over
    the requests it keeps: the others were left out, not lost."""
    after = decode_and_load(candidate_db, candidate)
    source = after.cut_from or {}
    # The digest before the baseline is opened (opening an older file adds the columns a newer proxy records).
    digest = source_digest(baseline_db) if source.get("file") == baseline_db.name else None
    before = decode_and_load(baseline_db, baseline)
    cut = digest is not None and source.get("source") == digest and source.get("session_id") == before.id
    if cut:
        kept = {r.request_id for r in after.requests}
        before = msgspec.structs.replace(before, requests=[r for r in before.requests if r.request_id in kept])
    report = build_report("diff", before, after, rules, [decode_and_load(baseline_db, n) for n in noise])
    if cut:
        how = ", ".join(f"{k} {v}" for k, v in (source.get("selection") or {}).items()) or "all requests"
        report.findings.append(Finding("behaviour", Severity.INFO, "cut_of_baseline", (
            f"the candidate is a cut of the baseline ({how}): compared over the {len(kept)} requests it keeps"),
            field="cut_of_baseline"))
    return report


def schema_report(old: Schema, new: Schema) -> Report:
    """Every change between two release schemas, with the decoders it breaks."""
    findings = diff_schemas(old, new)
    return Report(title="schema diff", baseline=old.release, candidate=new.release, findings=findings,
                  schemas=_side_by_side(old, new, findings),
                  checks=[f"schema:{n}" for n in sorted(set(old.structs) | set(new.structs))])


def _side_by_side(a: Schema, b: Schema, findings) -> dict[str, dict[str, list[str]]]:
    """The structs that findings name, as field lines of each side."""
    structs = sorted({f.struct for f in findings if f.category == "schema" and f.struct in a.structs
                      and f.struct in b.structs})
    return {s: {"baseline": schema_lines(a.structs[s].fields), "candidate": schema_lines(b.structs[s].fields)}
            for s in structs}
