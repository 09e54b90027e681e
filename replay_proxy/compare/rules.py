"""Noise rules and thresholds are data: ``rules.json``, with ``--rules FILE`` replacing any of its keys."""

from __future__ import annotations

import importlib.resources
import json
from pathlib import Path
from typing import Any

from replay_proxy.errors import ReplayProxyError


class RulesError(ReplayProxyError):
    """A rules file is not valid JSON or not an object."""


def load_rules(path: Path | None = None) -> dict[str, Any]:
    """The default noise rules, with the keys of ``path`` (if given) replacing them."""
    rules = json.loads((importlib.resources.files("replay_proxy.compare") / "rules.json").read_text())
    if path is not None:
        try:
            extra = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RulesError(f"rules file {path}: {exc}") from None
        if not isinstance(extra, dict):
            raise RulesError(f"rules file {path}: expected a JSON object")
        rules.update(extra)
    return rules
