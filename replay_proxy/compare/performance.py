"""Performance findings: how much TTFT, inter-token latency, end-to-end time and throughput changed.

Each metric is estimated as the relative change of a percentile (p50, p90)
from the baseline to the candidate, with a 95% confidence interval from a
bootstrap over requests:

* Latency is skewed and multi-modal (prefill, batching, the odd scheduler
  hiccup), so no distribution is assumed: the percentile itself is the
  statistic, and resampling requests says how much it could move. A rank
  test would answer "is there a shift?" but not "how large, at p90?".
* Inter-token gaps are taken from the time the engine stamped on each
  output (``EngineCoreOutputs.timestamp``) when every output of the request
  has one: a reader starved of the CPU for a moment (two cores shared by an
  engine, a player and a writer) reads a backlog of outputs at once, which
  bunches their arrival times but not the engine's stamps. TTFT and
  end-to-end time span two processes, so they stay on the proxy's clock.
* Requests are the unit resampled, never single tokens: the inter-token
  gaps of one request are not independent, so a request's gaps travel
  together. Where requests match (same prompt and sampling values), pairs
  are resampled together, which removes the per-prompt variation that both
  sessions share.
* The change is estimated on the log scale (ratio of percentiles), so that
  +10% and -9.1% are the same distance, then reported as a percentage.
* Repeat runs of the baseline build (``noise``) measure how much identical
  builds differ from run to run; that variance is added to the bootstrap's,
  so a machine that drifts between runs widens every interval.

A change is reported only when the whole interval lies beyond the practical
threshold (``min_relative_change``, 5%) and the absolute change is above a
small floor (``min_delta_ms``): a regression when worse, an improvement when
better. Otherwise the finding says no change was detected and gives the
minimum detectable effect: the smallest true change this sample would show
four times in five. "No finding" is then never mistaken for "no regression".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Change, Finding, Severity
from replay_proxy.compare.rules import Performance, Rules
from replay_proxy.store.session import Matching, Request, Session, match_requests

Z_95 = 1.959964  # two-sided 95%
Z_POWER = 0.841621  # 80% power
RESAMPLES = 1000
SEED = 20261201  # a fixed seed: the same sessions give the same report


def _gaps_ms(times_ns: list[int]) -> list[float]:
    return [(b - a) / 1e6 for a, b in zip(times_ns, times_ns[1:])]


# Per request, the values a metric takes (an empty list: the request has none).
Values = Callable[[Request], list[float]]  # a latency's values in one request
Statistic = Callable[[tuple['_Units', np.ndarray]], np.ndarray]  # a side's figure under each row of weights
LATENCIES: dict[str, Values] = {
    "ttft_ms": lambda r: [(r.first_token_ns - r.added_ns) / 1e6] if r.first_token_ns is not None else [],
    "itl_ms": lambda r: _gaps_ms(r.output_times if r.engine_times_ns is None else r.engine_times_ns),
    "e2e_ms": lambda r: [(r.last_ns - r.added_ns) / 1e6] if r.last_ns is not None and not r.frontend_aborted
    else [],
}


def latency_samples(session: Session) -> dict[str, list[float]]:
    """Every value of each latency metric in a session (for the plots)."""
    return {metric: [v for r in session.requests for v in values(r)] for metric, values in LATENCIES.items()}


def timing_findings(baseline: Session, candidate: Session, matching: Matching, noise: Sequence[Session],
                    candidate_runs: Sequence[Session], replayed_noise: bool, keys: list[str], rules: Rules,
                    other_cpu: dict[str, float]) -> list[Finding]:
    """Latency and throughput, or why they are not judged: each build's runs, pooled, against the other's, so each
    side needs two runs or more, none of them a recording (its peers shared the machine with the live side). A
    replay's sides are the baseline build's runs (``noise``) and the candidate's (``candidate`` and
    ``candidate_runs``), interleaved (A B A B); a diff's, ``baseline`` with ``noise`` and the candidate's.
    ``other_cpu``: by run, the share of the machine's CPU that other processes took: above ``max_other_cpu`` a
    busy neighbour, not a build, would be measured."""
    busy = {run: share for run, share in other_cpu.items() if share > rules.performance.max_other_cpu}
    if not replayed_noise:
        noise = [baseline, *noise]
    sides = noise, [candidate, *candidate_runs]
    recorded = [run.label for side in sides for run in side if not run.replayed]
    if not replayed_noise and (recorded or min(map(len, sides)) < 2):
        why = (f"{', '.join(recorded)}: {'a recording' if len(recorded) == 1 else 'recordings'}, whose peers shared "
               "the machine with the live side" if recorded else
               "one run a side does not say how much runs of one build differ")
        return [Finding("performance", Severity.INFO, Code.TIMING_NOT_JUDGED, (
            f"timing not judged: {why}"
            + "; diff two or more replays of each build (--noise, --candidate-noise), or replay with --baseline-cmd "
            "and --noise-runs 2 or more"), field="timing")]
    if replayed_noise and len(noise) < 2:
        return [Finding("performance", Severity.INFO, Code.TIMING_NOT_JUDGED, (
            "timing not judged: " + ("a replay's latency is not the recording's (the recorded engine shared the "
                                     "machine with the live frontend)" if not noise else
                                     "one run of the baseline build does not say how much runs of one build differ")
            + "; --baseline-cmd with --noise-runs 2 or more compares it with the baseline build's runs, "
            "interleaved with the candidate's"), field="timing")]
    if busy:
        return [Finding("performance", Severity.INFO, Code.TIMING_NOT_JUDGED, (
            "timing not judged: other processes took " + ", ".join(f"{share:.0%} of the machine's CPU during {run}"
                                                                   for run, share in busy.items())
            + f" (more than {rules.performance.max_other_cpu:.0%}): a busy neighbour, not a build, would be "
            "measured; replay on a quieter machine"), field="timing", candidate=busy)]
    before, after = _pooled(sides[0]), _pooled(sides[1])
    findings = performance_findings(before, after, match_requests(before, after, keys), rules,
                                    runs=(list(sides[0]), sides[1]))
    if not replayed_noise:
        return findings
    findings.append(Finding("performance", Severity.INFO, Code.TIMING_BASELINE, (
        f"latency is compared with {len(noise)} run(s) of the baseline build, replayed as the candidate was and "
        f"interleaved with its {1 + len(candidate_runs)} run(s), not with the recording"), field="timing_baseline"))
    return findings


def _pooled(runs: Sequence[Session]) -> Session:
    """Several runs of one build as one session of all their requests, in run order."""
    return runs[0] if len(runs) == 1 else msgspec.structs.replace(
        runs[0], requests=[r for run in runs for r in run.requests])


def performance_findings(baseline: Session, candidate: Session, matching: Matching, rules: Rules,
                         noise: Sequence[Session] = (), runs: tuple[list[Session], list[Session]] | None = None
                         ) -> list[Finding]:
    """``noise``: repeat runs of the baseline build, each compared with ``baseline`` for the run-to-run
    variation. ``runs``: instead, each side is several runs pooled (the baseline build's, the candidate's,
    interleaved): the variation is taken between consecutive baseline runs, and a change is reported only
    when every candidate run lies beyond every baseline run, so that load which comes and goes on a shared
    machine, falling on one run, is not a regression."""
    keys = rules.match_sampling_keys
    if runs is not None:
        noise_pairs = list(zip(runs[0], runs[0][1:]))
    else:
        noise_pairs = [(baseline, n) for n in noise]
    repeats = [match_requests(x, y, keys).pairs for x, y in noise_pairs]
    # (field, metric, the statistic of a side's units under its weights, each request's values or None, percentile)
    measures: list[tuple[str, str, Statistic, Values | None, int]] = [
        (f"{metric}.p{p}", metric, functools.partial(_quantile, p=p), values, p)
        for metric, values in LATENCIES.items() for p in rules.percentiles]
    measures.append(("throughput_tokens_s", "throughput_tokens_s", _throughput, None, 50))
    findings = []
    for field, metric, statistic, values, percentile in measures:
        estimate = _Estimate(baseline, candidate, matching.pairs, statistic, values)
        if estimate.usable and min(estimate.samples) >= rules.min_samples.get(percentile, 1):
            noise_changes = [_Estimate(x, y, r, statistic, values).point_change()
                             for (x, y), r in zip(noise_pairs, repeats)]
            per_run = None if runs is None else (
                [_Estimate(run, run, [], statistic, values).base for run in runs[0]],
                [_Estimate(run, run, [], statistic, values).base for run in runs[1]])
            findings.append(_finding(field, metric, estimate, noise_changes, rules.performance,
                                     higher_is_better=values is None,
                                     unit="ms" if values is not None else "tokens/s", per_run=per_run or None))
    return findings


def _spread(values: list[float]) -> str:
    return f"{min(values):.3g}..{max(values):.3g}"


class _Units:
    """Requests as resampling units, with their values flattened: ``owner[k]`` is the unit of value k."""

    def __init__(self, requests: list[Request], values: Callable[[Request], list[float]] | None):
        self.requests = requests
        flat, owner = [], []
        for i, request in enumerate(requests):
            for v in (values(request) if values else ()):
                flat.append(v)
                owner.append(i)
        order = np.argsort(flat, kind="stable")
        self.values = np.asarray(flat, dtype=float)[order]
        self.owner = np.asarray(owner, dtype=int)[order]
        self.tokens = np.asarray([len(r.tokens) for r in requests], dtype=float)
        self.added = np.asarray([r.added_ns for r in requests], dtype=float)
        self.last = np.asarray([r.last_ns if r.last_ns is not None else r.added_ns for r in requests], dtype=float)


def _quantile(units: tuple[_Units, np.ndarray], p: float) -> np.ndarray:
    """The p-th percentile of the pooled values, under each row of weights (how often each unit was drawn)."""
    u, weights = units
    w = weights[:, u.owner]
    cumulative = w.cumsum(axis=1)
    target = cumulative[:, -1:] * (p / 100)
    index = np.minimum((cumulative < target).sum(axis=1), len(u.values) - 1)
    chosen: np.ndarray = u.values[index]
    return chosen


def _throughput(units: tuple[_Units, np.ndarray]) -> np.ndarray:
    """Tokens per second of the drawn requests, from the first one added to the last one's end."""
    u, weights = units
    drawn = weights > 0
    span_s = (np.where(drawn, u.last, -np.inf).max(axis=1) - np.where(drawn, u.added, np.inf).min(axis=1)) / 1e9
    return np.where(span_s > 0, (weights @ u.tokens) / np.maximum(span_s, 1e-12), np.nan)


