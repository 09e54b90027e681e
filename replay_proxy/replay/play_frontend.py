"""Replay against a new engine build: the proxy plays the recorded frontend.

Theory of operation. The proxy binds a handshake ROUTER (the engine dials
it, as it would the real frontend) and, like the frontend, one input ROUTER
and one output PULL per recorded API server. Each engine's HELLO gets an
INIT naming those sockets and the recorded parallel config; the engine's
registrations and READY are kept for the comparison. Then the recorded
inputs go out as the raw recorded bytes, in recorded order, to the recorded
engine identity on the recorded API server's socket:

* ``pace="original"`` keeps the recorded relative timing, scheduled against
  one clock (no drift from sleeping after each send); a number scales it
  (2 = twice as fast); ``"fast"`` sends as fast as the engine takes them;
* an ABORT is not paced by the clock: it goes as soon as every request it
  names has been sent and has produced as many tokens as it had when the
  recorded frontend aborted it (or has finished), so it lands at the same
  point of generation on an engine faster or slower than the recorded one.
  The recorded frontend aborted because its client had seen those tokens,
  not because of the time or of other requests, so that is the order kept:
  its ADDs, then that progress, then the ABORT. The other inputs keep their
  own times and may pass it either way, which changes only how requests
  are batched, already not reproducible on vLLM's CPU build.

Outputs are collected until every request has finished or been aborted and
every utility call is answered, or until ``finish_timeout``. Everything that
crosses is reported to the observer (``replay/player.py``).

What the judging needs (compare/tokens.py, compare/scoring.py) is asked of the
engine as a frontend may ask it. Every generation request goes out asking for
the top ``rules.judging.top_logprobs`` logprobs of each token it generates (or
the recorded number, if more): vLLM computes them from the raw logits beside
the sampler, so what is sampled does not change. After the session, each
``scoring_passes`` pass sends, for every request that produced tokens, its
prompt and recorded output as one prompt asking for one token and the top-k
prompt logprobs (teacher-forced scoring), all at once, the second pass in
reverse order so that its batches differ (the run-to-run noise of scoring).

An engine can be kept for the next replay (``keep``; ``replay.run.KeptEngine``):
the player leaves its ``FrontendSockets`` open, and the next player, given that
link, skips the handshake. The engine would be sent the same INIT again (the
player makes it from the recording's parallel config and its own sockets, not
from the recorded bytes), so the handshake that crossed at the engine's start
is reported again as the replay's own, with the times it crossed. Between
the replays, the engine's prefix cache is emptied (``FrontendSockets.reset``: the
utility call ``reset_prefix_cache``, part of neither replay), so each finds
it as a freshly started engine has it.
"""

from __future__ import annotations

import uuid
from collections import defaultdict

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.net.relay import Observer, local_address_like
from replay_proxy.net.zmq_socket import SocketClosed, ZmqSocket
from replay_proxy.processes import OtherLoad
from replay_proxy.replay.player import Player, ReplayError, ReplayOptions, ReplayOutcome, Tally
from replay_proxy.store.session import SCORE_PREFIX, RecordedFrame, Session
from replay_proxy.wire.encode import encode, token_ids
from replay_proxy.wire.handshake import engine_identity, engine_index
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.messages import Channel, Direction, Kind, RequestType, WireDecoder
from replay_proxy.wire.values import decode_msgpack

SETTLE_S = 1.0  # after the recorded engines are ready, listen this long for unrecorded ones
# Once the engine has said it could not read something it was sent, what it still owes may never come: the wait
# for outstanding requests ends when nothing has moved for this long (it would else run out --finish-timeout).
REJECTED_QUIET_S = 5.0
RESET = "reset_prefix_cache"  # the kept engine's state a replay could see: EngineCore.reset_prefix_cache()


class EngineNotReset(ReplayError):
    """A kept engine did not empty its prefix cache: the next replay needs an engine of its own."""


