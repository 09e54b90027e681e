"""Judging what tokens cannot: teacher-forced scoring, and the distribution of what was sampled.

Teacher-forced scoring (llama.cpp's ``--kl-divergence``, on replayed
traffic). Each recorded request's prompt and recorded output went to the
baseline build and to the candidate as one prompt asking for prompt logprobs
(``replay/play_frontend.py``), so both builds scored the very same tokens,
whatever was sampled and however the requests were batched (a redacted
session's pseudonyms too). Per output token, with P the baseline's top-k
distribution and Q the candidate's:

* KL(P || Q) over P's top-k tokens and one bucket for the rest (a lower
  bound on the full-vocabulary KL; a token missing from Q's top-k counts
  at most as likely as Q's last listed one);
* delta-p: the change in the probability of the recorded token;
* same top-1: whether both builds rank the same token first.

The noise floor is the baseline scored twice (its second pass in reverse
order, so batched differently), and against each further baseline run. A
request fails when its mean KL is beyond ``judging.min_kl`` and beyond every
request's floor; the session, when the 95% interval of its mean KL (a
bootstrap over requests) lies beyond both ``judging.min_kl`` and the floor's.

The distribution of what was sampled. vLLM returns raw logprobs (before
temperature), so a temperature or a penalty applied wrongly leaves every
score alike and every sampled token still "allowed", but moves which tokens
get sampled: over the session's sampled requests, the mean raw logprob of
the sampled tokens in the candidate's replay against the baseline's, paired
by request and judged against the same build's own spread
(``compare/shift.py``), its effect stated in nats per token and in standard
deviations of the requests' shifts.
"""

from __future__ import annotations

import math

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Judgement, Severity
from replay_proxy.compare.rules import Rules
from replay_proxy.compare.shift import mean_interval, paired_shift
from replay_proxy.compare.tokens import SAMPLED, SCORED, greedy
from replay_proxy.store.session import Request, Session, TokenLogprobs

FLOOR = 1e-12  # a probability no bucket goes below (log of zero)


class Score(msgspec.Struct, frozen=True):
    """One request's recorded output, scored by two builds (or by one build twice)."""

    kl: float  # mean KL(P || Q) per token, nats
    max_delta_p: float  # the largest change in a recorded token's probability
    same_top1: float  # the share of positions where both rank the same token first
    tokens: int


def position_kl(p: TokenLogprobs, q: TokenLogprobs) -> float:
    """KL(P || Q) over P's top-k tokens and a bucket for the rest (the module's docstring)."""
    q_last = min(q.top.values(), default=q.logprob)
    listed_p = {t: math.exp(lp) for t, lp in p.top.items()}
    listed_q = {t: math.exp(q.top[t]) if t in q.top else math.exp(q.logprob) if t == q.token else math.exp(q_last)
                for t in listed_p}
    rest_p, rest_q = max(FLOOR, 1 - sum(listed_p.values())), max(FLOOR, 1 - sum(listed_q.values()))
    kl = sum(pi * math.log(pi / max(FLOOR, listed_q[t])) for t, pi in listed_p.items() if pi > 0)
    return max(0.0, kl + rest_p * math.log(rest_p / rest_q))


def score(a: list[TokenLogprobs], b: list[TokenLogprobs]) -> Score | None:
    """How far ``b``'s scoring of one output lies from ``a``'s; None when either has no rows."""
    pairs = [(p, q) for p, q in zip(a, b) if p.top and q.top]
    if not pairs:
        return None
    kls = [position_kl(p, q) for p, q in pairs]
    return Score(kl=sum(kls) / len(kls),
                 max_delta_p=max(abs(_p(q.logprob) - _p(p.logprob)) for p, q in pairs),
                 same_top1=sum(_top1(p) == _top1(q) for p, q in pairs) / len(pairs),
                 tokens=len(pairs))


def _p(logprob: float) -> float:
    return math.exp(logprob) if math.isfinite(logprob) else 0.0


def _top1(row: TokenLogprobs) -> int:
    """The likeliest token of a position's top-k."""
    return max(row.top, key=lambda token: row.top[token])


def output_rows(session: Session, scoring: int, request: Request) -> list[TokenLogprobs]:
    """``session``'s pass ``scoring`` rows of ``request``'s recorded output tokens (row i scores token i + 1)."""
    rows = session.scores.get(scoring, {}).get(request.request_id, [])
    start = len(request.prompt) - 1
    return rows[start:start + len(request.tokens)]


class Scoring(msgspec.Struct, frozen=True):
    """Teacher-forced scoring of a session: per request, the candidate's score and the noise floor's."""

    candidate: dict[str, Score]
    noise: dict[str, Score]


