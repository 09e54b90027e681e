"""Behaviour findings: per matched request, what the engine produced and what the frontend did.

Each request is judged by every tier whose evidence it allows
(``compare/tokens.py``: exact tokens, the first divergence, the sampling
invariants; ``compare/context.py``: logprobs where both builds saw the same
context; ``compare/scoring.py``: teacher-forced scoring): it fails if any
tier fails it, and its verdict lists each. Finish reasons must be the same,
an ABORT where it was recorded; utility calls must get the same results.
Greedy or seeded requests that ran batched, in either session, do not
reproduce on vLLM's CPU build: unless repeat runs of the baseline build
(``repeats``) show them stable, they are judged at their first divergence
rather than held to every token.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from replay_proxy.compare.codes import Code
from replay_proxy.compare.context import context_judgement, context_shift_findings, noise_floor
from replay_proxy.compare.findings import Finding, Judgement, RequestVerdict, Severity
from replay_proxy.compare.rules import Rules
from replay_proxy.compare.tokens import (INVARIANTS, TIERS, UNJUDGED, deterministic, invariant_violations,
                                         token_judgement)
from replay_proxy.store.session import Matching, Request, Session


def batched(session: Session) -> set[str]:
    """Requests that ran while another request on the same engine was running."""
    spans = sorted((r.added_ns, r.last_ns or r.added_ns, r.engine_index, r.request_id) for r in session.requests)
    overlapping = set()
    for i, (start, end, engine, rid) in enumerate(spans):
        for other_start, other_end, other_engine, other in spans[i + 1:]:
            if other_start >= end:
                break  # sorted by start: no later one overlaps this one
            if engine == other_engine:
                overlapping |= {rid, other}
    return overlapping


def behaviour_findings(baseline: Session, candidate: Session, matching: Matching, rules: Rules,
                       repeats: Sequence[Matching] = (), frontend_under_test: bool = False,
                       scored: dict[str, Judgement] | None = None) -> tuple[list[Finding], list[RequestVerdict]]:
    """The findings, and each baseline request's verdict. ``repeats``: the baseline's requests matched with
    each repeat run of the baseline build's; ``scored``: the teacher-forced judgements, by request."""
    findings, verdicts = [], []
    for request in matching.missing:
        findings.append(Finding("behaviour", Severity.REGRESSION, Code.REQUEST_UNMATCHED,
                                f"baseline request with a {len(request.prompt)}-token prompt has no counterpart",
                                message_kind="ADD", request_id=request.request_id))
        verdicts.append(RequestVerdict(request.request_id, UNJUDGED, False, "no counterpart in the candidate"))
    for request in matching.extra:
        findings.append(Finding("behaviour", Severity.WARNING, Code.REQUEST_EXTRA,
                                "the candidate has a request the baseline does not", message_kind="ADD",
                                request_id=request.request_id))
    # Batched requests do not reproduce on vLLM's CPU build: noise, unless repeat runs show them stable.
    # A slower candidate batches requests that ran alone when recorded: those are noise too.
    unstable = {a.request_id for repeat in repeats for a, b in repeat.pairs if a.tokens != b.tokens}
    batched_in_candidate = batched(candidate)
    ran_batched = batched(baseline) | {a.request_id for a, b in matching.pairs
                                       if b.request_id in batched_in_candidate}
    noisy = {rid for rid in ran_batched if not repeats or rid in unstable} | unstable
    # A sampled request reproduces only where every repeat run showed it so.
    stable = ({a.request_id for a, _ in repeats[0].pairs}.intersection(
        *({a.request_id for a, _ in repeat.pairs} for repeat in repeats[1:])) - unstable) if repeats else set()
    floor = noise_floor(repeats)
    for a, b in matching.pairs:
        rid = a.request_id
        if a.frontend_aborted or b.frontend_aborted:
            if a.frontend_aborted != b.frontend_aborted:
                findings.append(Finding("behaviour", Severity.REGRESSION, Code.ABORT_MISMATCH,
                                        "aborted by the frontend in "
                                        f"{'baseline' if a.frontend_aborted else 'candidate'}"
                                        " only", request_id=rid))
            else:
                findings.append(_abort_landing(a, b, rules.abort_progress_tolerance_tokens))
            verdicts.append(RequestVerdict(rid, UNJUDGED, a.frontend_aborted == b.frontend_aborted,
                                    "aborted by the frontend: judged by where its ABORT landed"))
            continue
        judged = []
        reproduces = rid not in noisy if deterministic(baseline, a) else rid in stable
        for judgement, finding in (token_judgement(baseline, a, b, reproduces, rules),
                                   context_judgement(a, b, floor, rules)):
            judged += [judgement] if judgement is not None else []
            findings += [finding] if finding is not None else []
        if scored and rid in scored:
            judged.append(scored[rid])
        broken = invariant_violations(candidate, b, b.params.get("_eos_token_id"), rules.judging.vocab_size)
        for rule, what in broken:
            findings.append(Finding("behaviour", Severity.REGRESSION, Code.SAMPLING_INVARIANT, f"{rule}: {what}",
                                    request_id=rid, field=rule, tier=INVARIANTS))
        judged.append(Judgement(INVARIANTS, not broken, "; ".join(w for _, w in broken) or (
            f"{len(b.tokens)} tokens within its sampling parameters"
            + ("" if b.token_logprobs and not candidate.speculates else " (lengths and stop tokens: " + (
                "the engine drafted tokens, and its raw logprobs do not rank what its rejection sampler chose)"
                if b.token_logprobs else "no logprobs to rank them)")))))
        verdicts.append(_verdict(rid, judged))
        if a.finish_reason != b.finish_reason:
            severity = Severity.REGRESSION if deterministic(baseline, a) and rid not in noisy else Severity.WARNING
            findings.append(Finding("behaviour", severity, Code.FINISH_REASON_CHANGED,
                                    f"finish reason {a.finish_reason} -> {b.finish_reason}",
                                    request_id=rid, baseline=a.finish_reason, candidate=b.finish_reason))
        elif len(a.tokens) != len(b.tokens) and not deterministic(baseline, a):
            findings.append(Finding("behaviour", Severity.WARNING, Code.LENGTH_CHANGED,
                                    f"generated {len(a.tokens)} tokens, now {len(b.tokens)}", request_id=rid,
                                    baseline=len(a.tokens), candidate=len(b.tokens)))
    findings += context_shift_findings(matching.pairs, repeats)
    findings += _utility_findings(baseline, candidate, frontend_under_test, rules.unordered_utility_results)
    return findings, verdicts


