"""One recorded session, loaded once: what replay plays back and what compare compares.

A session is read from its database into a ``Session``; everything after
that is pure. Its frames are kept as recorded (raw parts: a replay resends
these bytes) beside their decoded fields; its requests are put together from
the concept tables (tokens, times, where an ABORT landed). Requests of two
sessions are the same request when the user asked for the same thing: the
prompt and the sampling values that decide the output, in effect (sent, or
the release's default), never the request id, which is random per run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import sqlite_utils

from replay_proxy.errors import ReplayProxyError
from replay_proxy.store.queries import find_session, list_sessions, open_recording
from replay_proxy.store.raw import frame_bytes
from replay_proxy.store.tables import open_database
from replay_proxy.store.writer import finish_decoding
from replay_proxy.wire.messages import HANDSHAKE_KINDS, INPUT_KINDS, OUTPUT_KINDS, Channel, Direction, Kind, WireDecoder
from replay_proxy.wire.schema import Schema
from replay_proxy.wire.registry import schema_for



class SessionError(ReplayProxyError):
    """The recorded session cannot be used as asked."""


class RecordedFrame(msgspec.Struct, frozen=True):
    seq: int
    ts_ns: int
    kind: Kind
    engine_index: int
    client_index: int | None
    parts: list[bytes]  # exactly as recorded: replay resends these bytes
    decoded: Any = None
    tokens_before_abort: dict[str, int] = {}  # ABORT only: by request it names, its tokens when it crossed


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """One position's logprobs as the engine returned them: raw (vLLM's default ``logprobs_mode``), before
    temperature, penalties and the top-k/top-p/min-p cut."""

    token: int  # the token at this position: the one sampled, or (scoring) the one given
    logprob: float
    rank: int  # of ``token`` among the vocabulary, 1 the most likely
    top: dict[int, float]  # the k most likely tokens, with their logprobs


# A replay's teacher-forced scoring requests (replay/play_frontend.py) are named
# ``{SCORE_PREFIX}{pass}-{recorded request id}``: the session keeps them apart from its requests.
SCORE_PREFIX = "replay-proxy-score-"


class Request(msgspec.Struct):
    seq: int
    request_id: str
    engine_index: int | None
    prompt: list[int]
    params: dict[str, Any]  # sampling params as sent
    tokens: list[int]
    finish_reason: str | None
    added_ns: int
    first_token_ns: int | None
    last_ns: int | None
    abort_progress: int | None  # tokens produced before the (first) ABORT that named it crossed; None: not aborted
    output_times: list[int]  # ts of outputs that carried tokens
    # The same outputs by the engine's clock (the time it stamped on them), in ns; None unless every one
    # has a stamp. Inter-token gaps are taken from these: a reader starved of the CPU reads a backlog of
    # outputs at once, which bunches their arrival times but not the engine's stamps.
    engine_times_ns: list[int] | None
    token_logprobs: list[TokenLogprobs] = []  # per token generated, when the request asked for logprobs

    @property
    def logprobs(self) -> list[float]:
        """Each generated token's logprob (where the request asked for logprobs)."""
        return [t.logprob for t in self.token_logprobs]

    @property
    def frontend_aborted(self) -> bool:
        return self.abort_progress is not None


