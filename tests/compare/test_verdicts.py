"""Each request's verdict on hand-built sessions: exact tokens, the first divergence, the sampling invariants,
teacher-forced scoring and the distribution of what was sampled, each tier shown failing where it must.

Distributions here are small and peaked, as a trained model's: a top-4 of logprobs per position, the rest of
the mass beyond it.
"""

import math
import random
from pathlib import Path

import msgspec

from replay_proxy.compare.findings import Severity, exit_code
from replay_proxy.compare.report import Comparison, Replayed, build_report
from replay_proxy.compare.rules import load_rules
from replay_proxy.compare.scoring import position_kl
from replay_proxy.compare.tokens import invariant_violations
from replay_proxy.errors import ExitCode
from replay_proxy.report.render import grouped, verdict_counts
from replay_proxy.store.session import RecordedFrame, Request, Session, TokenLogprobs, load_session
from replay_proxy.wire.messages import Kind, Side
from replay_proxy.wire.registry import load_schema

RECORDINGS = Path(__file__).resolve().parents[2] / "recordings"

RULES = load_rules()
SCHEMA = load_schema("0.32.0")
JUDGED = Replayed(Side.ENGINE, asked_logprobs=True)  # a replay against an engine, with the judging's logprobs
MS = 1_000_000


def row(token: int, top: dict[int, float]) -> TokenLogprobs:
    """A position's logprobs: ``token`` chosen among ``top`` (token -> logprob)."""
    logprob = top.get(token, min(top.values()) - 1)
    return TokenLogprobs(token, logprob, 1 + sum(lp > logprob for lp in top.values()), top)


PEAKED = {10: math.log(0.6), 11: math.log(0.2), 12: math.log(0.1), 13: math.log(0.05)}


def request(rid: str, tokens: list[int], start_ms: float = 0, rows=None, **params) -> Request:
    """A request of ``tokens`` generated one per 10 ms from ``start_ms``, each chosen among ``PEAKED``."""
    times = [int((start_ms + 10 * (i + 1)) * MS) for i in range(len(tokens))]
    return Request(seq=0, request_id=rid, engine_index=0, prompt=[1, 2, 3], params=params, tokens=tokens,
                   finish_reason="length", added_ns=int(start_ms * MS), first_token_ns=times[0], last_ns=times[-1],
                   abort_progress=None, output_times=times, engine_times_ns=times,
                   token_logprobs=rows if rows is not None else [row(t, PEAKED) for t in tokens])


def session(name: str, *requests: Request, scores=None) -> Session:
    return Session(db_path=Path("unused.db"), id=hash(name) % 1000, name=name, schema=SCHEMA, init=None,
                   engines=[0], handshake=[], inputs=[], outputs=[], registrations=[], requests=list(requests),
                   utility=[], scores=scores or {})


def judge(baseline: Session, candidate: Session, recording: Session | None = None):
    """A replay's report: ``candidate`` against ``baseline``, the baseline build's one replay of ``recording``."""
    report = build_report(Comparison(title="replay", baseline=recording or baseline, candidate=candidate,
                                     baseline_runs=(baseline,), replayed=JUDGED), RULES)
    return report, {v.request_id: v for v in report.verdicts}


GREEDY = dict(temperature=0.0, max_tokens=4)


def test_a_greedy_request_that_ran_alone_is_held_to_its_exact_tokens():
    _, verdicts = judge(session("b", request("r", [10, 10, 10, 10], **GREEDY)),
                        session("c", request("r", [10, 10, 10, 10], **GREEDY)))
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("exact", True)
    report, verdicts = judge(session("b", request("r", [10, 10, 10, 10], **GREEDY)),
                             session("c", request("r", [10, 10, 11, 10], **GREEDY)))
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("exact", False)
    assert exit_code(report.findings) is ExitCode.BEHAVIOUR


def batched_pair(rid: str, tokens: list[int], **params) -> tuple[Request, Request]:
    """``rid`` with ``tokens``, and a second request running beside it."""
    return request(rid, tokens, **params), request(f"{rid}-beside", [10, 10, 10, 10], start_ms=5, **GREEDY)


