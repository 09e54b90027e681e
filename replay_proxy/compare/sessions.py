"""Compare two recorded sessions: schema, behaviour and performance findings.

A session is loaded once from its database into ``SessionData``; everything
after that is pure. Requests are matched on what the user asked for (prompt
tokens and the sampling parameters that decide the output), never on
request ids, which are random per run. Noise is data (``rules.json``):
fields that differ on every run, tolerances, thresholds.
"""

from __future__ import annotations

import importlib.resources
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import sqlite_utils

from replay_proxy.compare.findings import PYTHON_FRONTEND, RUST_FRONTEND, Finding, Report, Severity
from replay_proxy.compare.schema_diff import readers
from replay_proxy.errors import ReplayProxyError
from replay_proxy.store.queries import find_session
from replay_proxy.wire.schema import Schema, schema_for, schema_lines
from replay_proxy.wire.values import decode_msgpack, kind_of


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


class RequestRecord(msgspec.Struct):
    seq: int
    request_id: str
    engine_index: int | None
    prompt: list[int]
    params: dict[str, Any]  # sampling params as sent
    effective: dict[str, Any]  # the match keys as the engine sees them: sent, else the release's default
    tokens: list[int]
    finish_reason: str | None
    added_ns: int
    first_token_ns: int | None
    last_ns: int | None
    frontend_aborted: bool
    abort_progress: int | None  # tokens produced before the (first) ABORT that named it crossed
    output_times: list[int]  # ts of outputs that carried tokens
    logprobs: list[float]


class Shape(msgspec.Struct):
    """What a positional struct looked like on the wire across a session."""

    lengths: set[int] = set()
    kinds: dict[int, set[str]] = {}  # position -> msgpack kinds seen there, nil included


class SessionData(msgspec.Struct):
    label: str
    schema: Schema
    registration_keys: set[str]
    registration: dict[str, Any]
    requests: list[RequestRecord]
    utility: list[dict[str, Any]]
    shapes: dict[str, Shape]
    finish_reasons: set[str]


def effective(params: dict[str, Any], schema: Schema, keys: list[str]) -> dict[str, Any]:
    """What the engine makes of the params: Python omits defaults, Rust sends f32 and [] for None."""
    defaults = {f.name: f.default for f in schema.structs["SamplingParams"].fields}
    effective = {}
    for key in keys:
        value = params.get(key, defaults.get(key))
        if isinstance(value, float):
            value = round(value, 5)
        effective[key] = None if value == [] else value
    return effective


