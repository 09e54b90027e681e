"""Findings rendered for people and for CI: terminal, JSON, JUnit XML, self-contained HTML."""

from __future__ import annotations

import html
import math
import xml.etree.ElementTree as ET
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from replay_proxy.compare.findings import Finding, Report, RequestVerdict, Severity, exit_code, report_json, worst_first
from replay_proxy.compare.tokens import TIERS
from replay_proxy.report.tables import fits

SEVERITY_STYLE = {Severity.BREAKING: "bold red", Severity.REGRESSION: "red", Severity.WARNING: "yellow",
                  Severity.INFO: "dim"}


def where(finding: Finding) -> str:
    place = finding.struct or finding.message_kind or ""
    if finding.field:
        place += f".{finding.field}" if place else finding.field
    if finding.position is not None:
        place += f" @{finding.position}"
    if finding.request_id:
        place += f" [{finding.request_id}]"
    return place


def caused(finding: Finding, limit: int = 3) -> str:
    """The failures a finding caused (a reader's rejection), a line each, the first ``limit`` of them."""
    lines = [f"  caused {c[:200]}" for c in finding.consequences[:limit]]
    if len(finding.consequences) > limit:
        lines.append(f"  ... and {len(finding.consequences) - limit} more it caused")
    return "\n".join(lines)


GROUP_AT = 3  # this many findings of one kind on as many requests are shown as one group


def grouped(findings: list[Finding]) -> list[tuple[Finding, list[str]]]:
    """Findings with one cause shown once: those of one severity, category, code and tier that each name a
    request, when there are ``GROUP_AT`` or more, as the first of them and the requests they name; the
    others alone, naming none. In report order (worst first)."""
    kinds: dict[tuple, list[Finding]] = {}
    for f in findings:
        if f.request_id is not None:
            kinds.setdefault((f.severity, f.category, f.code, f.tier), []).append(f)
    shown, out = set(), []
    for f in findings:
        same = kinds.get((f.severity, f.category, f.code, f.tier), []) if f.request_id is not None else []
        if len(same) < GROUP_AT:
            out.append((f, []))
        elif id(same[0]) not in shown:
            shown.add(id(same[0]))
            out.append((f, [g.request_id for g in same]))
    return out


def group_line(finding: Finding, requests: list[str], limit: int = 6) -> str:
    """A group's finding: how many requests, the first one's words, and which requests."""
    if not requests:
        return finding.message
    names = ", ".join(requests[:limit]) + (f", ... ({len(requests) - limit} more)" if len(requests) > limit else "")
    return f"{len(requests)} requests, e.g. {finding.message}\n  requests: {names}"


def verdict_counts(report: Report) -> str:
    """How many requests each tier judged and failed, then in all: ``exact 12 (0 failed), ...; 36 requests,
    1 failed``. A request no tier judged counts as ``unjudged``."""
    tiers: dict[str, list[bool]] = {}
    for v in report.verdicts:
        for j in v.judged or (v,):
            tiers.setdefault(j.tier, []).append(j.passed)
    failed = sum(not v.passed for v in report.verdicts)
    order = sorted(tiers, key=lambda t: TIERS.index(t) if t in TIERS else len(TIERS))
    return ", ".join(f"{t} {len(tiers[t])} ({tiers[t].count(False)} failed)" for t in order) + \
        f"; {len(report.verdicts)} requests, {failed} failed"


