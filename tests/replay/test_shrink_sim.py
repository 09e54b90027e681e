"""`replay-proxy shrink` with sim peers: a poisoned request, a pair that fails only together, no finding."""

import json
import shlex
import subprocess
import sys

import pytest
import trio

from replay_proxy.replay.shrink import Peer, Shrinker, ShrinkError, shrink
from replay_proxy.wire.messages import Side
from tests.helpers import RecordedSession

SIM_ENGINE = [sys.executable, "-m", "replay_proxy", "sim", "engine", "--handshake", "tcp://127.0.0.1:{port}"]


async def _record(db, requests: int, poisoned: int | None, max_tokens: int = 6) -> None:
    """``requests`` requests sent at once (so they run together, if each runs for longer than the ADDs take to
    send: ``max_tokens`` steps of 2 ms), one of them asking for 26 logprobs (more than the 20 every replay asks
    for, to judge what the engine generates)."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            session = await RecordedSession(nursery, db, name="staging").start()
            frontend = session.frontend
            for k in range(requests):
                await frontend.add(f"r{k}", [7, 8, k % 50], max_tokens=max_tokens, temperature=0.0,
                                   **({"logprobs": 26} if k == poisoned else {}))
            await frontend.wait_for(lambda: len(frontend.finish_reasons) == requests)
            nursery.cancel_scope.cancel()
    session.recorder.close()


@pytest.fixture(scope="module")
def five_hundred(tmp_path_factory):
    db = tmp_path_factory.mktemp("shrink") / "staging.db"
    trio.run(_record, db, 500, 317)
    return db


@pytest.fixture(scope="module")
def sixteen(tmp_path_factory):
    db = tmp_path_factory.mktemp("shrink") / "staging.db"
    trio.run(_record, db, 16, None, 50)  # (each request runs 0.1 s: all of them at once, on a loaded machine too)
    return db


def engine(drift: dict | None = None) -> Peer:
    command = shlex.join([*SIM_ENGINE, *(["--drift", json.dumps(drift)] if drift else [])])
    # (a dead engine never finishes what it had: each failing candidate waits out finish_timeout_s)
    return Peer(against=Side.ENGINE, command=command, ready_timeout_s=20, finish_timeout_s=3)


def test_one_poisoned_request_of_500_shrinks_to_it_in_at_most_40_replays(tmp_path, five_hundred):
    summary = shrink(five_hundred, "staging", tmp_path / "out", engine({"die_on_logprobs_over": 25}), max_replays=40)
    assert summary["kept"] == ["r317"] and summary["minimal"]
    assert summary["finding"]["code"] == "engine_dead" and summary["replays"] <= 40
    assert summary["requests"] == {"before": 500, "after": 1}
    # Then the request itself: all it keeps of its own is what kills the engine, its 26 logprobs.
    assert summary["simplified"] == {"r317": {"defaults": ["temperature"], "prompt_len": 1, "max_tokens": 1}}
    assert json.loads((tmp_path / "out" / "shrink.json").read_text()) == summary
    # The shrunk session is that request, and it still kills the engine.
    replayed = Shrinker(tmp_path / "out" / "shrunk.db", "staging", engine({"die_on_logprobs_over": 25}),
                        tmp_path / "again")
    (tmp_path / "again").mkdir()
    assert replayed.start("engine_dead").code == "engine_dead" and replayed.smallest == ["r317"]


def test_a_pair_that_fails_only_together_shrinks_to_the_pair(tmp_path, sixteen):
    summary = shrink(sixteen, "staging", tmp_path / "out", engine({"die_when_together": ["r5", "r12"]}), jobs=2)
    assert summary["kept"] == ["r5", "r12"] and summary["minimal"]
    # Each alone was tried and passed: the pair is 1-minimal.
    assert {"requests": 1, "finding": False} in summary["candidates"]


def test_a_finding_that_is_not_in_the_whole_replay_is_exit_1_saying_what_was(tmp_path, sixteen):
    with pytest.raises(ShrinkError, match="has no token_mismatch"):
        shrink(sixteen, "staging", tmp_path / "out", engine(), finding="token_mismatch")
    result = subprocess.run([sys.executable, "-m", "replay_proxy", "shrink", "--db", str(sixteen), "--session",
                             "staging", "--out", str(tmp_path / "cli"), "--against", "engine", "--engine-cmd",
                             engine().command, "--finding", "token_mismatch", "--ready-timeout", "20",
                             "--finish-timeout", "10"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "has no token_mismatch" in result.stderr and "Traceback" not in result.stderr
    missing = subprocess.run([sys.executable, "-m", "replay_proxy", "shrink", "--db", str(sixteen), "--session",
                              "staging", "--out", str(tmp_path / "cli2"), "--against", "engine", "--engine-cmd",
                              "sim engine without a port"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "{port}" in missing.stderr