def load_session(db_path: Path, session: str, rules: dict[str, Any]) -> SessionData:
    db = sqlite_utils.Database(db_path)
    row = find_session(db, session)
    sid = row["id"]
    schema = schema_for(row["vllm_version"])[0]
    # Engine 0's first: values such as data_parallel_rank are compared engine for engine, whatever the start order.
    registrations = [json.loads(r["payload"]) for r in db.query(
        "SELECT payload FROM handshakes WHERE session_id = ? AND kind = 'REGISTRATION' ORDER BY engine_index, seq",
        [sid])]
    outputs: dict[str, list[dict]] = defaultdict(list)
    for o in db.query("SELECT request_id, ts_ns, new_token_ids, finish_reason, new_logprobs FROM outputs "
                      "WHERE session_id = ? ORDER BY seq, position", [sid]):
        outputs[o["request_id"]].append(o)
    aborted: dict[str, int] = {}
    for r in db.query("SELECT request_id, tokens_before_abort FROM abort_progress WHERE session_id = ? ORDER BY seq",
                      [sid]):
        aborted.setdefault(r["request_id"], r["tokens_before_abort"])
    requests = []
    for r in db.query("SELECT seq, request_id, engine_index, prompt_token_ids, sampling_params, ts_ns "
                      "FROM requests WHERE session_id = ? ORDER BY seq", [sid]):
        outs = outputs.get(r["request_id"], [])
        tokens, times, logprobs = [], [], []
        for o in outs:
            new = json.loads(o["new_token_ids"] or "[]")
            tokens += new
            if new:
                times.append(o["ts_ns"])
            if o["new_logprobs"]:
                values = json.loads(o["new_logprobs"]).get("logprobs") or {}
                logprobs += [v for v in values.get("values") or [] if isinstance(v, float)]
        params = json.loads(r["sampling_params"] or "{}")
        requests.append(RequestRecord(
            seq=r["seq"], request_id=r["request_id"], engine_index=r["engine_index"],
            prompt=json.loads(r["prompt_token_ids"] or "[]"), params=params,
            effective=effective(params, schema, rules["match_sampling_keys"]),
            tokens=tokens, finish_reason=next((o["finish_reason"] for o in outs if o["finish_reason"]), None),
            added_ns=r["ts_ns"], first_token_ns=times[0] if times else None,
            last_ns=outs[-1]["ts_ns"] if outs else None, frontend_aborted=r["request_id"] in aborted,
            abort_progress=aborted.get(r["request_id"]), output_times=times, logprobs=logprobs))
    utility = list(db.query("SELECT method, args, failure_message, result FROM utility_calls "
                            "WHERE session_id = ? ORDER BY called_ns", [sid]))
    shapes: dict[str, Shape] = defaultdict(Shape)
    for frame in db.query("SELECT kind, raw FROM frames WHERE session_id = ? AND kind IN "
                          "('ADD', 'OUTPUTS', 'UTILITY_OUTPUT')", [sid]):
        parts = decode_msgpack(frame["raw"])
        body = decode_msgpack(parts[1] if frame["kind"] == "ADD" else parts[0])
        _observe_shapes(shapes, frame["kind"], body)
    return SessionData(
        label=f"{row['name']} (#{sid})", schema=schema,
        registration_keys=set().union(*(r.keys() for r in registrations)) if registrations else set(),
        registration=registrations[0] if registrations else {}, requests=requests, utility=utility,
        shapes=dict(shapes),
        finish_reasons={r.finish_reason for r in requests if r.finish_reason})


def _observe(shapes: dict[str, Shape], struct: str, value: Any) -> None:
    if not isinstance(value, list):
        return
    shape = shapes[struct]
    shape.lengths.add(len(value))
    for position, item in enumerate(value):
        shape.kinds.setdefault(position, set()).add(kind_of(item))


def _observe_shapes(shapes: dict[str, Shape], kind: str, body: Any) -> None:
    """Positions that are the same in every release: EngineCoreOutputs 1 (outputs), 4 (utility_output)."""
    if kind == "ADD":
        _observe(shapes, "EngineCoreRequest", body)
        return
    _observe(shapes, "EngineCoreOutputs", body)
    if isinstance(body, list):
        for output in body[1] if len(body) > 1 and isinstance(body[1], list) else []:
            _observe(shapes, "EngineCoreOutput", output)
        if len(body) > 4:
            _observe(shapes, "UtilityOutput", body[4])


def compare_sessions(baseline: SessionData, candidate: SessionData, rules: dict[str, Any],
                     noise: list[SessionData] = (), frontend_under_test: bool = False) -> list[Finding]:
    pairs, _, _ = match_requests(baseline, candidate)
    return [*schema_findings(baseline, candidate, rules),
            *sampling_findings(pairs, candidate, rules),
            *behaviour_findings(baseline, candidate, rules, noise, frontend_under_test),
            *performance_findings(baseline, candidate, rules, noise)]


