"""Logprobs wherever the two builds saw the same context (the ``same_context`` tier).

Position i of a request's output was generated from its prompt and its first
i tokens. Until two runs of one request generate different tokens, both
builds saw the same context: at each position before the first differing
token, and at that position itself, their logprobs are two computations of
one distribution, whether the request was greedy, seeded or sampled, alone
or batched. vLLM returns them raw, from the logits the sampler receives, so a
change to the model or to what reaches the sampler (a scaled logit, a bad
cast between the two) shows there at once, on every request, whatever the
batch did after; a cut or a temperature applied otherwise leaves them alone
(the invariants and the sampled distribution see those).

Per position, the distance between the two top-k lists is the largest
difference of one token's logprob over every token either side lists (a
token that one side does not list counts there as likely as its last listed
one: a lower bound), so a change that keeps the order, such as a scaled
logit, shows as plainly as one that reorders. A request fails when its
largest distance is beyond the noise: where repeat runs of the baseline
build exist, the largest distance between them at the positions where they
in turn saw the same context (never below float32's ``LOGPROB_SLACK``);
with one baseline run, ``judging.same_context_logprob`` (rules.json), sized
for a GPU's batch noise.

A change too small to pass that tolerance at any one position (logits scaled
by 1.25 move a flat distribution's logprobs by 0.1 to 0.2 nats) still moves
every position alike, where a batch's noise moves them at random: over the
session, the mean change of the logprob of the token the baseline found most
likely, per request at its same-context positions, paired by request and
judged against the same build's own spread (``compare/shift.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Judgement, Severity
from replay_proxy.compare.rules import Rules
from replay_proxy.compare.shift import paired_shift
from replay_proxy.compare.tokens import LOGPROB_SLACK, SAME_CONTEXT
from replay_proxy.store.session import Matching, Request, TokenLogprobs


class Distance(msgspec.Struct, frozen=True):
    """How far one request's logprobs moved where both runs saw the same context."""

    largest: float  # nats: the largest difference of one token's logprob at one position
    position: int  # where it was
    positions: int  # how many positions both runs saw the same context at


def shared_positions(a: Request, b: Request) -> int:
    """How many of the first positions both runs generated from the same context: up to the first differing
    token, and that position itself, where both have logprobs."""
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
                 min(len(a.tokens), len(b.tokens)))
    return min(first + 1, len(a.token_logprobs), len(b.token_logprobs))


def position_distance(p: TokenLogprobs, q: TokenLogprobs) -> float:
    """The largest difference of one token's logprob between two computations of one position (the module's
    docstring)."""
    ps, qs = {**p.top, p.token: p.logprob}, {**q.top, q.token: q.logprob}
    p_last, q_last = min(p.top.values(), default=p.logprob), min(q.top.values(), default=q.logprob)
    return max((abs(ps[t] - qs[t]) if t in ps and t in qs else
                max(0.0, ps[t] - q_last) if t in ps else max(0.0, qs[t] - p_last)
                for t in ps.keys() | qs.keys()), default=0.0)


def distance(a: Request, b: Request) -> Distance | None:
    """``b``'s distance from ``a`` where both saw the same context; None where either has no logprobs."""
    shared = shared_positions(a, b)
    if shared <= 0:
        return None
    each = [position_distance(p, q) for p, q in zip(a.token_logprobs[:shared], b.token_logprobs[:shared])]
    worst = max(range(shared), key=each.__getitem__)
    return Distance(each[worst], worst, shared)


def noise_floor(repeats: Sequence[Matching]) -> float | None:
    """The largest distance between the baseline build's runs, over every request; None without repeat runs."""
    if not repeats:
        return None
    return max((d.largest for repeat in repeats for a, b in repeat.pairs if (d := distance(a, b)) is not None),
               default=0.0)


def context_judgement(a: Request, b: Request, floor: float | None, rules: Rules
                      ) -> tuple[Judgement | None, Finding | None]:
    """The ``same_context`` judgement of a matched pair (None where either side has no logprobs), and the
    finding of a failure. ``floor``: the baseline runs' own largest distance (``noise_floor``)."""
    d = distance(a, b)
    if d is None:
        return None, None
    limit, against = ((max(floor, LOGPROB_SLACK), "the baseline runs' own spread") if floor is not None else
                      (rules.judging.same_context_logprob, "the tolerance for one baseline run"))
    said = (f"over the {d.positions} position(s) where both builds saw the same context, a logprob moved by up "
            f"to {d.largest:.3g} nats (at position {d.position}; {against}: {limit:.3g})")
    if d.largest <= limit:
        return Judgement(SAME_CONTEXT, True, said), None
    return Judgement(SAME_CONTEXT, False, said), Finding(
        "behaviour", Severity.REGRESSION, Code.CONTEXT_LOGPROBS_DIFFER, said, tier=SAME_CONTEXT,
        request_id=a.request_id, position=d.position, baseline=round(limit, 6), candidate=round(d.largest, 6))


def _top_shift(a: Request, b: Request) -> float | None:
    """The mean change, over the positions where both saw the same context, of the logprob ``b`` gives the
    token ``a`` found most likely (one ``b`` does not list counts as likely as its last listed one)."""
    shared = shared_positions(a, b)
    if shared <= 0:
        return None
    moves = []
    for p, q in zip(a.token_logprobs[:shared], b.token_logprobs[:shared]):
        ps, qs = {**p.top, p.token: p.logprob}, {**q.top, q.token: q.logprob}
        best = max(ps, key=ps.__getitem__)
        moves.append(qs.get(best, min(q.top.values(), default=q.logprob)) - ps[best])
    return sum(moves) / len(moves)


def context_shift_findings(pairs: list[tuple[Request, Request]], repeats: Sequence[Matching]) -> list[Finding]:
    """The session's shift where both builds saw the same context (the module's docstring); none where fewer
    than two requests have logprobs on both sides."""
    shifts = [s for a, b in pairs if (s := _top_shift(a, b)) is not None]
    if len(shifts) < 2:
        return []
    repeat_means = [sum(each) / len(each) for repeat in repeats
                    if (each := [s for a, b in repeat.pairs if (s := _top_shift(a, b)) is not None])]
    shift = paired_shift(shifts, repeat_means)
    return [shift.finding(
        (Code.CONTEXT_SHIFT, Code.CONTEXT_SAME),
        f"where both builds saw the same context ({len(shifts)} requests), the logprob of the token the baseline "
        f"found most likely moved by {shift.said('nats')}",
        f"the candidate's distributions are {'sharper' if shift.mean > 0 else 'flatter'} than the baseline's "
        "everywhere (a scaled logit, a temperature applied twice, a numerics change)",
        tier=SAME_CONTEXT, field="same_context", baseline=0.0, candidate=round(shift.mean, 6))]
