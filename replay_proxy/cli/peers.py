"""Peers to run the proxy with: the sim peers (``sim frontend | engine``), real ones (``peers fetch``)."""

from __future__ import annotations

from typing import Annotated

import msgspec
import typer

from replay_proxy.cli.common import check_address, err, fail, out, peers_app, sim_app
from replay_proxy.errors import ExitCode


def parse_drift(text: str | None, knobs: type):
    """``--drift`` JSON as the sim peer's knobs; a bad value is a usage error."""
    try:
        return msgspec.json.decode(text, type=knobs) if text else knobs()
    except msgspec.DecodeError as exc:
        raise fail(f"--drift: {exc}", ExitCode.USAGE) from None


@sim_app.command("frontend")
def sim_frontend(
    handshake: Annotated[str, typer.Option(callback=check_address, help="Handshake address to bind.")],
    engines: Annotated[int, typer.Option(min=1, help="Engines to wait for.")] = 1,
    api_servers: Annotated[int, typer.Option(min=1, help="Input/output socket pairs (API servers).")] = 1,
    release: Annotated[str, typer.Option(help="vLLM release whose schema this frontend speaks.")] = "0.32.0",
    requests: Annotated[int, typer.Option(min=0, help="Requests in the workload.")] = 20,
    http_port: Annotated[int | None, typer.Option(
        help="Instead of running the workload, serve an OpenAI-style API on this port until SIGTERM or Ctrl-C.")]
        = None,
    drift: Annotated[str | None, typer.Option(
        help='Drift knobs as JSON, e.g. \'{"require_registration_key": "x"}\' (see sim/drift.py).')] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 60.0,
) -> None:
    """Run a fake frontend: wait for the engines, then run a small workload, or serve HTTP.

    Example: replay-proxy sim frontend --handshake tcp://127.0.0.1:29550 --engines 2
    """
    from replay_proxy.sim.drift import FrontendDrift
    from replay_proxy.sim.run import SimTimeout, run_frontend

    knobs = parse_drift(drift, FrontendDrift)
    try:
        run_frontend(handshake, engines=engines, api_servers=api_servers, release=release, requests=requests,
                     http_port=http_port, drift=knobs, timeout_s=timeout, say=err.print)
    except SimTimeout as exc:
        raise fail(str(exc), ExitCode.REPLAY_FAILED) from None


@sim_app.command("engine")
def sim_engine(
    handshake: Annotated[str, typer.Option(callback=check_address, help="Handshake address to dial.")],
    index: Annotated[int, typer.Option(min=0, help="Engine index (data-parallel rank).")] = 0,
    release: Annotated[str, typer.Option(help="vLLM release whose schema this engine speaks.")] = "0.32.0",
    step_ms: Annotated[float, typer.Option(min=0.1, help="One engine step (a token for each running request).")]
        = 2.0,
    step_spread: Annotated[float, typer.Option(min=0.0, help=(
        "Spread of step times: each is --step-ms times a lognormal of this sigma (seeded by --index)."))] = 0.0,
    vocab_size: Annotated[int | None, typer.Option(
        min=11, help="Generate tokens of a vocabulary this large (a real frontend's model's; default 900).")] = None,
    drift: Annotated[str | None, typer.Option(
        help='Drift knobs as JSON, e.g. \'{"drop_registration_key": "block_size"}\' (see sim/drift.py).')] = None,
) -> None:
    """Run a fake engine until SIGTERM or Ctrl-C.

    Example: replay-proxy sim engine --handshake tcp://127.0.0.1:29560 --index 0
    """
    from replay_proxy.sim.drift import EngineDrift
    from replay_proxy.sim.run import run_engine

    run_engine(handshake, index=index, release=release, step_s=step_ms / 1000, step_spread=step_spread,
               vocab_size=vocab_size, drift=parse_drift(drift, EngineDrift))


@peers_app.command("fetch")
def peers_fetch(
    vllm_rs: Annotated[list[str], typer.Option("--vllm-rs", help="A release whose Rust frontend to fetch.")],
) -> None:
    """Fetch peers into the cache once (bounded downloads) and print where each is.

    Example: replay-proxy peers fetch --vllm-rs 0.29.0 --vllm-rs 0.33.0
    """
    from replay_proxy import releases

    for release in vllm_rs:
        out.print(releases.vllm_rs(release))
