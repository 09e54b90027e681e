"""The compatibility matrix rendered: terminal table, JSON, JUnit, a self-contained HTML heat map, markdown.

Rows are frontends, columns engines. A cell shows its verdict: observed
where it was observed, else predicted (marked ``*``: some kind of request it
was judged for was only predicted); ``!`` marks a cell whose observation
disagrees with its prediction. The markdown adds a table per kind of request
beyond completion, over the cells judged for it.
"""

from __future__ import annotations

import html
import xml.etree.ElementTree as ET
from pathlib import Path

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from replay_proxy.matrix import KINDS, Cell, Evidence, Verdict
from replay_proxy.matrix.deploy import Answer
from replay_proxy.matrix.run import MatrixRun
from replay_proxy.matrix.sent import SentReading

COLOURS = {Verdict.WORKS: "#2e7d32", Verdict.DEGRADED: "#f9a825", Verdict.BREAKS: "#c62828",
           Verdict.UNKNOWN: "#757575"}
RICH = {Verdict.WORKS: "green", Verdict.DEGRADED: "yellow", Verdict.BREAKS: "bold red", Verdict.UNKNOWN: "dim"}


def grid(cells: list[Cell]) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    """Frontends and engines in the order first met, and the cells by (frontend, engine)."""
    frontends = list(dict.fromkeys(c.frontend for c in cells))
    engines = list(dict.fromkeys(c.engine for c in cells))
    return frontends, engines, {(c.frontend, c.engine): c for c in cells}


def label(cell: Cell, kind: str | None = None) -> str:
    """``works``, ``breaks*`` (predicted only), ``degraded!`` (observed, disagreeing with the prediction), for
    ``kind`` or for every kind judged."""
    kinds = [kind] if kind else cell.kinds
    predicted_only = any(cell.judgement_of(k) is cell.predicted for k in kinds)
    return cell.verdict_for(kinds).value + ("*" if predicted_only else "!" if cell.agrees is False else "")


def evidence_of(cell: Cell) -> list[Evidence]:
    """What each kind's verdict rests on: its evidence in the observation where that judged it, else in
    the prediction."""
    return [e for k in cell.kinds for e in cell.judgement_of(k).evidence if e.kind == k]


def print_table(cells: list[Cell], console: Console) -> None:
    frontends, engines, by = grid(cells)
    table = Table(title="frontend x engine (* predicted only, ! observed unlike predicted)")
    table.add_column("frontend")
    for engine in engines:
        table.add_column(f"engine {engine}")
    for frontend in frontends:
        row = [by.get((frontend, e)) for e in engines]
        table.add_row(frontend, *(f"[{RICH[c.verdict]}]{label(c)}[/]" if c else "" for c in row))
    console.print(table)


def print_run(run: MatrixRun, console: Console, log: Console) -> None:
    """The table on ``console``; on ``log``, each disagreement and a line of totals."""
    print_table(run.cells, console)
    for cell in run.disagreeing:
        log.print(f"[yellow]observed {cell.observed.verdict.value}, predicted {cell.predicted.verdict.value}:[/] "
                  f"{cell.frontend} x engine {cell.engine}", highlight=False)
    log.print(f"{len(run.cells)} cells, {sum(c.observed is not None for c in run.cells)} observed, "
              f"{len(run.disagreeing)} disagreeing with their prediction, in {run.seconds:.0f} s")


def print_answer(answer: Answer, console: Console) -> None:
    """can-i-deploy's answer: the verdict and where it comes from, its reasons, the upgrade order."""
    verdict, kinds = answer.verdict, answer.by_kind()
    said = f"{answer.cell.frontend} with engine {answer.cell.engine}: [{RICH[verdict]}]{verdict.value}[/]"
    if len(kinds) == 1:  # one kind of request: its source on the same line
        [(_, _, source, reasons)] = kinds
        console.print(f"{said} ({source})")
        _print_reasons(reasons, console, "  ")
    else:
        console.print(f"{said} ({'; '.join(f'{v.value} for {kind}' for kind, v, _, _ in kinds)})")
        for kind, kind_verdict, source, reasons in kinds:
            console.print(f"  for {kind}: [{RICH[kind_verdict]}]{kind_verdict.value}[/] ({source})")
            _print_reasons(reasons, console, "    ")
    for line in answer.upgrade:
        console.print(line, highlight=False)


def _print_reasons(reasons: list[tuple[Evidence, int]], console: Console, indent: str) -> None:
    for evidence, count in reasons:
        more = f" (and {count - 1} more like it)" if count > 1 else ""
        console.print(f"{indent}{evidence_line(evidence)}{more}", highlight=False, markup=False)


