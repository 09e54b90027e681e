"""A protocol-faithful fake EngineCore.

It dials a handshake address like a headless ``vllm serve --headless``
engine: HELLO, waits for INIT, connects one input DEALER and one output PUSH
per API server, sends the registration on every input socket, then READY.
Requests produce a deterministic token stream (a function of the prompt,
the seed and the position), one token per request per engine step, batched
into one EngineCoreOutputs per API server per step, as the real scheduler
does. A request that asks for logprobs (or prompt logprobs) gets them as
vLLM sends them (numpy arrays in each output, torch tensors for the prompt,
large ones in aux frames), from a fixed peaked distribution: the token it
generates first, with half the mass, then tokens of a quarter, an eighth, ...
``EngineDrift`` knobs reproduce the breaks seen in vLLM's history.
When INIT names a DP coordinator, the engine subscribes to it and waits for
its READY before registering, then reports its request counts there after
every step, as vLLM's engines do.
"""

from __future__ import annotations

import array
import math
import random
import sys

import msgspec
import trio
import zmq

from replay_proxy.net.zmq_socket import SocketClosed, ZmqSocket
from replay_proxy.sim.drift import EngineDrift, with_inserted_field
from replay_proxy.wire.encode import encode, struct_value, tensor
from replay_proxy.wire.handshake import engine_identity, parse_init
from replay_proxy.wire.messages import COORDINATOR_READY, ENGINE_CORE_DEAD, SUBSCRIBE_ALL, RequestType
from replay_proxy.wire.schema import Flag, Namer
from replay_proxy.wire.registry import load_schema
from replay_proxy.wire.values import decode_msgpack, token_ids

VOCAB = 900
FINISH = {"stop": 0, "length": 1, "abort": 2, "error": 3}


def token_at(prompt: list[int], seed: int | None, position: int, vocab_size: int = VOCAB) -> int:
    """The token the sim engine generates at ``position`` for a prompt, of a vocabulary of ``vocab_size``."""
    return (sum(prompt) * 31 + (seed or 0) * 17 + position * 7 + len(prompt)) % (vocab_size - 10) + 10


