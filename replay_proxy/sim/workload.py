"""A small, varied workload for the sim frontend: what a staging run looks like.

Start-up utility calls to every engine (as the Python frontend makes them),
then greedy and seeded requests spread over engines and API servers, one
request that ends on a stop token, and one long request aborted by the
frontend after a few tokens.
"""

from __future__ import annotations

import trio

from replay_proxy.sim.engine import token_at
from replay_proxy.sim.frontend import SimFrontend


async def run_workload(frontend: SimFrontend, requests: int = 20, abort_after_tokens: int = 3) -> None:
    engines, api_servers = frontend.engines, frontend.api_servers
    calls = []
    for engine in range(engines):
        for client in range(api_servers):
            for method in ("reset_mm_cache", "get_supported_tasks"):
                calls.append(await frontend.utility(method, engine=engine, client=client))
    ids = []
    for k in range(requests):
        engine, client = k % engines, (k // engines) % api_servers
        prompt = [11 + k, 12, 13 + k % 5]
        params = {"max_tokens": 4 + k % 5, "temperature": 0.0}
        if k % 3 == 1:
            params.update(temperature=0.8, seed=1000 + k)
        if k % 7 == 3:  # the third generated token is a stop token
            params["stop_token_ids"] = [token_at(prompt, None, 2)]
        ids.append(f"cmpl-{k}")
        await frontend.add(ids[-1], prompt, engine=engine, client=client, **params)
    await frontend.add("cmpl-long", [42, 43], max_tokens=10_000, temperature=0.0)
    await frontend.wait_for(lambda: len(frontend.tokens["cmpl-long"]) >= abort_after_tokens)
    await frontend.abort(["cmpl-long"])
    await frontend.wait_for(lambda: all(r in frontend.finish_reasons for r in ids)
                            and all(c in frontend.utility_results for c in calls))
    await trio.sleep(0.05)  # let any output already in flight for the aborted request arrive
