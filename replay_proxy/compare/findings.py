"""A finding is data: what differs, where, how bad, and for whom.

Rendering (text, JUnit XML, HTML) lives in ``replay_proxy.report``; report.json's
document is here (``report_json``), for the matrix too, which sits below the
report layer. The exit code of a comparison follows from its worst finding.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from replay_proxy.compare.codes import Code
from replay_proxy.errors import ExitCode


class Severity(enum.IntEnum):
    INFO = 0
    WARNING = 1  # worth a look; not a regression (noise, a feature silently ignored)
    REGRESSION = 2  # behaviour or performance got worse
    BREAKING = 3  # a real decoder rejects or misreads the message


Category = Literal["schema", "behaviour", "performance", "replay"]
# The decoders that read each direction: Python msgspec, Rust rmp-serde.
PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND = "python-engine", "python-frontend", "rust-frontend"


class Judgement(msgspec.Struct, frozen=True):
    """One tier's judgement of one request (compare/tokens.py, compare/context.py, compare/scoring.py)."""

    tier: str  # exact, first_divergence, same_context, scored, invariants; unjudged
    passed: bool
    why: str


class RequestVerdict(msgspec.Struct, frozen=True):
    """How one request was judged: every tier that judged it (``judged``, strongest first), and the one that
    decides (``tier``, ``why``): the strongest that failed it, else the strongest that passed it. It fails if
    any tier fails it."""

    request_id: str
    tier: str
    passed: bool
    why: str
    judged: tuple[Judgement, ...] = ()


class Change(msgspec.Struct, frozen=True):
    """An estimated relative change and its 95% confidence interval (0.10 = +10%)."""

    relative: float
    low: float
    high: float
    minimum_detectable: float  # the smallest true change in the worse direction this sample shows 4 times in 5
    paired: bool  # resampled by matched request pairs (else two independent samples)
    samples: tuple[int, int]  # values on each side
    noise_runs: int = 0  # repeat runs of the baseline build whose run-to-run variation widened the interval


class Finding(msgspec.Struct, frozen=True, omit_defaults=True):
    category: Category
    severity: Severity
    code: Code  # a stable name: field_inserted, token_mismatch, ttft_regression, ...
    message: str  # one readable sentence
    message_kind: str | None = None
    struct: str | None = None
    field: str | None = None
    position: int | None = None
    baseline: Any = None
    candidate: Any = None
    request_id: str | None = None
    breaks: tuple[str, ...] = ()  # the decoders that fail on it
    change: Change | None = None  # performance: the estimate behind the finding
    consequences: tuple[str, ...] = ()  # the failures it caused, not findings of their own (compare/rejection.py)
    tier: str | None = None  # behaviour: the evidence that judged it (compare/tokens.py, compare/scoring.py)


class Report(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one comparison produced, assembled once (``compare.report.build_report``)."""

    title: str
    baseline: str
    candidate: str
    findings: list[Finding]
    # Latency samples (ms) per metric for the plots: {"ttft_ms": {"baseline": [...], "candidate": [...]}}
    samples: dict[str, dict[str, list[float]]] = {}
    # Side by side structs with findings: {struct: {"baseline": [field lines], "candidate": [...]}}
    schemas: dict[str, dict[str, list[str]]] = {}
    noise: list[str] = []  # repeat runs of the baseline build that set the noise floor
    checks: list[str] = []  # what was compared (JUnit testcases that passed are named from these)
    performance_threshold: float | None = None  # the practical threshold a performance change must pass
    verdicts: list[RequestVerdict] = []  # each baseline request's: the tier that judged it, and why it passed or failed
    # Teacher-forced scoring, per request, mean KL nats/token: {"noise floor": [...], "candidate": [...]}
    kl: dict[str, list[float]] = {}
    # Requests whose tokens diverged: {request id: {"position": i, "baseline": [logprob, ...], "candidate": [...]}}
    divergences: dict[str, dict[str, Any]] = {}
    recorded_in: str | None = None  # a replay's: the database its sessions were recorded in


def exit_code(findings: list[Finding]) -> ExitCode:
    """The run's exit code: the most serious class of finding present."""
    def has(category: str, severity: Severity) -> bool:
        return any(f.category == category and f.severity >= severity for f in findings)

    if has("replay", Severity.REGRESSION):
        return ExitCode.REPLAY_FAILED
    if has("schema", Severity.BREAKING):
        return ExitCode.SCHEMA_BREAKING
    if has("behaviour", Severity.REGRESSION):
        return ExitCode.BEHAVIOUR
    if has("performance", Severity.REGRESSION):
        return ExitCode.PERFORMANCE
    return ExitCode.OK


def worst_first(findings: list[Finding]) -> list[Finding]:
    order = {"replay": 0, "schema": 1, "behaviour": 2, "performance": 3}
    return sorted(findings, key=lambda f: (-f.severity, order[f.category], f.struct or "", f.position or 0,
                                           f.field or "", f.request_id or ""))


def report_json(report: Report) -> bytes:
    """``report.json``: the report, its exit code, its findings worst first with their severity's name."""
    return msgspec.json.format(msgspec.json.encode(
        {**msgspec.to_builtins(report), "exit_code": int(exit_code(report.findings)),
         "findings": [{**msgspec.to_builtins(f), "severity": f.severity.name.lower()}
                      for f in worst_first(report.findings)]}))