class SimEngine:
    def __init__(self, handshake_address: str, index: int = 0, *, release: str = "0.32.0",
                 drift: EngineDrift = EngineDrift(), step_s: float = 0.002, step_spread: float = 0.0,
                 vocab_size: int = VOCAB, context: zmq.Context | None = None):
        """``vocab_size``: of the tokens it generates (a real frontend's model's, in front of one)."""
        self.address = handshake_address
        self.index = index
        self.identity = engine_identity(index)
        self.schema = with_inserted_field(load_schema(release), "EngineCoreOutput", drift.insert_output_field)
        self.release = release
        self.vocab_size = vocab_size
        self.drift = drift
        self.step_s = step_s
        # Real steps vary with the batch: each takes step_s times a lognormal of this spread, drawn
        # from a sequence seeded by the engine index, so that every run of an engine steps alike.
        self.step_spread = step_spread
        self._step_times = random.Random(index)
        self.context = context or zmq.Context.instance()
        self.running: dict[str, _Running] = {}
        self.received: list[tuple[str, list[bytes]]] = []  # (client input index, frames)
        self.rejected: list[list[bytes]] = []  # ADDs that do not decode under this engine's schema
        self.added = 0
        self.dead = False
        self.from_coordinator: list[list[bytes]] = []
        self.stats_sent = 0
        self._stats: ZmqSocket | None = None  # the PUSH to the DP coordinator, if there is one
        self._wake = trio.Event()

    async def run(self) -> None:
        sockets: list[ZmqSocket] = []
        try:
            handshake = self._socket(sockets, zmq.DEALER)
            handshake.connect(self.address)
            await handshake.send([encode({"status": "HELLO", "local": False, "headless": True})])
            _, addresses = parse_init((await handshake.receive())[0])
            coordinator = None
            if addresses.coordinator_input and addresses.coordinator_output:
                coordinator = self._socket(sockets, zmq.XSUB)
                coordinator.connect(addresses.coordinator_input)
                await coordinator.send([SUBSCRIBE_ALL])
                while await coordinator.receive() != [COORDINATOR_READY]:
                    pass
                self._stats = self._socket(sockets, zmq.PUSH)
                self._stats.connect(addresses.coordinator_output)
            self.inputs = inputs = [self._socket(sockets, zmq.DEALER) for _ in addresses.inputs]
            self.outputs = [self._socket(sockets, zmq.PUSH) for _ in addresses.outputs]
            for sock, address in zip(inputs, addresses.inputs):
                sock.connect(address)
                await sock.send([encode(self._registration())])
            for sock, address in zip(self.outputs, addresses.outputs):
                sock.connect(address)
            await handshake.send([encode({"status": "READY", "local": False, "headless": True})])
            async with trio.open_nursery() as nursery:
                for client, sock in enumerate(inputs):
                    nursery.start_soon(self._serve_input, client, sock)
                if coordinator is not None:
                    nursery.start_soon(self._serve_coordinator, coordinator)
                await self._step_loop()
                nursery.cancel_scope.cancel()
        finally:
            for sock in sockets:
                sock.close()

    def _socket(self, sockets: list[ZmqSocket], socket_type: int) -> ZmqSocket:
        sock = ZmqSocket(self.context, socket_type, identity=self.identity if socket_type == zmq.DEALER else None,
                         linger_ms=1000)
        sockets.append(sock)
        return sock

    def _registration(self) -> dict:
        fields = {
            "max_model_len": 256, "num_gpu_blocks": 1024, "block_size": 16, "dp_stats_address": None,
            "dtype": "float32", "vllm_version": self.release, "world_size": 1,
            "data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
            "decode_context_parallel_size": 1, "data_parallel_rank": self.index, "max_num_seqs": 4,
            "max_num_batched_tokens": 2048, "instance_id": f"sim-{self.index}",
            "supports_lora": False, "max_loras": 0,
        }
        value = struct_value(self.schema, "EngineCoreReadyResponse", fields)
        if self.drift.drop_registration_key:
            value.pop(self.drift.drop_registration_key, None)
        if self.drift.add_registration_key:
            value[self.drift.add_registration_key] = True
        return value

    async def _serve_input(self, client: int, sock: ZmqSocket) -> None:
        try:
            while True:
                frames = await sock.receive()
                self.received.append((client, frames))
                await self._handle(frames)
        except SocketClosed:
            return

    async def _serve_coordinator(self, sock: ZmqSocket) -> None:
        try:
            while True:
                self.from_coordinator.append(await sock.receive())  # START_DP_WAVE
        except SocketClosed:
            return

    async def _handle(self, frames: list[bytes]) -> None:
        try:
            kind, body = RequestType(frames[0]), decode_msgpack(frames[1])
        except (ValueError, IndexError, msgspec.DecodeError):
            return  # kept in self.received; a real engine's input thread would choke here
        if kind is RequestType.ADD:
            namer = Namer(self.schema, frames[1:])  # tensor references count from the body
            fields = namer.struct("EngineCoreRequest", body)
            refused = [f for f in namer.flags if f.issue in ("type_mismatch", "missing_required")]
            if refused:  # vLLM's typed decoder raises here, in its input thread; the request never runs
                self.rejected.append(frames)
                print(f"sim engine {self.index}: {_complaint(refused[0])}", file=sys.stderr, flush=True)
                return
            params = fields["sampling_params"] or {}
            self.running[fields["request_id"]] = _Running(
                prompt=token_ids(fields["prompt_token_ids"]) or [], seed=params.get("seed"),
                max_tokens=params.get("max_tokens", 16), stop_token_ids=params.get("stop_token_ids") or [],
                client=fields.get("client_index", 0), vocab_size=self.vocab_size,
                logprobs=params.get("logprobs"), prompt_logprobs=params.get("prompt_logprobs"),
            )
            self.added += 1
            if self._fails_on(params):
                await self._die()
        elif kind is RequestType.ABORT:
            for request_id in body:
                self.running.pop(request_id, None)  # frontend-initiated: no reply, as in vLLM
        elif kind is RequestType.UTILITY:
            client, call_id, method, _args = body
            result = {"get_supported_tasks": ["generate"], "reset_prefix_cache": True}.get(method)
            utility = struct_value(self.schema, "UtilityOutput", {"call_id": call_id, "result": [None, result]})
            await self._send(client, {"utility_output": utility})
        self._wake.set()

    def _fails_on(self, params: dict) -> bool:
        """Whether the ADD just taken kills the engine (the drift knobs that do)."""
        drift = self.drift
        if drift.die_after_requests is not None and self.added >= drift.die_after_requests:
            return True
        if drift.die_on_logprobs_over is not None and (params.get("logprobs") or 0) > drift.die_on_logprobs_over:
            return True
        return drift.die_when_together is not None and all(r in self.running for r in drift.die_when_together)

    async def _die(self) -> None:
        self.dead = True
        for sock in self.outputs:
            await sock.send([ENGINE_CORE_DEAD])

    async def _step_loop(self) -> None:
        # Steps keep to a clock, one every period, so the period is the step time whatever the
        # work of a step costs on this machine: a step_time_fraction is then exactly that slowdown.
        period = self.step_s * (1 + self.drift.step_time_fraction)
        spread = self.step_spread
        due = None
        while not self.dead:
            if not self.running:
                await self._wake.wait()
                self._wake = trio.Event()
                due = None
                continue
            step = period * self._step_times.lognormvariate(0, spread) if spread else period
            due = max((due or trio.current_time()) + step, trio.current_time())
            await trio.sleep_until(due)
            by_client: dict[int, list[dict]] = {}
            for request_id, request in list(self.running.items()):
                if request_id not in self.running:
                    continue
                output = request.step(request_id, self.drift)
                by_client.setdefault(request.client, []).append(output)
                if output.get("finish_reason") is not None:
                    del self.running[request_id]
            for client, outputs in by_client.items():
                await self._send(client, {"outputs": outputs})
            if self._stats is not None:
                stats = struct_value(self.schema, "SchedulerStats", {"num_running_reqs": len(self.running),
                                                                     "num_waiting_reqs": 0})
                await self._stats.send([encode(struct_value(self.schema, "EngineCoreOutputs", {
                    "engine_index": self.index, "timestamp": trio.current_time(), "scheduler_stats": stats}))])
                self.stats_sent += 1

    async def _send(self, client: int, named: dict) -> None:
        named = {"engine_index": self.index, "timestamp": trio.current_time(), **named}
        if self.drift.append_outputs_field:
            named["$extra"] = self.drift.appended_value
        aux: list[bytes] = []
        for output in named.get("outputs", ()):
            for name, value in list(output.items()):
                if name in ("new_logprobs", "new_prompt_logprobs_tensors"):
                    output[name] = [tensor(*t, aux) if isinstance(t, tuple) else t for t in value]
        await self.outputs[client].send([encode(struct_value(self.schema, "EngineCoreOutputs", named)), *aux])