def test_a_batched_greedy_request_that_diverges_at_a_tie_passes_and_one_that_does_not_fails():
    tie = {10: -0.7, 11: -0.75, 12: -3.0, 13: -4.0}
    base = batched_pair("r", [10, 10, 10], **GREEDY)
    near = batched_pair("r", [10, 11, 10], **GREEDY)
    base[0].token_logprobs[1] = row(10, tie)
    near[0].token_logprobs[1] = row(11, {**tie, 11: -0.69})
    _, verdicts = judge(session("b", *base), session("c", *near))
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("first_divergence", True), verdicts["r"].why
    far = batched_pair("r", [10, 12, 12], **GREEDY)
    far[0].token_logprobs[1] = row(12, PEAKED)  # the candidate took a token 1.8 nats below its own best
    report, verdicts = judge(session("b", *base), session("c", *far))
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("first_divergence", False), verdicts["r"].why
    assert "divergence_not_close" in {f.code for f in report.findings if f.severity is Severity.REGRESSION}


def test_a_batched_seeded_request_may_diverge_only_where_its_logprobs_moved():
    seeded = dict(temperature=0.8, seed=7, max_tokens=3)
    base = batched_pair("r", [10, 11, 10], **seeded)
    same_distribution = batched_pair("r", [10, 12, 10], **seeded)  # the same logprobs, another draw: no seed
    _, verdicts = judge(session("b", *base), session("c", *same_distribution))
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("first_divergence", False), verdicts["r"].why
    moved = batched_pair("r", [10, 12, 10], **seeded)
    moved[0].token_logprobs[1] = row(12, {k: v + 0.001 * k for k, v in PEAKED.items()})  # a batch's numerics
    _, verdicts = judge(session("b", *base), session("c", *moved))
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("first_divergence", True), verdicts["r"].why


def judge_runs(baselines: list[Session], candidate: Session):
    """A replay's report against several interleaved runs of the baseline build (the first is judged against,
    the others are repeats)."""
    report = build_report(Comparison(title="replay", baseline=baselines[0], candidate=candidate,
                                     baseline_runs=tuple(baselines), replayed=JUDGED), RULES)
    return report, {v.request_id: v for v in report.verdicts}


SAMPLED = dict(temperature=0.8, top_p=0.9, max_tokens=4)
SCALED = {t: lp * 1.25 for t, lp in PEAKED.items()}  # the same order, each logprob further from the best


def test_logprobs_where_both_builds_saw_the_same_context_judge_every_request_sampled_or_not():
    """A sampled request whose very first token differs shares one context with the baseline's, its prompt:
    position 0. Logits scaled before the sampler keep every order (greedy tokens unchanged), and show there. A
    comparator that skips position 0, or compares only before the first differing token, passes this one."""
    base = request("r", [10, 11, 10, 10], **SAMPLED)
    moved = request("r", [11, 10, 10, 10], rows=[row(11, SCALED)] + [row(10, PEAKED)] * 3, **SAMPLED)
    report, verdicts = judge(session("b", base), session("c", moved))
    assert [(j.tier, j.passed) for j in verdicts["r"].judged] == [("same_context", False), ("invariants", True)]
    failed = next(f for f in report.findings if f.code == "context_logprobs_differ")
    assert failed.position == 0 and failed.candidate > RULES.judging.same_context_logprob
    assert exit_code(report.findings) is ExitCode.BEHAVIOUR
    other_draw = request("r", [11, 10, 10, 10], rows=[row(11, PEAKED)] + [row(10, SCALED)] * 3, **SAMPLED)
    _, verdicts = judge(session("b", base), session("c", other_draw))  # moved only after the contexts part
    assert verdicts["r"].passed and verdicts["r"].judged[0].tier == "same_context"


def test_with_repeat_runs_the_same_context_is_held_to_the_baseline_build_s_own_spread():
    """One baseline run: a GPU's batch noise (``same_context_logprob``) is let through. Repeat runs that agree
    to the last bit hold the candidate to that: a slight, order-keeping change fails."""
    slight = {t: lp * 1.02 for t, lp in PEAKED.items()}
    base = request("r", [10, 10, 10, 10], **SAMPLED)
    candidate = session("c", request("r", [10, 10, 10, 10], rows=[row(10, slight)] * 4, **SAMPLED))
    _, verdicts = judge(session("b", base), candidate)
    assert verdicts["r"].passed, verdicts["r"].why
    _, verdicts = judge_runs([session("b1", base), session("b2", base)], candidate)
    assert {j.tier: j.passed for j in verdicts["r"].judged}["same_context"] is False


