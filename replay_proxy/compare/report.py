"""Report assembly: two loaded sessions in, one ``Report`` out (``diff`` and both replays);
and the report of two release schemas (``schema diff``)."""

from __future__ import annotations

from typing import Any

from replay_proxy.compare.behaviour import behaviour_findings
from replay_proxy.compare.findings import Report
from replay_proxy.compare.performance import latency_samples, performance_findings
from replay_proxy.compare.sampling import sampling_findings
from replay_proxy.compare.schema import observed_shapes, schema_findings
from replay_proxy.compare.schema_diff import diff_schemas
from replay_proxy.store.session import Session, match_requests
from replay_proxy.wire.schema import Schema, schema_lines

METRICS = ("ttft_ms", "itl_ms", "e2e_ms", "throughput_tokens_s")


def build_report(title: str, baseline: Session, candidate: Session, rules: dict[str, Any],
                 noise: list[Session] = (), frontend_under_test: bool = False) -> Report:
    """The one place where two sessions become a report."""
    matching = match_requests(baseline, candidate, rules["match_sampling_keys"])
    shapes = observed_shapes(baseline), observed_shapes(candidate)
    findings = [*schema_findings(baseline, candidate, shapes, rules),
                *sampling_findings(matching.pairs, candidate, rules),
                *behaviour_findings(baseline, candidate, matching, rules, noise, frontend_under_test),
                *performance_findings(baseline, candidate, rules, noise)]
    a, b = latency_samples(baseline), latency_samples(candidate)
    return Report(
        title=title, baseline=baseline.label, candidate=candidate.label, findings=findings,
        samples={m: {"baseline": a[m], "candidate": b[m]} for m in ("ttft_ms", "itl_ms") if a[m] or b[m]},
        schemas=_side_by_side(baseline.schema, candidate.schema, findings), noise=[n.label for n in noise],
        checks=([f"schema:{s}" for s in sorted(shapes[0])] + ["schema:EngineCoreReadyResponse"]
                + [f"behaviour:{r.request_id}" for r in baseline.requests] + [f"performance:{m}" for m in METRICS]))


def schema_report(old: Schema, new: Schema) -> Report:
    """Every change between two release schemas, with the decoders it breaks."""
    findings = diff_schemas(old, new)
    return Report(title="schema diff", baseline=old.release, candidate=new.release, findings=findings,
                  schemas=_side_by_side(old, new, findings),
                  checks=[f"schema:{n}" for n in sorted(set(old.structs) | set(new.structs))])


def _side_by_side(a: Schema, b: Schema, findings) -> dict[str, dict[str, list[str]]]:
    """The structs that findings name, as field lines of each side."""
    structs = sorted({f.struct for f in findings if f.category == "schema" and f.struct in a.structs
                      and f.struct in b.structs})
    return {s: {"baseline": schema_lines(a.structs[s].fields), "candidate": schema_lines(b.structs[s].fields)}
            for s in structs}
