"""The man-in-the-middle between a vLLM frontend and its engines.

Theory of operation. Engines dial the proxy's handshake ROUTER as if it were
the frontend. For each engine identity the proxy opens a DEALER with that
same identity to the frontend's real handshake ROUTER and relays HELLO
upstream and READY. When the frontend's INIT comes back, the proxy

1. binds, per API server i, a ROUTER and a PULL of its own for that engine,
2. connects a DEALER (engine identity) to the frontend's ``inputs[i]`` and a
   PUSH to its ``outputs[i]``,
3. rewrites INIT so the engine dials the sockets of step 1, and sends it on.

From then on each of those socket pairs is an independent one-way pipe,
forwarded by its own task: frames are passed on as received (never
re-encoded) and handed to the observer *after* they were sent, so recording
never delays the peer. Giving every engine its own proxy sockets also tells
the proxy which engine sent each output, which a shared PULL could not.

The DP coordinator's addresses in INIT pass through unchanged by default:
engines talk to it directly. With ``record_coordinator`` the proxy binds,
per engine, an XPUB and a PULL in their place and connects an XSUB and a
PUSH of its own to the coordinator: one upstream subscriber per engine,
because the coordinator counts subscriptions before it sends its READY.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Protocol

import msgspec
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from replay_proxy.net.zmq_socket import SocketClosed, ZmqSocket
from replay_proxy.wire.handshake import HandshakeError, engine_index, parse_init, rewrite_init
from replay_proxy.wire.messages import Channel, Direction


class FrameEvent(msgspec.Struct, frozen=True, gc=False):
    """One multipart message that crossed the proxy, as it arrived."""

    ts_ns: int
    channel: Channel
    direction: Direction
    engine_index: int | None
    client_index: int | None
    frames: list[bytes]
    forwarded: list[bytes] | None = None  # only when the proxy changed what it sent (INIT)


class Observer(Protocol):
    def frame(self, event: FrameEvent) -> None: ...

    def engine_lost(self, engine_index: int, reason: str) -> None: ...


def local_address_like(listen: str) -> str:
    """An address to bind a new proxy socket on, beside ``listen``.

    tcp gets the same host on an ephemeral port; ipc a fresh path in the same
    folder.
    """
    if listen.startswith("tcp://"):
        host = listen[len("tcp://"):].rsplit(":", 1)[0]
        if host in ("*", "0.0.0.0"):
            host = "127.0.0.1"
        return f"tcp://{host}:0"
    if listen.startswith("ipc://"):
        folder = os.path.dirname(listen[len("ipc://"):]) or "."
        return f"ipc://{folder}/replay-proxy-{uuid.uuid4().hex[:12]}"
    raise ValueError(f"unsupported transport in {listen!r}: use tcp:// or ipc://")


class Relay:
    """Relays one frontend and any number of engines, reporting every frame."""

    def __init__(self, listen: str, upstream: str, observer: Observer, *, record_coordinator: bool = False,
                 context: zmq.Context | None = None):
        self.listen = listen
        self.upstream = upstream
        self.observer = observer
        self.record_coordinator = record_coordinator
        self.context = context or zmq.Context.instance()
        self.engines: dict[bytes, EngineLink] = {}
        self.listening = trio.Event()
        self._sockets: list[ZmqSocket] = []

    def socket(self, socket_type: int, *, identity: bytes | None = None) -> ZmqSocket:
        sock = ZmqSocket(self.context, socket_type, identity=identity)
        self._sockets.append(sock)
        return sock

    async def run(self) -> None:
        """Relay until cancelled; every socket is closed on the way out."""
        try:
            async with trio.open_nursery() as nursery:
                self._handshake = self.socket(zmq.ROUTER)
                self.listen = self._handshake.bind(self.listen)
                self.listening.set()
                while True:
                    identity, *frames = await self._handshake.receive()
                    ts_ns = time.time_ns()
                    link = self.engines.get(identity)
                    if link is None:
                        link = self.engines[identity] = EngineLink(self, identity)
                        nursery.start_soon(link.relay_handshake_replies, nursery)
                    await link.handshake.send(frames)
                    self._report(ts_ns, Channel.HANDSHAKE, Direction.TO_FRONTEND, link.index, None, frames)
        finally:
            for sock in self._sockets:
                sock.close()

    def _report(self, ts_ns: int, channel: Channel, direction: Direction, engine: int | None,
                client: int | None, frames: list[bytes], forwarded: list[bytes] | None = None) -> None:
        self.observer.frame(FrameEvent(ts_ns, channel, direction, engine, client, frames, forwarded))


class EngineLink:
    """Everything the proxy holds for one engine identity."""

    def __init__(self, relay: Relay, identity: bytes):
        self.relay = relay
        self.identity = identity
        self.index = engine_index(identity)
        self.handshake = relay.socket(zmq.DEALER, identity=identity)
        self.handshake.connect(relay.upstream)

    async def relay_handshake_replies(self, nursery: trio.Nursery) -> None:
        relay = self.relay
        while True:
            frames = await self.handshake.receive()
            ts_ns = time.time_ns()
            forwarded = frames
            if len(frames) == 1:
                try:
                    forwarded = [self._connect_clients(frames[0], nursery)]
                except HandshakeError:
                    pass  # not an INIT we understand: relay it untouched, it is recorded as is
            relay._report(ts_ns, Channel.HANDSHAKE, Direction.TO_ENGINE, self.index, None, frames,
                          forwarded if forwarded is not frames else None)
            await relay._handshake.send([self.identity, *forwarded])

    def _connect_clients(self, init: bytes, nursery: trio.Nursery) -> bytes:
        """Open the per-API-server sockets for an INIT and return the rewritten INIT."""
        _, addresses = parse_init(init)
        relay = self.relay
        inputs, outputs = [], []
        for client, (frontend_input, frontend_output) in enumerate(zip(addresses.inputs, addresses.outputs)):
            engine_side_in = relay.socket(zmq.ROUTER)
            inputs.append(engine_side_in.bind(local_address_like(relay.listen)))
            frontend_side_in = relay.socket(zmq.DEALER, identity=self.identity)
            frontend_side_in.connect(frontend_input)
            engine_side_out = relay.socket(zmq.PULL)
            outputs.append(engine_side_out.bind(local_address_like(relay.listen)))
            frontend_side_out = relay.socket(zmq.PUSH)
            frontend_side_out.connect(frontend_output)
            nursery.start_soon(self._pipe, Channel.INPUT, Direction.TO_FRONTEND, client,
                               engine_side_in, frontend_side_in)
            nursery.start_soon(self._pipe, Channel.INPUT, Direction.TO_ENGINE, client,
                               frontend_side_in, engine_side_in)
            nursery.start_soon(self._pipe, Channel.OUTPUT, Direction.TO_FRONTEND, client,
                               engine_side_out, frontend_side_out)
            if client == 0:
                nursery.start_soon(self._watch, engine_side_in)
        coordinator = {}
        if relay.record_coordinator and addresses.coordinator_input and addresses.coordinator_output:
            coordinator = self._connect_coordinator(addresses.coordinator_input, addresses.coordinator_output,
                                                    nursery)
        return rewrite_init(init, inputs, outputs, **coordinator)

    def _connect_coordinator(self, coordinator_input: str, coordinator_output: str,
                             nursery: trio.Nursery) -> dict[str, str]:
        """Relay this engine's coordinator channels; return the addresses the engine is to dial instead."""
        relay = self.relay
        engine_side_pub = relay.socket(zmq.XPUB)  # the engine's XSUB subscribes here ...
        engine_side_pull = relay.socket(zmq.PULL)
        replacement = {"coordinator_input": engine_side_pub.bind(local_address_like(relay.listen)),
                       "coordinator_output": engine_side_pull.bind(local_address_like(relay.listen))}
        coordinator_sub = relay.socket(zmq.XSUB)  # ... and this subscription is passed on as the engine's
        coordinator_sub.connect(coordinator_input)
        coordinator_push = relay.socket(zmq.PUSH)
        coordinator_push.connect(coordinator_output)
        nursery.start_soon(self._pipe, Channel.COORDINATOR_INPUT, Direction.TO_FRONTEND, None,
                           engine_side_pub, coordinator_sub)
        nursery.start_soon(self._pipe, Channel.COORDINATOR_INPUT, Direction.TO_ENGINE, None,
                           coordinator_sub, engine_side_pub)
        nursery.start_soon(self._pipe, Channel.COORDINATOR_OUTPUT, Direction.TO_FRONTEND, None,
                           engine_side_pull, coordinator_push)
        return replacement

    async def _watch(self, engine_side: ZmqSocket) -> None:
        """Tell the observer when the engine's connection drops (a SIGKILL sends no ENGINE_CORE_DEAD)."""
        monitor = engine_side.monitor(zmq.EVENT_DISCONNECTED)
        self.relay._sockets.append(monitor)
        try:
            event = parse_monitor_message(await monitor.receive())
        except SocketClosed:
            return
        self.relay.observer.engine_lost(self.index, f"its connection to the proxy dropped ({event['endpoint']})")

    async def _pipe(self, channel: Channel, direction: Direction, client: int | None,
                    source: ZmqSocket, sink: ZmqSocket) -> None:
        """Forward every message from source to sink, then report it.

        On the input channel the engine-facing socket is a ROUTER: what the
        engine sends arrives prefixed with its identity (dropped here, the
        frontend-facing DEALER carries it), and what goes to the engine gets
        the identity prepended so the ROUTER can route it.
        """
        report = self.relay._report
        from_router = channel is Channel.INPUT and direction is Direction.TO_FRONTEND
        to_router = channel is Channel.INPUT and direction is Direction.TO_ENGINE
        try:
            while True:
                frames = await source.receive()
                ts_ns = time.time_ns()
                if from_router:
                    frames = frames[1:]
                await sink.send([self.identity, *frames] if to_router else frames)
                report(ts_ns, channel, direction, self.index, client, frames)
        except SocketClosed:
            return