def connection_events(watch: ZmqSocket) -> list[str]:
    """The monitor events ``watch`` holds, by name, in order (ACCEPTED, HANDSHAKE_SUCCEEDED, ...), but for the
    socket's own LISTENING."""
    events = []
    while True:
        try:
            event = zmq.Event(parse_monitor_message(watch.receive_nowait())["event"])
        except trio.WouldBlock:
            return events
        if event is not zmq.Event.LISTENING:
            events.append(event.name)


class FrontendSockets:
    """The sockets the player binds where the frontend would (handshake, and an input and an output per API
    server), and what crossed them in the handshake: the player's end of the engines' link."""

    def __init__(self, context: zmq.Context, api_servers: int, parallel_config: dict):
        socket = lambda kind: ZmqSocket(context, kind, linger_ms=1000)  # noqa: E731
        self.handshake = socket(zmq.ROUTER)
        self.inputs = [socket(zmq.ROUTER) for _ in range(api_servers)]
        self.outputs = [socket(zmq.PULL) for _ in range(api_servers)]
        self.parallel_config = parallel_config
        self.crossed: list[CapturedFrame] = []  # the handshake's frames and the engines' registrations
        self.engines: set[int] = set()

    def serves(self, session: Session) -> bool:
        """Whether ``session``'s replay would make the same handshake: its engines, API servers and INIT."""
        return (set(session.engines) == self.engines and len(self.inputs) == session.api_servers
                and session.parallel_config == self.parallel_config)

    async def reset(self, timeout_s: float) -> None:
        """Empty each engine's prefix cache, waiting (bounded) for its answer. What the engines sent before
        answering is left over from the replay before: dropped, with the call and its answers."""
        decoder = WireDecoder()
        for frame in self.crossed:  # learns the engines' release from their registrations
            decoder.decode(frame.channel, frame.direction, frame.parts)
        calls = {uuid.uuid4().int >> 64: engine for engine in self.engines}
        for call_id, engine in calls.items():
            await self.inputs[0].send([engine_identity(engine), RequestType.UTILITY.value,
                                       encode([0, call_id, RESET, []])])
        with trio.move_on_after(timeout_s) as waiting:
            while calls:
                message = decoder.decode(Channel.OUTPUT, Direction.TO_FRONTEND, await self.outputs[0].receive())
                utility = message.fields.get("utility_output") if isinstance(message.fields, dict) else None
                if not isinstance(utility, dict) or utility.get("call_id") not in calls:
                    continue
                engine, result = calls.pop(utility["call_id"]), utility.get("result")
                if utility.get("failure_message") or (isinstance(result, list) and result[-1] is False):
                    raise EngineNotReset(f"engine {engine} could not {RESET}: "
                                         f"{utility.get('failure_message') or 'it has blocks still in use'}")
        if waiting.cancelled_caught:
            raise EngineNotReset(f"engines {sorted(calls.values())} did not answer {RESET} within {timeout_s:g} s")

    def close(self) -> None:
        for sock in (self.handshake, *self.inputs, *self.outputs):
            sock.close()


