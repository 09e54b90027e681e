"""A protocol-faithful fake frontend (the engine-core client side).

Like ``vllm serve --data-parallel-size-local 0`` it binds one input ROUTER
and one output PULL per API server, then the handshake ROUTER, and waits for
the expected engines: HELLO -> INIT (with the input/output address lists),
registration on every input ROUTER, READY. Afterwards it sends ADD, ABORT
and UTILITY messages the way an API server does (``client_index`` = its API
server index) and collects outputs per request.

With ``coordinator`` it also plays vLLM's DP coordinator: an XPUB the
engines subscribe to (READY once every engine has subscribed; a
START_DP_WAVE when the first request arrives, as when paused engines are
woken) and a PULL for the engines' stats.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import defaultdict

import msgspec
import trio
import zmq

from replay_proxy.errors import ReplayProxyError
from replay_proxy.net.zmq_socket import SocketClosed, ZmqSocket
from replay_proxy.sim.drift import FrontendDrift, with_inserted_field
from replay_proxy.wire.encode import encode, struct_value, token_ids
from replay_proxy.wire.handshake import engine_identity, engine_index
from replay_proxy.wire.messages import COORDINATOR_READY, ENGINE_CORE_DEAD, SUBSCRIBE_ALL, RequestType
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.values import decode_msgpack


class FrontendError(ReplayProxyError):
    """The sim frontend saw a protocol violation."""


class SimFrontend:
    def __init__(self, handshake_address: str = "tcp://127.0.0.1:0", *, engines: int = 1,
                 api_servers: int = 1, release: str = "0.32.0", drift: FrontendDrift = FrontendDrift(),
                 coordinator: bool = False, context: zmq.Context | None = None):
        self.handshake_address = handshake_address
        self.engines = engines
        self.api_servers = api_servers
        self.schema = with_inserted_field(load_schema(release), "EngineCoreRequest", drift.insert_request_field)
        self.drift = drift
        self.coordinator = coordinator
        self.coordinator_stats: list[list[bytes]] = []  # what the engines sent the coordinator
        self.waves_started = 0
        self.context = context or zmq.Context.instance()
        self.registrations: dict[tuple[int, int], dict] = {}  # (engine, api server) -> registration
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish_reasons: dict[str, int] = {}
        self.aborted: set[str] = set()  # request ids this frontend aborted
        self.utility_results: dict[int, list] = {}
        self.outputs_received: list[tuple[int, list[bytes]]] = []  # (api server, frames)
        self.dead_sentinels = 0  # ENGINE_CORE_DEAD frames received, one per engine per API server
        self.undecodable = 0
        self.ready = trio.Event()
        self._changed = trio.Event()
        self._sockets: list[ZmqSocket] = []
        self._added = itertools.count()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Bind, hand the handshake address to ``task_status``, handshake, then serve."""
        try:
            self.inputs = [self._socket(zmq.ROUTER) for _ in range(self.api_servers)]
            self.output_sockets = [self._socket(zmq.PULL) for _ in range(self.api_servers)]
            input_addresses = [s.bind("tcp://127.0.0.1:0") for s in self.inputs]
            output_addresses = [s.bind("tcp://127.0.0.1:0") for s in self.output_sockets]
            handshake = self._socket(zmq.ROUTER)
            self.handshake_address = handshake.bind(self.handshake_address)
            task_status.started(self.handshake_address)
            async with trio.open_nursery() as nursery:
                coordinator = {"coordinator_input": None, "coordinator_output": None}
                if self.coordinator:
                    self._publish, stats = self._socket(zmq.XPUB), self._socket(zmq.PULL)
                    coordinator = {"coordinator_input": self._publish.bind("tcp://127.0.0.1:0"),
                                   "coordinator_output": stats.bind("tcp://127.0.0.1:0")}
                    nursery.start_soon(self._coordinate, stats)
                init = encode({
                    "addresses": {"inputs": input_addresses, "outputs": output_addresses, **coordinator,
                                  "frontend_stats_publish_address": None},
                    "parallel_config": {},
                })
                await self._handshake(handshake, init)
                for client, sock in enumerate(self.output_sockets):
                    nursery.start_soon(self._collect, client, sock)
        finally:
            for sock in self._sockets:
                sock.close()

    async def _coordinate(self, stats: ZmqSocket) -> None:
        try:
            subscribed = 0
            while subscribed < self.engines:  # vLLM's coordinator counts one subscription per engine
                subscribed += await self._publish.receive() == [SUBSCRIBE_ALL]
            await self._publish.send([COORDINATOR_READY])
            while True:
                self.coordinator_stats.append(await stats.receive())
        except SocketClosed:
            return

    def _socket(self, socket_type: int) -> ZmqSocket:
        sock = ZmqSocket(self.context, socket_type, linger_ms=1000)
        self._sockets.append(sock)
        return sock

    async def _handshake(self, handshake: ZmqSocket, init: bytes) -> None:
        states: dict[int, str] = {}
        while len(states) < self.engines or any(s != "READY" for s in states.values()):
            identity, payload = await handshake.receive()
            status = decode_msgpack(payload).get("status")
            index = engine_index(identity)
            if status == "HELLO" and index not in states:
                states[index] = "HELLO"
                await handshake.send([identity, init])
            elif status == "READY" and states.get(index) == "HELLO":
                states[index] = "READY"
            else:
                raise FrontendError(f"engine {index}: {status} in state {states.get(index, 'NEW')}")
        for client, sock in enumerate(self.inputs):
            for _ in range(self.engines):
                identity, payload = await sock.receive()
                registration = decode_msgpack(payload)
                required = self.drift.require_registration_key
                if required and required not in registration:  # as vLLM's frontend logs msgspec's error
                    raise FrontendError(f"engine {engine_index(identity)} registration: msgspec.ValidationError: "
                                        f"Object missing required field `{required}`")
                self.registrations[(engine_index(identity), client)] = registration
        self.ready.set()

    async def _collect(self, client: int, sock: ZmqSocket) -> None:
        try:
            while True:
                frames = await sock.receive()
                self.outputs_received.append((client, frames))
                if frames == [ENGINE_CORE_DEAD]:
                    self.dead_sentinels += 1
                else:
                    try:
                        self._absorb(decode_msgpack(frames[0]))
                    except (msgspec.DecodeError, TypeError, KeyError, IndexError):
                        self.undecodable += 1
                self._notify()
        except SocketClosed:
            return

    def _absorb(self, outputs: list) -> None:
        """Read outputs positionally with this frontend's schema, as vLLM does."""
        fields = dict(zip(self._names("EngineCoreOutputs"), outputs))
        for output in fields.get("outputs") or []:
            output = dict(zip(self._names("EngineCoreOutput"), output))
            request_id = output["request_id"]
            self.tokens[request_id].extend(output["new_token_ids"])
            if output.get("finish_reason") is not None:
                self.finish_reasons[request_id] = output["finish_reason"]
        utility = fields.get("utility_output")
        if utility is not None:
            self.utility_results[utility[0]] = utility

    def _names(self, struct: str) -> list[str]:
        return [f.name for f in self.schema.structs[struct].fields]

    async def add(self, request_id: str, prompt: list[int], *, engine: int = 0, client: int = 0,
                  request: dict | None = None, **sampling) -> None:
        """ADD a request; ``request``: more EngineCoreRequest fields (a LoRA, a cache salt, trace headers)."""
        params = dict(sampling)
        if self.drift.rename_sampling_key and self.drift.rename_sampling_key[0] in params:
            old, new = self.drift.rename_sampling_key
            params[new] = params.pop(old)
        if self.drift.add_sampling_key:
            params[self.drift.add_sampling_key] = 1
        aux_frames: list[bytes] = []  # (a long prompt's, from 0.34.0 on)
        prompt_field = self.schema.structs["EngineCoreRequest"].by_name["prompt_token_ids"]
        body = struct_value(self.schema, "EngineCoreRequest", {
            "request_id": request_id, "prompt_token_ids": token_ids(prompt_field, prompt, aux_frames),
            "mm_features": None,
            "sampling_params": struct_value(self.schema, "SamplingParams", params),
            "pooling_params": None, "arrival_time": time.time(), "lora_request": None,
            "cache_salt": None, "data_parallel_rank": None, "client_index": client, **(request or {}),
        })
        await self._send(engine, client, RequestType.ADD, body, aux_frames)
        if self.coordinator and not self.waves_started:  # wake the other (paused) engines
            self.waves_started += 1
            await self._publish.send([RequestType.START_DP_WAVE.value, encode([0, engine])])

    async def add_balanced(self, request_id: str, prompt: list[int], **sampling) -> tuple[int, int]:
        """Send to each engine and API server in turn, as vLLM's load balancing would when idle;
        return the (engine, API server) chosen."""
        n = next(self._added)
        engine, client = n % self.engines, (n // self.engines) % self.api_servers
        await self.add(request_id, prompt, engine=engine, client=client, **sampling)
        return engine, client

    async def abort(self, request_ids: list[str], *, engine: int = 0, client: int = 0) -> None:
        await self._send(engine, client, RequestType.ABORT, request_ids)
        self.aborted.update(request_ids)
        self._notify()

    async def utility(self, method: str, *args, engine: int = 0, client: int = 0) -> int:
        call_id = uuid.uuid1().int >> 64  # as vLLM's Python client does: an unsigned 64-bit int
        await self._send(engine, client, RequestType.UTILITY, [client, call_id, method, list(args)])
        return call_id

    async def _send(self, engine: int, client: int, kind: RequestType, body, aux_frames: list[bytes] = ()) -> None:
        await self.inputs[client].send([engine_identity(engine), kind.value, encode(body), *aux_frames])

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate) -> None:
        """Wait until ``predicate()`` holds (callers bound this with trio.fail_after)."""
        while not predicate():
            await self._changed.wait()
