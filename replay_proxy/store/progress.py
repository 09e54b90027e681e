"""What a writer reports as it writes (``Progress``), and the end of the session it is told (``Stop``): the two
messages of the recorder's protocol (``recorder/protocol.py``) that the writer of a file (``writer.py``) makes and
reads itself, so they are the file's side, below the recorder."""

from __future__ import annotations

import msgspec

from replay_proxy.store.counts import WriterCounts


class Stop(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Every frame before it is in; how the session ended, and the tap's final counts."""

    status: str
    error: str | None
    frames_seen: int
    bytes_seen: int
    redaction_counts: str | None = None  # what the redactor blanked and dropped (it adds them on its way)


class Progress(msgspec.Struct, frozen=True, array_like=True):
    counts: WriterCounts = msgspec.field(default_factory=WriterCounts)  # every count, in one struct (counts.py)
    write_error: str | None = None  # the last one
    drift: str | None = None  # the newest drift alarm
    decoded_through_ns: int = 0  # when the newest frame decoded so far crossed the proxy (its ts_ns)
    vllm_version: str | None = None  # as the engines' registration announced it
    # A rotating recording: the file being written and its session, and its rotations so far.
    db_path: str | None = None
    session_id: int | None = None
    rotations: int = 0
    rotations_failed: int = 0
    files_deleted: int = 0  # by --keep and --max-total-gb
    frames_seen_closed_files: int = 0  # what the files already closed counted as seen
    last: bool = False  # the writer's last report, sent after the session's end