class Session(msgspec.Struct):
    db_path: Path
    id: int
    name: str
    schema: Schema  # of the release that sent it (its registration's vllm_version), or the nearest
    init: dict[str, Any] | None  # the frontend's INIT as recorded (engine 0's)
    engines: list[int]  # engine indexes, from the recorded HELLOs
    handshake: list[RecordedFrame]  # HELLO, INIT, READY, REGISTRATION in recorded order
    inputs: list[RecordedFrame]  # ADD, ABORT, UTILITY in recorded order
    outputs: list[RecordedFrame]  # OUTPUTS, UTILITY_OUTPUT, ENGINE_CORE_DEAD
    registrations: list[dict[str, Any]]  # engine 0's first, whatever the start order
    requests: list[Request]
    utility: list[dict[str, Any]]  # calls beside their results, in call order
    redacted: bool = False  # its tokens are pseudonyms (``replay-proxy redact``, ``record --redact-key``)
    cut_from: dict[str, Any] | None = None  # what it was cut from (``replay-proxy cut``): source digest, session
    replayed: bool = False  # a replay's session; else a recording (its peers shared the machine with the live side)
    # Its requests were sent by a replay against an engine (the proxy as the frontend): as recorded, but for
    # what the replay asks of every request (the judging's logprobs; --hold-lengths)
    sent_by_replay: bool = False
    # Teacher-forced scoring (a replay's): by pass, by recorded request id, the logprobs of each token the
    # request produced when recorded, given its prompt and the tokens before it.
    scores: dict[int, dict[str, list[TokenLogprobs]]] = {}

    @property
    def label(self) -> str:
        return f"{self.name} (#{self.id})"

    @property
    def api_servers(self) -> int:
        """Input/output address pairs in the recorded INIT."""
        return len(self.init["addresses"]["inputs"]) if self.init else 0

    @property
    def parallel_config(self) -> dict[str, Any]:
        return (self.init or {}).get("parallel_config") or {}

    @property
    def speculates(self) -> bool:
        """Its engine drafted tokens (speculative decoding): its outputs' scheduler stats count drafts."""
        return any(isinstance(f.decoded, dict) and (f.decoded.get("scheduler_stats") or {}).get("spec_decoding_stats")
                   for f in self.outputs)

    @property
    def finish_reasons(self) -> set[str]:
        return {r.finish_reason for r in self.requests if r.finish_reason}


def decode_kept(db_path: Path, session: str | None = None) -> list[tuple[str, int | None]]:
    """``replay-proxy decode``: decode what each session (or ``session``) kept undecoded. For each session
    that had some: its name, and the frames decoded (None: it is still recording, its writer decodes them). It
    writes: an older file is brought to this version's layout first (``open_database``)."""
    rows = [find_session(open_recording(db_path), session)] if session is not None else list_sessions(db_path)
    if any(row["frames_undecoded"] and row["status"] != "recording" for row in rows):
        open_database(db_path).close()
    return [(row["name"], None if row["status"] == "recording" else finish_decoding(str(db_path), row["id"]))
            for row in rows if row["frames_undecoded"]]


def decode_and_load(db_path: Path, session: str) -> Session:
    """Decode what ``session`` kept undecoded (a writer that had to stop keeps frames as they came), once,
    into its database, then load it: what a replay reads of the file it wrote itself."""
    row = find_session(open_recording(db_path), session)
    if row["frames_undecoded"]:
        if row["status"] == "recording":
            raise SessionError(f"session {row['name']!r} is still recording and {row['frames_undecoded']:,} of "
                               "its frames are not decoded yet: wait for it to end")
        finish_decoding(str(db_path), row["id"])  # (decoding may find the release it was recorded with)
    return load_session(db_path, str(row["id"]))


def load_session(db_path: Path, session: str) -> Session:
    """Session ``session`` (name or id) of the recording at ``db_path``, read as it is: one whose frames are
    not all decoded yet is refused (``decode_and_load`` decodes them first)."""
    db = open_recording(db_path)
    row = find_session(db, session)
    if row["frames_undecoded"]:
        raise SessionError(f"{row['frames_undecoded']:,} frames of session {row['name']!r} are not decoded yet: "
                           f"replay-proxy decode --db {db_path} --session {row['id']}")
    return _load(Path(db_path), db, row)


