"""What the recorder and its writer process say to each other, as msgspec Structs.

* ``WriterStart``: how the recorder starts the writer (its one command-line argument, JSON);
  ``RedactorStart``: how it starts the redactor process, which sits between the two when recording
  with ``--redact-key`` (``recorder/redactor.py``) and passes the same messages on, redacted.
* Recorder to writer, on the tap socket: a ``Batch`` (this header, then the tap's entries as a
  second part, so the writer counts a message without decoding its frames), or the ``Stop``
  that follows the last one. Both are one msgpack union, told apart by their tag.
* Writer to recorder, on the progress socket: ``Progress`` after every step; cumulative, so only
  the newest matters (the socket conflates).

``Progress`` and ``Stop`` are defined with the file's writer, which makes and reads them itself
(``store/progress.py``); the rest, and every encoding, is the recorder's.

The entries themselves are the capture format (``wire/capture.py``).
"""

from __future__ import annotations

import msgspec

from replay_proxy.redact.settings import RedactionSettings
from replay_proxy.store.progress import Progress, Stop
from replay_proxy.store.sample import RequestSample
from replay_proxy.wire.capture import encode_entries

__all__ = ["Batch", "Progress", "RedactorStart", "RotationSettings", "Stop", "WriterStart", "batch_message",
           "decode_progress", "encode_progress", "header", "stop_message"]


class RotationSettings(msgspec.Struct, frozen=True):
    """record's rotation options, for the writer, which rotates (``recorder/rotation/``)."""

    pattern: str  # --db, with strftime fields
    rotate_bytes: int | None = None  # --rotate-mb
    every_s: float | None = None  # --rotate-every, aligned to the clock
    keep: int | None = None  # --keep: this run's files, the one being written included
    max_total_bytes: int | None = None  # --max-total-gb


class WriterStart(msgspec.Struct, frozen=True):
    db_path: str
    session_id: int
    tap_address: str  # the writer binds it; the recorder's tap connects
    progress_address: str  # the recorder binds it
    parent_pid: int  # the proxy, given (it may be gone before the writer looks): another parent means it died
    hold_frames: int  # waiting frames beyond this are kept undecoded (half the recorder's queue)
    sockets_folder: str  # where the two addresses' files are: the writer removes it if it ends last
    max_bytes: int | None = None  # a cap on the database file
    upstream_pid: int | None = None  # the redactor process, if any: the proxy gone, its Stop may still come
    sample: RequestSample | None = None  # record --sample-requests (store/sample.py)
    rotation: RotationSettings | None = None  # record --rotate-mb and the rest


class RedactorStart(msgspec.Struct, frozen=True):
    tap_address: str  # the redactor binds it; the recorder's tap connects
    writer_address: str  # the writer's tap address: the redactor connects
    parent_pid: int  # the proxy, as for the writer
    redaction: RedactionSettings


class Batch(msgspec.Struct, frozen=True, tag=True, array_like=True):
    frames: int  # frames in the entries that follow
    frames_seen: int  # the tap's counts when it sent this, for a writer whose proxy dies
    bytes_seen: int


_encode = msgspec.msgpack.Encoder().encode
_decode_header = msgspec.msgpack.Decoder(Batch | Stop).decode
_decode_progress = msgspec.msgpack.Decoder(Progress).decode


def batch_message(entries: list[list[bytes]], batch: Batch) -> list[bytes]:
    """Entries as the tap received them ([identity, ...] each), as one message to the writer."""
    return [_encode(batch), encode_entries(entries)]


def stop_message(stop: Stop) -> list[bytes]:
    return [_encode(stop)]


def header(message: list[bytes]) -> Batch | Stop:
    return _decode_header(message[0])


def encode_progress(progress: Progress) -> bytes:
    return _encode(progress)


def decode_progress(data: bytes) -> Progress:
    return _decode_progress(data)
