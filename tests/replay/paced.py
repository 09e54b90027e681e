"""A paced sim session, recorded through `replay-proxy record` to a sim engine process of a realistic step
time: what the performance verdicts are measured on, in the suite and in scripts/bench/false_alarms.py."""

import json

import trio

from replay_proxy.processes import Child, free_port
from replay_proxy.sim.frontend import SimFrontend
from tests.helpers import CLI

STEP_MS = 20  # the sim engine's step, with a spread of 0.2 (a lognormal, seeded: every run steps alike)
REQUESTS = 300


def engine_argv(listen, fraction=0.0):
    drift = ["--drift", json.dumps({"step_time_fraction": fraction})] if fraction else []
    return [*CLI, "sim", "engine", "--handshake", listen, "--step-ms", str(STEP_MS), "--step-spread", "0.2", *drift]


def record_paced(logs, requests=REQUESTS):
    """Greedy requests, one every 30 ms, through `replay-proxy record` to a sim engine process."""
    db = logs / "rec.db"
    upstream, listen = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proxy = Child([*CLI, "record", "--listen", listen, "--upstream", upstream, "--db", str(db), "--session", "paced"],
                  logs / "proxy.log")
    engine = Child(engine_argv(listen), logs / "engine.log")
    try:
        proxy.wait_for_log("listening on", timeout=30)

        async def workload():
            frontend = SimFrontend(upstream)
            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    await nursery.start(frontend.run)
                    await frontend.ready.wait()
                    start = trio.current_time()
                    for k in range(requests):
                        await trio.sleep_until(start + k * 0.03)
                        await frontend.add(f"r{k}", [3, k % 97, 5], max_tokens=5, temperature=0.0)
                    await frontend.wait_for(lambda: len(frontend.finish_reasons) == requests)
                    nursery.cancel_scope.cancel()

        trio.run(workload)
    finally:
        engine.stop()
        assert proxy.stop(timeout=30) == 0, proxy.log_tail()
    return db
