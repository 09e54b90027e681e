"""A real recording of each installable engine release (recordings/vllm-X-python.db: that release's own
Python frontend and engine, made with our recorder) decodes under its own schema with no flags."""

import sqlite3
from pathlib import Path

import msgspec
import pytest

from replay_proxy.wire.messages import Channel, Direction, WireDecoder

RECORDINGS = sorted((Path(__file__).resolve().parents[2] / "recordings").glob("vllm-*-python.db"))


def test_every_installable_engine_release_has_a_recording():
    releases = [p.name.split("-")[1] for p in RECORDINGS]
    assert releases == ["0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda p: p.name)
def test_a_release_recording_decodes_under_its_own_schema_without_flags(recording):
    release = recording.name.split("-")[1]
    db = sqlite3.connect(f"file:{recording}?mode=ro", uri=True)
    decoder = WireDecoder()
    kinds = set()
    for channel, direction, raw in db.execute("SELECT channel, direction, raw FROM frames ORDER BY session_id, seq"):
        message = decoder.decode(Channel(channel), Direction(direction), msgspec.msgpack.decode(raw))
        assert (message.flags, message.error) == ((), None), (release, message.kind, message.flags, message.error)
        kinds.add(message.kind.name)
    assert {"REGISTRATION", "ADD", "OUTPUTS", "UTILITY", "UTILITY_OUTPUT"} <= kinds
    assert (decoder.vllm_version.split("+")[0], decoder.schema.release, decoder.schema_exact) == (release, release, True)
    # And so did the recorder, live: no flag on any frame, no drift alarm (its registration, too, is named
    # with the release it announces, not with the newest schema).
    assert db.execute("SELECT COUNT(*) FROM frames WHERE flags IS NOT NULL OR decode_error IS NOT NULL").fetchone() \
        == (0,)
    assert db.execute("SELECT COUNT(*) FROM drift_alarms").fetchone() == (0,)