class _Running:
    def __init__(self, prompt: list[int], seed: int | None, max_tokens: int | None,
                 stop_token_ids: list[int], client: int, vocab_size: int, logprobs: int | None = None,
                 prompt_logprobs: int | None = None):
        self.prompt, self.seed, self.stop_token_ids, self.client = prompt, seed, stop_token_ids, client
        self.vocab_size = vocab_size
        self.max_tokens = math.inf if max_tokens is None else max_tokens
        self.generated = 0
        self.logprobs, self.prompt_logprobs = logprobs, prompt_logprobs

    def _top(self, first: int, k: int, drift: EngineDrift) -> list[tuple[int, float]]:
        """The k most likely tokens after a context whose most likely token is ``first``, with logprobs."""
        tokens = [(first - 10 + 13 * i) % (self.vocab_size - 10) + 10 for i in range(k)]
        return [(t, math.log(0.5) * (i + 1) * (1 + drift.logprob_scale)) for i, t in enumerate(tokens)]

    def _rows(self, chosen: list[int], firsts: list[int], k: int, drift: EngineDrift) -> tuple[list, list, list]:
        """Each position's row, as vLLM lays it out: its own token and its logprob, then the top k; and ranks."""
        ids, values, ranks = [], [], []
        for token, first in zip(chosen, firsts):
            top = self._top(first, max(k, 1), drift)
            own = dict(top).get(token, math.log(0.5) * (len(top) + 1))
            ids += [token, *(t for t, _ in top[:k])]
            values += [own, *(lp for _, lp in top[:k])]
            ranks.append(next((i + 1 for i, (t, _) in enumerate(top) if t == token), len(top) + 1))
        return ids, values, ranks

    def step(self, request_id: str, drift: EngineDrift) -> dict:
        token = token_at(self.prompt, self.seed, self.generated, self.vocab_size) + drift.token_offset
        self.generated += 1
        finish = None
        if token in self.stop_token_ids:
            finish = FINISH["stop"]
        elif self.generated >= self.max_tokens:
            finish = FINISH["length"]
        if finish is not None and drift.finish_reason:
            finish = FINISH[drift.finish_reason]
        output = {"request_id": request_id, "new_token_ids": [token], "finish_reason": finish}
        if finish == FINISH["stop"]:
            output["stop_reason"] = token
        if self.logprobs is not None:  # a LogprobsLists of numpy arrays, one row
            k = self.logprobs
            ids, values, ranks = self._rows([token], [token], k, drift)
            output["new_logprobs"] = [("<i4", [1, k + 1], array.array("i", ids).tobytes()),
                                      ("<f4", [1, k + 1], array.array("f", values).tobytes()),
                                      ("<i8", [1], array.array("q", ranks).tobytes()), None]
        if self.prompt_logprobs is not None and self.generated == 1:  # a LogprobsTensors, a row per prompt token
            k, rows = self.prompt_logprobs, len(self.prompt) - 1
            firsts = [token_at(self.prompt[:i + 1], None, 0, self.vocab_size) for i in range(rows)]
            ids, values, ranks = self._rows(self.prompt[1:], firsts, k, drift)
            output["new_prompt_logprobs_tensors"] = [("int64", [rows, k + 1], array.array("q", ids).tobytes()),
                                                     ("float32", [rows, k + 1], array.array("f", values).tobytes()),
                                                     ("int64", [rows], array.array("q", ranks).tobytes()), None, None]
        return output


def _complaint(flag: Flag) -> str:
    """What vLLM's engine logs when its decoder refuses an ADD, in msgspec's words."""
    if flag.issue == "missing_required":
        return f"msgspec.ValidationError: Object missing required field `{flag.field}` - at `{flag.path}`"
    got = {"map": "object", "nil": "null", "bin": "bytes"}.get(flag.got or "", flag.got)  # (msgspec's names)
    return f"msgspec.ValidationError: Expected `{flag.expected}`, got `{got}` - at `{flag.path}`"
