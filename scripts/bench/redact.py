"""``replay-proxy redact``'s rate in tokens a second, beside the same copy made without redacting.

A recording shaped like staging traffic (``--requests`` requests of
``--prompt`` tokens that share a ``--shared``-token system prompt, each
answered with ``--outputs`` tokens, one a step, 32 requests a step, as a
0.32.0 engine sends them) is written by the recorder's writer. Then it is
redacted into a new file (``redact_database``: read, redact, write every
table), and, as the floor, the same frames are copied by the same writer
without redacting. Both are timed in CPU seconds of this one process (one
core); the rate is prompt and output tokens redacted a second.

    .venv/bin/python scripts/bench/redact.py [--requests 2000] [--prompt 1024] [--outputs 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from replay_proxy.redact.settings import Redaction, RedactionSettings  # noqa: E402
from replay_proxy.store.copy import recorded_frames, redact_database  # noqa: E402
from replay_proxy.store.tables import open_database  # noqa: E402
from replay_proxy.store.writer import DECODE_FRAMES, Writer  # noqa: E402
from replay_proxy.wire.capture import CapturedFrame  # noqa: E402
from replay_proxy.wire.encode import encode, struct_value  # noqa: E402
from replay_proxy.wire.messages import Channel, Direction  # noqa: E402
from replay_proxy.wire.registry import load_schema  # noqa: E402
from scripts.bench.writer import registration  # noqa: E402

SCHEMA = load_schema("0.32.0")
VOCAB = 32_000
BATCH = 32  # requests a step


def frames(args: argparse.Namespace) -> list[CapturedFrame]:
    """Registration, then per batch of 32: their ADDs and ``--outputs`` steps of one token each."""
    clock = iter(range(1_700_000_000_000_000_000, 1 << 62, 1_000_000))
    seq = iter(range(1, 1 << 62))
    made = [CapturedFrame(next(seq), next(clock), Channel.INPUT, Direction.TO_FRONTEND, 0, 0,
                          [registration(SCHEMA.release)])]
    shared = [(t * 7919) % VOCAB for t in range(args.shared)]
    for first in range(0, args.requests, BATCH):
        batch = range(first, min(first + BATCH, args.requests))
        for r in batch:
            prompt = shared + [(r * 104729 + t * 31) % VOCAB for t in range(args.prompt - args.shared)]
            body = struct_value(SCHEMA, "EngineCoreRequest", {
                "request_id": f"cmpl-{r:032x}-0", "prompt_token_ids": prompt, "mm_features": None,
                "sampling_params": {"temperature": 0.0, "max_tokens": args.outputs, "_eos_token_id": 2,
                                    "_all_stop_token_ids": [2]},
                "pooling_params": None, "arrival_time": 1.0, "lora_request": None, "cache_salt": None,
                "data_parallel_rank": None})
            made.append(CapturedFrame(next(seq), next(clock), Channel.INPUT, Direction.TO_ENGINE, 0, 0,
                                      [b"\x00", encode(body)]))
        for step in range(args.outputs):
            outputs = [struct_value(SCHEMA, "EngineCoreOutput", {
                "request_id": f"cmpl-{r:032x}-0", "new_token_ids": [(r + step * 13) % VOCAB + 3],
                "finish_reason": 1 if step == args.outputs - 1 else None}) for r in batch]
            body = struct_value(SCHEMA, "EngineCoreOutputs", {"engine_index": 0, "timestamp": 1000.0 + step,
                                                              "outputs": outputs})
            made.append(CapturedFrame(next(seq), next(clock), Channel.OUTPUT, Direction.TO_FRONTEND, 0, 0,
                                      [encode(body)]))
    return made


def written(path: Path, captured: list, redaction: Redaction | None = None) -> Writer:
    db = open_database(path)
    session = db["sessions"].insert({"name": "staging", "mode": "record", "status": "complete"}).last_pk
    db.close()
    writer = Writer(str(path), session, redaction=redaction)
    for first in range(0, len(captured), DECODE_FRAMES):
        writer.write_frames(captured[first:first + DECODE_FRAMES])
    return writer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt", type=int, default=1024, help="tokens in each prompt")
    parser.add_argument("--shared", type=int, default=512, help="of which the system prompt every request shares")
    parser.add_argument("--outputs", type=int, default=64, help="tokens each request produces, one a step")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    captured = frames(args)
    tokens = args.requests * (args.prompt + args.outputs)
    redact_s, copy_s = [], []
    with tempfile.TemporaryDirectory(prefix="bench-redact-") as folder:
        folder = Path(folder)
        key = folder / "redaction.key"
        key.write_bytes(os.urandom(32))
        redaction = Redaction(RedactionSettings(str(key), VOCAB))
        written(folder / "staging.db", captured).finish()
        for round_ in range(args.rounds):  # interleaved, so a drift of the machine falls on both
            start = time.process_time()
            redact_database(folder / "staging.db", folder / f"ci-{round_}.db", redaction)
            redact_s.append(time.process_time() - start)
            start = time.process_time()
            with sqlite3.connect(folder / "staging.db") as source:
                read = list(recorded_frames(source, 1))
            written(folder / f"copy-{round_}.db", read).finish()
            copy_s.append(time.process_time() - start)
    redact, copy = statistics.median(redact_s), statistics.median(copy_s)
    print(f"{args.requests:,} requests of {args.prompt:,} prompt tokens ({args.shared} shared) and {args.outputs} "
          f"output tokens: {tokens:,} tokens, {len(captured):,} frames; medians of {args.rounds} rounds, "
          f"CPU seconds of one process")
    print(f"copy through the writer, not redacted: {copy:6.2f} s")
    print(f"replay-proxy redact:                    {redact:6.2f} s = {tokens / redact:,.0f} tokens/s "
          f"(target >= 500,000), {redact / copy:.2f}x the unredacted copy")


if __name__ == "__main__":
    main()