class FrontendPlayer(Player):
    """Plays the frontend of ``session`` to the engine(s) that dial ``listen``."""

    def __init__(self, session: Session, listen: str, observer: Observer, options: ReplayOptions,
                 context: zmq.Context | None = None, *, link: FrontendSockets | None = None,
                 keep: bool = False, scoring_passes: int = 0):
        """``link``: a kept engine's (``link.serves(session)``), whose handshake is not made again; ``keep``:
        leave the link open at the end (``self.link``) for the next replay; ``scoring_passes``: teacher-forced
        scoring passes after the session."""
        super().__init__(session, observer, options, context)
        self.listen, self.link, self.keep = listen, link, keep
        self.scoring_passes = scoring_passes
        self._scored: set[str] = set()  # scoring requests that finished
        self._handshaking = False
        self._tokens: dict[str, int] = defaultdict(int)
        self._finished: set[str] = set()
        self._answered: set[int] = set()
        self._dead_on_api_servers: list[int] = []  # API servers whose output socket got ENGINE_CORE_DEAD
        self._moved = trio.Event()  # set (and renewed) on every output and every ADD sent
        self._rejected: str | None = None  # what the engine's log said it could not read (``peer_rejected``)
        self._sent_requests: set[str] = set()
        self._recorded_requests = [f.decoded["request_id"] for f in session.inputs
                                   if f.kind is Kind.ADD and isinstance(f.decoded, dict)]
        self._pending_aborts = [f for f in session.inputs if f.kind is Kind.ABORT]
        self._recorded = {r.request_id: r for r in session.requests}
        self._registered: dict[int, set[int]] = defaultdict(set)  # engine -> the API servers it registered with

    def tally(self) -> Tally:
        """Requests sent, requests finished, requests recorded, tokens received."""
        return Tally(len(self._sent_requests), len(self._finished), len(self._recorded_requests),
                     sum(self._tokens.values()))

    async def run(self) -> ReplayOutcome:
        try:
            async with trio.open_nursery() as nursery:
                if self.link is None:
                    self.link = FrontendSockets(self.context, self.session.api_servers, self.session.parallel_config)
                    self.listen = self.link.handshake.bind(self.listen)
                    self._start_reading(nursery)
                    await self._handshake()
                    with trio.move_on_after(SETTLE_S):  # an extra engine usually says HELLO by now
                        await self._refuse_extra_engines()
                else:
                    for frame in self.link.crossed:
                        self._report(frame.channel, frame.direction, frame.engine_index, frame.client_index,
                                     frame.parts, frame.ts_ns)
                    self._start_reading(nursery)
                nursery.start_soon(self._refuse_extra_engines)
                load = OtherLoad().start()  # what else the machine does while the session is timed
                await self._send_inputs()
                await self._wait_finished()
                self.outcome.other_cpu = load.share()
                scoring_from = trio.current_time()
                for scoring in range(self.scoring_passes):
                    await self._score(scoring)
                self.outcome.scoring_seconds = trio.current_time() - scoring_from
                nursery.cancel_scope.cancel()
        finally:
            if not self.keep and self.link is not None:
                self.link.close()
        return self.outcome

    def _start_reading(self, nursery: trio.Nursery) -> None:
        for client, sock in enumerate(self.link.inputs):
            nursery.start_soon(self._registrations, client, sock)
        for client, sock in enumerate(self.link.outputs):
            nursery.start_soon(self._collect, client, sock)

    def _report(self, channel: Channel, direction: Direction, engine: int | None, client: int | None,
                parts: list[bytes], ts_ns: int | None = None) -> CapturedFrame:
        frame = super()._report(channel, direction, engine, client, parts, ts_ns)
        if self._handshaking:
            self.link.crossed.append(frame)
        return frame

    async def _handshake(self) -> None:
        link, handshake = self.link, self.link.handshake
        watches = [sock.watch() for sock in link.inputs]  # what reached them, said if the engines' did not
        addresses = {
            "inputs": [s.bind(local_address_like(self.listen)) for s in link.inputs],
            "outputs": [s.bind(local_address_like(self.listen)) for s in link.outputs],
            "coordinator_input": None, "coordinator_output": None, "frontend_stats_publish_address": None,
        }
        expected, registered = set(self.session.engines), self._registered
        states: dict[int, str] = {}
        init = encode({"addresses": addresses, "parallel_config": link.parallel_config})
        self._handshaking = True
        with trio.move_on_after(self.ready_timeout) as waiting:
            while not (states.keys() == expected and all(s == "READY" for s in states.values())
                       and all(len(registered[e]) == self.session.api_servers for e in expected)):
                with trio.move_on_after(0.05):
                    identity, *frames = await handshake.receive()
                    index = engine_index(identity)
                    self._report(Channel.HANDSHAKE, Direction.TO_FRONTEND, index, None, frames)
                    status = self.decoder.decode(Channel.HANDSHAKE, Direction.TO_FRONTEND, frames).kind
                    if index not in expected:
                        raise ReplayError(
                            f"engine {index} connected, but the recording has engines {sorted(expected)}: "
                            "start as many engines as were recorded (one per data-parallel rank)")
                    if status is Kind.HELLO:
                        states[index] = "HELLO"
                        await handshake.send([identity, init])
                        self._report(Channel.HANDSHAKE, Direction.TO_ENGINE, index, None, [init])
                    elif status is Kind.READY:
                        states[index] = "READY"
        self._handshaking = False
        link.engines = expected
        seen = [connection_events(watch) for watch in watches]
        for sock, watch in zip(link.inputs, watches):
            sock.unwatch()
            watch.close()
        if waiting.cancelled_caught:
            raise ReplayError(
                f"the engine side was not ready after {self.ready_timeout:g} s: recorded engines "
                f"{sorted(expected)} x {self.session.api_servers} API server(s); handshake states "
                f"{ {e: states.get(e, 'none') for e in sorted(expected)} }, registrations "
                f"{ {e: len(registered[e]) for e in sorted(expected)} }; connections to the input socket"
                + "".join(f"\n  {address}: {', '.join(events) or 'none'}"
                          for address, events in zip(addresses["inputs"], seen)))

    async def _refuse_extra_engines(self) -> None:
        identity, *frames = await self.link.handshake.receive()
        self._report(Channel.HANDSHAKE, Direction.TO_FRONTEND, engine_index(identity), None, frames)
        raise ReplayError(
            f"engine {engine_index(identity)} connected, but the recording has engines {self.session.engines}: "
            "start as many engines as were recorded (one per data-parallel rank)")

    async def _registrations(self, client: int, sock: ZmqSocket) -> None:
        try:
            while True:
                identity, *frames = await sock.receive()
                index = engine_index(identity)
                self._registered[index].add(client)
                self._report(Channel.INPUT, Direction.TO_FRONTEND, index, client, frames)
                self.decoder.decode(Channel.INPUT, Direction.TO_FRONTEND, frames)  # learns vllm_version
        except SocketClosed:
            return

    async def _collect(self, client: int, sock: ZmqSocket) -> None:
        try:
            while True:
                frames = await sock.receive()
                message = self.decoder.decode(Channel.OUTPUT, Direction.TO_FRONTEND, frames)
                fields = message.fields if isinstance(message.fields, dict) else {}
                engine = fields.get("engine_index")
                self._report(Channel.OUTPUT, Direction.TO_FRONTEND, engine if isinstance(engine, int) else None,
                             client, frames)
                if message.kind is Kind.ENGINE_CORE_DEAD:
                    self._dead_on_api_servers.append(client)
                for output in fields.get("outputs") or []:
                    if isinstance(output, dict) and isinstance(output.get("request_id"), str):
                        if output["request_id"].startswith(SCORE_PREFIX):
                            if output.get("finish_reason") is not None:
                                self._scored.add(output["request_id"])
                            continue
                        self._tokens[output["request_id"]] += len(output.get("new_token_ids") or [])
                        if output.get("finish_reason") is not None:
                            self._finished.add(output["request_id"])
                utility = fields.get("utility_output")
                if isinstance(utility, dict):
                    self._answered.add(utility.get("call_id"))
                await self._release_aborts()
        except SocketClosed:
            return

    async def _send_inputs(self) -> None:
        inputs = self.session.inputs
        if not inputs:
            return
        start, first_ts = trio.current_time(), inputs[0].ts_ns
        for frame in inputs:
            if frame.kind is Kind.ABORT:
                continue  # sent by _release_aborts, at its requests' progress
            if self.factor is not None:
                due = start + (frame.ts_ns - first_ts) / 1e9 / self.factor
                await trio.sleep_until(due)
                self.outcome.pacing_errors_ms.append((trio.current_time() - due) * 1e3)
            await self._send(frame)
        with trio.move_on_after(self.finish_timeout):
            while self._pending_aborts and not self._dead_on_api_servers:
                await self._moved.wait()
        for frame in list(self._pending_aborts):  # never reached their progress: sent late, and reported so
            self._pending_aborts.remove(frame)
            await self._send(frame)
        self.outcome.send_seconds = trio.current_time() - start

    def _abort_due(self, frame: RecordedFrame) -> bool:
        # A request whose ADD the recording lacks (recorded mid-flight) cannot progress: not waited for.
        return all(rid in self._sent_requests and (self._tokens[rid] >= n or rid in self._finished)
                   for rid, n in frame.tokens_before_abort.items() if rid in self._recorded_requests)

    async def _release_aborts(self) -> None:
        """Send each pending ABORT whose requests reached their recorded progress, at once.

        Called right after each ADD sent and each output counted, by the task
        that changed the progress, so no other output is counted in between.
        """
        while (frame := next((f for f in self._pending_aborts if self._abort_due(f)), None)) is not None:
            self._pending_aborts.remove(frame)
            await self._send(frame)
        self._moved.set()
        self._moved = trio.Event()

    async def _send(self, frame: RecordedFrame) -> None:
        parts = self._asking(frame) if frame.kind is Kind.ADD else frame.parts
        await self._send_parts(frame.engine_index, frame.client_index or 0, parts)
        if frame.kind is Kind.ADD and isinstance(frame.decoded, dict):
            self._sent_requests.add(frame.decoded["request_id"])
            await self._release_aborts()

    async def _send_parts(self, engine: int, client: int, parts: list[bytes]) -> None:
        await self.link.inputs[client].send([engine_identity(engine), *parts])
        self._report(Channel.INPUT, Direction.TO_ENGINE, engine, client, parts)
        self.outcome.sent += 1

    def _asking(self, frame: RecordedFrame) -> list[bytes]:
        """A recorded ADD as sent: asking for the top-k logprobs the judging needs, and with
        ``--hold-lengths`` for exactly the tokens its request produced when recorded (max_tokens that many,
        and min_tokens too, one less where it ended on a stop token: EOS or a stop token stays possible
        there, so a faithful engine ends as recorded). Unchanged when neither applies."""
        top = self.options.rules.judging.top_logprobs
        if not isinstance(frame.decoded, dict):  # an ADD that did not decode: resent as it was recorded
            return frame.parts
        body = decode_msgpack(frame.parts[1])
        params = body[self.session.schema.position("EngineCoreRequest", "sampling_params")]
        if not isinstance(params, dict):  # a pooling request
            return frame.parts
        before = dict(params)
        recorded = self._recorded.get(frame.decoded.get("request_id"))
        if self.options.hold_lengths and recorded and recorded.tokens:  # (no output recorded: nothing to hold)
            tokens = len(recorded.tokens)
            params.update(max_tokens=tokens, min_tokens=tokens - 1 if recorded.finish_reason == "stop" else tokens)
        if top and (params.get("logprobs") or 0) < top:
            params["logprobs"] = top
        return frame.parts if params == before else [frame.parts[0], encode(body), *frame.parts[2:]]

    async def _score(self, scoring: int) -> None:
        """One teacher-forced scoring pass (the module's docstring): the requests at once, then a wait
        (bounded) for each to finish."""
        adds = [f for f in self.session.inputs if f.kind is Kind.ADD and isinstance(f.decoded, dict)]
        sent = []
        for frame in adds if scoring % 2 == 0 else reversed(adds):
            request_id = f"{SCORE_PREFIX}{scoring}-{frame.decoded['request_id']}"
            parts = self._scoring(frame, request_id)
            if parts is not None:
                await self._send_parts(frame.engine_index, frame.client_index or 0, parts)
                sent.append(request_id)
        with trio.move_on_after(self.finish_timeout):
            while not self._scored.issuperset(sent):
                await self._moved.wait()

    def _scoring(self, frame: RecordedFrame, request_id: str) -> list[bytes] | None:
        """The scoring request of a recorded ADD: its prompt and recorded output as the prompt, one token
        asked for, the top-k prompt logprobs; None for a request that cannot be scored (no tokens, a prompt
        of embeddings or multimodal features, longer than the engine's context)."""
        schema, body = self.session.schema, decode_msgpack(frame.parts[1])
        fields = schema.structs["EngineCoreRequest"].by_name
        at = {name: field.position for name, field in fields.items() if field.position < len(body)}
        recorded = self._recorded.get(frame.decoded["request_id"])
        params = body[at["sampling_params"]]
        limit = (self.session.registrations or [{}])[0].get("max_model_len") or 0
        if (recorded is None or not recorded.tokens or not recorded.prompt or not isinstance(params, dict)
                or any(body[at[name]] for name in ("mm_features", "prompt_embeds") if name in at)
                or len(recorded.prompt) + len(recorded.tokens) >= limit):
            return None
        scoring = {"temperature": 0.0, "max_tokens": 1, "min_tokens": 0, "logprobs": None, "stop_token_ids": [],
                   "prompt_logprobs": self.options.rules.judging.top_logprobs, "seed": None, "n": 1,
                   "structured_outputs": None, "guided_decoding": None, "skip_reading_prefix_cache": True}
        known = schema.structs["SamplingParams"].by_name
        params.update({k: v for k, v in scoring.items() if k in known})
        aux: list[bytes] = []
        body[at["request_id"]] = request_id
        body[at["prompt_token_ids"]] = token_ids(fields["prompt_token_ids"], recorded.prompt + recorded.tokens, aux)
        for name, value in (("external_req_id", request_id), ("block_hashes", None), ("prompt_is_token_ids", None)):
            if name in at:
                body[at[name]] = value
        return [frame.parts[0], encode(body), *aux]

    def peer_rejected(self, said: str) -> None:
        """The engine's log says it could not read something it was sent (``said``): from here on, the wait for
        outstanding requests ends once nothing has moved for ``REJECTED_QUIET_S``."""
        self._rejected = said
        self._moved.set()
        self._moved = trio.Event()

    async def _wait_finished(self) -> None:
        """Wait (bounded) for every request to finish or be aborted and every call to be answered; after the
        engine said it rejected something, only while what it owes still comes (``peer_rejected``)."""
        inputs = self.session.inputs
        aborted = {rid for f in inputs if f.kind is Kind.ABORT for rid in f.decoded["request_ids"]}
        calls = {f.decoded["call_id"] for f in inputs if f.kind is Kind.UTILITY and isinstance(f.decoded, dict)}
        done = lambda r: r in self._finished or r in aborted  # noqa: E731
        pending = lambda: ([r for r in self._recorded_requests if not done(r)], calls - self._answered)  # noqa: E731
        quiet = False  # nothing moved for REJECTED_QUIET_S after a rejection
        with trio.move_on_after(self.finish_timeout) as waiting:
            # (a dead engine answers nothing more: vLLM's frontend fails every request then, and so does this)
            while any(pending()) and not self._dead_on_api_servers and not quiet:
                with trio.move_on_after(REJECTED_QUIET_S if self._rejected else float("inf")) as idle:
                    await self._moved.wait()
                quiet = idle.cancelled_caught
        unfinished, unanswered = pending()
        self.outcome.finished = sum(r in self._finished for r in self._recorded_requests)
        self.outcome.tokens = sum(self._tokens.values())
        if waiting.cancelled_caught or quiet:
            why = (f"stopped waiting {REJECTED_QUIET_S:g} s after the engine said it could not read what it was "
                   f"sent and nothing moved" if quiet else f"stopped waiting after {self.finish_timeout:g} s")
            self.outcome.findings.append(Finding(
                "replay", Severity.INFO, Code.FINISH_TIMEOUT,
                f"{why}: {len(unfinished)} request(s) unfinished, {len(unanswered)} utility call(s) unanswered",
                candidate=unfinished[:10]))
        for client in self._dead_on_api_servers:
            self.outcome.findings.append(Finding("behaviour", Severity.REGRESSION, Code.ENGINE_DEAD,
                                                 f"ENGINE_CORE_DEAD on the output socket of API server {client}"))
