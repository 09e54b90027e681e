"""How the matrix plans its observation: which replays a set of cells needs (nothing is run here)."""

import shutil
import sqlite3

import msgspec

from replay_proxy.matrix import RECORDINGS, Frontend, Verdict, frontends_in, recording_of
from replay_proxy.matrix.observe import judge, legs_of, sends
from replay_proxy.wire.messages import Direction


def test_frontends_share_an_engine_replay_exactly_when_they_send_the_same(tmp_path):
    frontends = frontends_in("vllm-rs:0.22.0..0.33.0,vllm:0.27.0..0.32.0")
    cells = [(f, e) for f in frontends for e in ("0.30.0", "0.31.0")]
    legs = legs_of(cells, RECORDINGS, tmp_path)
    for f, e in cells:
        for g, d in cells:
            same = sends(recording_of(f), f.release) == sends(recording_of(g), g.release) and e == d
            assert (legs[(f, e)][0] is legs[(g, d)][0]) == same, (f, e, g, d)
    engine_legs = {id(pair[0]) for pair in legs.values()}
    assert 2 <= len(engine_legs) < len(cells)  # some frontends do send the same: fewer replays than cells
    to_frontend = legs[(Frontend("vllm", "0.27.0"), "0.30.0")][1]
    assert (to_frontend.direction, to_frontend.frontend) == (Direction.TO_FRONTEND, Frontend("vllm", "0.27.0"))
    assert to_frontend.recording == recording_of(Frontend("vllm", "0.30.0"))  # what engine 0.30.0 sent


def edited(tmp_path, change) -> tuple:
    """A copy of the 0.31.0 Python recording with ``change(request)`` applied to every ADD's array."""
    path, session = recording_of(Frontend("vllm", "0.31.0"))
    copy = tmp_path / f"{change.__name__}.db"
    shutil.copy(path, copy)
    db = sqlite3.connect(copy)
    for seq, raw in db.execute("SELECT seq, raw FROM frames WHERE kind = 'ADD'").fetchall():
        parts = msgspec.msgpack.decode(raw)
        request = msgspec.msgpack.decode(parts[1])
        change(request)
        parts[1] = msgspec.msgpack.encode(request)
        db.execute("UPDATE frames SET raw = ? WHERE seq = ?", (msgspec.msgpack.encode(parts), seq))
    db.commit()
    db.close()
    return copy, session


def test_what_a_frontend_sends_leaves_out_ids_and_times_but_not_a_sampling_value(tmp_path):
    def new_ids_and_times(request):
        request[0], request[5] = "cmpl-another-0", request[5] + 100.0

    def another_temperature(request):
        request[3]["temperature"] = 0.5

    original = sends(recording_of(Frontend("vllm", "0.31.0")), "0.31.0")
    assert sends(edited(tmp_path, new_ids_and_times), "0.31.0") == original
    assert sends(edited(tmp_path, another_temperature), "0.31.0") != original


def test_a_cell_without_a_recording_is_unknown_never_works(tmp_path):
    legs = legs_of([(Frontend("vllm", "0.25.0"), "0.30.0")], RECORDINGS, tmp_path)
    judgement = judge(legs[(Frontend("vllm", "0.25.0"), "0.30.0")])
    assert judgement.verdict is Verdict.UNKNOWN and "no recording" in judgement.evidence[0].message
