"""``replay-proxy sim frontend`` and ``sim engine``: a sim peer in the foreground, until its work is
done or SIGTERM / Ctrl-C."""

from __future__ import annotations

import signal
from collections.abc import Callable

import trio

from replay_proxy.errors import ReplayProxyError
from replay_proxy.sim.api import serve_api
from replay_proxy.sim.drift import EngineDrift, FrontendDrift
from replay_proxy.sim.engine import SimEngine
from replay_proxy.sim.frontend import SimFrontend
from replay_proxy.sim.workload import run_workload


class SimTimeout(ReplayProxyError):
    """A sim frontend's workload did not finish in time."""


async def _until_signalled(start: Callable[[trio.Nursery], object]) -> None:
    """Run what ``start`` starts in a nursery until SIGTERM or SIGINT."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            await start(nursery)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


def run_frontend(handshake: str, *, engines: int = 1, api_servers: int = 1, release: str = "0.32.0", requests: int = 20,
                 http_port: int | None = None, drift: FrontendDrift | None = None, timeout_s: float = 60.0,
                 say: Callable[[str], None] = print) -> None:
    """Wait for the engines, then run ``requests`` requests (bounded by ``timeout_s``), or, with
    ``http_port``, serve an OpenAI-style API on it until signalled."""
    frontend = SimFrontend(handshake, engines=engines, api_servers=api_servers, release=release,
                           drift=drift or FrontendDrift())

    async def serve(nursery: trio.Nursery) -> None:
        await nursery.start(frontend.run)
        await frontend.ready.wait()  # like vLLM: the API comes up once the engines are ready
        port = await nursery.start(serve_api, frontend, http_port)
        say(f"sim frontend: serving http://127.0.0.1:{port}")

    async def workload() -> None:
        with trio.move_on_after(timeout_s) as scope:
            async with trio.open_nursery() as nursery:
                await nursery.start(frontend.run)
                await frontend.ready.wait()
                await run_workload(frontend, requests)
                nursery.cancel_scope.cancel()
        if scope.cancelled_caught:
            raise SimTimeout(f"sim frontend: workload not done after {timeout_s:g} s")
        tokens = sum(len(t) for t in frontend.tokens.values())
        say(f"sim frontend: {len(frontend.finish_reasons)} requests finished, {tokens} tokens, "
            f"{len(frontend.utility_results)} utility results")

    if http_port is None:
        trio.run(workload)
    else:
        trio.run(_until_signalled, serve)


def run_engine(handshake: str, *, index: int = 0, release: str = "0.32.0", step_s: float = 0.002,
               step_spread: float = 0.0, vocab_size: int | None = None, drift: EngineDrift | None = None) -> None:
    """A sim engine until signalled."""
    engine = SimEngine(handshake, index, release=release, drift=drift or EngineDrift(), step_s=step_s,
                       step_spread=step_spread, **({"vocab_size": vocab_size} if vocab_size else {}))

    async def start(nursery: trio.Nursery) -> None:
        nursery.start_soon(engine.run)

    trio.run(_until_signalled, start)
