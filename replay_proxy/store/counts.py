"""One account of every frame a recording saw, whatever path it took. Sans-IO.

Every frame that crossed the proxy is in exactly one place: recorded (in the database, decoded or kept to
decode later), sampled out (left out by ``--sample-requests``), dropped (never to be in the database) or
queued (on its way there)::

    seen = recorded + sampled out + dropped + queued

``FrameCounts`` is that equation. The tap counts what it saw and dropped (``TapCounts``), the writer what
it wrote, sampled out or failed to write; ``live`` puts the two together while a session records, ``ended``
once it is over (nothing is queued then), and a rotating recording's files add up with ``+``. The
recorder's statistics, the ``sessions`` row (``tables.end_session``) and the metrics are all read from it.
"""

from __future__ import annotations

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
