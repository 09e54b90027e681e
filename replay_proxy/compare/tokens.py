"""What each request generated, judged by the strongest evidence it allows.

* ``exact``: a greedy or seeded request that reproduces (it ran alone in
  both sessions, or was stable in every repeat run of the baseline) must
  generate the baseline's tokens; so must a sampled request that every
  repeat run of the baseline showed stable (vLLM's CPU build, with its
  default seed, reproduces them).
* ``first_divergence``: a greedy or seeded one that does not reproduce
  (batched on vLLM's CPU build, where a batch's numerics move a near-tie) is
  judged where its tokens first differ, as vLLM's own tests judge two runs
  (``check_logprobs_close``): each side's token must be among the other
  side's top-k logprobs, and for a greedy request the two must be nearly
  tied there (within ``judging.tie_logprob``) on each side that has them; for
  a seeded one, the logprobs there must have moved (a batch's numerics move
  a seeded draw only by moving the distribution it is drawn from).
  Where only the candidate has logprobs (the baseline is the recording) the
  check is one-sided.
* ``same_context`` (``compare/context.py``): every request's logprobs where
  both builds saw the same context.
* ``invariants``: every token the candidate generated obeys its request's
  sampling parameters as the candidate's own logprobs define them: greedy
  is rank 1, top-k, min-p, and top-p by a lower bound on the mass of the
  tokens ranked above the sampled one (the listed top-k and, by the sampled
  token's rank, every unlisted token at least as likely as it; given the
  vocabulary's size, all the unlisted mass the tokens below it cannot hold;
  above temperature 1, only given that size); a stop token (or EOS without ``ignore_eos``) ends the request
  once ``min_tokens`` are out, and none comes before; ``max_tokens`` holds.
  vLLM returns raw logprobs (before temperature and penalties): a request
  with penalties, a logit bias or allowed / bad words is judged by the
  length and stop rules only.

Teacher-forced scoring and the distribution of what was sampled
(``compare/scoring.py``) judge what the tokens cannot.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Judgement, Severity
from replay_proxy.compare.rules import Rules
from replay_proxy.store.session import Request, Session, TokenLogprobs

EXACT, FIRST_DIVERGENCE, SAME_CONTEXT, SCORED, INVARIANTS, UNJUDGED = (
    "exact", "first_divergence", "same_context", "scored", "invariants", "unjudged")
TIERS = (EXACT, FIRST_DIVERGENCE, SAME_CONTEXT, SCORED, INVARIANTS)  # a request's, strongest first
SAMPLED = "sampled"  # the session's sampled requests together (compare/scoring.py)
GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: below it a request is greedy
LOGPROB_SLACK = 1e-4  # float32 logprobs: equal within this
# Sampling values that change the logits before the sampler sees them: raw logprobs no longer rank its choices.
LOGIT_CHANGERS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
LOGIT_LISTS = ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs", "guided_decoding")


def greedy(session: Session, request: Request) -> bool:
    return (session.schema.sampling_value(request.params, "temperature") or 0.0) < GREEDY_TEMPERATURE


def deterministic(session: Session, request: Request) -> bool:
    """Greedy or seeded: the same tokens run after run (when it ran alone)."""
    return greedy(session, request) or session.schema.sampling_value(request.params, "seed") is not None


def token_judgement(baseline: Session, a: Request, b: Request, reproduces: bool, rules: Rules
                    ) -> tuple[Judgement | None, Finding | None]:
    """The ``exact`` or ``first_divergence`` judgement of a request (None where its tokens cannot be judged),
    and the finding of a failure or of a divergence left unjudged. ``reproduces``: it ran alone, or repeat runs
    of the baseline build showed it stable; a sampled request is judged only then, and exactly."""
    rid = a.request_id
    if not reproduces and not deterministic(baseline, a):
        return None, None
    if a.tokens == b.tokens:
        return Judgement(EXACT, True, f"the same {len(a.tokens)} tokens"), None
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), min(len(a.tokens), len(b.tokens)))
    finding = functools.partial(Finding, request_id=rid, position=first, baseline=a.tokens[first:first + 5],
                                candidate=b.tokens[first:first + 5])  # (the divergence, as each finding says it)
    if reproduces:
        why = f"tokens diverge at position {first} of {len(a.tokens)}, and the request reproduces (it ran alone " \
              "or was stable in every baseline run)"
        return Judgement(EXACT, False, why), finding("behaviour", Severity.REGRESSION, Code.TOKEN_MISMATCH, why,
                                                     tier=EXACT)
    ours, theirs = _at(b, first), _at(a, first)
    if ours is None or first >= min(len(a.tokens), len(b.tokens)):
        why = (f"tokens diverge at position {first} of {len(a.tokens)}; batched, so not reproducible on vLLM's CPU "
               "build, and " + ("the candidate returned no logprobs to judge the divergence" if ours is None else
                                "one side ended there") + " (--noise-runs tell whether it is stable)")
        return None, finding("behaviour", Severity.WARNING, Code.TOKEN_MISMATCH, why, tier=UNJUDGED)
    problem = _divergence_problem(a.tokens[first], b.tokens[first], theirs, ours, greedy(baseline, a),
                                  rules.judging.tie_logprob)
    sides = "both builds' top-k" if theirs is not None else "the candidate's top-k (the baseline has no logprobs)"
    if problem:
        why = f"tokens diverge at position {first} of {len(a.tokens)}: {problem}"
        return Judgement(FIRST_DIVERGENCE, False, why), finding(
            "behaviour", Severity.REGRESSION, Code.DIVERGENCE_NOT_CLOSE, why, tier=FIRST_DIVERGENCE)
    return Judgement(FIRST_DIVERGENCE, True, f"batched; tokens diverge at position {first} between tokens "
                                             f"close in {sides}"), None


def _at(request: Request, position: int) -> TokenLogprobs | None:
    return request.token_logprobs[position] if position < len(request.token_logprobs) else None


def _divergence_problem(base_token: int, cand_token: int, base: TokenLogprobs | None, cand: TokenLogprobs,
                        is_greedy: bool, tie: float) -> str | None:
    """Why the divergence is not one of two close tokens (None if it is)."""
    if base_token not in cand.top:
        return f"the baseline's token {base_token} is not in the candidate's top {len(cand.top)}"
    if base is not None and cand_token not in base.top:
        return f"the candidate's token {cand_token} is not in the baseline's top {len(base.top)}"
    if is_greedy:
        for name, side, chosen, other in (("candidate", cand, cand_token, base_token),
                                          ("baseline", base, base_token, cand_token)):
            if side is not None and other in side.top and side.logprob - side.top[other] > tie:
                return (f"greedy, yet the {name} put token {chosen} {side.logprob - side.top[other]:.3g} nats above "
                        f"token {other} (a tie is within {tie:g})")
    elif base is not None:
        # A seeded draw from one distribution with one generator is one token: a batch's numerics can move the
        # draw only by moving the logprobs (by at least half the margin the draw had), so where both builds
        # gave the same logprobs there, the seed was not honoured or the sampler changed.
        moved = max((abs(base.top[t] - cand.top[t]) for t in base.top.keys() & cand.top.keys()), default=math.inf)
        if moved <= LOGPROB_SLACK:
            return (f"seeded, and both builds gave the tokens there the same logprobs (within {LOGPROB_SLACK:g}): "
                    "one seed draws one token from one distribution, so the seed was not honoured or the sampler "
                    "changed")
    return None


def invariant_violations(session: Session, request: Request, eos: int | None, vocab_size: int | None = None
                         ) -> list[tuple[str, str]]:
    """(rule, what broke it) for each sampling rule the request's generated tokens break (the module's
    docstring), judged from its own logprobs; ``vocab_size``: the model's, where known (``judging.vocab_size``)."""

    def value(key: str) -> Any:
        return session.schema.sampling_value(request.params, key)

    tokens, broken = request.tokens, []
    max_tokens, min_tokens = value("max_tokens"), value("min_tokens") or 0
    stops = set(value("stop_token_ids") or ()) | ({eos} if eos is not None and not value("ignore_eos") else set())
    if isinstance(max_tokens, int) and len(tokens) > max_tokens:
        broken.append(("max_tokens", f"{len(tokens)} tokens generated, max_tokens {max_tokens}"))
    early = next((i for i, t in enumerate(tokens[:min_tokens]) if t in stops), None)
    if early is not None:
        broken.append(("min_tokens", f"stop token {tokens[early]} at position {early}, before min_tokens {min_tokens}"))
    elif request.finish_reason == "stop" and len(tokens) < min_tokens:
        broken.append(("min_tokens", f"stopped after {len(tokens)} tokens, min_tokens {min_tokens}"))
    past = next((i for i, t in enumerate(tokens[:-1]) if t in stops and i >= min_tokens), None)
    if past is not None and not request.frontend_aborted:
        broken.append(("stop_token_ids", f"stop token {tokens[past]} at position {past} did not end the request "
                                         f"({len(tokens)} tokens)"))
    elif tokens and tokens[-1] in stops and len(tokens) >= min_tokens and request.finish_reason == "length":
        broken.append(("stop_token_ids", f"ended on stop token {tokens[-1]} with finish reason length"))
    if any(value(k) not in (None, default) for k, default in LOGIT_CHANGERS.items()) or any(
            value(k) for k in LOGIT_LISTS):
        return broken  # the sampler's logits are not the raw ones the logprobs come from
    if session.speculates:  # a rejection sampler's draws are not ranked by the target's raw logprobs either:
        return broken  # real 0.32.0 with n-gram drafts gave a greedy request a rank-407 token at a rejected draft
    temperature, top_k = value("temperature") or 0.0, value("top_k") or 0
    top_p, min_p = value("top_p") or 1.0, value("min_p") or 0.0
    # Until min_tokens are out the engine masks every stop token (its _all_stop_token_ids): not candidates then.
    masked = stops | set(request.params.get("_all_stop_token_ids") or ())
    # Logits of a bf16 or fp16 model tie (a top-k shows it: two tokens of one position with one logprob): the
    # rank then counts ties as above, which the nucleus may not, and bounds nothing.
    ranks_bound = not any(len(set(row.top.values())) < len(row.top) for row in request.token_logprobs)
    for i, row in enumerate(request.token_logprobs[:len(tokens)]):
        if i < min_tokens:
            row = _without(row, masked)
        if not row.top:
            continue
        best = max(row.top.values())
        if temperature < GREEDY_TEMPERATURE:
            if row.logprob < best - LOGPROB_SLACK:
                broken.append(("greedy", f"token {row.token} at position {i} is rank {row.rank} "
                                         f"({best - row.logprob:.3g} nats below the most likely)"))
            continue
        if 0 < top_k < row.rank and row.logprob < sorted(row.top.values(), reverse=True)[min(top_k, len(row.top)) - 1] \
                - LOGPROB_SLACK:
            broken.append(("top_k", f"token {row.token} at position {i} is rank {row.rank}, top_k {top_k}"))
        if min_p > 0 and row.logprob - best < temperature * math.log(min_p) - LOGPROB_SLACK:
            share = math.exp((row.logprob - best) / temperature)
            broken.append(("min_p", f"token {row.token} at position {i} has {share:.3g} of the most likely token's "
                                    f"probability, min_p {min_p:g}"))
        above = _mass_above(row, temperature, top_k, vocab_size, ranks_bound)
        if top_p < 1 and above is not None and above > top_p + LOGPROB_SLACK:
            broken.append(("top_p", f"token {row.token} at position {i} lies outside the nucleus: tokens more likely "
                                    f"than it hold at least {above:.3f} of the mass, top_p {top_p:g}"))
    return broken


