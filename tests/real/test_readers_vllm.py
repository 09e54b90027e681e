"""The readers' rules (replay_proxy/compare/readers.json), pinned against the real readers.

Python: real 0.32.0 frames from our recording, changed one way each, decoded by vLLM's own classes
(tests/real/oracle.py). Rust: each release's recording replayed against that release's real vllm-rs
binary (0.27.0, 0.30.0, 0.31.0, 0.32.0, 0.33.0; 0.33.0 with 0.32.0's recording) with the proxy as its engine,
changed the same ways, each change sized by that release's own Rust structs (read from its source).
Each test compares what the real reader did with what the rules, and the Rust structs they turn on,
say it does, so a rule or a struct read wrong fails here.
"""

import json
import sqlite3

import msgspec
import pytest

from replay_proxy.compare.findings import PYTHON_ENGINE, PYTHON_FRONTEND, RUST_FRONTEND
from replay_proxy.compare.readers import reader_schema, verdict
from replay_proxy.wire.registry import load_schema
from replay_proxy.compare.rejection import REQUEST_FAILURES
from replay_proxy.store.raw import frames_with_bytes
from tests.real import peers
from tests.helpers import edit_frames as edit_in_place
from tests.real.vllm_reads import oracle

pytestmark = pytest.mark.real_vllm
UNSET = object()


def recorded(kind):
    """The first recorded frame of ``kind`` with something in it: (session_id, seq, parts)."""
    where = " AND nbytes > 100" if kind == "OUTPUTS" else ""
    row = frames_with_bytes(sqlite3.connect(peers.RECORDING), f"kind = ?{where}", [kind])[0]
    return row["session_id"], row["seq"], row["parts"]


def changed(value, path, new=UNSET, append=UNSET, cut=None):
    """A copy of a decoded msgpack value with the item at ``path`` replaced, appended to, cut, or deleted."""
    value = msgspec.msgpack.decode(msgspec.msgpack.encode(value))
    *parents, last = path
    holder = value
    for key in parents:
        holder = holder[key]
    if append is not UNSET:
        holder[last].append(append)
    elif cut is not None:
        holder[last] = holder[last][:cut]
    elif new is UNSET:
        del holder[last]
    else:
        holder[last] = new
    return value


def test_python_readers_with_vllms_own_decoder():
    request = msgspec.msgpack.decode(recorded("ADD")[2][1])
    outputs = msgspec.msgpack.decode(recorded("OUTPUTS")[2][0])
    registration = msgspec.msgpack.decode(recorded("REGISTRATION")[2][0])
    required = sum(f.required for f in load_schema("0.32.0").structs["EngineCoreRequest"].fields)  # the leading ones
    cases = {  # name: (class, value, reader, rule)
        "request_extra": ("EngineCoreRequest", [*request, 7], PYTHON_ENGINE, "extra_trailing_elements"),
        "request_short": ("EngineCoreRequest", request[:required], PYTHON_ENGINE, "missing_trailing_with_default"),
        "sampling_unknown": ("EngineCoreRequest", changed(request, [3, "sim_unknown_key"], new=1),
                             PYTHON_ENGINE, "unknown_map_key"),
        "request_missing": ("EngineCoreRequest", request[:1], PYTHON_ENGINE, "missing_required_key"),
        "request_type": ("EngineCoreRequest", changed(request, [0], new=12), PYTHON_ENGINE, "changed_type"),
        "output_extra": ("EngineCoreOutputs", changed(outputs, [1, 0], append=7), PYTHON_FRONTEND,
                         "extra_trailing_elements"),
        "output_short": ("EngineCoreOutputs", changed(outputs, [1, 0], cut=6), PYTHON_FRONTEND,
                         "missing_trailing_with_default"),
        "registration_unknown": ("EngineCoreReadyResponse", {**registration, "sim_unknown_key": 1}, PYTHON_FRONTEND,
                                 "unknown_map_key"),
        "registration_missing": ("EngineCoreReadyResponse", changed(registration, ["block_size"]), PYTHON_FRONTEND,
                                 "missing_required_key"),
        "output_type": ("EngineCoreOutputs", changed(outputs, [1, 0, 1], new="tokens"), PYTHON_FRONTEND,
                        "changed_type"),
    }
    stdin = json.dumps({name: (cls, msgspec.msgpack.encode(value).hex()) for name, (cls, value, _, _) in cases.items()})
    got = oracle("tolerate", stdin)
    for name, (_, _, reader, rule) in cases.items():
        expected = "rejected" if verdict(reader, rule) == "rejects" else "accepted"
        assert got[name].split(":")[0] == expected, (name, reader, rule, got[name])


def replay_vllm_rs(tmp_path, release, edit):
    """The recording of ``release`` (its engine's traffic), changed by ``edit(db)``, replayed against vllm-rs
    ``release``: (result, finding codes, report). At ten times the recorded pace: what the reader accepts is
    the question, not when (the recorded engines stalled 12 s at their first logprobs request,
    docs/real-vllm.md). Unpaced is slower: a reader that rejects leaves every request in flight until the
    finish wait ends."""
    http, rpc = peers.free_port(), peers.free_port()
    result, report = peers.replay_cli(tmp_path, "--against", "frontend", "--pace", "10",
                                      "--upstream", f"tcp://127.0.0.1:{rpc}",
                                      "--http", f"http://127.0.0.1:{http}", "--frontend-cmd",
                                      peers.command(peers.rust_frontend_argv(http, rpc, release)), edit=edit,
                                      recording=peers.recording_of(release))
    return result, {f["code"] for f in report["findings"]}, report


