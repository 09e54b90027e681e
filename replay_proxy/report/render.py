"""Findings rendered for people and for CI: terminal, JSON, JUnit XML, self-contained HTML."""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from replay_proxy.compare.findings import Finding, Report, Severity, exit_code, worst_first

SEVERITY_STYLE = {Severity.BREAKING: "bold red", Severity.REGRESSION: "red", Severity.WARNING: "yellow",
                  Severity.INFO: "dim"}


def where(finding: Finding) -> str:
    place = finding.struct or finding.message_kind or ""
    if finding.field:
        place += f".{finding.field}"
    if finding.position is not None:
        place += f" @{finding.position}"
    if finding.request_id:
        place += f" [{finding.request_id}]"
    return place


def print_summary(report: Report, console: Console, show_info: bool = False) -> None:
    findings = [f for f in worst_first(report.findings) if show_info or f.severity > Severity.INFO]
    noise = f" (noise floor: {len(report.noise)} baseline runs)" if report.noise else ""
    table = Table(title=f"{report.title}: {report.baseline} -> {report.candidate}{noise}", title_justify="left")
    for column in ("severity", "category", "code", "where", "finding"):
        table.add_column(column, overflow="fold")
    for f in findings:
        table.add_row(Text(f.severity.name.lower(), style=SEVERITY_STYLE[f.severity]), f.category, f.code,
                      Text(where(f)), Text(f.message))
    if findings:
        console.print(table)
    counts = {s.name.lower(): sum(f.severity == s for f in report.findings) for s in reversed(Severity)}
    console.print(", ".join(f"{n} {k}" for k, n in counts.items()) + f" -> exit {int(exit_code(report.findings))}")


def write_reports(report: Report, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = [directory / "report.json", directory / "junit.xml", directory / "report.html"]
    paths[0].write_bytes(msgspec.json.format(msgspec.json.encode(
        {**msgspec.to_builtins(report), "exit_code": int(exit_code(report.findings)),
         "findings": [{**msgspec.to_builtins(f), "severity": f.severity.name.lower()}
                      for f in worst_first(report.findings)]})))
    paths[1].write_bytes(junit(report))
    paths[2].write_text(html_page(report))
    return paths


def junit(report: Report) -> bytes:
    """One testsuite per category; a testcase per struct / request / metric checked."""
    suites = ET.Element("testsuites", name=report.title)
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
                failure.text = "\n".join(f"[{f.severity.name.lower()}] {where(f)}: {f.message}" for f in bad)
            notes = [f for f in fs if f.severity < Severity.REGRESSION]
            if notes:
                ET.SubElement(case, "system-out").text = "\n".join(f"[{f.severity.name.lower()}] {f.message}"
                                                                  for f in notes)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def _cdf_svg(title: str, series: dict[str, list[float]], width: int = 460, height: int = 260) -> str:
    """A cumulative distribution plot as inline SVG (no scripts, no network)."""
    values = [v for vs in series.values() for v in vs]
    if not values:
        return ""
    top = max(values) or 1.0
    left, bottom = 50, height - 30
    colours = {"baseline": "#3b6ea8", "candidate": "#d9622b"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(title)}"><title>{html.escape(title)}</title>',
             f'<text x="{width // 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{bottom}" x2="{width - 10}" y2="{bottom}" stroke="#444"/>',
             f'<line x1="{left}" y1="30" x2="{left}" y2="{bottom}" stroke="#444"/>',
             f'<text x="{width - 10}" y="{height - 8}" text-anchor="end" font-size="11">{top:.2f} ms</text>',
             f'<text x="{left - 4}" y="34" text-anchor="end" font-size="11">1.0</text>']
    for i, (name, vs) in enumerate(series.items()):
        vs = sorted(vs)
        points = " ".join(f"{left + (v / top) * (width - 10 - left):.1f},{bottom - (k + 1) / len(vs) * (bottom - 30):.1f}"
                          for k, v in enumerate(vs))
        colour = colours.get(name, "#666")
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{points}"/>')
        parts.append(f'<text x="{left + 10}" y="{48 + 14 * i}" font-size="11" fill="{colour}">'
                     f'{html.escape(name)} (n={len(vs)})</text>')
    parts.append("</svg>")
    return "".join(parts)


def html_page(report: Report) -> str:
    rows = "".join(
        f'<tr class="s{int(f.severity)}"><td>{f.severity.name.lower()}</td><td>{f.category}</td>'
        f"<td>{html.escape(f.code)}</td><td>{html.escape(where(f))}</td><td>{html.escape(f.message)}</td></tr>"
        for f in worst_first(report.findings))
    plots = "".join(_cdf_svg(f"{metric} (CDF)", series) for metric, series in report.samples.items())
    schemas = "".join(
        f"<h3>{html.escape(struct)}</h3><table class='side'><tr><th>{html.escape(report.baseline)}</th>"
        f"<th>{html.escape(report.candidate)}</th></tr>"
        + "".join(f"<tr><td>{html.escape(a)}</td><td class='{'same' if a == b else 'diff'}'>{html.escape(b)}</td></tr>"
                  for a, b in _zip_longest(sides["baseline"], sides["candidate"]))
        + "</table>"
        for struct, sides in report.schemas.items())
    code = int(exit_code(report.findings))
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(report.title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;color:#222}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top;font-size:13px}}
tr.s3 td:first-child{{background:#f4b6b6}}tr.s2 td:first-child{{background:#f8d0c0}}tr.s1 td:first-child{{background:#fbeeb8}}
td.diff{{background:#fde2c8}}.plots svg{{margin-right:1em;border:1px solid #eee}}</style></head><body>
<h1>{html.escape(report.title)}</h1><p>baseline <b>{html.escape(report.baseline)}</b>, candidate
<b>{html.escape(report.candidate)}</b>: {len(report.findings)} findings, exit code {code}</p>
{"<p>noise floor from " + html.escape(", ".join(report.noise)) + "</p>" if report.noise else ""}
<h2>Findings</h2><table><tr><th>severity</th><th>category</th><th>code</th><th>where</th><th>finding</th></tr>{rows}</table>
{'<h2>Latency</h2><div class="plots">' + plots + '</div>' if plots else ''}
{'<h2>Schemas side by side</h2>' + schemas if schemas else ''}
</body></html>"""


def _zip_longest(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else "", b[i] if i < len(b) else "") for i in range(n)]