def test_a_small_change_at_every_same_context_position_shifts_the_session_where_noise_does_not():
    """Each request's logprobs moved by less than one baseline run's tolerance, but all alike: the session's
    shift is beyond the noise. The same build's noise (each request moved at random) is not."""
    requests = [request(f"r{k}", [10, 10, 10, 10], start_ms=1000 * k, **SAMPLED) for k in range(24)]
    flatter = {t: lp * 1.05 for t, lp in PEAKED.items()}
    moved = [request(f"r{k}", [10, 10, 10, 10], start_ms=1000 * k, rows=[row(10, flatter)] * 4, **SAMPLED)
             for k in range(24)]
    report, verdicts = judge(session("b", *requests), session("c", *moved))
    assert all(v.passed for v in verdicts.values())  # no request beyond the tolerance on its own
    shift = next(f for f in report.findings if f.field == "same_context")
    assert shift.code == "context_shift" and exit_code(report.findings) is ExitCode.BEHAVIOUR, shift.message
    rng = random.Random(5)
    noisy = [request(f"r{k}", [10, 10, 10, 10], start_ms=1000 * k, **SAMPLED, rows=[
        row(10, {t: lp + rng.uniform(-0.05, 0.05) for t, lp in PEAKED.items()}) for _ in range(4)])
        for k in range(24)]
    report, _ = judge(session("b", *requests), session("c", *noisy))
    assert next(f for f in report.findings if f.field == "same_context").code == "context_same"
    assert exit_code(report.findings) is ExitCode.OK


def test_a_sampled_request_every_baseline_run_reproduced_is_held_to_its_exact_tokens():
    base = request("r", [10, 11, 12, 10], **SAMPLED)
    other = request("r", [10, 11, 10, 10], **SAMPLED)
    _, verdicts = judge_runs([session("b1", base), session("b2", base)], session("c", other))
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("exact", False), verdicts["r"].why
    _, verdicts = judge_runs([session("b1", base), session("b2", other)], session("c", other))  # not stable
    assert "exact" not in {j.tier for j in verdicts["r"].judged}
    _, verdicts = judge(session("b", base), session("c", other))  # one run: nothing shows it reproduces
    assert "exact" not in {j.tier for j in verdicts["r"].judged}


def test_every_tier_that_judged_a_request_is_in_its_verdict_and_counted():
    report, verdicts = judge(session("b", request("r", [10, 10, 10, 10], **GREEDY)),
                             session("c", request("r", [10, 10, 10, 10], rows=[row(10, SCALED)] * 4, **GREEDY)))
    assert [(j.tier, j.passed) for j in verdicts["r"].judged] == [
        ("exact", True), ("same_context", False), ("invariants", True)]
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("same_context", False)  # any tier failing fails it
    assert verdict_counts(report) == ("exact 1 (0 failed), same_context 1 (1 failed), invariants 1 (0 failed); "
                                      "1 requests, 1 failed")


def violations(tokens, rows=None, finish="length", vocab_size=None, **params):
    made = msgspec.structs.replace(request("r", tokens, rows=rows, **params), finish_reason=finish)
    return {rule for rule, _ in invariant_violations(session("c"), made, eos=1, vocab_size=vocab_size)}


def test_sampled_tokens_are_held_to_their_request_s_sampling_parameters():
    assert violations([10, 11, 12], temperature=0.8, top_k=3) == set()
    assert violations([10, 13], temperature=0.8, top_k=3) == {"top_k"}
    # min_p 0.1 at temperature 1: token 13 (0.05) is under a tenth of token 10 (0.6)
    assert violations([10, 13], temperature=1.0, min_p=0.1) == {"min_p"}
    # top_p 0.75: tokens 10 and 11 hold 0.8 above token 12, so 12 lies outside the nucleus
    assert violations([10, 12], temperature=1.0, top_p=0.75) == {"top_p"}
    assert violations([10, 11], temperature=1.0, top_p=0.75) == set()
    # Greedy takes the most likely token.
    assert violations([10, 11], temperature=0.0) == {"greedy"}
    # Penalties change the logits the sampler sees: the raw logprobs no longer rank its choice.
    assert violations([10, 13], temperature=0.8, top_k=3, repetition_penalty=1.3) == set()


def flat(rank: int, vocab: int = 32000) -> TokenLogprobs:
    """A position of a flat distribution (a random model's, or a trained one's where it is unsure): a top-4 of
    about 0.002 each, the rest spread over the vocabulary so that the token at ``rank`` has 0.0008 and every
    token above it at least that much."""
    top = {t: math.log(0.0021 - 0.0001 * k) for k, t in enumerate(range(10, 14))}
    return TokenLogprobs(5000, math.log(0.0008), rank, top)


