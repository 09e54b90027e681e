"""The writer's decode-and-write rate, beside the floor any writer could reach, in one run.

Frames shaped like a busy vLLM 0.32.0 engine's steps (each an EngineCoreOutputs
with 32 per-request outputs of one token and scheduler stats, as the engine
sends them), batched as the C forwarding loop batches them and passed as the
recorder's tap passes them, go through ``store.writer.Writer`` (decoded
into every table, as its loop does when it keeps up) into a fresh SQLite
file. The floor is the minimal pipeline (``floor.py``) over the same frames:
msgspec decoding into typed array-like Structs, one tuple per output row,
``executemany`` into a table of the same columns, a transaction per 500
frames, the same SQLite page size and journal settings. Both are timed in
CPU seconds of this one process (one core), and the rate is output rows per
second. Then as many ADDs, shaped as vLLM 0.32.0's Python frontend sends a
completion's, go through the writer from the input link and through the
minimal pipeline of ADDs (``floor.py``): an ADD's CPU is given beside that
floor's and beside an output row's of the same run (an ADD makes a frames
row and a keyed requests row; an output row is 1/32 of an engine step).
Last, vLLM 0.34.0's ADDs, whose prompt is an int32 array (16 tokens inline,
100 in an aux frame), each against a 0.32.0 ADD of as many tokens, in the
same run.

    .venv/bin/python scripts/bench/writer.py [--frames 20000] [--outputs 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.store.tables import open_database  # noqa: E402
from replay_proxy.store.writer import Writer  # noqa: E402
from replay_proxy.wire.capture import capture_tag, encode_entries  # noqa: E402
from replay_proxy.wire.encode import encode, struct_value, token_ids  # noqa: E402
from replay_proxy.wire.messages import Channel  # noqa: E402
from scripts.bench.busy import step as engine_step  # noqa: E402  (one busy 0.32.0 engine step)
from replay_proxy.wire.registry import load_schema  # noqa: E402
from scripts.bench.floor import MinimalPipeline, MinimalRequests  # noqa: E402

TAP_FRAMES = 2048  # frames per tap message (32 batches of 64): about what the writer decodes at once


def registration(release: str) -> bytes:
    return encode({"status": "READY", "local": False, "headless": True, "vllm_version": release,
                   "data_parallel_size": 1, "max_model_len": 256, "block_size": 16, "num_gpu_blocks": 100})


def c_batch(messages: list[tuple[int, int, list[bytes]]]) -> bytes:
    """A batch of copies in the C forwarding loop's layout (wire/capture.py)."""
    body = b"".join(struct.pack("<QqI", seq, ts, len(parts)) + b"".join(struct.pack("<I", len(p)) + p for p in parts)
                    for seq, ts, parts in messages)
    return struct.pack("<IQ", len(messages), sum(len(p) for _, _, parts in messages for p in parts)) + body


def python_frontend_add(k: int, release: str = "0.32.0", prompt_tokens: int = 16) -> list[bytes]:
    """An ADD as vLLM's Python frontend of ``release`` sends it for a completion (the sampling parameters of
    the recordings' ADDs: the frontend sends the fields it sets, defaults or not); from 0.34.0 on its prompt
    is an int32 array, in an aux frame from 64 tokens on."""
    schema, aux = load_schema(release), []
    prompt = token_ids(schema.structs["EngineCoreRequest"].by_name["prompt_token_ids"],
                       [100 + (k + i) % 800 for i in range(prompt_tokens)], aux)
    return [b"\x00", encode(struct_value(schema, "EngineCoreRequest", {
        "request_id": f"cmpl-{k:016x}-0-{k % 65536:08x}", "prompt_token_ids": prompt,
        "mm_features": None, "sampling_params": {
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "temperature": 0.0,
            "watermarking": False, "stop": [], "stop_token_ids": [], "max_tokens": 16, "output_kind": 2,
            "skip_clone": True, "_eos_token_id": 1, "_all_stop_token_ids": [1], "bad_words": [],
            "skip_reading_prefix_cache": False},
        "pooling_params": None, "arrival_time": 1_796_143_721.171 + k / 1000, "lora_request": None,
        "cache_salt": None, "data_parallel_rank": None, "external_req_id": f"cmpl-{k:016x}-0"})), *aux]


def tap_messages(frames: list[list[bytes]], channel: Channel) -> list[tuple[int, bytes]]:
    """The frames as the tap passes them on: batches of copies from one link, 2,048 frames a message
    (each as the writer holds it: its frames, its entries)."""
    tag = capture_tag(channel, 0, 0)
    numbered = [(seq, 1_700_000_000_000_000_000 + seq * 10_000_000, parts) for seq, parts in enumerate(frames, 2)]
    return [(min(TAP_FRAMES, len(numbered) - start),
             encode_entries([[tag, c_batch(numbered[i:i + 64])]
                             for i in range(start, min(start + TAP_FRAMES, len(numbered)), 64)]))
            for start in range(0, len(numbered), TAP_FRAMES)]