def _without(row: TokenLogprobs, masked: set[int]) -> TokenLogprobs:
    """``row`` with the ``masked`` tokens taken out of the running (its token's rank counts the rest)."""
    if not masked & row.top.keys():
        return row
    above = sum(1 for t, lp in row.top.items() if t in masked and lp > row.logprob)
    return TokenLogprobs(row.token, row.logprob, row.rank - above,
                         {t: lp for t, lp in row.top.items() if t not in masked})


def _mass_above(row: TokenLogprobs, temperature: float, top_k: int, vocab_size: int | None, ranks_bound: bool
                ) -> float | None:
    """A lower bound on the probability (at ``temperature``, within ``top_k``) of the tokens more likely than
    ``row.token``; None where none can be had (above temperature 1 without the vocabulary's size, or without
    ``ranks_bound``: logits that tie).

    The top-k lists some of those tokens exactly. The token's rank counts all of them (vLLM ranks a token
    among every token at least as likely: a tie counts as above, so this holds only where logits do not tie),
    each unlisted one at least as likely as the token and no likelier than the last listed one. The unlisted
    mass is known (the raw logprobs are normalized); with the vocabulary's size, so is how many tokens lie
    below the token, each no likelier than it: what they cannot hold lies above it. At a temperature T,
    p**(1/T) is bounded by p times a power of the bound on p (convex at T <= 1, concave above: Jensen's
    inequality bounds the tokens below)."""
    vocab_size = vocab_size if ranks_bound else None  # with ties, only the listed tokens bound anything
    if temperature > 1 and vocab_size is None:
        return None
    ranked = sorted(row.top.values(), reverse=True)
    kept = ranked[:top_k] if top_k else ranked
    best, own = max(ranked[0], row.logprob), row.logprob

    def weight(lp: float) -> float:  # (scaled by the best: no overflow)
        return math.exp((lp - best) / temperature)

    def power(mass: float, cap: float) -> float:
        return mass * math.exp(cap * (1 / temperature - 1) - best / temperature)

    others = {t: lp for t, lp in row.top.items() if t != row.token}
    listed_above = [lp for lp in others.values() if lp > own + LOGPROB_SLACK and lp >= kept[-1]]
    listed_below = [lp for lp in others.values() if lp <= own + LOGPROB_SLACK and lp >= kept[-1]]
    unlisted_above = max(0, row.rank - 1 - sum(lp >= own - LOGPROB_SLACK for lp in others.values())) \
        if ranks_bound else 0
    if top_k and top_k <= len(ranked):  # every token kept is listed
        above, below = sum(map(weight, listed_above)), sum(map(weight, listed_below))
        return above / (above + weight(own) + below)
    cap = min(own, ranked[-1])  # what an unlisted token below it may have at most
    unlisted = max(0.0, 1 - math.exp(own) * (row.token not in row.top) - sum(math.exp(lp) for lp in row.top.values()))
    mass_above = unlisted_above * math.exp(own)
    unlisted_below = None
    if vocab_size is not None:
        unlisted_below = max(0, vocab_size - row.rank - sum(lp < own - LOGPROB_SLACK for lp in others.values()))
        mass_above = max(mass_above, unlisted - unlisted_below * math.exp(cap))
    rest = max(0.0, unlisted - mass_above)
    if temperature <= 1:
        above = power(mass_above, own)  # each at least as likely as the token: p**(1/T) >= p * own**(1/T - 1)
        tail = power(rest, cap)
    else:  # each no likelier than the last listed; the tokens below hold at most n * (mass / n)**(1/T)
        above = power(mass_above, ranked[-1])
        tail = unlisted_below * weight(min(cap, math.log(rest / unlisted_below))) if unlisted_below and rest > 0 \
            else 0.0
    above += sum(map(weight, listed_above))
    return above / (above + weight(own) + sum(map(weight, listed_below)) + tail)
