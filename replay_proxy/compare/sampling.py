"""How each SamplingParams key travels in the candidate's requests, next to the baseline's.

A key the engine does not know is silently ignored by it; a value changed or
dropped changes what the engine does (it falls back to its default); a
default sent or left out, a float32 for a float64, another key order are
compatible, and so are a flag left out that asked for nothing (false, where
the default is none) and the EOS token named among the stop ids where the
request stops at EOS anyway (smg's way). Keys that a frontend handles itself
may be left out by design.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.compare.rules import Rules
from replay_proxy.store.session import Request, Session, stop_ids_beyond_eos


def sampling_findings(pairs: list[tuple[Request, Request]], candidate: Session, rules: Rules,
                      set_by_replay: frozenset[str] = frozenset()) -> list[Finding]:
    """How each SamplingParams key travels in the candidate's requests.

    Keys the candidate's engine release does not know are found in every
    request; the other comparisons need a matched baseline request. ``set_by_replay``: keys the
    replay itself set (``--hold-lengths``), not compared.
    """
    defaults = candidate.schema.sampling_defaults
    by_frontend = set(rules.frontend_handled_sampling_keys)
    by_key: dict[str, list[str]] = defaultdict(list)
    for request in candidate.requests:
        for key in request.params:
            if key not in defaults:
                by_key[key].append("unknown")
    orders_differ = 0
    for a, b in pairs:
        old, new = a.params, b.params
        orders_differ += [k for k in new if k in old] != [k for k in old if k in new]
        for key in dict.fromkeys([*old, *new]):
            before, after = old.get(key, defaults.get(key)), new.get(key, defaults.get(key))
            if key not in defaults or key in set_by_replay:
                continue
            if _same(before, after):
                by_key[key].append("default sent" if key not in old else "default omitted" if key not in new
                                   else "same")
            elif key == "stop_token_ids" and _same(stop_ids_beyond_eos(candidate.schema, old),
                                                   stop_ids_beyond_eos(candidate.schema, new)):
                by_key[key].append("eos named")
            elif isinstance(before, float) and isinstance(after, float) and \
                    abs(before - after) < rules.float_tolerance:
                by_key[key].append("f32")
            elif key not in new:
                by_key[key].append("handled by the frontend" if key in by_frontend else "dropped")
            else:
                by_key[key].append("added" if key not in old else "changed")
    findings = []
    for key, kinds in sorted(by_key.items()):
        for kind in sorted(set(kinds) - {"same"}, key=lambda k: -SAMPLING_KINDS[k][0]):
            severity, meaning = SAMPLING_KINDS[kind]
            code = Code(f"sampling_key_{kind.replace(' ', '_')}")
            findings.append(Finding(
                "schema" if kind == "unknown" else "behaviour", severity, code,
                f"SamplingParams.{key}: {meaning} ({kinds.count(kind)} request(s))", message_kind="ADD",
                struct="SamplingParams", field=key))
    if orders_differ:
        findings.append(Finding("schema", Severity.INFO, Code.SAMPLING_KEY_ORDER,
                                f"SamplingParams keys come in another order in {orders_differ} request(s) "
                                "(msgpack maps are matched by key: compatible)", message_kind="ADD",
                                struct="SamplingParams"))
    return findings


SAMPLING_KINDS = {
    "unknown": (Severity.WARNING, "a key this engine release does not know: ignored by the engine"),
    "added": (Severity.WARNING, "now sent with a value the baseline did not ask for"),
    "changed": (Severity.REGRESSION, "sent with another value"),
    "dropped": (Severity.REGRESSION, "no longer sent: the engine falls back to its default, not the baseline's value"),
    "handled by the frontend": (Severity.INFO, "no longer sent; the frontend handles it itself (compatible by design)"),
    "default sent": (Severity.INFO, "sent explicitly at its default (compatible)"),
    "default omitted": (Severity.INFO, "left out at its default (compatible)"),
    "eos named": (Severity.INFO, "names the EOS token, where the request stops at EOS anyway (compatible)"),
    "f32": (Severity.INFO, "sent as float32, equal within float32 precision (compatible)"),
}


def _same(a: Any, b: Any) -> bool:
    """Equal as the engine sees it: an empty list and nil are both "none", and so are a false flag and nil."""
    if isinstance(a, list) or isinstance(b, list):
        return bool((a or None) == (b or None))
    if a is False or b is False:
        return a in (False, None) and b in (False, None)
    return bool(a == b)
