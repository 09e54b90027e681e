"""One account of every frame (store/counts.py): seen = recorded + sampled out + dropped + queued, on every path
a recording can take, in the counts and in the statistics made from them; and each path's own figures."""

import contextlib

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from replay_proxy.record.metrics import Collector
from replay_proxy.record.status import status_record
from replay_proxy.store.counts import FrameCounts, TapCounts, WriterCounts, dropped_by_reason, writer_counts_help
from replay_proxy.store.tables import begin_session, read_recording
from replay_proxy.store.writer import Writer
from replay_proxy.store.progress import Progress
from replay_proxy.recorder.recorder import recorder_stats


def _live(tap: TapCounts, writer_gone: bool = False, **written: int) -> FrameCounts:
    """As Recorder.statistics puts them together, from the tap's counts and the writer's (``WriterCounts``)."""
    c = Progress(WriterCounts(**written)).counts
    return FrameCounts.live(tap.frames_seen, c.frames_recorded, c.frames_sampled_out,
                            tap.frames_dropped + c.frames_failed, writer_gone)


def _rotated() -> FrameCounts:
    """Three files, each ended with its own counts (what the tap dropped while it was current counted there)."""
    return FrameCounts.ended(40, 38) + FrameCounts.ended(35, 30, 5) + FrameCounts.ended(25, 25)


PATHS = {
    # path: (its account, what it must say)
    "complete": (FrameCounts.ended(100, 100), FrameCounts(100, 100)),
    "interrupted (the proxy gone: the last batch's count)": (FrameCounts.ended(50, 50), FrameCounts(50, 50)),
    "still writing at the stop": (_live(TapCounts(frames_seen=5000, frames_sent=5000), frames_recorded=1200),
                                  FrameCounts(5000, 1200, queued=3800)),
    "queue full": (_live(TapCounts(frames_seen=3000, frames_sent=2, dropped_queue_full=2998), frames_recorded=2),
                   FrameCounts(3000, 2, dropped=2998)),
    "writer dead, live": (_live(TapCounts(frames_seen=200, frames_sent=150, dropped_writer_lost=50),
                                frames_recorded=100, writer_gone=True), FrameCounts(200, 100, dropped=100)),
    "writer dead, ended by what is kept": (FrameCounts.ended(200, 100), FrameCounts(200, 100, dropped=100)),
    "disk full": (_live(TapCounts(frames_seen=12_000, frames_sent=12_000), frames_recorded=7000, frames_failed=5000),
                  FrameCounts(12_000, 7000, dropped=5000)),
    "late at stop": (_live(TapCounts(frames_seen=5, frames_sent=2, dropped_late=3), frames_recorded=2),
                     FrameCounts(5, 2, dropped=3)),
    "sampled": (FrameCounts.ended(100, 70, 30), FrameCounts(100, 70, 30)),
    "sampled, live": (_live(TapCounts(frames_seen=100, frames_sent=100), frames_recorded=60, frames_sampled_out=30),
                      FrameCounts(100, 60, 30, queued=10)),
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


def test_every_count_the_writer_keeps_reaches_metrics_the_json_log_and_the_session_row(tmp_path):
    """WriterCounts is the one place a count of the writer's is declared: each field, given a value of its own,
    reaches /metrics by its declared name, the JSON log and the session's row by its own, and a writer that picks
    the session up again (decode) goes on from the row. A field carried by hand would miss one of them."""
    values = {name: 101 + i for i, name in enumerate(WriterCounts.__struct_fields__)}
    counts = FrameCounts.ended(10_000, values["frames_recorded"], values["frames_sampled_out"])
    stats = recorder_stats(counts, TapCounts(frames_seen=counts.seen), Progress(WriterCounts(**values)),
                           write_failed=values["frames_failed"], error=None, writer_lost=None, db_path="r.db")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector(lambda: (stats, 0)))
    metrics = {s.name: s.value for family in text_string_to_metric_families(generate_latest(registry).decode())
               for s in family.samples}
    for name, about in writer_counts_help().items():
        metric = "replay_proxy_" + (about.metric or (name if about.gauge else f"{name}_total"))
        assert metrics.get(metric) == values[name], (name, metric)
    assert {name: status_record(stats, None)[name] for name in values} == values

    db = tmp_path / "r.db"
    session_id, _ = begin_session(db, {"name": "counted", "status": "recording"})
    writer = Writer(str(db), session_id)
    writer.counts = WriterCounts(**values)
    writer.dead, writer.alarmed = set(range(values["engines_dead"])), set(range(values["drift_alarms"]))
    writer.finish()
    with contextlib.closing(read_recording(db)) as connection:
        row = connection.execute(f"SELECT {', '.join(values)} FROM sessions WHERE id = ?", [session_id]).fetchone()
    assert dict(zip(values, row)) == values
    again = msgspec.structs.asdict(Writer(str(db), session_id).counts)
    kept_in_tables = {"frames_undecoded", "engines_dead", "drift_alarms"}  # (counted from their own tables)
    assert {k: v for k, v in again.items() if k not in kept_in_tables} == \
        {k: v for k, v in values.items() if k not in kept_in_tables}
