"""One account of every frame a recording saw, whatever path it took. Sans-IO.

Every frame that crossed the proxy is in exactly one place: recorded (in the database, decoded or kept to
decode later), sampled out (left out by ``--sample-requests``), dropped (never to be in the database) or
queued (on its way there)::

    seen = recorded + sampled out + dropped + queued

``FrameCounts`` is that equation. The tap counts what it saw and dropped (``TapCounts``), the writer what
it wrote, sampled out or failed to write (``WriterCounts``); ``live`` puts the two together while a session
records, ``ended`` once it is over (nothing is queued then), and a rotating recording's files add up with
``+``. The recorder's statistics, the ``sessions`` row (``tables.end_session``) and the metrics are all read
from it.

``WriterCounts`` is every count the writer keeps, in one struct: the writer counts into it, its ``Progress``
carries it, a rotating recording's files add up with ``+``, and the recorder's statistics (which have its
fields), the JSON status log, ``/metrics`` and the ``sessions`` row (a column each) take every field by
name. A new statistic is a new field there, with its ``Help``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Annotated

import msgspec


class FrameCounts(msgspec.Struct, frozen=True):
    seen: int = 0  # forwarded by the proxy
    recorded: int = 0  # in the database, decoded or kept
    sampled_out: int = 0  # left out by --sample-requests: neither recorded nor dropped
    dropped: int = 0  # never to be in the database
    queued: int = 0  # on their way to it

    def balanced(self) -> bool:
        return self.seen == self.recorded + self.sampled_out + self.dropped + self.queued

    def __add__(self, other: FrameCounts) -> FrameCounts:
        return FrameCounts(*(a + b for a, b in zip(msgspec.structs.astuple(self), msgspec.structs.astuple(other))))

    @classmethod
    def ended(cls, seen: int, recorded: int, sampled_out: int = 0) -> FrameCounts:
        """A session's end: nothing is on its way, so what is neither recorded nor sampled out was dropped."""
        return cls(seen, recorded, sampled_out, seen - recorded - sampled_out)

    @classmethod
    def live(cls, seen: int, recorded: int, sampled_out: int, lost: int, writer_gone: bool) -> FrameCounts:
        """While recording: what is neither recorded, sampled out nor ``lost`` (dropped by the tap, or not
        written) is queued. Once the writer is gone nothing is: what it had not written is dropped."""
        queued = 0 if writer_gone else seen - lost - recorded - sampled_out
        return cls(seen, recorded, sampled_out, seen - recorded - sampled_out - queued, queued)


class TapCounts(msgspec.Struct):
    """What the tap saw and dropped. Written by the tap's thread alone; read by others one field at a time."""

    frames_seen: int = 0
    bytes_seen: int = 0
    frames_numbered: int = 0  # messages the relay numbered that came (frames and engine losses)
    frames_sent: int = 0  # passed on to the writer
    dropped_queue_full: int = 0  # at a full queue, while the writer was there
    dropped_writer_lost: int = 0  # once the writer (or the redactor) was gone
    dropped_late: int = 0  # numbered by the stopped relay, never come to the tap
    bytes_by_link: dict[tuple[str, str], int] = msgspec.field(default_factory=dict)  # (channel, direction)

    @property
    def frames_dropped(self) -> int:
        return self.dropped_queue_full + self.dropped_writer_lost + self.dropped_late

    def queued(self, frames_written: int, frames_failed: int, frames_sampled_out: int) -> int:
        """Frames passed on that the writer has not accounted for yet."""
        return self.frames_sent - frames_written - frames_failed - frames_sampled_out


def dropped_by_reason(dropped: int, tap: TapCounts, write_failed: int) -> dict[str, int]:
    """``dropped`` frames by why: "queue_full" and "late_at_stop" (the tap's), "write_failed" (a full disk,
    the --max-db-mb cap), and the rest "writer_lost": on their way to, or held by, a writer or redactor that
    died."""
    reasons = {"queue_full": tap.dropped_queue_full, "write_failed": write_failed, "late_at_stop": tap.dropped_late}
    reasons["writer_lost"] = max(0, dropped - sum(reasons.values()))
    return reasons


@dataclasses.dataclass(frozen=True)
class Help:
    """What a count of ``WriterCounts`` means, as ``/metrics`` says it: ``replay_proxy_{metric}``, by default the
    field's name and ``_total`` (a counter); ``gauge``: a figure that also goes down."""

    text: str
    metric: str | None = None
    gauge: bool = False


class WriterCounts(msgspec.Struct, array_like=True):
    """What the writer counted of one session (or of a rotating recording's files, added up). Mutable: the
    writer's own; what leaves it (``Writer.progress``) is a copy."""

    frames_recorded: Annotated[int, Help("Frames in the database, decoded or kept to decode.")] = 0
    frames_failed: Annotated[int, Help("Frames that could not be written (a full disk, --max-db-mb).")] = 0
    frames_undecoded: Annotated[int, Help("Frames kept in the database, not decoded yet.", "undecoded_frames",
                                          gauge=True)] = 0
    frames_undecodable: Annotated[int, Help("Frames recorded with a decode error (forwarded byte-identical).",
                                            "decode_errors_total")] = 0
    frames_sampled_out: Annotated[int, Help("Frames --sample-requests left out (not dropped).")] = 0
    outputs_sampled_out: Annotated[int, Help("Outputs of requests --sample-requests left out.")] = 0
    requests: Annotated[int, Help("Requests added (their ADDs decoded).")] = 0
    engines_dead: Annotated[int, Help("Engines that sent ENGINE_CORE_DEAD or vanished.")] = 0
    drift_alarms: Annotated[int, Help("Distinct ways the traffic disagreed with its release's schema.")] = 0

    def __add__(self, other: WriterCounts) -> WriterCounts:
        """Two files' counts (their dead engines and drift alarms may be the same ones: the caller knows)."""
        return WriterCounts(*(a + b for a, b in zip(msgspec.structs.astuple(self), msgspec.structs.astuple(other))))


def writer_counts_help() -> dict[str, Help]:
    """Each field of ``WriterCounts`` and its ``Help`` (a field without one fails here, at once)."""
    hints = typing.get_type_hints(WriterCounts, include_extras=True)
    return {name: next(h for h in hints[name].__metadata__ if isinstance(h, Help))
            for name in WriterCounts.__struct_fields__}
