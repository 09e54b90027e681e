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
from replay_proxy.wire.schema import release_key

Rule = Literal["extra_trailing_elements", "missing_trailing_with_default", "unknown_map_key",
               "missing_required_key", "changed_type"]
READERS = (PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND)


@functools.cache
def reader_rules() -> dict[str, dict]:
    data = json.loads((importlib.resources.files("replay_proxy.compare") / "readers.json").read_text())
    return {reader: data[reader] for reader in READERS}


def _rule(reader: str, rule: Rule, struct: str | None, release: str | None) -> dict:
    """A reader's rule, or its exception for ``struct`` where it makes one for the reader's ``release``
    (None: the newest)."""
    entry = reader_rules()[reader]["rules"][rule]
    special = entry.get("except", {}).get(struct)
    if special is None or (release and "since" in special and release_key(release) < release_key(special["since"])):
        return entry
    return special


def verdict(reader: str, rule: Rule, struct: str | None = None, release: str | None = None) -> str:
    """What ``reader`` of ``release`` does with a message of ``struct`` that ``rule`` describes."""
    return _rule(reader, rule, struct, release)["verdict"]


def source(reader: str, rule: Rule, struct: str | None = None, release: str | None = None) -> str:
    """Where the rule ``reader`` of ``release`` follows for ``struct`` comes from."""
    return _rule(reader, rule, struct, release)["source"]


def rejecting(readers: tuple[str, ...], rule: Rule, struct: str | None = None,
              release: str | None = None) -> tuple[str, ...]:
    """Those of ``readers`` (of ``release``) that reject a message (of ``struct``) under ``rule``."""
    return tuple(r for r in readers if verdict(r, rule, struct, release) == "rejects")


def how_they_read(readers: tuple[str, ...], rule: Rule, struct: str | None = None, release: str | None = None) -> str:
    """One clause per verdict: 'python-frontend ignores them; rust-frontend rejects them (...)'."""
    by_verdict: dict[str, list[str]] = {}
    for reader in readers:
        by_verdict.setdefault(verdict(reader, rule, struct, release), []).append(reader)
    clauses = []
    for what, names in by_verdict.items():
        source = _rule(names[0], rule, struct, release)["source"] if what == "rejects" else None
        verb = what.removesuffix("s") if len(names) > 1 else what
        clauses.append(f"{' and '.join(names)} {verb} them" + (f" ({source.split(':')[0]})" if source else ""))
    return "; ".join(clauses)