def _load(db_path: Path, db: sqlite_utils.Database, row: dict[str, Any]) -> Session:
    sid = row["id"]
    progress: dict[int, dict[str, int]] = defaultdict(dict)
    for r in db.query("SELECT seq, request_id, tokens_before_abort FROM abort_progress WHERE session_id = ? "
                      "ORDER BY seq", [sid]):
        progress[r["seq"]][r["request_id"]] = r["tokens_before_abort"]
    # ADDs and output frames keep what their tables hold there, not in ``decoded``: named again from the raw
    # bytes.
    schema = schema_for(row["vllm_version"])[0]
    decoder = WireDecoder(schema, frontend_release=row.get("frontend_release"),
                          frontend_source=row.get("frontend_source"))

    def decoded(r: dict[str, Any], parts: list[bytes]) -> Any:
        if r["kind"] in (Kind.OUTPUTS, Kind.UTILITY_OUTPUT):
            return decoder.decode(Channel.OUTPUT, Direction.TO_FRONTEND, parts).fields
        if r["kind"] == Kind.ADD:
            return decoder.decode(Channel.INPUT, Direction.TO_ENGINE, parts).fields
        return msgspec.json.decode(r["decoded"]) if r["decoded"] else None

    rows = {r["seq"]: r for r in db.query("SELECT seq, ts_ns, kind, engine_index, client_index, decoded FROM frames "
                                          "WHERE session_id = ? AND channel IN ('handshake', 'input', 'output')",
                                          [sid])}
    frames = [RecordedFrame(f.seq, r["ts_ns"], Kind(r["kind"]), r["engine_index"], r["client_index"], f.parts,
                            decoded(r, f.parts), progress.get(f.seq, {}))
              for f in frame_bytes(db.conn, sid, rows.keys()) for r in [rows[f.seq]]]
    # (a recorded coordinator is neither replayed nor compared)
    handshake = [f for f in frames if f.kind in HANDSHAKE_KINDS]
    init = next((f.decoded for f in handshake if f.kind is Kind.INIT), None)
    registrations = [json.loads(r["payload"]) for r in db.query(
        "SELECT payload FROM handshakes WHERE session_id = ? AND kind = 'REGISTRATION' ORDER BY engine_index, seq",
        [sid])]
    aborted = {rid: tokens for per_abort in reversed(progress.values()) for rid, tokens in per_abort.items()}
    outputs = _outputs(db, sid)
    requests = _requests(db, sid, aborted, outputs)
    return Session(
        db_path=db_path, id=sid, name=row["name"], schema=schema, init=init,
        engines=sorted({f.engine_index for f in handshake if f.kind is Kind.HELLO}), handshake=handshake,
        inputs=[f for f in frames if f.kind in INPUT_KINDS], outputs=[f for f in frames if f.kind in OUTPUT_KINDS],
        registrations=registrations, requests=[r for r in requests if not r.request_id.startswith(SCORE_PREFIX)],
        scores=_scores(requests, outputs),
        utility=list(db.query("SELECT method, args, failure_message, result FROM utility_calls "
                              "WHERE session_id = ? ORDER BY called_ns", [sid])),
        redacted=row.get("redaction_key") is not None, cut_from=json.loads(row["cut_from"] or "null"),
        replayed=row["mode"] == "replay", sent_by_replay=row["mode"] == "replay" and not row["upstream"])


def _outputs(db: sqlite_utils.Database, sid: int) -> dict[str, list[dict[str, Any]]]:
    outputs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for o in db.query("SELECT request_id, ts_ns, engine_time_s, new_token_ids, finish_reason, new_logprobs, other "
                      "FROM outputs WHERE session_id = ? ORDER BY seq, position", [sid]):
        outputs[o["request_id"]].append(o)
    return outputs


def _requests(db: sqlite_utils.Database, sid: int, aborted: dict[str, int], outputs: dict[str, list[dict[str, Any]]]
              ) -> list[Request]:
    requests = []
    for r in db.query("SELECT seq, request_id, engine_index, prompt_token_ids, sampling_params, ts_ns "
                      "FROM requests WHERE session_id = ? ORDER BY seq", [sid]):
        outs = outputs.get(r["request_id"], [])
        tokens, times, engine_times, logprobs = [], [], [], []
        for o in outs:
            new = json.loads(o["new_token_ids"] or "[]")
            tokens += new
            if new:
                times.append(o["ts_ns"])
                engine_times.append(o["engine_time_s"])
            if o["new_logprobs"]:
                logprobs += logprob_rows(json.loads(o["new_logprobs"]), "sampled_token_ranks")
        requests.append(Request(
            seq=r["seq"], request_id=r["request_id"], engine_index=r["engine_index"],
            prompt=json.loads(r["prompt_token_ids"] or "[]"), params=json.loads(r["sampling_params"] or "{}"),
            tokens=tokens, finish_reason=next((o["finish_reason"] for o in outs if o["finish_reason"]), None),
            added_ns=r["ts_ns"], first_token_ns=times[0] if times else None,
            last_ns=outs[-1]["ts_ns"] if outs else None, abort_progress=aborted.get(r["request_id"]),
            output_times=times, token_logprobs=logprobs,
            engine_times_ns=None if None in engine_times else [round(t * 1e9) for t in engine_times]))
    return requests