class _Estimate:
    """The log-ratio of one statistic between two sessions, and its bootstrap standard error."""

    def __init__(self, a: Session, b: Session, pairs: list[tuple[Request, Request]],
                 statistic: Callable[[tuple[_Units, np.ndarray]], np.ndarray],
                 values: Callable[[Request], list[float]] | None):
        # The units resampled: matched pairs that have values on both sides, when there are two or
        # more of them; else each side's own requests, independently.
        paired = [(x, y) for x, y in pairs if values is None or (values(x) and values(y))]
        self.paired = len(paired) >= 2
        if self.paired:
            self.a, self.b = _Units([x for x, _ in paired], values), _Units([y for _, y in paired], values)
        else:
            self.a, self.b = _Units(a.requests, values), _Units(b.requests, values)
        self.statistic = statistic
        self.samples = ((len(self.a.values), len(self.b.values)) if values
                        else (len(self.a.requests), len(self.b.requests)))
        self.usable = min(self.samples) >= 1 and len(self.a.requests) >= 2 and len(self.b.requests) >= 2
        if self.usable:
            self.base, self.cand = (float(statistic((u, np.ones((1, len(u.requests)))))[0]) for u in (self.a, self.b))
            self.usable = self.base > 0 and self.cand > 0 and math.isfinite(self.base) and math.isfinite(self.cand)

    def point_change(self) -> float:
        """log(candidate / baseline) of the statistic on the whole samples."""
        return math.log(self.cand / self.base) if self.usable else 0.0

    def standard_error(self) -> float:
        rng = np.random.default_rng(SEED)

        def draw(n: int) -> np.ndarray:
            return rng.multinomial(n, np.full(n, 1 / n), size=RESAMPLES).astype(float)

        wa = draw(len(self.a.requests))
        wb = wa if self.paired else draw(len(self.b.requests))  # a pair is drawn on both sides at once
        with np.errstate(divide="ignore", invalid="ignore"):  # a resample with no values: dropped just below
            ratios = np.log(self.statistic((self.b, wb)) / self.statistic((self.a, wa)))
        ratios = ratios[np.isfinite(ratios)]
        return float(ratios.std(ddof=1)) if len(ratios) > 1 else math.inf


