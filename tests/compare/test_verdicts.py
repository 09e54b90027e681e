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
from replay_proxy.compare.report import build_report
from replay_proxy.compare.rules import load_rules
from replay_proxy.compare.scoring import position_kl
from replay_proxy.compare.tokens import invariant_violations
from replay_proxy.errors import ExitCode
from replay_proxy.report.render import grouped
from replay_proxy.store.session import RecordedFrame, Request, Session, TokenLogprobs, load_session
from replay_proxy.wire.messages import Kind
from replay_proxy.wire.schema import load_schema

RECORDINGS = Path(__file__).resolve().parents[2] / "recordings"

RULES = load_rules()
SCHEMA = load_schema("0.32.0")
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
    report = build_report("replay", recording or baseline, candidate, RULES, [baseline], replayed_noise=True,
                          asked_logprobs=True)
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


def violations(tokens, rows=None, finish="length", **params):
    made = msgspec.structs.replace(request("r", tokens, rows=rows, **params), finish_reason=finish)
    return {rule for rule, _ in invariant_violations(session("c"), made, eos=1)}


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