def main_reason(cell: Cell) -> str:
    """The first piece of evidence behind the verdict, in one line (its kind named, where several were judged)."""
    evidence = evidence_of(cell)
    reasons = [e for e in evidence if e.verdict is cell.verdict] or evidence
    if not reasons:
        return ""
    kind = f"{reasons[0].kind}: " if len(cell.kinds) > 1 else ""
    return f"{kind}{reasons[0].direction or 'both'}: {reasons[0].message}"


def junit(cells: list[Cell]) -> bytes:
    """A testcase per cell: breaks is a failure, degraded a failure of type degraded, unknown skipped."""
    failures = sum(c.verdict in (Verdict.BREAKS, Verdict.DEGRADED) for c in cells)
    suite = ET.Element("testsuite", name="compatibility matrix", tests=str(len(cells)), failures=str(failures),
                       skipped=str(sum(c.verdict is Verdict.UNKNOWN for c in cells)))
    for cell in cells:
        case = ET.SubElement(suite, "testcase", classname=cell.frontend, name=f"engine {cell.engine}",
                             time=str((cell.observed and cell.observed.seconds) or 0))
        text = "\n".join(evidence_line(e) for e in evidence_of(cell))
        if cell.verdict is Verdict.UNKNOWN:
            ET.SubElement(case, "skipped", message=main_reason(cell)[:300])
        elif cell.verdict is not Verdict.WORKS:
            ET.SubElement(case, "failure", type=cell.verdict.value, message=main_reason(cell)[:300]).text = text
        ET.SubElement(case, "system-out").text = f"predicted {cell.predicted.verdict.value}; observed " + (
            cell.observed.verdict.value if cell.observed else "no") + "\n" + text
    suites = ET.Element("testsuites", name="replay-proxy matrix")
    suites.append(suite)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def evidence_line(e: Evidence) -> str:
    """``[breaks] to_frontend EngineCoreOutputs[8]: ... (source: ...)``, the place left out where the message
    starts with it; the source is the reader rule's, or the replay's report. Evidence of a kind of request
    other than completion names it: ``[breaks] lora to_engine ...``."""
    where = ".".join(str(p) for p in (e.struct, e.field) if p) + (f"[{e.position}]" if e.position is not None else "")
    if where and e.message.startswith(where.split("[")[0]):
        where = ""
    kind = "" if e.kind == "completion" else f"{e.kind} "
    return (f"[{e.verdict.value}] {kind}{e.direction or 'both'}{' ' + where if where else ''}: {e.message}"
            + (f" (source: {e.source})" if e.source else ""))


def markdown(cells: list[Cell]) -> str:
    """The grid over every kind judged, then a grid per kind beyond completion, over the cells judged for it."""
    text = _grid_markdown(cells)
    for kind in [k for k in KINDS if k != "completion"]:
        judged = [c for c in cells if kind in c.kinds]
        if judged:
            text += f"\n{kind} requests, where recorded on both sides:\n\n" + _grid_markdown(judged, kind)
    return text


def _grid_markdown(cells: list[Cell], kind: str | None = None) -> str:
    frontends, engines, by = grid(cells)
    lines = ["| frontend | " + " | ".join(f"engine {e}" for e in engines) + " |",
             "|---|" + "---|" * len(engines)]
    for frontend in frontends:
        lines.append(f"| {frontend} | " + " | ".join(label(by[(frontend, e)], kind) if (frontend, e) in by else ""
                                                     for e in engines) + " |")
    return "\n".join(lines) + "\n"


def evidence_markdown(cells: list[Cell], width: int = 300) -> str:
    """What decided each cell that is not plain works, one line each, cut at ``width`` characters
    (matrix.json and matrix.html hold all of it)."""
    lines = []
    for c in cells:
        if c.verdict is not Verdict.WORKS or c.agrees is False:
            reason = " ".join(main_reason(c).split())
            lines.append(f"- **{c.frontend} x engine {c.engine}: {label(c)}** (predicted {c.predicted.verdict.value}): "
                         f"{reason[:width]}{' ...' if len(reason) > width else ''}\n")
    return "".join(lines)


