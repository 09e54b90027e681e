"""The README's tour and the docs' examples that need no real vLLM, run as a newcomer runs them.

A walk is a stretch of a page: its ``sh`` blocks run in order, in one folder, with the project's venv first
on PATH; a ``text`` block that starts with ``$ `` holds commands (a trailing backslash continues one) each
followed by its output, and a ``text`` block that does not is the output of the ``sh`` block before it (or
of the walk's first command). Output is held to the page line by line, blank lines and runs of spaces aside:
a line ``...`` stands for any lines, and ``...`` inside a line for any text (what the page leaves out, or
what varies from run to run, as the page says).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from replay_proxy.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
TOUR_PORT = "29560"  # the tour's handshake port: a free one in the test (a second suite may be running)


class Walk:
    def __init__(self, page: str, start: str, end: str, first: str | None = None):
        """The stretch of ``page`` from ``start`` to ``end``; ``first``: the command whose output the first
        ``text`` block is (the page names it in prose)."""
        self.page, self.start, self.end, self.first = page, start, end, first

    def blocks(self) -> list[tuple[str, str]]:
        text = (ROOT / self.page).read_text()
        stretch = text[text.index(self.start):text.index(self.end, text.index(self.start))]
        return re.findall(r"^```(sh|text)\n(.*?)^```", stretch, re.M | re.S)


WALKS = {
    "the README's tour": Walk("README.md", "## A five-minute tour", "## Recording in staging",
                              first=f"{sys.executable} scripts/demo.py"),
    "docs/database.md: Parquet to DuckDB": Walk("docs/database.md", "<!-- walk: parquet -->", "<!-- /walk -->"),
    "docs/comparing.md: schema diff": Walk("docs/comparing.md", "<!-- walk: schema diff -->", "<!-- /walk -->"),
    "docs/comparing.md: two frontends": Walk("docs/comparing.md", "<!-- walk: two frontends -->", "<!-- /walk -->"),
    "docs/comparing.md: vllm-rs against python": Walk("docs/comparing.md", "<!-- walk: vllm-rs against python -->",
                                                      "<!-- /walk -->"),
    "docs/matrix.md: readers": Walk("docs/matrix.md", "<!-- walk: readers -->", "<!-- /walk -->"),
}


def commands(block: str) -> list[tuple[str, list[str]]]:
    """A ``$`` block's commands, each with the lines the page shows it printing."""
    shown: list[tuple[str, list[str]]] = []
    lines = block.splitlines()
    while lines:
        command = lines.pop(0)[2:]
        while command.endswith("\\"):
            command = command[:-1].rstrip() + " " + lines.pop(0).strip()
        output = []
        while lines and not lines[0].startswith("$ "):
            output.append(lines.pop(0))
        shown.append((command, output))
    return shown


def normal(line: str) -> str:
    return " ".join(line.split())


def holds(shown: list[str], printed: str) -> str | None:
    """None if ``printed`` is what the page shows, else the first line of the page that it lacks."""
    actual = [normal(line) for line in printed.splitlines() if line.strip()]
    at, gap = 0, False
    for line in (normal(line) for line in shown if line.strip()):
        if line == "...":
            gap = True
            continue
        pattern = re.compile(".*?".join(re.escape(part) for part in line.split("...")) + "$")
        while at < len(actual) and not pattern.match(actual[at]):
            if not gap:
                return f"{line!r} (printed instead: {actual[at]!r})"
            at += 1
        if at == len(actual):
            return f"{line!r} (not printed)"
        at, gap = at + 1, False
    return None


@pytest.mark.parametrize("name", sorted(WALKS))
def test_each_walk_runs_as_the_page_says_and_prints_what_it_shows(name, tmp_path):
    walk = WALKS[name]
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")  # the project, as a clone has it; what the walk writes is new
    for folder in ("recordings", "docs"):  # copies, which no other test touches while the walk reads them
        shutil.copytree(ROOT / folder, tmp_path / folder)
    port = str(free_port())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "COLUMNS": "200"}
    committed = {p: p.read_bytes() for folder in ("recordings", "docs") for p in (tmp_path / folder).rglob("*")
                 if p.is_file()}

    def run(script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script.replace(TOUR_PORT, port)], cwd=tmp_path,
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)

    printed = ""
    if walk.first:
        done = run(walk.first)
        assert done.returncode == 0, f"{walk.first} failed:\n{done.stdout}"
        printed = done.stdout
    for kind, block in walk.blocks():
        if kind == "sh":
            done = run(block)
            assert done.returncode == 0, f"{walk.page}: this block failed:\n{block}\n{done.stdout}"
            printed = done.stdout
        elif block.startswith("$ "):
            for command, shown in commands(block):  # (its exit code is what its output says: 3 for a break)
                printed = run(command).stdout
                lacks = holds([line.replace(TOUR_PORT, port) for line in shown], printed)
                assert lacks is None, f"{walk.page}: `{command}` did not print {lacks}; it printed:\n{printed}"
        else:
            lacks = holds([line.replace(TOUR_PORT, port) for line in block.splitlines()], printed)
            assert lacks is None, f"{walk.page}: the page shows {lacks}; what ran printed:\n{printed}"
    # Reading never writes: the committed recordings and docs it read are as they were, nothing made beside them
    # (a tour once left 46 to 58 -wal and -shm files in recordings/).
    assert {p: p.read_bytes() for folder in ("recordings", "docs") for p in (tmp_path / folder).rglob("*")
            if p.is_file()} == committed


def test_every_link_between_the_pages_leads_somewhere():
    """Each relative link of the README and docs/ names a file that exists, and a heading of it where it
    names one (as GitHub makes a heading's anchor)."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            linked = (page.parent / target) if target else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("shown, printed, ok", [
    (["a", "...", "c"], "a\nb\nc\n", True),
    (["a", "c"], "a\nb\nc\n", False),  # without "...", nothing is skipped
    (["x ... z"], "x  y  z\n", True),
    (["x ... z"], "x y\n", False),
    (["a", "b"], "a\n", False),
])
def test_the_page_is_held_line_by_line_with_only_what_it_elides_skipped(shown, printed, ok):
    assert (holds(shown, printed) is None) is ok