def _finding(field: str, metric: str, estimate: _Estimate, noise_changes: list[float], limits: Performance,
             *, higher_is_better: bool, unit: str, per_run: tuple[list[float], list[float]] | None = None) -> Finding:
    """``per_run``: the statistic of each baseline run and of each candidate run; a change must hold between
    the closest two of them too."""
    threshold = limits.min_relative_change
    floor = limits.min_delta_ms.get(metric, 0.0)
    change = estimate.point_change()
    run_to_run = sum(d * d for d in noise_changes) / len(noise_changes) if noise_changes else 0.0
    se = math.sqrt(estimate.standard_error() ** 2 + run_to_run)
    low, high = change - Z_95 * se, change + Z_95 * se
    worse_low, worse_high = (-high, -low) if higher_is_better else (low, high)  # "worse" is positive
    delta = abs(estimate.cand - estimate.base)
    numbers = Change(relative=math.expm1(change), low=math.expm1(low), high=math.expm1(high),
                     minimum_detectable=math.expm1(math.log1p(threshold) + (Z_95 + Z_POWER) * se),
                     paired=estimate.paired, samples=estimate.samples, noise_runs=len(noise_changes))
    name = metric.removesuffix("_ms").removesuffix("_tokens_s")
    said = (f"{field} {estimate.base:.3g} -> {estimate.cand:.3g} {unit}: {numbers.relative:+.1%} "
            f"(95% CI {numbers.low:+.1%} to {numbers.high:+.1%}; {'paired' if estimate.paired else 'unpaired'}, "
            f"n={estimate.samples[0]}/{estimate.samples[1]}"
            + (f", {len(noise_changes)} noise run(s)" if noise_changes else "") + ")")
    beyond = math.log1p(threshold)
    if per_run is not None and all(v > 0 for side in per_run for v in side):
        gap = math.log(min(per_run[1]) / max(per_run[0])), math.log(max(per_run[1]) / min(per_run[0]))
        closest_worse, closest_better = (-gap[1], -gap[0]) if higher_is_better else gap
        if worse_low > beyond and closest_worse <= beyond:
            worse_low = closest_worse
            said += (f"; within the runs' spread (baseline runs {_spread(per_run[0])}, candidate runs "
                     f"{_spread(per_run[1])})")
        if worse_high < -beyond and closest_better >= -beyond:
            worse_high = closest_better
    if worse_low > beyond and delta > floor:
        return Finding("performance", Severity.REGRESSION, Code(f"{name}_regression"), f"{said}: worse beyond "
                       f"{threshold:.0%}", field=field, baseline=round(estimate.base, 3),
                       candidate=round(estimate.cand, 3), change=numbers)
    if worse_high < -beyond and delta > floor:
        return Finding("performance", Severity.INFO, Code(f"{name}_improvement"), f"{said}: better beyond "
                       f"{threshold:.0%}", field=field, baseline=round(estimate.base, 3),
                       candidate=round(estimate.cand, 3), change=numbers)
    return Finding("performance", Severity.INFO, Code(f"{name}_no_change"),
                   f"{said}: no change detected; the smallest change this sample could show is "
                   f"{numbers.minimum_detectable:.1%}", field=field, baseline=round(estimate.base, 3),
                   candidate=round(estimate.cand, 3), change=numbers)
