"""A release's own vLLM as the oracle of what frames say: tests/real/oracle.py run in its interpreter."""

import contextlib
import json
import os
import sqlite3
import subprocess
from pathlib import Path


from replay_proxy.releases import message_classes
from replay_proxy.store.raw import frames_with_bytes
from replay_proxy.wire.messages import Channel, Direction, Kind, WireDecoder
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.values import Tensor
from tests.real import peers

ORACLE = Path(__file__).with_name("oracle.py")


def oracle(mode, stdin=None, release="0.32.0"):
    """Run oracle.py's ``mode`` with ``release``'s vLLM: what it printed, as JSON. A release with no engine
    here (0.33.0 on) lends its message classes to the 0.32.0 interpreter, as ``schema extract`` does."""
    venv, env = peers.CACHE / f"vllm-{release}", None
    if not venv.exists():
        venv, env = peers.CACHE / "vllm-0.32.0", {**os.environ, "PYTHONPATH": str(message_classes(release))}
    result = subprocess.run([str(venv / "bin" / "python"), str(ORACLE), mode],
                            input=stdin, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def same(ours, theirs, path="$"):
    """Every value our decoder names is vLLM's: the same field names, the same values, the same types (a
    tensor: its flat values and shape)."""
    if isinstance(theirs, dict) and theirs.keys() == {"utility_result"}:  # vLLM unwraps [type info, value]
        assert isinstance(ours, list) and len(ours) == 2 and ours[0] is None, (path, ours)
        same(ours[1], theirs["utility_result"], f"{path}[1]")
    elif isinstance(ours, Tensor):
        shape, probe, flat = [], theirs, theirs
        while isinstance(probe, list):
            shape.append(len(probe))
            probe = probe[0] if probe else None
        while flat and isinstance(flat[0], list):
            flat = [v for row in flat for v in row]
        assert (ours.shape, ours.values) == (shape, flat), path
    elif isinstance(ours, dict):
        assert isinstance(theirs, dict), (path, theirs)
        for key, value in ours.items():
            assert key in theirs, f"{path}.{key}: vLLM reads no such field"
            same(value, theirs[key], f"{path}.{key}")
    elif isinstance(ours, list):
        assert isinstance(theirs, list) and len(ours) == len(theirs), (path, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            same(a, b, f"{path}[{i}]")
    else:
        assert (type(ours), ours) == (type(theirs), theirs), path


def read_as_vllm_does(db: Path, release: str = "0.32.0") -> list[tuple[str, dict]]:
    """Check that every ADD, utility call and EngineCoreOutputs of a recording, as our decoder names it with
    ``release``'s schema, is what that release's own decoder reads from the same frames; return (kind, what
    we named) of each."""
    decoder = WireDecoder(load_schema(release))
    with contextlib.closing(sqlite3.connect(db)) as connection:
        recorded = [(r["kind"], r["channel"], r["direction"], r["parts"]) for r in frames_with_bytes(
            connection, "kind IN ('ADD', 'UTILITY', 'OUTPUTS', 'UTILITY_OUTPUT')")]
    ours, messages = [], []
    for kind, channel, direction, parts in recorded:
        message = decoder.decode(Channel(channel), Direction(direction), parts)
        assert (message.kind, message.flags, message.error) == (Kind(kind), (), None)
        ours.append((kind, message.fields))
        body = parts if direction == Direction.TO_FRONTEND else parts[1:]  # (an input's request type byte)
        messages.append(["OUTPUTS" if kind == "UTILITY_OUTPUT" else kind, [bytes(p).hex() for p in body]])
    theirs = oracle("recorded", json.dumps(messages), release)
    for i, ((kind, a), b) in enumerate(zip(ours, theirs, strict=True)):
        same(a, b, f"{kind}#{i}")
    return [(m[0], fields) for m, (_, fields) in zip(messages, ours)]
