"""record --sample-requests: the same requests on every engine and API server, and exact counts of what the
sample left out, against what the sim frontend received (the traffic as it crossed, unsampled)."""

import hashlib

import msgspec
import sqlite_utils
import trio

from replay_proxy.sim.workload import run_workload
from replay_proxy.store.counts import FrameCounts
from replay_proxy.store.progress import Stop
from replay_proxy.store.sample import InSample, RequestSample
from replay_proxy.store.tables import open_database
from replay_proxy.store.writer import Copies, Writer
from replay_proxy.wire.capture import RELAY, encode_entries, relay_entry
from replay_proxy.wire.messages import ENGINE_CORE_DEAD
from replay_proxy.wire.registry import load_schema
from tests.helpers import frame

REQUESTS = 120


def left_out_of(received: list[tuple[int, list[bytes]]], in_sample: InSample) -> tuple[int, int]:
    """(frames, outputs) that the sample leaves out of the output frames the frontend received: a frame
    whose every output is another request's goes, and from a mixed one the other requests' outputs."""
    schema = load_schema("0.32.0")
    outputs_at, utility_at = (schema.position("EngineCoreOutputs", name) for name in ("outputs", "utility_output"))
    rid_at = schema.position("EngineCoreOutput", "request_id")
    frames = outputs = 0
    for _, parts in received:
        if parts == [ENGINE_CORE_DEAD]:
            continue
        value = msgspec.msgpack.decode(parts[0])
        ids = [output[rid_at] for output in value[outputs_at] or []]
        others = [rid for rid in ids if rid not in in_sample]
        outputs += len(others)
        utility = value[utility_at] if len(value) > utility_at else None
        frames += bool(ids) and len(others) == len(ids) and utility is None
    return frames, outputs


def test_the_decision_is_a_keyed_hash_of_the_request_id_alone():
    sample = InSample(RequestSample(0.25, "staging"))
    key = hashlib.sha256(b"staging").digest()
    for rid in (f"cmpl-{k}" for k in range(500)):
        digest = hashlib.blake2b(rid.encode(), key=key, digest_size=8).digest()
        assert (rid in sample) == (int.from_bytes(digest, "big") < 2**62)  # the same on any proxy
    ids = [f"cmpl-{k}" for k in range(4000)]
    assert 900 < sum(rid in sample for rid in ids) < 1100  # about a quarter
    other_seed = InSample(RequestSample(0.25, "another"))
    assert [rid in sample for rid in ids] != [rid in other_seed for rid in ids]
    assert all(rid in InSample(RequestSample(1.0)) for rid in ids)


async def test_a_quarter_of_the_requests_on_two_engines_and_two_api_servers_with_exact_counts(
        session_factory, db_path):
    sample = RequestSample(0.25, "staging")
    with trio.fail_after(60):
        session = await session_factory(engines=2, api_servers=2, sample=sample)
        await run_workload(session.frontend, requests=REQUESTS)
    stats = session.recorder.close()
    frontend, in_sample = session.frontend, InSample(sample)
    sent = [f"cmpl-{k}" for k in range(REQUESTS)] + ["cmpl-long"]
    chosen = {rid for rid in sent if rid in in_sample}
    assert 0 < len(chosen) < len(sent) / 2

    db = sqlite_utils.Database(db_path)
    rows = list(db.query("SELECT request_id, engine_index, client_index FROM requests"))
    assert {r["request_id"] for r in rows} == chosen  # one decision for the ADD on whichever link it took
    assert {(r["engine_index"], r["client_index"]) for r in rows} == {(e, c) for e in range(2) for c in range(2)}
    tokens = {rid: [] for rid in chosen}
    for r in db.query("SELECT request_id, new_token_ids FROM outputs ORDER BY seq, position"):
        tokens[r["request_id"]] += msgspec.json.decode(r["new_token_ids"])
    assert tokens == {rid: frontend.tokens[rid] for rid in chosen}  # every output of the sample, no other
    # The utility calls and their results are all there, whatever the sample.
    assert db.execute("SELECT COUNT(*) FROM frames WHERE kind = 'UTILITY'").fetchone()[0] == 2 * 2 * 2
    assert db.execute("SELECT COUNT(*) FROM frames WHERE kind = 'UTILITY_OUTPUT'").fetchone()[0] == 2 * 2 * 2

    output_frames, outputs = left_out_of(frontend.outputs_received, in_sample)
    adds_and_aborts = len(set(sent) - chosen) + ("cmpl-long" not in chosen)
    assert (stats.frames_sampled_out, stats.outputs_sampled_out) == (adds_and_aborts + output_frames, outputs)
    assert stats.frames_seen == stats.frames_recorded + stats.frames_sampled_out and stats.frames_dropped == 0
    assert stats.frames().balanced()
    row = db["sessions"].get(session.recorder.session_id)
    assert (row["frames_sampled_out"], row["outputs_sampled_out"], row["frames_dropped"]) == (
        stats.frames_sampled_out, stats.outputs_sampled_out, 0)
    assert (row["sample_requests"], row["sample_seed"], row["status"]) == (0.25, "staging", "complete")


def test_frames_kept_undecoded_under_load_are_sampled_when_they_are_decoded(db_path):
    session_id = open_database(db_path)["sessions"].insert({"name": "kept", "status": "recording"}).last_pk
    sample = RequestSample(0.25)
    writer = Writer(str(db_path), session_id, sample=sample)
    writer.keep([(300, encode_entries([[RELAY, *relay_entry(frame(seq, f"r{seq}"))] for seq in range(1, 301)]))])
    # Kept as they came: recorded so far.
    assert (writer.counts.frames_recorded, writer.counts.frames_sampled_out) == (300, 0)
    writer.decode_all()
    chosen = sum(f"r{seq}" in InSample(sample) for seq in range(1, 301))
    assert (writer.counts.frames_recorded, writer.counts.frames_sampled_out) == (chosen, 300 - chosen)
    writer.finish(Stop("complete", None, 300, 0))
    db = sqlite_utils.Database(db_path)
    row = db["sessions"].get(session_id)
    assert (row["frames_recorded"], row["frames_sampled_out"], row["frames_dropped"], row["frames_undecoded"]) == (
        chosen, 300 - chosen, 0, 0)
    assert db["aborts"].count == chosen


def test_copies_for_another_file_of_a_rotation_count_only_as_copied_however_the_sample_takes_them(db_path):
    """A rotating recording writes a split frame's other part, and each file's start, as copies: the frames are
    counted in the file that holds them whole, so nothing of a copy is counted here as sampled out (the sample's
    part of it was counted there), and the file's account stays balanced."""
    session_id = open_database(db_path)["sessions"].insert({"name": "copies", "status": "recording"}).last_pk
    sample = RequestSample(0.25)
    writer = Writer(str(db_path), session_id, sample=sample)
    copies = [frame(seq, f"r{seq}") for seq in range(1, 101)]
    writer.write_copies(copies, Copies.FRAME)
    chosen = sum(f"r{seq}" in InSample(sample) for seq in range(1, 101))
    assert (writer.frames_copied, writer.counts.frames_recorded, writer.counts.frames_sampled_out) == (chosen, 0, 0)
    assert writer.counts.outputs_sampled_out == 0 and 0 < chosen < 100
    writer.write_frames([frame(seq, f"r{seq}") for seq in range(101, 121)])
    kept = sum(f"r{seq}" in InSample(sample) for seq in range(101, 121))
    assert writer.account(20) == FrameCounts(20, kept, 20 - kept) and writer.account(20).balanced()
    assert sqlite_utils.Database(db_path)["aborts"].count == chosen + kept