def sampling_findings(pairs: list[tuple[RequestRecord, RequestRecord]], candidate: SessionData,
                      rules: dict[str, Any]) -> list[Finding]:
    """How each SamplingParams key travels in the candidate's requests.

    Keys the candidate's engine release does not know are found in every
    request; the other comparisons need a matched baseline request.
    """
    defaults = {f.name: f.default for f in candidate.schema.structs["SamplingParams"].fields}
    by_frontend = set(rules["frontend_handled_sampling_keys"])
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
            if key not in defaults:
                continue
            if _same(before, after):
                by_key[key].append("default sent" if key not in old else "default omitted" if key not in new
                                   else "same")
            elif isinstance(before, float) and isinstance(after, float) and abs(before - after) < 1e-6:
                by_key[key].append("f32")
            elif key not in new:
                by_key[key].append("handled by the frontend" if key in by_frontend else "dropped")
            else:
                by_key[key].append("added" if key not in old else "changed")
    findings = []
    for key, kinds in sorted(by_key.items()):
        for kind in sorted(set(kinds) - {"same"}, key=lambda k: -SAMPLING_KINDS[k][0]):
            severity, meaning = SAMPLING_KINDS[kind]
            findings.append(Finding(
                "schema" if kind == "unknown" else "behaviour", severity, f"sampling_key_{kind.replace(' ', '_')}",
                f"SamplingParams.{key}: {meaning} ({kinds.count(kind)} request(s))", message_kind="ADD",
                struct="SamplingParams", field=key))
    if orders_differ:
        findings.append(Finding("schema", Severity.INFO, "sampling_key_order",
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
    "f32": (Severity.INFO, "sent as float32, equal within float32 precision (compatible)"),
}


def _same(a: Any, b: Any) -> bool:
    """Equal as the engine sees it: an empty list and nil are both "none"."""
    if isinstance(a, list) or isinstance(b, list):
        return (a or None) == (b or None)
    return a == b


# --- schema -------------------------------------------------------------------------------

def schema_findings(baseline: SessionData, candidate: SessionData, rules: dict[str, Any]) -> list[Finding]:
    findings = []
    spec = baseline.schema.structs["EngineCoreReadyResponse"]
    if baseline.registration_keys:
        for key in sorted(baseline.registration_keys - candidate.registration_keys):
            required = key in spec.by_name and spec.by_name[key].required
            findings.append(Finding(
                "schema", Severity.BREAKING if required else Severity.WARNING, "registration_key_missing",
                f"the registration lacks {key!r}" + (f", which a {baseline.schema.release} frontend requires "
                                                     f"(\"Object missing required field `{key}`\")" if required else ""),
                message_kind="REGISTRATION", struct="EngineCoreReadyResponse", field=key,
                breaks=(PYTHON_FRONTEND, RUST_FRONTEND) if required else ()))
        for key in sorted(candidate.registration_keys - baseline.registration_keys):
            findings.append(Finding("schema", Severity.INFO, "registration_key_added",
                                    f"the registration has a new key {key!r} (frontends ignore unknown keys)",
                                    message_kind="REGISTRATION", struct="EngineCoreReadyResponse", field=key))
        ignored = set(rules["ignore_registration_keys"])
        for key in sorted(baseline.registration_keys & candidate.registration_keys - ignored):
            a, b = baseline.registration.get(key), candidate.registration.get(key)
            if a != b:
                findings.append(Finding("schema", Severity.WARNING, "registration_value_changed",
                                        f"registration {key}: {a!r} -> {b!r}", message_kind="REGISTRATION",
                                        struct="EngineCoreReadyResponse", field=key, baseline=a, candidate=b))
    for struct in ("EngineCoreRequest", "EngineCoreOutputs", "EngineCoreOutput", "UtilityOutput"):
        if struct in baseline.shapes and struct in candidate.shapes:
            findings += _shape_findings(struct, baseline, candidate)
    finish_names = {k.lower() for k in baseline.schema.enums.get("FinishReason", {})}
    for reason in sorted(candidate.finish_reasons - finish_names):
        findings.append(Finding("schema", Severity.BREAKING, "finish_reason_unknown",
                                f"finish reason {reason!r} is not one that {baseline.schema.release} knows",
                                message_kind="OUTPUTS", struct="FinishReason", candidate=reason,
                                breaks=(PYTHON_FRONTEND, RUST_FRONTEND)))
    return findings


def _alignment(a: Shape, b: Shape, at: int, shift: int) -> list[tuple[int, int]]:
    """Position pairs (baseline, candidate) if ``shift`` elements were inserted (or removed) at ``at``."""
    length_a, length_b = max(a.lengths), max(b.lengths)
    pairs = []
    for p in range(length_a):
        q = p if p < at else p + shift
        if 0 <= q < length_b and (shift >= 0 or p < at or p >= at - shift):
            pairs.append((p, q))
    return pairs


def _shape_findings(struct: str, baseline: SessionData, candidate: SessionData) -> list[Finding]:
    """Array drift between two sessions' observed shapes of ``struct``.

    Every way of lining the two up is tried: elements inserted (or removed)
    at each position, or at the end. The one under which the most positions
    saw exactly the same kinds (nil included: a field that is sometimes nil
    has a pattern of its own) wins; ties go to the simpler "at the end".
    """
    a, b = baseline.shapes[struct], candidate.shapes[struct]
    names_a = [f.name for f in baseline.schema.structs[struct].fields]
    names_b = [f.name for f in candidate.schema.structs[struct].fields]
    name_a = lambda p: names_a[p] if p < len(names_a) else f"${p}"  # noqa: E731
    name_b = lambda p: names_b[p] if p < len(names_b) else f"${p}"  # noqa: E731
    who = readers(baseline.schema, struct)
    length_a, length_b = max(a.lengths), max(b.lengths)
    shift = length_b - length_a
    end = min(length_a, length_b)
    score = lambda at: sum(a.kinds.get(p) == b.kinds.get(q) for p, q in _alignment(a, b, at, shift))  # noqa: E731
    at = max(range(end + 1), key=lambda i: (score(i), i)) if shift else end
    findings = []
    if at < end:
        moved = "inserted" if shift > 0 else "removed"
        findings.append(Finding(
            "schema", Severity.BREAKING, f"field_{moved}",
            f"{struct}: {abs(shift)} element(s) {moved} at position {at}; {name_a(at)} and every later field "
            f"moved {shift:+d}: a reader of one build misreads the other's messages",
            struct=struct, field=name_a(at), position=at, baseline=length_a, candidate=length_b, breaks=who))
    for p, q in _alignment(a, b, at, shift):
        kinds_a, kinds_b = a.kinds.get(p, set()) - {"nil"}, b.kinds.get(q, set()) - {"nil"}
        if kinds_a and kinds_b and not kinds_a & kinds_b:
            findings.append(Finding(
                "schema", Severity.BREAKING, "position_type_changed",
                f"{struct} position {p} ({name_a(p)}) held {sorted(kinds_a)}, now {sorted(kinds_b)}",
                struct=struct, field=name_a(p), position=p, baseline=sorted(kinds_a), candidate=sorted(kinds_b),
                breaks=who))
    if at == end and shift > 0:
        rust = tuple(r for r in who if r == RUST_FRONTEND)
        findings.append(Finding(
            "schema", Severity.BREAKING if rust else Severity.INFO, "array_longer",
            f"{struct} arrays grew from {length_a} to {length_b} elements (new: "
            f"{', '.join(name_b(p) for p in range(length_a, length_b))}); Python readers skip extra trailing "
            "elements" + ("; the Rust frontend's reader rejects them (LengthMismatch)" if rust else ""),
            struct=struct, position=length_a, baseline=length_a, candidate=length_b, breaks=rust))
    elif at == end and shift < 0:
        required = [f.name for f in baseline.schema.structs[struct].fields[length_b:length_a] if f.required]
        findings.append(Finding(
            "schema", Severity.BREAKING if required else Severity.INFO, "array_shorter",
            f"{struct} arrays shrank from {length_a} to {length_b} elements (missing: "
            f"{', '.join(name_a(p) for p in range(length_b, length_a))})"
            + (f"; {', '.join(required)} required" if required else "; readers fill in defaults"),
            struct=struct, position=length_b, baseline=length_a, candidate=length_b,
            breaks=who if required else ()))
    return findings


# --- behaviour ----------------------------------------------------------------------------

def match_key(request: RequestRecord) -> str:
    return json.dumps([request.prompt, request.effective], sort_keys=True)


def match_requests(baseline: SessionData, candidate: SessionData):
    """Pairs (baseline, candidate) by content and order; unmatched ones on either side."""
    waiting: dict[str, list[RequestRecord]] = defaultdict(list)
    for request in candidate.requests:
        waiting[match_key(request)].append(request)
    pairs, missing = [], []
    for request in baseline.requests:
        queue = waiting.get(match_key(request))
        if queue:
            pairs.append((request, queue.pop(0)))
        else:
            missing.append(request)
    extra = [r for queue in waiting.values() for r in queue]
    return pairs, missing, extra


def batched(session: SessionData) -> set[str]:
    """Requests that ran while another request on the same engine was running."""
    spans = [(r.added_ns, r.last_ns or r.added_ns, r.engine_index, r.request_id) for r in session.requests]
    overlapping = set()
    for i, (start, end, engine, rid) in enumerate(spans):
        for other_start, other_end, other_engine, other in spans[i + 1:]:
            if engine == other_engine and start < other_end and other_start < end:
                overlapping |= {rid, other}
    return overlapping


def deterministic(request: RequestRecord) -> bool:
    return request.effective.get("temperature") == 0.0 or request.effective.get("seed") is not None


def behaviour_findings(baseline: SessionData, candidate: SessionData, rules: dict[str, Any],
                       noise: list[SessionData] = (), frontend_under_test: bool = False) -> list[Finding]:
    findings = []
    pairs, missing, extra = match_requests(baseline, candidate)
    for request in missing:
        findings.append(Finding("behaviour", Severity.REGRESSION, "request_unmatched",
                                f"baseline request with a {len(request.prompt)}-token prompt has no counterpart",
                                message_kind="ADD", request_id=request.request_id))
    for request in extra:
        findings.append(Finding("behaviour", Severity.WARNING, "request_extra",
                                "the candidate has a request the baseline does not", message_kind="ADD",
                                request_id=request.request_id))
    # Batched requests do not reproduce on vLLM's CPU build: noise, unless repeat runs show them stable.
    unstable = _unstable(baseline, noise, rules)
    noisy = {rid for rid in batched(baseline) if not noise or rid in unstable}
    for a, b in pairs:
        rid = a.request_id
        if a.frontend_aborted or b.frontend_aborted:
            if a.frontend_aborted != b.frontend_aborted:
                findings.append(Finding("behaviour", Severity.REGRESSION, "abort_mismatch",
                                        f"aborted by the frontend in {'baseline' if a.frontend_aborted else 'candidate'}"
                                        " only", request_id=rid))
            else:
                findings.append(_abort_landing(a, b, rules["abort_progress_tolerance_tokens"]))
            continue
        if a.tokens != b.tokens and deterministic(a):
            first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y),
                         min(len(a.tokens), len(b.tokens)))
            is_noise = rid in noisy or rid in unstable
            why = (" (varied between baseline runs too)" if rid in unstable else
                   " (batched with other requests: not reproducible run to run on vLLM's CPU build; "
                   "--noise runs of the baseline tell whether it is)" if rid in noisy else "")
            findings.append(Finding(
                "behaviour", Severity.WARNING if is_noise else Severity.REGRESSION, "token_mismatch",
                f"tokens diverge at position {first} of {len(a.tokens)}{why}", request_id=rid, position=first,
                baseline=a.tokens[first:first + 5], candidate=b.tokens[first:first + 5]))
        if a.finish_reason != b.finish_reason:
            findings.append(Finding("behaviour", Severity.REGRESSION if deterministic(a) else Severity.WARNING,
                                    "finish_reason_changed", f"finish reason {a.finish_reason} -> {b.finish_reason}",
                                    request_id=rid, baseline=a.finish_reason, candidate=b.finish_reason))
        elif len(a.tokens) != len(b.tokens) and not deterministic(a):
            findings.append(Finding("behaviour", Severity.WARNING, "length_changed",
                                    f"generated {len(a.tokens)} tokens, now {len(b.tokens)}", request_id=rid,
                                    baseline=len(a.tokens), candidate=len(b.tokens)))
        if a.logprobs and b.logprobs and a.tokens == b.tokens:
            worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
            if worst > rules["logprob_tolerance"]:
                findings.append(Finding("behaviour", Severity.REGRESSION, "logprobs_differ",
                                        f"logprobs differ by up to {worst:.2g} (tolerance {rules['logprob_tolerance']})",
                                        request_id=rid, baseline=rules["logprob_tolerance"], candidate=worst))
    findings += _utility_findings(baseline, candidate, frontend_under_test)
    return findings