def print_summary(report: Report, console: Console, show_info: bool = False) -> None:
    findings = [f for f in worst_first(report.findings) if show_info or f.severity > Severity.INFO]
    noise = f" (noise floor: {len(report.noise)} baseline runs)" if report.noise else ""
    title = f"{report.title}: {report.baseline} -> {report.candidate}{noise}"
    table = Table(title=title, title_justify="left")
    for column in ("severity", "category", "code", "where", "finding"):
        table.add_column(column, overflow="fold")
    rows = []  # (severity, category, code, where, what it says)
    for f, requests in grouped(findings):
        severity = Text(f.severity.name.lower(), style=SEVERITY_STYLE[f.severity])
        place = f"{f.tier}: {len(requests)} requests" if requests else where(f)
        said = "\n".join(filter(None, (group_line(f, requests), caused(f))))
        rows.append((severity, f.category, f.code, place, said))
        table.add_row(severity, f.category, f.code, Text(place), Text(said))
    if findings and fits(table, console):
        console.print(table)
    elif findings:  # narrower: each finding a line, what it says indented under it
        console.print(title, highlight=False, markup=False)
        for severity, category, code, place, said in rows:
            console.print(Text.assemble(severity, f" {category} {code} {place}"))
            for line in Text(said).wrap(console, max(console.width - 2, 20)):
                line.rstrip()
                console.print(Text("  ") + line, soft_wrap=True)
    if report.verdicts:
        console.print(f"requests judged by tier: {verdict_counts(report)}")
    estimates = [f for f in report.findings if f.change is not None]
    if estimates:
        _print_estimates(estimates, console)
    counts = {s.name.lower(): sum(f.severity == s for f in report.findings) for s in reversed(Severity)}
    console.print(", ".join(f"{n} {k}" for k, n in counts.items()) + f" -> exit {int(exit_code(report.findings))}")


def _print_estimates(findings: list[Finding], console: Console) -> None:
    """Every performance estimate, whatever its verdict: "no change" comes with what it could have seen."""
    title = "performance: change with 95% interval"
    table = Table(title=title, title_justify="left")
    for column in ("metric", "baseline", "candidate", "change", "95% interval", "verdict", "detectable"):
        table.add_column(column, justify="left" if column in ("metric", "verdict") else "right")
    lines = []
    for f in sorted(findings, key=lambda f: f.field or ""):
        c = f.change
        verdict = Text(_verdict(f).replace("_", " "), style=SEVERITY_STYLE[f.severity])
        table.add_row(f.field, f"{f.baseline:g}", f"{f.candidate:g}", f"{c.relative:+.1%}",
                      f"{c.low:+.1%} .. {c.high:+.1%}", verdict, f"{c.minimum_detectable:.1%}")
        lines.append(Text.assemble(f"{f.field}: {f.baseline:g} -> {f.candidate:g}, {c.relative:+.1%} "
                                   f"({c.low:+.1%} .. {c.high:+.1%}), ", verdict,
                                   f"; detectable {c.minimum_detectable:.1%}"))
    if fits(table, console):
        console.print(table)
    else:  # narrower: a line a metric
        console.print(title)
        for line in lines:
            console.print(line)


def write_reports(report: Report, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "report.json", directory / "junit.xml", directory / "report.html"]
    paths[0].write_bytes(report_json(report))
    paths[1].write_bytes(junit(report))
    paths[2].write_text(html_page(report))
    return paths


def junit(report: Report) -> bytes:
    """One testsuite per category; a testcase per struct / request / metric checked, a request's with every
    tier that judged it."""
    suites = ET.Element("testsuites", name=report.title)
    verdicts = {v.request_id: v for v in report.verdicts}
    by_category: dict[str, dict[str, list[Finding]]] = {}
    for check in report.checks:
        category, _, name = check.partition(":")
        by_category.setdefault(category, {}).setdefault(name, [])
    for f in report.findings:
        name = f.request_id or f.struct or f.message_kind or f.field or f.code
        by_category.setdefault(f.category, {}).setdefault(name, []).append(f)
    for category, cases in by_category.items():
        failures = sum(any(f.severity >= Severity.REGRESSION for f in fs) for fs in cases.values())
        suite = ET.SubElement(suites, "testsuite", name=category, tests=str(len(cases)), failures=str(failures))
        for name, fs in sorted(cases.items()):
            case = ET.SubElement(suite, "testcase", classname=f"replay_proxy.{category}", name=name)
            bad = [f for f in fs if f.severity >= Severity.REGRESSION]
            if bad:
                failure = ET.SubElement(case, "failure", message=bad[0].message, type=bad[0].code)
                failure.text = "\n".join(f"[{f.severity.name.lower()}] {where(f)}: {f.message}"
                                          + "".join(f"\n  caused {c}" for c in f.consequences) for f in bad)
            notes = [f"[{f.severity.name.lower()}] {f.message}" for f in fs if f.severity < Severity.REGRESSION]
            verdict = verdicts.get(name) if category == "behaviour" else None
            notes += [f"[{j.tier}] {'passed' if j.passed else 'failed'}: {j.why}" for j in verdict.judged] \
                if verdict else []  # every tier that judged the request
            if notes:
                ET.SubElement(case, "system-out").text = "\n".join(notes)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def _ticks(top: float, count: int = 4) -> list[float]:
    """Round tick values from 0 to at least ``top``: steps of 1, 2 or 5 times a power of ten."""
    raw = top / count if top > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(math.ceil(top / step)) + 1)]


