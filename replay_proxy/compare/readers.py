"""The readers on the link, modelled: what each decoder does with a message unlike its own layout.

The rules are data (``readers.json``), each with where it comes from and the
test that pins it against the real reader; findings name the readers a change
breaks by asking them here, never by a reader's name in code.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from typing import Literal

from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND

Rule = Literal["extra_trailing_elements", "missing_trailing_with_default", "unknown_map_key",
               "missing_required_key", "changed_type"]
READERS = (PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND)


@functools.cache
def reader_rules() -> dict[str, dict]:
    data = json.loads((importlib.resources.files("replay_proxy.compare") / "readers.json").read_text())
    return {reader: data[reader] for reader in READERS}


def _rule(reader: str, rule: Rule, struct: str | None) -> dict:
    """A reader's rule, or its exception for ``struct`` where it makes one."""
    entry = reader_rules()[reader]["rules"][rule]
    return entry.get("except", {}).get(struct, entry)


def verdict(reader: str, rule: Rule, struct: str | None = None) -> str:
    return _rule(reader, rule, struct)["verdict"]


def rejecting(readers: tuple[str, ...], rule: Rule, struct: str | None = None) -> tuple[str, ...]:
    """Those of ``readers`` that reject a message (of ``struct``) under ``rule``."""
    return tuple(r for r in readers if verdict(r, rule, struct) == "rejects")


def how_they_read(readers: tuple[str, ...], rule: Rule, struct: str | None = None) -> str:
    """One clause per verdict: 'python-frontend ignores them; rust-frontend rejects them (...)'."""
    by_verdict: dict[str, list[str]] = {}
    for reader in readers:
        by_verdict.setdefault(verdict(reader, rule, struct), []).append(reader)
    clauses = []
    for what, names in by_verdict.items():
        source = _rule(names[0], rule, struct)["source"] if what == "rejects" else None
        verb = what.removesuffix("s") if len(names) > 1 else what
        clauses.append(f"{' and '.join(names)} {verb} them" + (f" ({source.split(':')[0]})" if source else ""))
    return "; ".join(clauses)