def _abort_landing(a: RequestRecord, b: RequestRecord, tolerance: int) -> Finding:
    """Where the ABORT landed in each session: tokens before it, not the total (what was in flight varies)."""
    off = abs(a.abort_progress - b.abort_progress) > tolerance
    return Finding("behaviour", Severity.WARNING if off else Severity.INFO,
                   "abort_progress" if off else "abort_landed",
                   f"ABORT after {a.abort_progress} tokens in the baseline, {b.abort_progress} in the candidate"
                   + (f" (more than {tolerance} off)" if off else ""),
                   message_kind="ABORT", request_id=a.request_id, baseline=a.abort_progress,
                   candidate=b.abort_progress)


def _unstable(baseline: SessionData, noise: list[SessionData], rules: dict[str, Any]) -> set[str]:
    """Baseline requests whose tokens differ in any repeat run of the baseline."""
    unstable = set()
    for repeat in noise:
        pairs, _, _ = match_requests(baseline, repeat)
        unstable |= {a.request_id for a, b in pairs if a.tokens != b.tokens}
    return unstable


def _utility_findings(baseline: SessionData, candidate: SessionData, frontend_under_test: bool) -> list[Finding]:
    """Utility calls by method; a call the frontend under test no longer makes is its choice: a warning."""
    findings = []
    remaining = defaultdict(list)
    for call in candidate.utility:
        remaining[call["method"]].append(call)
    for call in baseline.utility:
        counterpart = remaining[call["method"]].pop(0) if remaining[call["method"]] else None
        if counterpart is None:
            findings.append(Finding("behaviour", Severity.WARNING if frontend_under_test else Severity.REGRESSION,
                                    "utility_call_missing",
                                    f"utility call {call['method']} has no counterpart", message_kind="UTILITY",
                                    field=call["method"]))
        elif (call["result"], call["failure_message"]) != (counterpart["result"], counterpart["failure_message"]):
            findings.append(Finding(
                "behaviour", Severity.REGRESSION, "utility_result_changed",
                f"utility {call['method']} answered {counterpart['failure_message'] or counterpart['result']} "
                f"instead of {call['failure_message'] or call['result']}", message_kind="UTILITY_OUTPUT",
                field=call["method"], baseline=call["failure_message"] or call["result"],
                candidate=counterpart["failure_message"] or counterpart["result"]))
    for method, calls in remaining.items():
        for _ in calls:
            findings.append(Finding("behaviour", Severity.WARNING, "utility_call_extra",
                                    f"the candidate made an extra utility call {method}", message_kind="UTILITY",
                                    field=method))
    return findings