def _verdict(rid: str, judged: list[Judgement]) -> RequestVerdict:
    """A request's verdict: every tier that judged it, strongest first; decided by the strongest that failed
    it, else the strongest that passed it."""
    judged = sorted(judged, key=lambda j: TIERS.index(j.tier))
    decides = next((j for j in judged if not j.passed), judged[0])
    return RequestVerdict(rid, decides.tier, decides.passed, decides.why, tuple(judged))


def _abort_landing(a: Request, b: Request, tolerance: int) -> Finding:
    """Where the ABORT landed in each session: tokens before it, not the total (what was in flight varies)."""
    off = abs((a.abort_progress or 0) - (b.abort_progress or 0)) > tolerance  # (both aborted: neither is None)
    return Finding("behaviour", Severity.WARNING if off else Severity.INFO,
                   Code.ABORT_PROGRESS if off else Code.ABORT_LANDED,
                   f"ABORT after {a.abort_progress} tokens in the baseline, {b.abort_progress} in the candidate"
                   + (f" (more than {tolerance} off)" if off else ""),
                   message_kind="ABORT", request_id=a.request_id, baseline=a.abort_progress,
                   candidate=b.abort_progress)


def _utility_findings(baseline: Session, candidate: Session, frontend_under_test: bool,
                      unordered: frozenset[str]) -> list[Finding]:
    """Utility calls by method; a call the frontend under test no longer makes is its choice: a warning. The
    results of ``unordered`` methods are compared as sets."""
    findings = []
    remaining = defaultdict(list)
    for call in candidate.utility:
        remaining[call["method"]].append(call)
    for call in baseline.utility:
        counterpart = remaining[call["method"]].pop(0) if remaining[call["method"]] else None
        if counterpart is None:
            findings.append(Finding("behaviour", Severity.WARNING if frontend_under_test else Severity.REGRESSION,
                                    Code.UTILITY_CALL_MISSING,
                                    f"utility call {call['method']} has no counterpart", message_kind="UTILITY",
                                    field=call["method"]))
        elif (_result(call, unordered), call["failure_message"]) != (_result(counterpart, unordered),
                                                                      counterpart["failure_message"]):
            findings.append(Finding(
                "behaviour", Severity.REGRESSION, Code.UTILITY_RESULT_CHANGED,
                f"utility {call['method']} answered {counterpart['failure_message'] or counterpart['result']} "
                f"instead of {call['failure_message'] or call['result']}", message_kind="UTILITY_OUTPUT",
                field=call["method"], baseline=call["failure_message"] or call["result"],
                candidate=counterpart["failure_message"] or counterpart["result"]))
    for method, calls in remaining.items():
        for _ in calls:
            findings.append(Finding("behaviour", Severity.WARNING, Code.UTILITY_CALL_EXTRA,
                                    f"the candidate made an extra utility call {method}", message_kind="UTILITY",
                                    field=method))
    return findings


def _result(call: dict[str, Any], unordered: frozenset[str]) -> str | None:
    """A utility call's result (JSON: [type info, value]); of an ``unordered`` method, its list sorted."""
    result: str | None = call["result"]
    if call["method"] not in unordered or result is None:
        return result
    value = json.loads(result)
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], list):
        return json.dumps([value[0], sorted(value[1], key=json.dumps)])
    return result
