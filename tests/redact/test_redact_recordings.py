"""Every real recording shipped in recordings/, redacted: every field of every release has its action."""

import collections
import json
import shutil
from pathlib import Path

import pytest
import sqlite_utils

from replay_proxy.redact.settings import Redaction, RedactionSettings
from replay_proxy.store.copy import redact_database
from replay_proxy.store.raw import frames_with_bytes
from tests.redact.leaks import leaks, shape, tokens_of

RECORDINGS = sorted((Path(__file__).parents[2] / "recordings").glob("vllm-*.db"))
# The tiny models' vocab_size, in the config.json scripts/make_tiny_model.py writes: the random one's, and the
# trained one's (its tokenizer learnt from more text), which the bench-serve session's engine served.
VOCAB, TRAINED_VOCAB = 407, 900


def redaction_for(recording: Path, key: Path) -> Redaction:
    return Redaction(RedactionSettings(str(key), TRAINED_VOCAB if recording.stem == "vllm-0.32.0-bench-serve"
                                       else VOCAB))


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda p: p.stem)
def test_a_real_recording_redacts_whole_with_nothing_blanked_and_nothing_left(tmp_path, recording):
    source = tmp_path / recording.name
    shutil.copy(recording, source)
    key = tmp_path / "redaction.key"
    key.write_bytes(b"a key for the recordings' test!!")
    [(_, session_id, frames)] = redact_database(source, tmp_path / "ci.db", redaction_for(recording, key))
    redacted = sqlite_utils.Database(tmp_path / "ci.db")
    row = redacted["sessions"].get(session_id)
    assert frames == row["frames_recorded"] == sqlite_utils.Database(source)["sessions"].get(1)["frames_recorded"]
    assert "blanked" not in json.loads(row["redaction_counts"] or "{}")  # every field the release sent is named
    assert shape(tmp_path / "ci.db", session_id) == shape(source, 1)
    prompts, outputs = tokens_of(source, 1)
    ids = [r["request_id"] for r in sqlite_utils.Database(source).query("SELECT request_id FROM requests")]
    assert leaks(tmp_path / "ci.db", prompts + [o for o in outputs if len(o) >= 8], ids) == []
    assert redacted.execute("SELECT COUNT(*) FROM frames WHERE decode_error IS NOT NULL").fetchone()[0] == 0


def test_the_fast_paths_redact_every_recording_as_the_walk_does(tmp_path, monkeypatch):
    """Each shipped recording redacted with the fast paths (frames.PlainOutput for outputs, an ADD's ids and
    prompt alone, and the structs and fields frames.Kept names given back unchanged without a walk) and
    without them: the same bytes."""
    from replay_proxy.redact import frames

    key = tmp_path / "redaction.key"
    key.write_bytes(b"a key for the recordings' test!!")
    redaction = redaction_for(RECORDINGS[0], key)
    taken, fast = [], collections.Counter()
    of, really_unchanged = frames.PlainOutput.of, frames.Redactor._unchanged
    step, request = frames.Redactor._plain_step, frames.Redactor._plain_request

    def counted(redactor, name, value, but=()):
        kept = really_unchanged(redactor, name, value, but)
        fast[name] += kept
        return kept
    monkeypatch.setattr(frames.PlainOutput, "of", lambda schema, policy: taken.append(schema) or of(schema, policy))
    monkeypatch.setattr(frames.Redactor, "_unchanged", counted)

    def counted_step(*args):
        redacted = step(*args)
        fast["step"] += redacted is not None
        return redacted

    def counted_request(*args):
        taken_fast = request(*args)
        fast["ADD"] += taken_fast
        return taken_fast
    monkeypatch.setattr(frames.Redactor, "_plain_step", counted_step)
    monkeypatch.setattr(frames.Redactor, "_plain_request", counted_request)
    for recording in RECORDINGS:
        redact_database(recording, tmp_path / f"fast-{recording.name}", redaction_for(recording, key))
    monkeypatch.setattr(frames.PlainOutput, "of", lambda schema, policy: None)
    monkeypatch.setattr(frames.Kept, "of", lambda schema, policy, name: None)
    for recording in RECORDINGS:
        redact_database(recording, tmp_path / f"walked-{recording.name}", redaction_for(recording, key))
        raw = [[(r["seq"], r["parts"]) for r in frames_with_bytes(sqlite_utils.Database(
            tmp_path / f"{way}-{recording.name}").conn)] for way in ("fast", "walked")]
        assert raw[0] == raw[1], recording.name
    assert len(taken) == len(RECORDINGS)  # each took the fast path where it could:
    assert all(of(schema, redaction.policy) is not None for schema in taken)  # and it could, for every release
    assert fast["step"] > 0  # steps whose outputs alone were redacted, by the fast path
    assert fast["ADD"] > 0  # ADDs whose ids and prompt alone were redacted
    assert fast["SchedulerStats"] > 0 and fast["SamplingParams"] > 0  # and in the walk, structs kept as they are


def test_the_redactor_gives_way_before_each_frame_and_redacts_as_without(tmp_path, monkeypatch):
    """The recorder's redactor process gives way from ``before_each`` (recorder/redactor.py): it is called
    once a frame, in whatever order the frames came, and the redacted frames are those of a call without
    it. The process enters the kernel at every REDACTED_PER_YIELD-th of those calls."""
    import itertools
    import os
    import sqlite3
    import types

    from replay_proxy.recorder import redactor
    from replay_proxy.store.copy import recorded_frames

    key = tmp_path / "redaction.key"
    key.write_bytes(b"a key for the recordings' test!!")
    redaction = Redaction(RedactionSettings(str(key), VOCAB))
    for recording in RECORDINGS:
        frames = list(recorded_frames(sqlite3.connect(recording), 1))
        plain = redaction.redactor(None)
        whole = plain.frames(frames) + plain.flush()
        yields = []
        giving_way = redaction.redactor(None)
        assert giving_way.frames(frames[::-1], before_each=lambda: yields.append(1)) + giving_way.flush() == whole
        assert len(yields) == len(frames)
    entered = []
    monkeypatch.setattr(os, "sched_yield", lambda: entered.append(1))
    loop = types.SimpleNamespace(redacted=itertools.count())
    for _ in range(3 * redactor.REDACTED_PER_YIELD + 1):
        redactor.RedactorLoop.give_way(loop)
    assert len(entered) == 4  # before the first frame, and after each REDACTED_PER_YIELD