def teacher_forced(recording: Session, baseline: list[Session], candidate: Session) -> Scoring | None:
    """Each recorded request scored by the first baseline run and by the candidate, and the floor: the first
    baseline run's two passes, and the first against each further run. None when the runs were not scored."""
    if not baseline or not baseline[0].scores or not candidate.scores:
        return None
    first, cand, noise = baseline[0], {}, {}
    for request in recording.requests:
        rows = output_rows(first, 0, request)
        if (s := score(rows, output_rows(candidate, 0, request))) is not None:
            cand[request.request_id] = s
        scored = [score(rows, output_rows(first, 1, request)),
                  *(score(rows, output_rows(run, 0, request)) for run in baseline[1:])]
        floors = [f for f in scored if f is not None]
        if floors:
            noise[request.request_id] = max(floors, key=lambda f: f.kl)
    return Scoring(cand, noise)


def scoring_findings(scoring: Scoring | None, rules: Rules) -> tuple[list[Finding], dict[str, Judgement]]:
    """The session's scoring finding and each scored request's judgement (with a finding for each failure)."""
    if scoring is None or not scoring.candidate:
        return [Finding("behaviour", Severity.INFO, Code.SCORING_NOT_JUDGED,
                        "teacher-forced scoring not judged: it needs a baseline run (--baseline-cmd with --noise-runs)",
                        tier=SCORED, field="scoring")], {}
    limit = rules.judging.min_kl
    floor = max((s.kl for s in scoring.noise.values()), default=0.0)
    findings, verdicts = [], {}
    for rid, s in scoring.candidate.items():
        said = (f"scored on its {s.tokens} recorded tokens: KL {s.kl:.3g} nats/token (noise floor {floor:.3g}, "
                f"threshold {limit:g}), top-1 agrees at {s.same_top1:.0%}, a recorded token's probability moved by "
                f"up to {s.max_delta_p:.3g}")
        failed = s.kl > max(limit, floor)
        verdicts[rid] = Judgement(SCORED, not failed, said)
        if failed:
            findings.append(Finding("behaviour", Severity.REGRESSION, Code.SCORES_DIVERGE, said, tier=SCORED,
                                    request_id=rid, baseline=round(floor, 6), candidate=round(s.kl, 6)))
    mean, low, high = mean_interval([s.kl for s in scoring.candidate.values()])
    noise_mean, _, noise_high = mean_interval([s.kl for s in scoring.noise.values()] or [0.0])
    agree = sum(s.same_top1 * s.tokens for s in scoring.candidate.values()) / sum(
        s.tokens for s in scoring.candidate.values())
    beyond = low > max(limit, noise_high)
    findings.append(Finding(
        "behaviour", Severity.REGRESSION if beyond else Severity.INFO, Code.SCORING_KL if beyond else Code.SCORING_SAME,
        f"teacher-forced scoring of {len(scoring.candidate)} requests: mean KL {mean:.3g} nats/token (95% CI "
        f"{low:.3g} to {high:.3g}) against a noise floor of {noise_mean:.3g} (up to {noise_high:.3g}); top-1 agrees "
        f"at {agree:.1%}" + (f": beyond the floor and {limit:g}" if beyond else ""),
        tier=SCORED, field="scoring", baseline=round(noise_high, 6), candidate=round(mean, 6)))
    return findings, verdicts


def sampled_findings(baseline: list[Session], pairs: list[tuple[Request, Request]]) -> list[Finding]:
    """The distribution of what was sampled (the module's docstring), over the pairs of sampled requests."""
    first = baseline[0] if baseline else None
    if first is None:
        return []
    sampled = [(a, b) for a, b in pairs if not greedy(first, a) and a.token_logprobs and b.token_logprobs]
    if len(sampled) < 2:
        return []
    repeats = []
    for run in baseline[1:]:
        by_id = {r.request_id: r for r in run.requests}
        diffs = [_mean(by_id[a.request_id]) - _mean(a) for a, _ in sampled
                 if a.request_id in by_id and by_id[a.request_id].token_logprobs]
        if diffs:
            repeats.append(sum(diffs) / len(diffs))
    shift = paired_shift([_mean(b) - _mean(a) for a, b in sampled], repeats)
    ranks = sum(_rank(b) for _, b in sampled) / len(sampled), sum(_rank(a) for a, _ in sampled) / len(sampled)
    return [shift.finding(
        (Code.SAMPLED_SHIFT, Code.SAMPLED_SAME),
        f"the tokens sampled in {len(sampled)} sampled requests: mean raw logprob {shift.said('nats/token')} "
        f"against the baseline's; mean rank {ranks[1]:.2f} -> {ranks[0]:.2f}",
        f"{'more' if shift.mean > 0 else 'less'} likely tokens are sampled than the baseline samples: a "
        "temperature, penalty or cut applied otherwise",
        tier=SAMPLED, field="sampled_distribution", baseline=round(ranks[1], 3), candidate=round(ranks[0], 3))]


def _mean(request: Request) -> float:
    values = [t.logprob for t in request.token_logprobs if math.isfinite(t.logprob)]
    return sum(values) / len(values) if values else 0.0


def _rank(request: Request) -> float:
    return sum(t.rank for t in request.token_logprobs) / len(request.token_logprobs)
