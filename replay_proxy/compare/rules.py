"""Noise rules and thresholds are data: ``rules.json``, with ``--rules FILE`` replacing any of its keys (in the
sections ``performance`` and ``judging``, any of theirs).

Both are read into ``Rules``, which knows every key: a key it does not know (a typo) is an error,
not silently ignored. Keys that begin with ``_`` are comments.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import msgspec

from replay_proxy.errors import ReplayProxyError


SECTIONS = ("performance", "judging")  # keys whose object a rules file changes key by key


class RulesError(ReplayProxyError):
    """A rules file that cannot be used: not JSON, not an object, an unknown key or a value of the wrong type."""


class Performance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A change is reported when its 95% interval lies beyond ``min_relative_change`` and it moved more than
    the metric's ``min_delta_ms``."""

    min_relative_change: float
    min_delta_ms: dict[str, float]  # by metric: ttft_ms, itl_ms, e2e_ms
    max_other_cpu: float  # a replay run during which other processes took more of the machine's CPU: not timed


class Judging(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What judging each request asks of a replay and where its verdicts draw the line (compare/tokens.py,
    compare/context.py, compare/scoring.py)."""

    top_logprobs: int  # asked for on every request a replay sends (0: none, and no scoring)
    tie_logprob: float  # a greedy divergence between tokens this close (nats) is a tie
    min_kl: float  # nats per token: scoring below this is no change, whatever the noise floor
    same_context_logprob: float  # nats: with one baseline run, a logprob that moved less where both builds saw
    # the same context is no change (compare/context.py)
    vocab_size: int | None  # the model's, where given: bounds the top-p nucleus (compare/tokens.py)


class Rules(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    ignore_registration_keys: frozenset[str]
    match_sampling_keys: list[str]
    frontend_handled_sampling_keys: frozenset[str]
    float_tolerance: float
    performance: Performance
    judging: Judging
    percentiles: list[int]
    min_samples: dict[int, int]  # by percentile: estimated only with at least this many values on each side
    abort_progress_tolerance_tokens: int
    abort_wait_s: float  # a frontend under test that has not aborted a held request this long after: never will
    unordered_utility_results: frozenset[str]  # utility methods whose result is a set sent as a list
    link_broke_patterns: list[str]  # what a peer says when it cannot read the link: a break's evidence
    peer_cannot_run_patterns: list[str]  # what it says when it cannot run for a reason of its own

    def link_broke(self, said: str) -> bool:
        """Whether ``said`` (a finding's message: a peer's log line, an HTTP body) shows the link broke."""
        return any(re.search(pattern, said) for pattern in self.link_broke_patterns)


def _keys(data: object, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise RulesError(f"{where}: expected a JSON object")
    return {k: v for k, v in data.items() if not k.startswith("_")}


def load_rules(path: Path | None = None) -> Rules:
    """The default noise rules, with the keys of ``path`` (if given) replacing them."""
    rules = _keys(json.loads((importlib.resources.files("replay_proxy.compare") / "rules.json").read_text()),
                  "rules.json")
    where = "the default rules"
    if path is not None:
        where = f"rules file {path}"
        try:
            given = _keys(json.loads(Path(path).read_text()), where)
        except (OSError, json.JSONDecodeError) as exc:
            raise RulesError(f"{where}: {exc}") from None
        for key, value in given.items():  # a section's keys one by one: a file written before a key was added
            section = key in SECTIONS and isinstance(value, dict)  # to it still reads
            rules[key] = {**rules[key], **_keys(value, f"{where}: {key}")} if section else value
    try:
        return msgspec.convert(rules, Rules, strict=False)
    except msgspec.ValidationError as exc:
        known = ", ".join(Rules.__struct_fields__)
        raise RulesError(f"{where}: {exc}" + (f" (known keys: {known})" if "unknown field" in str(exc) else "")) \
            from None
