"""A session's shift between two builds, paired by request, judged against the same build's own spread.

Each request gives one number (how far the candidate moved it from the
baseline run); the session's shift is their mean, with a sign-flip interval
over requests at the two-sided 99.9% level, widened by how far the baseline
build's own interleaved runs move the same mean (their root mean square),
where there are several. Sign flips, since of one build's two runs neither
is the baseline: a request moves either way alike, whatever its magnitude.
The interval is the mean give or take the 99.9% quantile of the mean of the
requests' deviations from it, each given a random sign: it is the inversion
of the sign-flip test, exact for exchangeable runs, and a few requests that
sampled a very unlikely token (a peaked model's long tail) widen it as they
should. A bootstrap of the mean, skewed by them, flagged the same build in
1 of 20 replays of the trained model's traffic. No threshold of its own: a
shift is a regression when that interval excludes no shift (beyond
float32's ``LOGPROB_SLACK``). On vLLM's CPU build the same build gives the
same numbers, and the interval is a point.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.compare.tokens import LOGPROB_SLACK

RESAMPLES = 1000
SEED = 20261206
SHIFT_Z = 3.29  # two-sided 99.9%


class Shift(msgspec.Struct, frozen=True):
    mean: float
    low: float
    high: float
    repeats: int  # baseline runs whose spread widened the interval
    spread: float  # standard deviation of the requests' shifts

    @property
    def beyond(self) -> bool:
        return self.low > LOGPROB_SLACK or self.high < -LOGPROB_SLACK

    def said(self, unit: str) -> str:
        """The estimate in words: ``+0.031 nats/token (99.9% CI ...; +0.4 standard deviations ...)``."""
        effect = (f"{self.mean / self.spread:+.2f} standard deviations of the requests' shifts" if self.spread > 0
                  else "every request shifted alike")
        widened = f", widened by {self.repeats} repeat run(s)" if self.repeats else ""
        return f"{self.mean:+.3f} {unit} (99.9% CI {self.low:+.3f} to {self.high:+.3f}{widened}; {effect})"

    def finding(self, codes: tuple[Code, Code], said: str, meaning: str, **where: Any) -> Finding:
        """The session's behaviour finding: a regression with the first of ``codes`` and ``meaning`` said
        after ``said`` where the shift is beyond the noise, else information with the second."""
        if self.beyond:
            return Finding("behaviour", Severity.REGRESSION, codes[0], f"{said}: {meaning}", **where)
        return Finding("behaviour", Severity.INFO, codes[1], said, **where)


def paired_shift(shifts: list[float], repeat_means: list[float]) -> Shift:
    """``shifts``: each request's, candidate against the baseline run; ``repeat_means``: the same mean between
    the baseline run and each further run of the baseline build."""
    mean, low, high = sign_flip_interval(shifts, SHIFT_Z)
    run_to_run = math.sqrt(sum(d * d for d in repeat_means) / len(repeat_means)) if repeat_means else 0.0
    spread = float(np.std(shifts, ddof=1)) if len(shifts) > 1 else 0.0
    return Shift(mean, low - SHIFT_Z * run_to_run, high + SHIFT_Z * run_to_run, len(repeat_means), spread)


def sign_flip_interval(values: list[float], z: float) -> tuple[float, float, float]:
    """The mean and the interval that inverts the sign-flip test at the two-sided level of ``z`` (the module's
    docstring): the mean give or take that quantile of the mean of the deviations, each signed at random."""
    data = np.asarray(values, dtype=float)
    mean = float(data.mean())
    if len(data) < 2:
        return mean, mean, mean
    tail = math.erfc(z / math.sqrt(2))  # (two-sided: |mean| against one quantile)
    signs = np.random.default_rng(SEED).choice([-1.0, 1.0], size=(max(RESAMPLES, int(20 / tail)), len(data)))
    half = float(np.quantile(np.abs(signs @ (data - mean)) / len(data), 1 - tail))
    return mean, mean - half, mean + half


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """The mean and its bootstrap interval at the two-sided level of ``z`` (1.96: 95%; requests resampled)."""
    data = np.asarray(values, dtype=float)
    if len(data) < 2:
        return float(data.mean()), float(data.mean()), float(data.mean())
    tail = math.erfc(z / math.sqrt(2)) / 2
    rng = np.random.default_rng(SEED)  # enough resamples that each tail holds at least 20 of them
    means = data[rng.integers(0, len(data), size=(max(RESAMPLES, int(20 / tail)), len(data)))].mean(axis=1)
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(data.mean()), float(low), float(high)