def _cdf_svg(title: str, series: dict[str, list[float]], width: int = 460, height: int = 280,
             label: str = "latency (ms)") -> str:
    """A cumulative distribution plot as inline SVG (no scripts, no network), with labelled axes."""
    values = [v for vs in series.values() for v in vs]
    if not values:
        return ""
    ticks = _ticks(max(values))
    top = ticks[-1] or 1.0
    left, right, top_y, bottom = 56, width - 12, 30, height - 46
    x = lambda v: left + v / top * (right - left)  # noqa: E731
    y = lambda f: bottom - f * (bottom - top_y)  # noqa: E731
    colours = {"baseline": "#3b6ea8", "noise floor": "#3b6ea8", "candidate": "#d9622b"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}"><title>{html.escape(title)}</title>',
             f'<text x="{width // 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#444"/>',
             f'<line x1="{left}" y1="{top_y}" x2="{left}" y2="{bottom}" stroke="#444"/>',
             f'<text x="{(left + right) // 2}" y="{height - 8}" text-anchor="middle" font-size="11">'
             f'{html.escape(label)}</text>',
             f'<text x="14" y="{(top_y + bottom) // 2}" text-anchor="middle" font-size="11" '
             f'transform="rotate(-90 14 {(top_y + bottom) // 2})">fraction of samples</text>']
    for tick in ticks:
        parts.append(f'<line x1="{x(tick):.1f}" y1="{bottom}" x2="{x(tick):.1f}" y2="{bottom + 4}" stroke="#444"/>'
                     f'<text x="{x(tick):.1f}" y="{bottom + 16}" text-anchor="middle" font-size="10">{tick:g}</text>')
    for fraction in (0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<line x1="{left - 4}" y1="{y(fraction):.1f}" x2="{right}" y2="{y(fraction):.1f}" '
                     f'stroke="#eee"/><text x="{left - 6}" y="{y(fraction) + 3:.1f}" text-anchor="end" '
                     f'font-size="10">{fraction:g}</text>')
    for i, (name, vs) in enumerate(series.items()):
        vs = sorted(vs)
        points = " ".join(f"{x(v):.1f},{y((k + 1) / len(vs)):.1f}" for k, v in enumerate(vs))
        colour = colours.get(name, "#666")
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
        parts.append(f'<text x="{right - 4}" y="{bottom - 24 + 14 * i}" text-anchor="end" font-size="11" '
                     f'fill="{colour}">{html.escape(name)} (n={len(vs)})</text>')
    parts.append("</svg>")
    return "".join(parts)


VERDICT_COLOUR = {"regression": "#c0392b", "improvement": "#2e8b57", "no_change": "#777"}


def _verdict(finding: Finding) -> str:
    return finding.code.rsplit("_", 2)[-1] if not finding.code.endswith("no_change") else "no_change"