# --- performance --------------------------------------------------------------------------

def latency_samples(session: SessionData) -> dict[str, list[float]]:
    ttft, itl, e2e = [], [], []
    for r in session.requests:
        if r.first_token_ns is not None:
            ttft.append((r.first_token_ns - r.added_ns) / 1e6)
        itl += [(b - a) / 1e6 for a, b in zip(r.output_times, r.output_times[1:])]
        if r.last_ns is not None and not r.frontend_aborted:
            e2e.append((r.last_ns - r.added_ns) / 1e6)
    return {"ttft_ms": ttft, "itl_ms": itl, "e2e_ms": e2e}


def throughput(session: SessionData) -> float | None:
    tokens = sum(len(r.tokens) for r in session.requests)
    ends = [r.last_ns for r in session.requests if r.last_ns]
    if not ends or not tokens:
        return None
    span = (max(ends) - min(r.added_ns for r in session.requests)) / 1e9
    return tokens / span if span > 0 else None


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def performance_findings(baseline: SessionData, candidate: SessionData, rules: dict[str, Any],
                         noise: list[SessionData] = ()) -> list[Finding]:
    findings = []
    a, b = latency_samples(baseline), latency_samples(candidate)
    repeats = [latency_samples(n) for n in noise]
    for metric, limits in rules["performance"].items():
        if metric not in a or not a[metric] or not b[metric]:
            continue
        for p in rules["percentiles"]:
            if min(len(a[metric]), len(b[metric])) < rules["min_samples"].get(str(p), 1):
                continue
            base, cand = percentile(a[metric], p), percentile(b[metric], p)
            ratio = cand / base if base > 0 else float("inf")
            allowed = limits["max_ratio"]
            for repeat in repeats:  # the noise floor: how much identical builds vary
                if repeat[metric] and base > 0:
                    allowed = max(allowed, percentile(repeat[metric], p) / base * rules["noise_margin"])
            if ratio > allowed and cand - base > limits["min_delta_ms"]:
                findings.append(Finding(
                    "performance", Severity.REGRESSION, f"{metric.removesuffix('_ms')}_regression",
                    f"{metric} p{p} {base:.2f} -> {cand:.2f} ms ({ratio:.2f}x, allowed {allowed:.2f}x)",
                    field=f"{metric}.p{p}", baseline=round(base, 3), candidate=round(cand, 3)))
    base_tput, cand_tput = throughput(baseline), throughput(candidate)
    limit = rules["performance"].get("throughput_tokens_s", {}).get("min_ratio")
    if base_tput and cand_tput and limit and cand_tput / base_tput < limit:
        findings.append(Finding("performance", Severity.REGRESSION, "throughput_regression",
                                f"throughput {base_tput:.1f} -> {cand_tput:.1f} tokens/s "
                                f"({cand_tput / base_tput:.2f}x, allowed {limit}x)", field="throughput_tokens_s",
                                baseline=round(base_tput, 2), candidate=round(cand_tput, 2)))
    return findings


