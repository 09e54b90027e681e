"""One account of every frame (store/counts.py): seen = recorded + sampled out + dropped + queued, on every path
a recording can take, in the counts and in the statistics made from them; and each path's own figures."""

import pytest

from replay_proxy.store.counts import FrameCounts, TapCounts, dropped_by_reason
from replay_proxy.store.protocol import Progress
from replay_proxy.store.recorder import recorder_stats


def _live(tap: TapCounts, progress: Progress, writer_gone: bool = False) -> FrameCounts:
    """As Recorder.statistics puts them together."""
    return FrameCounts.live(tap.frames_seen, progress.frames_written, progress.frames_sampled_out,
                            tap.frames_dropped + progress.frames_failed, writer_gone)


def _rotated() -> FrameCounts:
    """Three files, each ended with its own counts (what the tap dropped while it was current counted there)."""
    return FrameCounts.ended(40, 38) + FrameCounts.ended(35, 30, 5) + FrameCounts.ended(25, 25)


PATHS = {
    # path: (its account, what it must say)
    "complete": (FrameCounts.ended(100, 100), FrameCounts(100, 100)),
    "interrupted (the proxy gone: the last batch's count)": (FrameCounts.ended(50, 50), FrameCounts(50, 50)),
    "still writing at the stop": (_live(TapCounts(frames_seen=5000, frames_sent=5000), Progress(frames_written=1200)),
                                  FrameCounts(5000, 1200, queued=3800)),
    "queue full": (_live(TapCounts(frames_seen=3000, frames_sent=2, dropped_queue_full=2998),
                         Progress(frames_written=2)), FrameCounts(3000, 2, dropped=2998)),
    "writer dead, live": (_live(TapCounts(frames_seen=200, frames_sent=150, dropped_writer_lost=50),
                                Progress(frames_written=100), writer_gone=True), FrameCounts(200, 100, dropped=100)),
    "writer dead, ended by what is kept": (FrameCounts.ended(200, 100), FrameCounts(200, 100, dropped=100)),
    "disk full": (_live(TapCounts(frames_seen=12_000, frames_sent=12_000),
                        Progress(frames_written=7000, frames_failed=5000)), FrameCounts(12_000, 7000, dropped=5000)),
    "late at stop": (_live(TapCounts(frames_seen=5, frames_sent=2, dropped_late=3), Progress(frames_written=2)),
                     FrameCounts(5, 2, dropped=3)),
    "sampled": (FrameCounts.ended(100, 70, 30), FrameCounts(100, 70, 30)),
    "sampled, live": (_live(TapCounts(frames_seen=100, frames_sent=100),
                            Progress(frames_written=60, frames_sampled_out=30)), FrameCounts(100, 60, 30, queued=10)),
    "rotated (three files added up)": (_rotated(), FrameCounts(100, 93, 5, dropped=2)),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_frame_is_in_one_place_on_every_path(path):
    counts, expected = PATHS[path]
    assert counts == expected
    assert counts.balanced()


@pytest.mark.parametrize("path", PATHS)
def test_the_statistics_say_what_the_account_says_and_every_drop_has_a_reason(path):
    counts, _ = PATHS[path]
    tap = TapCounts(frames_seen=counts.seen, dropped_queue_full=min(counts.dropped, 7))
    stats = recorder_stats(counts, tap, Progress(), write_failed=0, error=None, writer_lost=None, db_path="r.db")
    assert stats.frames() == counts
    assert sum(stats.frames_dropped_by_reason.values()) == counts.dropped


def test_an_unbalanced_account_is_told():
    assert not FrameCounts(10, 5, dropped=4).balanced()
    assert not (FrameCounts(10, 10) + FrameCounts(1, 0, queued=0)).balanced()


def test_drops_the_tap_and_the_writer_do_not_know_of_were_lost_with_the_writer():
    tap = TapCounts(dropped_queue_full=3, dropped_late=2)
    assert dropped_by_reason(20, tap, write_failed=5) == {"queue_full": 3, "write_failed": 5, "late_at_stop": 2,
                                                          "writer_lost": 10}