def _forest_svg(findings: list[Finding], threshold: float, width: int = 560) -> str:
    """Each performance estimate as a point and its 95% interval, against 0 and the practical threshold."""
    rows = [f for f in findings if f.change is not None]
    if not rows:
        return ""
    label_w, right, row_h = 150, width - 20, 22
    height = 40 + row_h * len(rows) + 30
    reach = max([threshold * 2] + [max(abs(f.change.low), abs(f.change.high)) for f in rows])
    reach = min(reach, 5.0)  # beyond +-500% the plot says nothing more
    x = lambda v: label_w + (max(-reach, min(reach, v)) + reach) / (2 * reach) * (right - label_w)  # noqa: E731
    bottom = 30 + row_h * len(rows)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             'aria-label="change per metric"><title>change per metric, with 95% intervals</title>',
             f'<text x="{width // 2}" y="16" text-anchor="middle" font-size="13">change per metric, 95% interval'
             '</text>']
    for edge in (-threshold, threshold):
        parts.append(f'<line x1="{x(edge):.1f}" y1="26" x2="{x(edge):.1f}" y2="{bottom}" stroke="#bbb" '
                     'stroke-dasharray="4 3"/>')
    parts.append(f'<line x1="{x(0):.1f}" y1="26" x2="{x(0):.1f}" y2="{bottom}" stroke="#444"/>')
    for tick in sorted({-reach, -reach / 2, 0.0, reach / 2, reach}):
        parts.append(f'<text x="{x(tick):.1f}" y="{bottom + 16}" text-anchor="middle" font-size="10">'
                     f'{tick:+.0%}</text>')
    for i, f in enumerate(rows):
        cy = 38 + row_h * i
        colour = VERDICT_COLOUR[_verdict(f)]
        parts.append(f'<text x="{label_w - 8}" y="{cy + 4}" text-anchor="end" font-size="11">'
                     f'{html.escape(f.field or f.code)}</text>'
                     f'<line x1="{x(f.change.low):.1f}" y1="{cy}" x2="{x(f.change.high):.1f}" y2="{cy}" '
                     f'stroke="{colour}" stroke-width="2"/>'
                     f'<circle cx="{x(f.change.relative):.1f}" cy="{cy}" r="4" fill="{colour}">'
                     f'<title>{html.escape(f.message)}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def _divergence_svg(request_id: str, divergence: dict, width: int = 460, height: int = 220) -> str:
    """Each build's logprob of its own token at each position of one request, the first divergence marked."""
    series = {side: divergence[side] for side in ("baseline", "candidate") if divergence.get(side)}
    values = [v for vs in series.values() for v in vs if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return ""
    low = min(min(values), -1.0)
    n = max(len(vs) for vs in series.values())
    left, right, top_y, bottom = 50, width - 12, 34, height - 40
    x = lambda i: left + i / max(1, n - 1) * (right - left)  # noqa: E731
    y = lambda v: top_y + (v / low) * (bottom - top_y)  # noqa: E731 (0 at the top, ``low`` at the bottom)
    title = f"logprob of each build's own token, diverging at position {divergence['position']}"
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(request_id)}: {html.escape(title)}"><title>{html.escape(title)}</title>',
             f'<text x="{width // 2}" y="12" text-anchor="middle" font-size="11">{html.escape(request_id)}</text>',
             f'<text x="{width // 2}" y="25" text-anchor="middle" font-size="11">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#444"/>',
             f'<line x1="{left}" y1="{top_y}" x2="{left}" y2="{bottom}" stroke="#444"/>',
             f'<text x="{(left + right) // 2}" y="{height - 8}" text-anchor="middle" font-size="11">position</text>',
             f'<text x="{left - 6}" y="{top_y + 4}" text-anchor="end" font-size="10">0</text>',
             f'<text x="{left - 6}" y="{bottom}" text-anchor="end" font-size="10">{low:.2g}</text>',
             f'<line x1="{x(divergence["position"]):.1f}" y1="{top_y}" x2="{x(divergence["position"]):.1f}" '
             f'y2="{bottom}" stroke="#c0392b" stroke-dasharray="4 3"/>']
    for i, (name, vs) in enumerate(series.items()):
        colour = {"baseline": "#3b6ea8", "candidate": "#d9622b"}[name]
        points = " ".join(f"{x(k):.1f},{y(v):.1f}" for k, v in enumerate(vs)
                          if isinstance(v, (int, float)) and math.isfinite(v))
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>'
                     f'<text x="{right - 4}" y="{bottom - 24 + 14 * i}" text-anchor="end" font-size="11" '
                     f'fill="{colour}">{name}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _judged(verdict: RequestVerdict) -> str:
    """Each tier that judged a request, a line each: passed or failed, and why."""
    return "<br>".join(f"<b>{html.escape(j.tier)}</b> {'passed' if j.passed else 'failed'}: {html.escape(j.why)}"
                       for j in verdict.judged) or html.escape(verdict.why)