def logprob_rows(tensors: Any, ranks: str) -> list[TokenLogprobs]:
    """The rows of a LogprobsLists / LogprobsTensors as recorded (each tensor's dtype, shape and flat values):
    column 0 the position's own token, then the top k; ``ranks``: the field with each row's rank. A tensor
    too large to be kept inline (its values not recorded) gives no rows."""
    if not isinstance(tensors, dict):
        return []
    ids, values, rank = (tensors.get(k) or {} for k in ("logprob_token_ids", "logprobs", ranks))
    if not all(isinstance(t.get("values"), list) for t in (ids, values, rank)) or len(ids.get("shape") or ()) != 2:
        return []
    width = ids["shape"][1]
    ids, values, rank = ids["values"], [float(v) for v in values["values"]], rank["values"]
    return [TokenLogprobs(ids[i * width], values[i * width], rank[i],
                          dict(zip(ids[i * width + 1:(i + 1) * width], values[i * width + 1:(i + 1) * width])))
            for i in range(len(rank))]


def _scores(requests: list[Request], outputs: dict[str, list[dict[str, Any]]]
            ) -> dict[int, dict[str, list[TokenLogprobs]]]:
    """The teacher-forced scoring requests' prompt logprobs, by pass and recorded request id: a row for each
    token of the scoring prompt (the recorded prompt and output) but the first, given the tokens before it."""
    scores: dict[int, dict[str, list[TokenLogprobs]]] = defaultdict(dict)
    for request in requests:
        if not request.request_id.startswith(SCORE_PREFIX):
            continue
        scoring, _, recorded = request.request_id.removeprefix(SCORE_PREFIX).partition("-")
        scores[int(scoring)][recorded] = [row for o in outputs.get(request.request_id, []) for row in logprob_rows(
            json.loads(o["other"] or "{}").get("new_prompt_logprobs_tensors"), "selected_token_ranks")]
    return dict(scores)


# --- the same request in two sessions --------------------------------------------------------

def request_key(schema: Schema, prompt: Any, params: dict[str, Any], keys: list[str]) -> str:
    """What the user asked for, as the engine sees it: the prompt and each of ``keys`` in effect.

    The Rust frontend sends float32 values and [] where Python sends None: both compare equal here. So does
    a stop id list that names the EOS token (smg's) and one that does not, unless it ignores EOS: the engine
    stops at EOS before it looks at the stop ids.
    """
    values = {}
    for key in keys:
        value = schema.sampling_value(params, key)
        if isinstance(value, float):
            value = round(value, 5)
        if key == "stop_token_ids":
            value = stop_ids_beyond_eos(schema, params)
        values[key] = None if value == [] else value
    return json.dumps([prompt, values], sort_keys=True)


def stop_ids_beyond_eos(schema: Schema, params: dict[str, Any]) -> list[int] | None:
    """The stop token ids that stop a request where EOS does not: all of them, but the EOS token itself unless
    the request ignores EOS (vLLM's engine stops at EOS before it looks at the stop ids: smg names EOS there,
    vLLM's frontends do not, and the engine does the same with either)."""
    value: list[int] | None = schema.sampling_value(params, "stop_token_ids")
    if not value or schema.sampling_value(params, "ignore_eos"):
        return value
    return [token for token in value if token != params.get("_eos_token_id")]


class Matching(msgspec.Struct):
    pairs: list[tuple[Request, Request]]  # (baseline, candidate)
    missing: list[Request]  # baseline requests without a counterpart
    extra: list[Request]  # candidate requests without a counterpart


def match_requests(baseline: Session, candidate: Session, keys: list[str]) -> Matching:
    """Pairs requests by what was asked (``request_key``), in order."""
    waiting: dict[str, list[Request]] = defaultdict(list)
    for request in candidate.requests:
        waiting[request_key(candidate.schema, request.prompt, request.params, keys)].append(request)
    pairs, missing = [], []
    for request in baseline.requests:
        queue = waiting.get(request_key(baseline.schema, request.prompt, request.params, keys))
        if queue:
            pairs.append((request, queue.pop(0)))
        else:
            missing.append(request)
    return Matching(pairs, missing, [r for queue in waiting.values() for r in queue])