def run_writer(frames: list[list[bytes]], channel: Channel, folder: Path, release: str = "0.32.0") -> float:
    """CPU seconds for the writer to keep and decode every frame, crossing ``channel`` (after the
    registration of an engine of ``release``, on the input link)."""
    db_path = folder / "writer.db"
    db = open_database(db_path)
    session = db["sessions"].insert({"name": "bench", "mode": "record", "status": "recording"}).last_pk
    db.close()
    writer = Writer(str(db_path), session)
    input_tag = capture_tag(Channel.INPUT, 0, 0)
    registering = c_batch([(1, 1_700_000_000_000_000_000, [registration(release)])])
    writer.write([(1, encode_entries([[input_tag, registering]]))])
    messages = tap_messages(frames, channel)
    start = time.process_time()
    for message in messages:  # as the writer's loop takes them when it keeps up: about DECODE_FRAMES at once
        writer.write([message])
    seconds = time.process_time() - start
    assert writer.write_error is None, writer.write_error
    writer.finish()
    connection = sqlite3.connect(db_path)
    if channel is Channel.INPUT:
        rows = connection.execute("SELECT COUNT(*) FROM requests").fetchone()[0]
        assert rows == len(frames), (rows, len(frames))  # every request row is there
    else:
        rows = connection.execute("SELECT COUNT(*) FROM outputs").fetchone()[0]
        assert rows == len(frames) * ARGS.outputs, (rows, len(frames))  # every output row is there
        connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        DISK_BYTES.append(db_path.stat().st_size)
    connection.close()
    return seconds


DISK_BYTES: list[int] = []  # the database file of each writer run, checkpointed


def run_floor(pipeline: MinimalPipeline | MinimalRequests, frames: list[list[bytes]]) -> float:
    """CPU seconds for a minimal pipeline (``floor.py``) to write the frames, a transaction per 500."""
    numbered = list(enumerate(frames))
    start = time.process_time()
    for first in range(0, len(numbered), 500):
        pipeline.write(numbered[first:first + 500])
    seconds = time.process_time() - start
    pipeline.close()
    return seconds


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=20_000)
    parser.add_argument("--outputs", type=int, default=32, help="per-request outputs in each engine step")
    parser.add_argument("--rounds", type=int, default=3)
    ARGS = parser.parse_args()
    frames = [engine_step(k, ARGS.outputs) for k in range(ARGS.frames)]
    steps = [[frame] for frame in frames]  # each message of one frame
    adds = [python_frontend_add(k) for k in range(ARGS.frames)]
    prompts = {(release, tokens): [python_frontend_add(k, release, tokens) for k in range(ARGS.frames)]
               for release in ("0.32.0", "0.34.0") for tokens in (16, 100)}
    rows = ARGS.frames * ARGS.outputs
    wire = sum(map(len, frames))
    writer_s, floor_s, adds_s, floor_adds_s = [], [], [], []
    prompts_s: dict[tuple[str, int], list[float]] = {key: [] for key in prompts}
    for _ in range(ARGS.rounds):  # interleaved, so a drift of the machine falls on all
        with tempfile.TemporaryDirectory(prefix="bench-writer-") as folder:
            writer_s.append(run_writer(steps, Channel.OUTPUT, Path(folder)))
            floor_s.append(run_floor(MinimalPipeline(Path(folder) / "floor.db", frames=False), steps))
        with tempfile.TemporaryDirectory(prefix="bench-writer-") as folder:
            adds_s.append(run_writer(adds, Channel.INPUT, Path(folder)))
            floor_adds_s.append(run_floor(MinimalRequests(Path(folder) / "floor-adds.db"), adds))
        for (release, tokens), made in prompts.items():
            with tempfile.TemporaryDirectory(prefix="bench-writer-") as folder:
                prompts_s[release, tokens].append(run_writer(made, Channel.INPUT, Path(folder), release))
    writer_rate, floor_rate = rows / statistics.median(writer_s), rows / statistics.median(floor_s)
    add_us, row_us = statistics.median(adds_s) / ARGS.frames * 1e6, 1e6 / writer_rate
    floor_add_us = statistics.median(floor_adds_s) / ARGS.frames * 1e6
    print(f"{ARGS.frames:,} engine steps of {ARGS.outputs} outputs ({rows:,} output rows, {wire / 1e6:.1f} MB on "
          f"the wire); medians of {ARGS.rounds} rounds, CPU seconds of one process")
    print(f"minimal pipeline (msgspec typed, executemany): {floor_rate:>10,.0f} output rows/s")
    print(f"replay-proxy writer (decode + write):          {writer_rate:>10,.0f} output rows/s  "
          f"= {writer_rate / floor_rate:.2f}x the floor (target >= 0.7x and >= 200,000 rows/s)")
    print(f"{ARGS.frames:,} ADDs as vLLM's Python frontend sends them, through each:")
    print(f"minimal pipeline of ADDs (msgspec typed, executemany): {floor_add_us:>5.1f} us an ADD")
    print(f"replay-proxy writer:                                   {add_us:>5.1f} us an ADD = "
          f"{add_us / floor_add_us:.2f}x the floor's; {add_us / row_us:.2f}x the writer's output row "
          f"({row_us:.1f} us; target <= 1.5x), {add_us / (row_us * ARGS.outputs):.2f}x its engine step")
    for tokens in (16, 100):
        old, new = (statistics.median(prompts_s[release, tokens]) / ARGS.frames * 1e6
                    for release in ("0.32.0", "0.34.0"))
        where = "inline" if 4 * tokens < 256 else "in an aux frame"
        print(f"a 0.34.0 ADD of {tokens} tokens (an int32 array {where}): {new:>5.1f} us = {new / old:.2f}x "
              f"a 0.32.0 ADD of {tokens} ({old:.1f} us; target <= 1.1x)")
    disk = statistics.median(DISK_BYTES)
    print(f"database {disk / 1e6:.1f} MB for {wire / 1e6:.1f} MB on the wire = {disk / wire:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
