"""Performance findings: TTFT, inter-token latency and end-to-end time at percentiles, and throughput.

Each is a ratio to the baseline against a threshold (rules.json), widened to
the slowest repeat run of the baseline build (``noise``) times
``noise_margin``, and ignored below an absolute floor.
"""

from __future__ import annotations

from typing import Any

from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.store.session import Session


def latency_samples(session: Session) -> dict[str, list[float]]:
    ttft, itl, e2e = [], [], []
    for r in session.requests:
        if r.first_token_ns is not None:
            ttft.append((r.first_token_ns - r.added_ns) / 1e6)
        itl += [(b - a) / 1e6 for a, b in zip(r.output_times, r.output_times[1:])]
        if r.last_ns is not None and not r.frontend_aborted:
            e2e.append((r.last_ns - r.added_ns) / 1e6)
    return {"ttft_ms": ttft, "itl_ms": itl, "e2e_ms": e2e}


def throughput(session: Session) -> float | None:
    tokens = sum(len(r.tokens) for r in session.requests)
    ends = [r.last_ns for r in session.requests if r.last_ns]
    if not ends or not tokens:
        return None
    span = (max(ends) - min(r.added_ns for r in session.requests)) / 1e9
    return tokens / span if span > 0 else None


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def performance_findings(baseline: Session, candidate: Session, rules: dict[str, Any],
                         noise: list[Session] = ()) -> list[Finding]:
    findings = []
    a, b = latency_samples(baseline), latency_samples(candidate)
    repeats = [latency_samples(n) for n in noise]
    for metric, limits in rules["performance"].items():
        if metric not in a or not a[metric] or not b[metric]:
            continue
        for p in rules["percentiles"]:
            if min(len(a[metric]), len(b[metric])) < rules["min_samples"].get(str(p), 1):
                continue
            base, cand = percentile(a[metric], p), percentile(b[metric], p)
            ratio = cand / base if base > 0 else float("inf")
            allowed = limits["max_ratio"]
            for repeat in repeats:  # the noise floor: how much identical builds vary
                if repeat[metric] and base > 0:
                    allowed = max(allowed, percentile(repeat[metric], p) / base * rules["noise_margin"])
            if ratio > allowed and cand - base > limits["min_delta_ms"]:
                findings.append(Finding(
                    "performance", Severity.REGRESSION, f"{metric.removesuffix('_ms')}_regression",
                    f"{metric} p{p} {base:.2f} -> {cand:.2f} ms ({ratio:.2f}x, allowed {allowed:.2f}x)",
                    field=f"{metric}.p{p}", baseline=round(base, 3), candidate=round(cand, 3)))
    base_tput, cand_tput = throughput(baseline), throughput(candidate)
    limit = rules["performance"].get("throughput_tokens_s", {}).get("min_ratio")
    if base_tput and cand_tput and limit and cand_tput / base_tput < limit:
        findings.append(Finding("performance", Severity.REGRESSION, "throughput_regression",
                                f"throughput {base_tput:.1f} -> {cand_tput:.1f} tokens/s "
                                f"({cand_tput / base_tput:.2f}x, allowed {limit}x)", field="throughput_tokens_s",
                                baseline=round(base_tput, 2), candidate=round(cand_tput, 2)))
    return findings