def test_the_nucleus_is_bounded_by_the_sampled_token_s_rank_on_a_flat_distribution():
    """The top-4 above the token holds 0.008 of the mass, so the top-k alone bounds nothing; its rank says
    1,195 unlisted tokens lie above it, each at least as likely: at least 0.96 of the mass, outside top_p 0.9.
    A bound that ignores the rank passes it."""
    assert violations([5000], rows=[flat(1200)], temperature=1.0, top_p=0.9) == {"top_p"}
    assert violations([5000], rows=[flat(1200)], temperature=0.7, top_p=0.9) == {"top_p"}
    assert violations([5000], rows=[flat(300)], temperature=1.0, top_p=0.9) == set()
    # bf16 logits tie (a top-k with two equal logprobs shows it): the rank counts ties as above, which vLLM's
    # nucleus may sort after the token, so it bounds nothing there.
    tied = TokenLogprobs(5000, math.log(0.0008), 1200, {10: math.log(0.002), 11: math.log(0.002), 12: -7.0})
    assert violations([5000], rows=[tied], temperature=1.0, top_p=0.9, vocab_size=32000) == set()


def test_the_vocabulary_s_size_bounds_the_nucleus_where_the_rank_alone_cannot():
    """A near-uniform distribution over 900 tokens (the random model's): the top-4 holds 0.01, the token at
    rank 890 has 0.001. Its rank says 885 unlisted tokens lie above it, at least 0.885 of the mass: not beyond
    top_p 0.95. The vocabulary says only 10 lie below it, holding at most 0.01: the rest of the unlisted mass,
    0.979, lies above it, outside the nucleus. Above temperature 1 only the vocabulary's size gives a bound."""
    top = {t: math.log(0.0026 - 0.0001 * k) for k, t in enumerate(range(10, 14))}
    tail = TokenLogprobs(500, math.log(0.001), 890, top)
    assert violations([500], rows=[tail], temperature=1.0, top_p=0.95) == set()
    assert violations([500], rows=[tail], temperature=1.0, top_p=0.95, vocab_size=900) == {"top_p"}
    assert violations([500], rows=[tail], temperature=1.2, top_p=0.9) == set()
    assert violations([500], rows=[tail], temperature=1.2, top_p=0.9, vocab_size=900) == {"top_p"}
    inside = TokenLogprobs(500, math.log(0.001), 300, top)  # 600 tokens below it: it may lie in the nucleus
    assert violations([500], rows=[inside], temperature=1.2, top_p=0.9, vocab_size=900) == set()


def test_an_engine_that_drafted_tokens_is_held_to_lengths_and_stop_tokens_only():
    """Its rejection sampler's draws are not ranked by the raw logprobs (a real 0.32.0 engine with n-gram drafts:
    a greedy token of rank 407 at a rejected draft), so greedy is not checked; stop tokens still are."""
    drafted = RecordedFrame(1, 0, Kind.OUTPUTS, 0, 0, [], {"scheduler_stats": {"spec_decoding_stats": {
        "num_drafts": 1, "num_draft_tokens": 1, "num_accepted_tokens": 0}}})
    speculating = msgspec.structs.replace(session("c"), outputs=[drafted])
    assert speculating.speculates and not session("c").speculates
    greedy_miss = request("r", [10, 11], temperature=0.0)
    assert {rule for rule, _ in invariant_violations(speculating, greedy_miss, eos=1)} == set()
    stop_missed = request("r", [10, 12, 11], temperature=0.8, stop_token_ids=[12])
    assert {rule for rule, _ in invariant_violations(speculating, stop_missed, eos=1)} == {"stop_token_ids"}


def test_stop_tokens_end_a_request_once_its_min_tokens_are_out_and_not_before():
    assert violations([10, 11, 12], finish="stop", temperature=0.8, stop_token_ids=[12]) == set()
    assert violations([10, 11, 12], finish="length", temperature=0.8, stop_token_ids=[12]) == {"stop_token_ids"}
    assert violations([10, 12, 11], temperature=0.8, stop_token_ids=[12]) == {"stop_token_ids"}
    assert violations([12, 10, 11], temperature=0.8, stop_token_ids=[12], min_tokens=2) == {"min_tokens"}
    assert violations([10, 11, 12, 13], temperature=0.8, max_tokens=3) == {"max_tokens"}
    # Until min_tokens are out the engine masks stop tokens: min_p is relative to the best token left.
    masked = [row(13, {12: math.log(0.9), 13: math.log(0.05), 10: math.log(0.04)}), row(10, PEAKED)]
    assert violations([13, 10], rows=masked, temperature=1.0, min_p=0.5, stop_token_ids=[12], min_tokens=1) == set()


