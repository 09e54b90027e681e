"""A real recording of each installable engine release (recordings/vllm-X-python.db: that release's own
Python frontend and engine, made with our recorder) decodes under its own schema with no flags; so do its
recordings of the shapes of request that are not matrix kinds (-varied.db, -fan-out.db:
scripts/make_recordings.py --shapes), each holding every shape its workload sends."""

from pathlib import Path

import pytest

from replay_proxy.store.raw import frames_with_bytes
from replay_proxy.store.session import load_session
from replay_proxy.store.tables import read_recording
from replay_proxy.wire.messages import Channel, Direction, Kind, WireDecoder
from tests.real import workload

FOLDER = Path(__file__).resolve().parents[2] / "recordings"
RECORDINGS = sorted(FOLDER.glob("vllm-*-python.db"))
VARIED, FAN_OUT = sorted(FOLDER.glob("vllm-*-python-varied.db")), sorted(FOLDER.glob("vllm-*-python-fan-out.db"))
INSTALLABLE = ["0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]
# 0.30.0's CPU build dies at its first ngram-drafted step (docs/real-vllm.md: a Triton kernel it cannot inspect).
DRAFTING_CRASHES = "0.30.0"


def test_every_installable_engine_release_has_a_recording_of_each_shape():
    for recordings in (RECORDINGS, VARIED, FAN_OUT):
        assert [p.name.split("-")[1] for p in recordings] == INSTALLABLE


def adds_of(recording: Path) -> list[dict]:
    """Its ADDs' named fields, after checking that no frame of it has a flag or a decode error."""
    db = read_recording(recording)
    assert db.execute("SELECT COUNT(*) FROM frames WHERE flags IS NOT NULL OR decode_error IS NOT NULL").fetchone() \
        == (0,)
    db.close()
    session = load_session(recording, "python-frontend")
    assert session.schema.release == recording.name.split("-")[1]
    return [f.decoded for f in session.inputs if f.kind is Kind.ADD]


@pytest.mark.parametrize("recording", VARIED, ids=lambda p: p.name)
def test_each_releases_varied_session_holds_structured_outputs_prompt_embeds_and_a_cached_chat(recording):
    adds = adds_of(recording)
    assert workload.structured_forms(adds) == workload.STRUCTURED_ON_THE_WIRE
    [embeds] = [a["prompt_embeds"] for a in adds if a.get("prompt_embeds") is not None]
    assert (embeds.dtype, embeds.shape, embeds.aux_frame) == ("float32", [workload.EMBED_ROWS, 128], 1)
    assert len(embeds.values) == workload.EMBED_ROWS * 128 and len(set(embeds.values)) > 1
    turns = [len(a["prompt_token_ids"]) for a in adds[:3]]
    assert turns == sorted(turns) and turns[0] > 128, turns  # each turn the last one's prompt and more


@pytest.mark.parametrize("recording", FAN_OUT, ids=lambda p: p.name)
def test_each_releases_fan_out_session_holds_beams_children_and_drafts(recording):
    adds = adds_of(recording)
    beams = [a for a in adds if "-beam-" in a["request_id"]]
    # One single-token request per beam and step (n is left out on the wire where it is its default, 1).
    assert len(beams) >= 3 and {(a["sampling_params"].get("n", 1), a["sampling_params"]["max_tokens"])
                                for a in beams} == {(1, 1)}
    assert sorted(a["request_id"][:2] for a in adds if a["request_id"][:2] in ("0_", "1_")) == ["0_", "1_"]
    session = load_session(recording, "python-frontend")
    drafts = [s["spec_decoding_stats"] for f in session.outputs
              for s in [(f.decoded or {}).get("scheduler_stats") or {}] if s.get("spec_decoding_stats")]
    died = [f for f in session.outputs if f.kind is Kind.ENGINE_CORE_DEAD]
    if recording.name.split("-")[1] == DRAFTING_CRASHES:  # and the recording holds its death, as it crossed
        assert (drafts, len(died)) == ([], 1) and session.outputs[-1].kind is Kind.ENGINE_CORE_DEAD
    else:
        assert sum(d["num_drafts"] for d in drafts) >= 1 and died == []


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda p: p.name)
def test_a_release_recording_decodes_under_its_own_schema_without_flags(recording):
    release = recording.name.split("-")[1]
    db = read_recording(recording)
    decoder = WireDecoder()
    kinds = set()
    for row in frames_with_bytes(db):
        message = decoder.decode(Channel(row["channel"]), Direction(row["direction"]), row["parts"])
        assert (message.flags, message.error) == ((), None), (release, message.kind, message.flags, message.error)
        kinds.add(message.kind.name)
    assert {"REGISTRATION", "ADD", "OUTPUTS", "UTILITY", "UTILITY_OUTPUT"} <= kinds
    assert (decoder.vllm_version.split("+")[0], decoder.schema.release, decoder.schema_exact) == \
        (release, release, True)
    # And so did the recorder, live: no flag on any frame, no drift alarm (its registration, too, is named
    # with the release it announces, not with the newest schema).
    assert db.execute("SELECT COUNT(*) FROM frames WHERE flags IS NOT NULL OR decode_error IS NOT NULL").fetchone() \
        == (0,)
    assert db.execute("SELECT COUNT(*) FROM drift_alarms").fetchone() == (0,)
