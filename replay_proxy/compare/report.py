"""Report assembly: two loaded sessions in, one ``Report`` out (``diff`` and both replays);
and the report of two release schemas (``schema diff``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.compare.behaviour import behaviour_findings
from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Report, RequestVerdict, Severity
from replay_proxy.compare.performance import LATENCIES, latency_samples, timing_findings
from replay_proxy.compare.rules import Rules
from replay_proxy.compare.sampling import sampling_findings
from replay_proxy.compare.schema import observed_shapes, schema_findings
from replay_proxy.compare.drift import drift_findings
from replay_proxy.compare.rejection import fold_consequences
from replay_proxy.compare.schema_diff import diff_schemas
from replay_proxy.compare.scoring import sampled_findings, scoring_findings, teacher_forced
from replay_proxy.store.cut import source_digest
from replay_proxy.store.session import Request, Session, load_session, match_requests
from replay_proxy.wire.messages import Side
from replay_proxy.wire.rust import RustSchema, pair_structs
from replay_proxy.wire.schema import Schema, schema_lines
from replay_proxy.wire.values import to_json

HELD_KEYS = frozenset({"max_tokens", "min_tokens"})  # what ``replay --hold-lengths`` sets in every ADD
ASKED_KEYS = frozenset({"logprobs"})  # what a replay against an engine asks of every ADD (the judging's logprobs)


class Replayed(msgspec.Struct, frozen=True):
    """How a replay made the candidate's runs and the baseline build's (a ``Comparison``'s ``replayed``)."""

    against: Side  # the peer under test (the replay played the other side)
    held_lengths: bool = False  # every request asked for its recorded lengths (replay --hold-lengths)
    asked_logprobs: bool = False  # every request asked for the judging's logprobs (against an engine)


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """What a report compares, and how its sessions came to be.

    ``baseline`` and ``candidate``: the two sessions. ``baseline_runs``: more runs of the baseline build (the
    noise floor); ``candidate_runs``: more of the candidate's, interleaved with them: timing pools them.
    ``replayed``: None where both sessions were recorded (``diff``); a replay's (``Replayed``) where the
    candidate and the baseline build's runs are replays, while the baseline is a recording made under other
    conditions (the real peers sharing the machine): behaviour is then judged against the first run of the
    baseline build, replayed as the candidate was (the others measure run-to-run variation), and timing against
    all of them, pooled, if there are two or more (with fewer, how much runs of one build differ is not known:
    timing is not judged). ``other_cpu``: by run, the share of the machine's CPU that other processes took while
    it ran: timing is not judged where one took more than ``performance.max_other_cpu`` (a busy neighbour, not
    this build). ``recorded_in``: the database the replay's sessions are in.
    """

    title: str
    baseline: Session
    candidate: Session
    baseline_runs: tuple[Session, ...] = ()
    candidate_runs: tuple[Session, ...] = ()
    replayed: Replayed | None = None
    other_cpu: dict[str, float] = msgspec.field(default_factory=dict)
    recorded_in: str | None = None


def build_report(comparison: Comparison, rules: Rules, added: Sequence[Finding] = ()) -> Report:
    """The one place where two sessions become a report. ``added``: what was found besides the two sessions (a
    player's findings, the peer's rejections, what judging cost, a cut's account), folded in with the rest
    (``fold_consequences``: what a rejection explains is moved under it).

    A redacted recording's tokens are pseudonyms an engine never produces: against an engine, behaviour
    is judged against the baseline build's replay of it (the first noise run), or not at all.
    """
    c, replayed = comparison, comparison.replayed
    baseline, candidate, noise = c.baseline, c.candidate, c.baseline_runs
    frontend_under_test = replayed is not None and replayed.against is Side.FRONTEND
    held_lengths = replayed is not None and replayed.held_lengths
    asked_logprobs = replayed is not None and replayed.asked_logprobs
    asked = asked_logprobs or baseline.sent_by_replay or candidate.sent_by_replay  # (diff of a replay's session)
    set_by_replay = (HELD_KEYS if held_lengths else frozenset()) | (ASKED_KEYS if asked else frozenset())
    keys = [k for k in rules.match_sampling_keys if k not in set_by_replay]
    matching = match_requests(baseline, candidate, keys)
    # Behaviour is judged against the baseline build's first replay where there is one (above); its other runs
    # (or the baseline's) are repeats, which show the requests of one build that do not reproduce.
    judged, repeat_runs, judged_matching = ((noise[0], noise[1:], match_requests(noise[0], candidate, keys))
                                            if replayed is not None and noise else (baseline, noise, matching))
    repeats = [match_requests(judged, run, rules.match_sampling_keys) for run in repeat_runs]
    shapes = observed_shapes(baseline), observed_shapes(candidate)
    pseudonyms = baseline.redacted and not frontend_under_test
    scoring = teacher_forced(baseline, list(noise), candidate) if replayed is not None else None
    scored_findings, scored = scoring_findings(scoring, rules) if asked_logprobs else ([], {})
    findings = [*schema_findings(baseline, candidate, shapes, rules),
                *sampling_findings(matching.pairs, candidate, rules, set_by_replay)]
    verdicts: list[RequestVerdict] = []
    if judged is not baseline or not pseudonyms:
        behaviour, verdicts = behaviour_findings(judged, candidate, judged_matching, rules, repeats,
                                                 frontend_under_test, scored)
        findings += behaviour
    findings += scored_findings
    if asked_logprobs:
        findings += sampled_findings(list(noise), judged_matching.pairs)
    findings += timing_findings(baseline, candidate, matching, noise, c.candidate_runs, replayed is not None, keys,
                                rules, c.other_cpu)
    if pseudonyms:
        findings.append(Finding("behaviour", Severity.INFO, Code.REDACTED_RECORDING, (
            f"the recording is redacted: the engine was sent pseudonymized tokens, so tokens, finish reasons and "
            f"utility results are judged against {judged.label}, the baseline build replayed with them"
            if judged is not baseline else
            "the recording is redacted: the engine was sent pseudonymized tokens, so tokens, finish reasons and "
            "utility results are not judged (--noise-runs with --baseline-cmd judges them against the baseline "
            "build)"), field="redacted_recording"))
    if held_lengths:
        findings.append(Finding("behaviour", Severity.INFO, Code.LENGTHS_HELD,
                                "each request asked for its recorded number of tokens (--hold-lengths)",
                                field="lengths_held"))
    timing = noise[0] if replayed is not None and noise else baseline
    a, b = latency_samples(timing), latency_samples(candidate)
    divergences = _divergences(judged_matching.pairs, findings)
    return Report(
        title=c.title, baseline=baseline.label, candidate=candidate.label, verdicts=verdicts,
        findings=fold_consequences([*findings, *added], rules), recorded_in=c.recorded_in,
        samples={m: {"baseline": a[m], "candidate": b[m]} for m in ("ttft_ms", "itl_ms") if a[m] or b[m]},
        schemas=_side_by_side(baseline.schema, candidate.schema, findings, (baseline.registrations,
                                                                            candidate.registrations)),
        noise=[n.label for n in noise],
        performance_threshold=rules.performance.min_relative_change,
        kl={"noise floor": [s.kl for s in scoring.noise.values()],
            "candidate": [s.kl for s in scoring.candidate.values()]} if scoring else {},
        divergences=divergences,
        checks=([f"schema:{s}" for s in sorted(shapes[0])] + ["schema:EngineCoreReadyResponse"]
                + [f"behaviour:{r.request_id}" for r in baseline.requests]
                + [f"performance:{m}.p{p}" for m in LATENCIES for p in rules.percentiles]
                + ["performance:throughput_tokens_s"]))


def _divergences(pairs: list[tuple[Request, Request]], findings: list[Finding], limit: int = 12
                 ) -> dict[str, dict[str, Any]]:
    """For the report's plot: where the tokens of a request first diverged, and each side's logprob of its own
    tokens (the first ``limit`` such requests that have logprobs)."""
    diverged = {f.request_id: f.position for f in findings
                if f.code in (Code.TOKEN_MISMATCH, Code.DIVERGENCE_NOT_CLOSE)}
    shown = [(a, b) for a, b in pairs if a.request_id in diverged and (a.logprobs or b.logprobs)][:limit]
    return {a.request_id: {"position": diverged[a.request_id], "baseline": a.logprobs, "candidate": b.logprobs}
            for a, b in shown}


def diff_sessions(baseline_db: Path, baseline: str, candidate_db: Path, candidate: str, rules: Rules,
                  noise: Sequence[str] = (), candidate_noise: Sequence[str] = ()) -> Report:
    """``replay-proxy diff``: two recorded sessions, and ``noise``, more runs of the baseline build (sessions
    of the baseline's database), and ``candidate_noise``, of the candidate's (of its database). A candidate cut
    from the baseline (``replay-proxy cut``) is compared over the requests it keeps: the others were left out,
    not lost."""
    after = load_session(candidate_db, candidate)
    source = after.cut_from or {}
    digest = source_digest(baseline_db) if source.get("file") == baseline_db.name else None
    before = load_session(baseline_db, baseline)
    cut = digest is not None and source.get("source") == digest and source.get("session_id") == before.id
    if cut:
        kept = {r.request_id for r in after.requests}
        before = msgspec.structs.replace(before, requests=[r for r in before.requests if r.request_id in kept])
    added = []
    if cut:
        how = ", ".join(f"{k} {v}" for k, v in (source.get("selection") or {}).items()) or "all requests"
        added.append(Finding("behaviour", Severity.INFO, Code.CUT_OF_BASELINE, (
            f"the candidate is a cut of the baseline ({how}): compared over the {len(kept)} requests it keeps"),
            field="cut_of_baseline"))
    return build_report(Comparison(
        title="diff", baseline=before, candidate=after,
        baseline_runs=tuple(load_session(baseline_db, n) for n in noise),
        candidate_runs=tuple(load_session(candidate_db, n) for n in candidate_noise)), rules, added)


def schema_report(old: Schema, new: Schema) -> Report:
    """Every change between two release schemas, with the decoders it breaks."""
    findings = diff_schemas(old, new)
    return Report(title="schema diff", baseline=old.release, candidate=new.release, findings=findings,
                  schemas=_side_by_side(old, new, findings),
                  checks=[f"schema:{n}" for n in sorted(set(old.structs) | set(new.structs))])


def drift_report(python: Schema, rust: RustSchema, rules: Rules) -> Report:
    """Every difference between a release's two languages, with the readers it breaks (``schema drift``)."""
    findings = drift_findings(python, rust, rules.frontend_handled_sampling_keys)
    return Report(title="schema drift", baseline=f"python {python.release}", candidate=f"rust {rust.release}",
                  findings=findings, checks=[f"schema:{n}" for n in sorted(pair_structs(python, rust))])


def _side_by_side(a: Schema, b: Schema, findings: list[Finding],
                  registrations: tuple[list[dict[str, Any]], list[dict[str, Any]]] = ([], [])
                  ) -> dict[str, dict[str, list[str]]]:
    """The structs that findings name, as field lines of each side; the registration, a map on the wire, as the
    keys each side's sent, aligned, one it lacks shown as missing."""
    structs = sorted({f.struct for f in findings if f.category == "schema" and f.struct in a.structs
                      and f.struct in b.structs})
    shown = {s: {"baseline": schema_lines(a.structs[s].fields), "candidate": schema_lines(b.structs[s].fields)}
             for s in structs}
    if "EngineCoreReadyResponse" in shown and all(registrations):
        sent = [side[0] for side in registrations]
        keys = sorted(set(sent[0]) | set(sent[1]))
        shown["EngineCoreReadyResponse"] = {
            side: [f"{k}: {to_json(held[k])}" if k in held else f"{k}: (missing)" for k in keys]
            for side, held in zip(("baseline", "candidate"), sent)}
    return shown


def combine(title: str, reports: Sequence[tuple[str, Report]]) -> Report:
    """One report of the replays of several sessions, each ``(label, report)`` in order: their findings, verdicts,
    checks and evidence, each named with its session's label (a request ``LABEL/ID``, a finding of no request
    ``LABEL: message``), their samples pooled. One replay's report is its own."""
    if len(reports) == 1:
        return reports[0][1]

    def named(label: str, finding: Finding) -> Finding:
        if finding.request_id is not None:
            return msgspec.structs.replace(finding, request_id=f"{label}/{finding.request_id}")
        return msgspec.structs.replace(finding, message=f"{label}: {finding.message}")

    samples: dict[str, dict[str, list[float]]] = {}
    kl: dict[str, list[float]] = {}
    for _, report in reports:
        for metric, sides in report.samples.items():
            for side, values in sides.items():
                samples.setdefault(metric, {}).setdefault(side, []).extend(values)
        for side, values in report.kl.items():
            kl.setdefault(side, []).extend(values)
    return Report(
        title=title, baseline="; ".join(r.baseline for _, r in reports),
        candidate="; ".join(r.candidate for _, r in reports),
        findings=[named(label, f) for label, r in reports for f in r.findings], samples=samples,
        schemas={struct: lines for _, r in reversed(reports) for struct, lines in r.schemas.items()},  # (the first's)
        noise=[f"{label}: {n}" for label, r in reports for n in r.noise],
        checks=[f"{label}: {c}" for label, r in reports for c in r.checks],
        performance_threshold=next((r.performance_threshold for _, r in reports
                                    if r.performance_threshold is not None), None),
        verdicts=[msgspec.structs.replace(v, request_id=f"{label}/{v.request_id}") for label, r in reports
                  for v in r.verdicts],
        kl=kl, divergences={f"{label}/{request}": d for label, r in reports for request, d in r.divergences.items()})