def scores(shift: float, tokens: int = 6) -> dict[int, dict[str, list[TokenLogprobs]]]:
    """Scoring rows of request r (a 3-token prompt and ``tokens`` outputs): ``PEAKED`` sharpened by ``shift``."""
    sharpened = {t: lp * (1 + shift) for t, lp in PEAKED.items()}
    rows = [row(10, sharpened) for _ in range(2 + tokens)]
    return {0: {"r": rows}, 1: {"r": rows}}


def test_teacher_forced_scoring_finds_a_numerics_shift_that_leaves_every_greedy_token_as_it_was():
    assert position_kl(row(10, PEAKED), row(10, PEAKED)) == 0
    recorded = session("rec", request("r", [10] * 6, **GREEDY))
    baseline = msgspec.structs.replace(recorded, name="b", scores=scores(0.0))
    same, _ = judge(baseline, msgspec.structs.replace(recorded, name="c", scores=scores(0.0)), recorded)
    assert {f.code for f in same.findings if f.tier == "scored"} == {"scoring_same"}
    shifted, verdicts = judge(baseline, msgspec.structs.replace(recorded, name="c", scores=scores(0.1)), recorded)
    assert {f.code for f in shifted.findings if f.severity is Severity.REGRESSION} >= {"scores_diverge", "scoring_kl"}
    # The request's own tokens did not change: the exact tier passed it, scoring failed it.
    assert (verdicts["r"].tier, verdicts["r"].passed) == ("scored", False)


def sampled_session(name: str, seed: int, hot: bool, requests: int = 24) -> Session:
    """``requests`` sampled requests; ``hot``: sampled as if at a higher temperature (less likely tokens)."""
    rng = random.Random(seed)
    weights = [0.3, 0.3, 0.2, 0.2] if hot else [0.7, 0.2, 0.07, 0.03]
    made = [request(f"r{k}", rng.choices(list(PEAKED), weights, k=16), start_ms=1000 * k, temperature=0.7,
                    max_tokens=16) for k in range(requests)]
    return session(name, *made)


def test_a_temperature_applied_otherwise_moves_what_is_sampled_and_fails_the_gate():
    """Every token is "allowed" (no top-k, top-p or min-p), no token is compared (all sampled): only the
    distribution of what was sampled sees it. A comparator that skips sampled requests passes this session."""
    report, _ = judge(sampled_session("b", 1, hot=False), sampled_session("c", 2, hot=True))
    shift = next(f for f in report.findings if f.tier == "sampled")
    assert shift.code == "sampled_shift" and exit_code(report.findings) is ExitCode.BEHAVIOUR, shift.message
    same, _ = judge(sampled_session("b", 1, hot=False), sampled_session("c", 3, hot=False))
    assert next(f for f in same.findings if f.tier == "sampled").code == "sampled_same"
    assert exit_code(same.findings) is ExitCode.OK, [f.message for f in same.findings if f.severity > 1]


def test_findings_with_one_cause_are_shown_once_with_their_requests():
    requests = [request(f"r{k}", [10, 10, 10, 10], start_ms=1000 * k, **GREEDY) for k in range(12)]
    broken = [request(f"r{k}", [11, 11, 11, 11], start_ms=1000 * k, rows=[row(11, PEAKED)] * 4, **GREEDY)
              for k in range(12)]
    report, _ = judge(session("b", *requests), session("c", *broken))
    groups = grouped([f for f in report.findings if f.severity is Severity.REGRESSION])
    codes = {f.code: names for f, names in groups}
    assert sorted(codes["token_mismatch"]) == sorted(f"r{k}" for k in range(12))
    assert len(groups) == len(codes)  # each kind of finding once


def test_a_session_whose_engine_drafted_tokens_speculates():
    """The committed fan-out recording's engine ran n-gram speculative decoding; the staging one's did not."""
    assert load_session(RECORDINGS / "vllm-0.32.0-python-fan-out.db", "1").speculates
    assert not load_session(RECORDINGS / "vllm-0.32.0-python.db", "1").speculates