def checks(baseline: SessionData) -> list[str]:
    """What a comparison looks at, as JUnit testcase names."""
    return ([f"schema:{s}" for s in sorted(baseline.shapes)] + ["schema:EngineCoreReadyResponse"]
            + [f"behaviour:{r.request_id}" for r in baseline.requests]
            + [f"performance:{m}" for m in ("ttft_ms", "itl_ms", "e2e_ms", "throughput_tokens_s")])


def build_report(title: str, baseline: SessionData, candidate: SessionData, rules: dict[str, Any],
                 noise: list[SessionData] = (), frontend_under_test: bool = False) -> Report:
    """The one place where two sessions become a report (diff and both replays call it)."""
    findings = compare_sessions(baseline, candidate, rules, noise, frontend_under_test)
    a, b = latency_samples(baseline), latency_samples(candidate)
    structs = sorted({f.struct for f in findings if f.category == "schema" and f.struct in baseline.schema.structs
                      and f.struct in candidate.schema.structs})
    return Report(
        title=title, baseline=baseline.label, candidate=candidate.label, findings=findings,
        samples={m: {"baseline": a[m], "candidate": b[m]} for m in ("ttft_ms", "itl_ms") if a[m] or b[m]},
        schemas={s: {"baseline": schema_lines(baseline.schema.structs[s].fields),
                     "candidate": schema_lines(candidate.schema.structs[s].fields)} for s in structs},
        noise=[n.label for n in noise], checks=checks(baseline))