def html_page(cells: list[Cell], title: str = "replay-proxy compatibility matrix") -> str:
    frontends, engines, by = grid(cells)
    index = {id(c): i for i, c in enumerate(cells)}
    head = "".join(f"<th>engine {html.escape(e)}</th>" for e in engines)
    rows = []
    for frontend in frontends:
        tds = []
        for engine in engines:
            cell = by.get((frontend, engine))
            if cell is None:
                tds.append("<td></td>")
                continue
            tds.append(f'<td style="background:{COLOURS[cell.verdict]}"><a href="#cell-{index[id(cell)]}" '
                       f'title="{html.escape(main_reason(cell)[:200])}">{html.escape(label(cell))}</a></td>')
        rows.append(f"<tr><th>{html.escape(frontend)}</th>{''.join(tds)}</tr>")
    details = []
    for cell in cells:
        parts = [f'<section id="cell-{index[id(cell)]}"><h3>{html.escape(cell.frontend)} x engine '
                 f'{html.escape(cell.engine)}: {html.escape(label(cell))}</h3>']
        for name, judgement in (("observed", cell.observed), ("predicted", cell.predicted)):
            if judgement is None:
                parts.append(f"<p>{name}: not observed</p>")
                continue
            parts.append(f"<p><b>{name}: {judgement.verdict.value}</b> &mdash; {html.escape(judgement.how)}</p><ul>")
            parts += [f'<li class="{e.verdict.value}">{html.escape(evidence_line(e))}</li>'
                      for e in sorted(judgement.evidence, key=lambda e: list(Verdict).index(e.verdict), reverse=True)]
            parts.append("</ul>")
        details.append("".join(parts) + '<p><a href="#top">back to the matrix</a></p></section>')
    style = ("body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
             "padding:4px 8px;text-align:center}td a{color:#fff;text-decoration:none;display:block}"
             "section{display:none;border-top:1px solid #ccc;margin-top:1em}section:target{display:block}"
             "li.breaks{color:#c62828}li.degraded{color:#8d6e00}li.unknown{color:#555}")
    legend = " ".join(f'<span style="background:{c};color:#fff;padding:2px 6px">{v.value}</span>'
                      for v, c in COLOURS.items())
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body id='top'><h1>{html.escape(title)}</h1><p>{legend} &nbsp; "
            "* predicted only, ! observed unlike predicted; click a cell for its evidence</p>"
            f"<table><tr><th>frontend</th>{head}</tr>{''.join(rows)}</table>{''.join(details)}</body></html>")


def matrix_json(cells: list[Cell]) -> bytes:
    """matrix.json, and ``matrix --json``: every cell, its verdict, prediction, observation and evidence."""
    return msgspec.json.format(msgspec.json.encode(
        [{**msgspec.to_builtins(c), "observed": msgspec.to_builtins(c.observed), "verdict": c.verdict.value,
          "agrees": c.agrees} for c in cells]))  # "observed" is null, not missing, where nothing was observed


def answer_json(answer: Answer) -> bytes:
    """``can-i-deploy --json``: what ``print_answer`` says, as a document."""
    verdict = answer.verdict
    return msgspec.json.format(msgspec.json.encode({
        "frontend": answer.cell.frontend, "engine": answer.cell.engine, "verdict": verdict.value,
        "exit_code": int(verdict.exit_code), "uses": answer.uses,
        "kinds": [{"kind": kind, "verdict": kind_verdict.value, "source": source,
                   "evidence": [{**msgspec.to_builtins(e), "count": count} for e, count in reasons]}
                  for kind, kind_verdict, source, reasons in answer.by_kind()],
        "upgrade": answer.upgrade}))


def write_reports(cells: list[Cell], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / name for name in ("matrix.json", "junit.xml", "matrix.html", "matrix.md")}
    paths["matrix.json"].write_bytes(matrix_json(cells))
    paths["junit.xml"].write_bytes(junit(cells))
    paths["matrix.html"].write_text(html_page(cells))
    paths["matrix.md"].write_text(markdown(cells) + "\n" + evidence_markdown(cells))
    return list(paths.values())


def print_sent(reading: SentReading, console: Console) -> None:
    """``replay-proxy readers``: a row per engine release, what it fills in and what it does not read as sent."""
    who = reading.frontend or "a frontend record --frontend did not name"
    console.print(f"session {reading.session!r}: {reading.requests} requests from {who}, to {reading.engine} "
                  "engines", highlight=False)
    table = Table("engine", "reads it", "fills in", "as sent, it", box=None, pad_edge=False)
    for r in reading.readings:
        filled = ", ".join(f"{f.field} ({f.default!r})" for f in r.filled) or "-"
        flagged = "; ".join(e.message for e in r.evidence if e.rule) or "-"
        table.add_row(r.engine, f"[{RICH[r.verdict]}]{r.verdict.value}[/]", escape(filled), escape(flagged))
    console.print(table)
    console.print(f"its layout exactly: {', '.join(reading.exact_layouts) or 'no release'}", highlight=False)
    if reading.unread_by_any:
        console.print(f"read by no release: {', '.join(reading.unread_by_any)}", highlight=False)
    for r in reading.rounded:
        console.print(f"rounded to float32: {r.struct}.{r.field} {r.sent!r} for {r.meant} ({r.messages} requests)",
                      highlight=False)
    console.print(f"verdict for engines {', '.join(reading.judged)}: [{RICH[reading.verdict]}]"
                  f"{reading.verdict.value}[/]", highlight=False)