def edit_frames(kind, change):
    """An edit of every recorded frame of ``kind``: its first part decoded, ``change``d, encoded again."""
    def edit(path):
        edit_in_place(path, f"kind = '{kind}'", lambda parts: [
            msgspec.msgpack.encode(change(msgspec.msgpack.decode(parts[0]))), *parts[1:]])
    return edit


FAILED = {"reader_rejected", "replay_failed", "http_failed", "http_response_differs"}


def each_output(change):
    def apply(body):
        body[1] = [change(list(output)) for output in body[1]]
        return body
    return apply


def rust_length(release, struct):
    """How many elements vllm-rs ``release``'s Rust struct for ``struct`` has (its own source's layout)."""
    return len(reader_schema(RUST_FRONTEND, release).structs[struct].fields)


def one_beyond(release, struct):
    """An array of ``struct`` padded with nils to vllm-rs ``release``'s length, then one element more: a
    trailing element that reader has no field for, whatever the recording's release."""
    length = rust_length(release, struct)
    return lambda array: [*array, *[None] * (length - len(array)), 7]


@pytest.mark.parametrize("release", sorted(peers.VLLM_RS))
def test_vllm_rs_rejects_extra_trailing_elements_of_engine_core_outputs(tmp_path, release):
    assert verdict(RUST_FRONTEND, "extra_trailing_elements", "EngineCoreOutputs", release) == "rejects"
    longer = edit_frames("OUTPUTS", one_beyond(release, "EngineCoreOutputs"))
    result, codes, report = replay_vllm_rs(tmp_path, release, longer)
    # Named as the schema break it is: the element past the reader's last field (exit 3); the HTTP failures
    # it caused are listed under it, not as findings of their own.
    assert result.returncode == 3 and "http_failed" not in codes, result.stdout + result.stderr
    [rejected] = [f for f in report["findings"] if f["code"] == "reader_rejected"]
    length = rust_length(release, "EngineCoreOutputs")
    assert (rejected["struct"], rejected["position"], rejected["breaks"]) == ("EngineCoreOutputs", length,
                                                                              [RUST_FRONTEND])
    assert f"EngineCoreOutputs: array had incorrect length, expected {length}" in rejected["message"]
    caused = {c.split(" ")[0] for c in rejected["consequences"]}
    assert "http_failed" in caused and caused <= set(REQUEST_FAILURES), rejected["consequences"]


@pytest.mark.parametrize("release", sorted(peers.VLLM_RS))
def test_vllm_rs_extra_trailing_elements_of_an_engine_core_output(tmp_path, release):
    # Rejected up to 0.30.0, served from 0.31.0 on: observed here (the protocol notes we started from said
    # rejected), and the rule follows the real reader.
    rejects = verdict(RUST_FRONTEND, "extra_trailing_elements", "EngineCoreOutput", release) == "rejects"
    extra = edit_frames("OUTPUTS", each_output(one_beyond(release, "EngineCoreOutput")))
    result, codes, report = replay_vllm_rs(tmp_path, release, extra)
    assert bool(codes & FAILED) == rejects, result.stdout + result.stderr
    if rejects:
        assert any("array had incorrect length" in f["message"] for f in report["findings"])


@pytest.mark.parametrize("release", sorted(peers.VLLM_RS))
def test_vllm_rs_fills_missing_trailing_output_elements(tmp_path, release):
    assert verdict(RUST_FRONTEND, "missing_trailing_with_default", "EngineCoreOutput", release) == "fills"
    assert not any(f.required for f in reader_schema(RUST_FRONTEND, release).structs["EngineCoreOutput"].fields[7:])
    result, codes, _ = replay_vllm_rs(tmp_path, release, edit_frames("OUTPUTS", each_output(lambda o: o[:7])))
    assert not codes & FAILED, result.stdout + result.stderr


@pytest.mark.parametrize("release", sorted(peers.VLLM_RS))
def test_vllm_rs_ignores_an_unknown_registration_key(tmp_path, release):
    assert verdict(RUST_FRONTEND, "unknown_map_key", "EngineCoreReadyResponse", release) == "ignores"
    unknown = edit_frames("REGISTRATION", lambda r: {**r, "sim_unknown_key": 1})
    result, codes, _ = replay_vllm_rs(tmp_path, release, unknown)
    assert not codes & FAILED, result.stdout + result.stderr


@pytest.mark.parametrize("release", sorted(peers.VLLM_RS))
def test_vllm_rs_rejects_a_changed_type(tmp_path, release):
    assert verdict(RUST_FRONTEND, "changed_type", "EngineCoreReadyResponse", release) == "rejects"
    as_text = edit_frames("REGISTRATION", lambda r: {**r, "block_size": "16"})
    result, codes, report = replay_vllm_rs(tmp_path, release, as_text)
    assert result.returncode == 3 and codes == {"reader_rejected"}, result.stdout + result.stderr
    [rejected] = report["findings"]
    assert rejected["struct"] == "EngineCoreReadyResponse" and "block_size" in rejected["candidate"]
    [stopped] = rejected["consequences"]  # the frontend exited: the replay it stopped is the consequence
    assert stopped.startswith("replay_failed: ") and "REGISTRATION (engine 0, API server 0)" in stopped