def html_page(report: Report) -> str:
    rows = "".join(
        f'<tr class="s{int(f.severity)}"><td>{f.severity.name.lower()}</td><td>{f.category}</td>'
        f"<td>{html.escape(f.code)}</td>"
        f"<td>{html.escape(f'{f.tier}: {len(requests)} requests' if requests else where(f))}</td>"
        f"<td>{html.escape(f.message)}{_consequences(f)}{_requests(requests)}</td></tr>"
        for f, requests in grouped(worst_first(report.findings)))
    verdicts = "".join(
        f'<tr class="{"" if v.passed else "s2"}"><td>{"passed" if v.passed else "failed"}</td><td>{html.escape(v.tier)}'
        f"</td><td>{html.escape(v.request_id)}</td><td>{_judged(v)}</td></tr>"
        for v in sorted(report.verdicts, key=lambda v: (v.passed, v.tier, v.request_id)))
    judged = "".join([_cdf_svg("teacher-forced KL per request (CDF)", report.kl, label="KL (nats/token)")
                      if any(report.kl.values()) else "",
                      *(_divergence_svg(rid, d) for rid, d in report.divergences.items())])
    plots = "".join(_cdf_svg(f"{metric} (CDF)", series) for metric, series in report.samples.items())
    forest = _forest_svg(report.findings, report.performance_threshold or 0.0)
    schemas = "".join(
        f"<h3>{html.escape(struct)}</h3><table class='side'><tr><th>{html.escape(report.baseline)}</th>"
        f"<th>{html.escape(report.candidate)}</th></tr>"
        + "".join(f"<tr><td>{html.escape(a)}</td><td class='{'same' if a == b else 'diff'}'>{html.escape(b)}</td></tr>"
                  for a, b in _zip_longest(sides["baseline"], sides["candidate"]))
        + "</table>"
        for struct, sides in report.schemas.items())
    judged_section = (f'<h2>Requests judged</h2><p>{html.escape(verdict_counts(report))}</p>'
                      f'<div class="plots">{judged}</div><details><summary>each request</summary><table><tr>'
                      f'<th>verdict</th><th>tier</th><th>request</th><th>why</th></tr>{verdicts}</table></details>'
                      if report.verdicts else "")
    code = int(exit_code(report.findings))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(report.title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;font-size:13px}}
tr.s3 td:first-child{{background:#f4b6b6}}tr.s2 td:first-child{{background:#f8d0c0}}
tr.s1 td:first-child{{background:#fbeeb8}}
td.diff{{background:#fde2c8}}.plots svg{{margin-right:1em;border:1px solid #eee}}</style></head><body>
<h1>{html.escape(report.title)}</h1><p>baseline <b>{html.escape(report.baseline)}</b>, candidate
<b>{html.escape(report.candidate)}</b>: {len(report.findings)} findings, exit code {code}</p>
{"<p>noise floor from " + html.escape(", ".join(report.noise)) + "</p>" if report.noise else ""}
<h2>Findings</h2><table><tr><th>severity</th><th>category</th><th>code</th><th>where</th><th>finding</th></tr>{rows}</table>
{judged_section}
{'<h2>Latency</h2><div class="plots">' + forest + plots + '</div>' if plots or forest else ''}
{'<h2>Schemas side by side</h2>' + schemas if schemas else ''}
</body></html>"""


def _requests(requests: list[str]) -> str:
    if not requests:
        return ""
    items = "".join(f"<li>{html.escape(r)}</li>" for r in requests)
    return f"<details><summary>{len(requests)} requests</summary><ul>{items}</ul></details>"


def _consequences(finding: Finding) -> str:
    if not finding.consequences:
        return ""
    items = "".join(f"<li>{html.escape(c)}</li>" for c in finding.consequences)
    return f"<details><summary>caused {len(finding.consequences)} failures</summary><ul>{items}</ul></details>"


def _zip_longest(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else "", b[i] if i < len(b) else "") for i in range(n)]
