"""What a redacted file must not hold, searched in every byte of it (its -wal included) and in its frames' bytes."""

import contextlib
import itertools
import json
import struct
import sqlite3
from pathlib import Path

import msgspec

from replay_proxy.store.raw import frames_with_bytes

WINDOW = 8  # consecutive original tokens that must appear nowhere


def file_bytes(db: Path) -> bytes:
    """The database and whatever SQLite keeps beside it, and its frames' bytes as they crossed: compressed in the
    file (store/raw.py), where a scan of the file alone would not see them."""
    with contextlib.closing(sqlite3.connect(db)) as connection:
        frames = b"".join(b"".join([*row["parts"], *(row["forwarded"] or [])])
                          for row in frames_with_bytes(connection))
    return frames + b"".join(Path(f"{db}{suffix}").read_bytes() for suffix in ("", "-wal", "-journal")
                             if Path(f"{db}{suffix}").exists())


def token_windows(sequence: list[int]) -> set[bytes]:
    """Each run of ``WINDOW`` tokens as msgpack, JSON text (both spacings) and packed int32 / int64 would hold it."""
    forms = set()
    for i in range(len(sequence) - WINDOW + 1):
        run = sequence[i:i + WINDOW]
        forms.add(b"".join(msgspec.msgpack.encode(t) for t in run))
        forms.add(",".join(map(str, run)).encode())
        forms.add(", ".join(map(str, run)).encode())
        forms.add(struct.pack(f"<{WINDOW}i", *run))
        forms.add(struct.pack(f"<{WINDOW}q", *run))
    return forms


def leaks(db: Path, sequences: list[list[int]], texts: list[str]) -> list[str]:
    """What of ``sequences`` (token runs) and ``texts`` (ids, stop strings, schemas...) ``db`` still holds."""
    data = file_bytes(db)
    found = [f"{WINDOW} tokens of {seq[:4]}..." for seq in sequences
             if any(form in data for form in token_windows(seq))]
    found += [text for text in texts if text.encode() in data or json.dumps(text).encode() in data]
    return found


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shape(db: Path, session_id: int) -> dict:
    """What redaction keeps: each request's prompt and output lengths and finish, and every pair's common prefix."""
    connection = sqlite3.connect(db)
    prompts = [json.loads(p or "[]") for (p,) in connection.execute(  # [] for prompt embeddings
        "SELECT prompt_token_ids FROM requests WHERE session_id = ? ORDER BY seq", [session_id])]
    timeline = connection.execute("SELECT tokens, finish_reason FROM request_timeline t JOIN requests r "
                                  "ON r.session_id = t.session_id AND r.request_id = t.request_id "
                                  "WHERE t.session_id = ? ORDER BY r.seq", [session_id]).fetchall()
    errors = connection.execute("SELECT COUNT(*) FROM frames WHERE session_id = ? AND decode_error IS NOT NULL",
                                [session_id]).fetchone()[0]
    connection.close()
    return {"prompt_lengths": [len(p) for p in prompts], "outputs": timeline, "decode_errors": errors,
            "common_prefixes": [common_prefix(a, b) for a, b in itertools.combinations(prompts, 2)]}


def tokens_of(db: Path, session_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each request's prompt, and its output tokens, in ADD order."""
    connection = sqlite3.connect(db)
    prompts, outputs = [], []
    for rid, prompt in connection.execute("SELECT request_id, prompt_token_ids FROM requests WHERE session_id = ? "
                                          "ORDER BY seq", [session_id]):
        prompts.append(json.loads(prompt or "[]"))  # [] for prompt embeddings
        outputs.append([t for (tokens,) in connection.execute(
            "SELECT new_token_ids FROM outputs WHERE session_id = ? AND request_id = ? ORDER BY seq, position",
            [session_id, rid]) for t in json.loads(tokens)])
    connection.close()
    return prompts, outputs
