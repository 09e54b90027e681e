"""Every real recording shipped in recordings/, redacted: every field of every release has its action."""

import json
import shutil
from pathlib import Path

import pytest
import sqlite_utils

from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.store.copy import redact_database
from tests.redact.leaks import leaks, shape, tokens_of

RECORDINGS = sorted((Path(__file__).parents[2] / "recordings").glob("vllm-*.db"))
VOCAB = 407  # the tiny model's: vocab_size in the config.json scripts/make_tiny_model.py writes


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda p: p.stem)
def test_a_real_recording_redacts_whole_with_nothing_blanked_and_nothing_left(tmp_path, recording):
    source = tmp_path / recording.name
    shutil.copy(recording, source)
    key = tmp_path / "redaction.key"
    key.write_bytes(b"a key for the recordings' test!!")
    [(_, session_id, frames)] = redact_database(source, tmp_path / "ci.db", Redaction(RedactionSettings(str(key),
                                                                                                        VOCAB)))
    redacted = sqlite_utils.Database(tmp_path / "ci.db")
    row = redacted["sessions"].get(session_id)
    assert frames == row["frames_recorded"] == sqlite_utils.Database(source)["sessions"].get(1)["frames_recorded"]
    assert "blanked" not in json.loads(row["redaction_counts"] or "{}")  # every field the release sent is named
    assert shape(tmp_path / "ci.db", session_id) == shape(source, 1)
    prompts, outputs = tokens_of(source, 1)
    ids = [r["request_id"] for r in sqlite_utils.Database(source).query("SELECT request_id FROM requests")]
    assert leaks(tmp_path / "ci.db", prompts + [o for o in outputs if len(o) >= 8], ids) == []
    assert redacted.execute("SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL").fetchone()[0] == 0
