"""The sim session the engine replay's tests share, and its replay against sim engines."""

import shutil

import sqlite_utils
import trio

from replay_proxy.processes import free_port
from replay_proxy.replay.player import PeerUnderTest, ReplayOptions
from replay_proxy.replay.run import replay_session
from replay_proxy.wire.messages import Side
from tests.helpers import RecordedSession
from tests.helpers import engines_command


async def record_baseline(db, engines, api_servers, coordinator=False):
    """Session "baseline" through the recorder, sim peers: r0..r7 (three alone, five batched), "long" aborted
    after 4 tokens, a utility call."""
    with trio.fail_after(60):  # the sim peers take a second or two: a hang fails here, not at CI's limit
        async with trio.open_nursery() as nursery:
            session = await RecordedSession(nursery, db, engines=engines, api_servers=api_servers, name="baseline",
                                            coordinator=coordinator, record_coordinator=coordinator).start()
            frontend = session.frontend
            call = await frontend.utility("get_supported_tasks")
            for k in range(8):  # three one at a time, then five batched together
                await frontend.add(f"r{k}", [7, 8, k], engine=k % engines, client=k % api_servers,
                                   max_tokens=3 + k, temperature=0.0)
                if k < 3:  # with a pause, so that a replay at the recorded pace runs them alone too
                    await frontend.wait_for(lambda k=k: f"r{k}" in frontend.finish_reasons)
                    await trio.sleep(0.1)
            await frontend.add("long", [9, 9], max_tokens=500, temperature=0.0)
            await frontend.wait_for(lambda: len(frontend.tokens["long"]) >= 4)
            await frontend.abort(["long"])
            await frontend.wait_for(lambda: len(frontend.finish_reasons) == 8 and call in frontend.utility_results)
            nursery.cancel_scope.cancel()
        session.recorder.close()


def replay_baseline(tmp_path, recorded, drift=None, engines=1, ready_timeout=20, noise_runs=0, pace="fast",
                    edit=None):
    """``replay_session`` of a copy of ``recorded`` (changed by ``edit``) against sim engines with ``drift``:
    (report, outcome, the copy)."""
    db = tmp_path / "replay.db"
    shutil.copy(recorded, db)
    if edit is not None:
        edit(sqlite_utils.Database(db))
    listen = f"tcp://127.0.0.1:{free_port()}"
    peer = PeerUnderTest(side=Side.ENGINE, address=listen, command=engines_command(listen, drift, engines))
    options = ReplayOptions(pace=pace, ready_timeout_s=ready_timeout, finish_timeout_s=10, report_dir=tmp_path,
                            noise_runs=noise_runs, baseline_command=engines_command(listen))
    report, outcome = replay_session(db, "baseline", peer, options)
    return report, outcome, db
