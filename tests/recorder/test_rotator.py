"""When a recording rotates, what the next file is called, which files --keep and --max-total-gb delete, and how
long a previous file stays open (recorder/rotation/rotator.py): sans-IO, so the clock and the sizes are the test's."""

import time
from pathlib import Path

import pytest

from replay_proxy.recorder.rotation import RotationSettings
from replay_proxy.recorder.rotation.rotator import (
    FINISHING_GROWTH, FINISHING_S, ROTATE_RETRY_S, Finishing, Rotator, file_named)

HOUR = 3600.0
T0 = 1_800_000_000.0  # on the hour (UTC): 2027-01-15 08:00:00
MB = 2**20


def rotator(**settings) -> Rotator:
    return Rotator(RotationSettings("rec-%H%M.db", **settings), Path("rec-0800.db"), now=T0)


@pytest.mark.parametrize(("settings", "now", "current_bytes", "due"), [
    ({}, T0 + 10 * HOUR, 10**12, False),  # no rotation asked for
    ({"every_s": HOUR}, T0 + HOUR - 0.001, 0, False),  # --rotate-every 1h: on the hour, not before ...
    ({"every_s": HOUR}, T0 + HOUR, 0, True),
    ({"every_s": HOUR}, T0 + 1.5 * HOUR, 0, True),  # ... and late rather than never
    ({"rotate_bytes": 64 * MB}, T0, 64 * MB - 1, False),  # --rotate-mb 64: at that size ...
    ({"rotate_bytes": 64 * MB}, T0, 64 * MB, True),
    ({"rotate_bytes": 64 * MB, "every_s": HOUR}, T0 + 1, 65 * MB, True),  # ... whichever comes first
])
def test_a_rotation_is_due_on_the_clock_boundary_or_at_the_size(settings, now, current_bytes, due):
    assert rotator(**settings).due(now, current_bytes) is due


def test_the_next_boundary_counts_from_the_rotation_on_the_epochs_grid():
    r = rotator(every_s=HOUR)
    r.rotated(Path("rec-0900.db"), now=T0 + HOUR + 5)  # a rotation a little after the hour
    assert not r.due(T0 + 2 * HOUR - 1, 0) and r.due(T0 + 2 * HOUR, 0)


def test_sighup_rotates_at_once_and_once():
    r = rotator()
    r.requested = True
    assert r.due(T0, 0)
    r.rotated(Path("rec-0800-1.db"), now=T0)
    assert not r.due(T0, 0) and r.rotations == 1


def test_a_failed_rotation_is_tried_again_after_the_retry_not_before():
    r = rotator(rotate_bytes=MB)
    r.failed(now=T0)
    assert not r.due(T0 + ROTATE_RETRY_S - 0.001, 2 * MB)
    assert r.due(T0 + ROTATE_RETRY_S, 2 * MB) and r.rotations_failed == 1


def test_the_next_file_takes_the_patterns_name_then_a_number_never_one_written_or_holding_data():
    r = rotator()
    at = T0 + 60  # 08:01 local time, whatever the zone: the name is made as the test makes it
    named = file_named("rec-%H%M.db", at)
    assert named == Path(time.strftime("rec-%H%M.db", time.localtime(at)))
    assert r.next_file(at, holds_data=lambda path: False) == named
    taken = {named, named.with_name(f"{named.stem}-1.db")}
    assert r.next_file(at, holds_data=taken.__contains__) == named.with_name(f"{named.stem}-2.db")
    r.rotated(named, at)  # written this run, and perhaps deleted since: never taken again
    assert r.next_file(at, holds_data=lambda path: False) == named.with_name(f"{named.stem}-1.db")


def files(r: Rotator, count: int) -> list[Path]:
    for n in range(1, count):
        r.rotated(Path(f"rec-{n}.db"), T0)
    return list(r.files)


@pytest.mark.parametrize(("settings", "open_count", "sizes", "deleted"), [
    ({"keep": 3}, 1, [10] * 5, 2),  # --keep 3 of 5: the two oldest
    ({"keep": 5}, 1, [10] * 5, 0),
    ({"keep": 1}, 1, [10] * 5, 4),  # only the one being written
    ({"max_total_bytes": 35}, 1, [10] * 5, 2),  # --max-total-gb: the oldest until the rest fit
    ({"max_total_bytes": 25}, 1, [20, 1, 1, 1, 10], 1),  # (by size, not by count)
    ({"max_total_bytes": 5}, 1, [10] * 5, 4),  # never the file being written, however large
    ({"keep": 2, "max_total_bytes": 45}, 1, [10] * 5, 3),  # both: whichever deletes more
    ({"keep": 1}, 3, [10] * 5, 2),  # the oldest file still finishing its requests holds back the newer ones
])
def test_keep_and_max_total_delete_the_oldest_closed_files(settings, open_count, sizes, deleted):
    r = rotator(**settings)
    paths = files(r, len(sizes))
    open_files = {paths[-1], *paths[-open_count:]}
    gone = r.expired(open_files, dict(zip(paths, sizes)))
    assert gone == paths[:deleted] and r.files == paths[deleted:] and r.files_deleted == deleted


def test_deleted_files_are_forgotten_so_they_are_not_counted_again():
    r = rotator(keep=2)
    paths = files(r, 3)
    assert r.expired({paths[-1]}, dict.fromkeys(paths, 1)) == paths[:1]
    assert r.expired({paths[-1]}, dict.fromkeys(paths[1:], 1)) == [] and r.files_deleted == 1


@pytest.mark.parametrize(("rotate_bytes", "pending", "now", "file_bytes", "over"), [
    (None, {"a"}, FINISHING_S, 10**12, False),  # its requests run: it stays open ...
    (None, set(), 0.0, 0, True),  # ... until they have all ended,
    (None, {"a"}, FINISHING_S + 0.001, 0, True),  # or for FINISHING_S at most,
    (64 * MB, {"a"}, 1.0, 10 * MB + int(64 * MB * FINISHING_GROWTH), False),  # or, with --rotate-mb,
    (64 * MB, {"a"}, 1.0, 10 * MB + int(64 * MB * FINISHING_GROWTH) + 1, True),  # until it has grown by a share of it
])
def test_a_previous_file_stays_open_while_its_requests_run_within_its_bounds(rotate_bytes, pending, now,
                                                                             file_bytes, over):
    settings = RotationSettings("rec.db", rotate_bytes=rotate_bytes)
    finishing = Finishing(set(pending), "0.32.0", settings, now=0.0, file_bytes=10 * MB)
    assert finishing.over(now, file_bytes) is over
