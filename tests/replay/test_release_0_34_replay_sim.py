"""A 0.34.0 recording (prompts as int arrays, a long one in an aux frame) replayed against engines: one of
0.34.0 runs it as recorded; one of 0.32.0 cannot read the prompt, and the replay ends, as soon as the engine
has said so and nothing moves, in one breaking finding that names the prompt and quotes the engine's decoder,
the requests' lost outputs folded under it."""

import shlex
import shutil
import sys

import pytest
import trio

from replay_proxy.compare.findings import Severity, exit_code
from replay_proxy.errors import ExitCode
from replay_proxy.processes import free_port
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import replay_session
from replay_proxy.wire.messages import Side
from tests.helpers import RecordedSession

PROMPTS = [[11, 12, 13, 14], [(3 * i) % 400 + 5 for i in range(200)], [20, 21, 22]]


async def _record(db):
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            session = await RecordedSession(nursery, db, name="baseline", frontend_release="0.34.0",
                                            engine_release="0.34.0").start()
            for k, prompt in enumerate(PROMPTS):
                await session.frontend.add(f"r{k}", prompt, max_tokens=4, temperature=0.0)
                await session.frontend.wait_for(lambda k=k: f"r{k}" in session.frontend.finish_reasons)
            nursery.cancel_scope.cancel()
        session.recorder.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    db = tmp_path_factory.mktemp("recorded") / "baseline.db"
    trio.run(_record, db)
    return db


def replay_against(tmp_path, recorded, release, finish_timeout_s=5):
    db = tmp_path / "replay.db"
    shutil.copy(recorded, db)
    listen = f"tcp://127.0.0.1:{free_port()}"
    command = shlex.join([sys.executable, "-m", "replay_proxy", "sim", "engine", "--handshake", listen,
                          "--release", release])
    options = ReplayOptions(pace="fast", ready_timeout_s=20, finish_timeout_s=finish_timeout_s, report_dir=tmp_path)
    return replay_session(db, "baseline", PeerUnderTest(side=Side.ENGINE, address=listen, command=command), options)


def test_an_engine_of_its_release_runs_it_as_recorded(tmp_path, recorded):
    report, outcome = replay_against(tmp_path, recorded, "0.34.0")
    timeless = [f for f in report.findings if f.category != "performance"]
    assert [f for f in timeless if f.severity >= Severity.WARNING] == []
    assert (outcome.sent, outcome.finished) == (3, 3)


def test_an_older_engine_that_cannot_read_the_prompt_is_one_breaking_finding(tmp_path, recorded):
    # A finish timeout longer than the engine's silence after its rejection: the wait ends on the rejection.
    report, outcome = replay_against(tmp_path, recorded, "0.32.0", finish_timeout_s=600)
    [stopped] = [f for f in report.findings if f.code == "finish_timeout"]
    assert stopped.message.startswith("stopped waiting 5 s after the engine said it could not read what it was "
                                      "sent and nothing moved: 3 request(s) unfinished"), stopped.message
    serious = [f for f in report.findings if f.severity >= Severity.REGRESSION]
    [rejected] = serious
    assert (rejected.code, rejected.struct, rejected.position, rejected.field) == (
        "reader_rejected", "EngineCoreRequest", 1, "prompt_token_ids")
    assert "as 0.34.0 sends it" in rejected.message and "msgspec.ValidationError" in rejected.message
    assert len(rejected.consequences) >= 3  # each request's missing outputs, under the cause
    assert outcome.finished == 0 and exit_code(report.findings) is ExitCode.SCHEMA_BREAKING
