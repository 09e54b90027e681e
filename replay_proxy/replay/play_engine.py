"""Replay against a new frontend build: the proxy plays the recorded engine(s).

Theory of operation. For each recorded engine the proxy dials the frontend's
handshake ROUTER with the recorded identity and sends the recorded HELLO;
the frontend's INIT names its input and output sockets (its shape must match
the recording: one pair per recorded API server). The proxy connects a
DEALER and a PUSH to each, sends the recorded REGISTRATION and READY as raw
bytes, and waits for the frontend's HTTP API. Then it drives the frontend as
users did: one HTTP request per recorded request (prompt as token ids, the
recorded sampling parameters and structured outputs, streaming as recorded,
a recorded client-side abort as an early disconnect; a pooling request as an
embedding of its prompt; a LoRA request naming its adapter as the model), at
the recorded pacing. A LoRA adapter the recorded frontend loaded (its ``add_lora`` call)
is loaded through this frontend's API at the same place, before any later
request is sent.

Each ADD the frontend produces is matched to its recorded request (prompt and
effective sampling values), compared field by field, and answered with the
recorded outputs of that request: the recorded output messages, cut down to
that request and with only its request id patched, at the recorded delays.
Utility calls are answered from the recording by method. What the HTTP client
gets back is checked against the recorded tokens and finish reason, or the
recorded pooled values.
"""

from __future__ import annotations

import functools
import json
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import trio
import zmq

from replay_proxy.compare.codes import Code
from replay_proxy.compare.findings import Finding, Severity
from replay_proxy.net.relay import Observer
from replay_proxy.net.zmq_socket import SocketClosed, ZmqSocket
from replay_proxy.processes import OtherLoad
from replay_proxy.replay.player import Player, ReplayError, ReplayOptions, ReplayOutcome, Tally, UserSaw
from replay_proxy.replay.text import PromptForm, Texts, TokenizerError, rejects_token_prompts
from replay_proxy.store.session import RecordedFrame, Session, request_key
from replay_proxy.wire.encode import encode
from replay_proxy.wire.handshake import engine_identity, parse_init
from replay_proxy.wire.messages import Channel, Direction, Kind
from replay_proxy.wire.values import decode_msgpack, token_ids

# Recorded sampling params that become OpenAI completion parameters of the same name.
HTTP_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "n",
               "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
               "min_tokens")


class EnginePlayer(Player):
    """Plays the engines of ``session`` to the frontend whose handshake is ``upstream`` and API ``http``."""

    def __init__(self, session: Session, upstream: str, http: str, observer: Observer, options: ReplayOptions,
                 context: zmq.Context | None = None):
        super().__init__(session, observer, options, context)
        self.upstream = upstream
        self.http = http.rstrip("/")
        self._outputs: dict[tuple[int, int], ZmqSocket] = {}  # (engine, client) -> PUSH
        self._adds = [f for f in session.inputs if f.kind is Kind.ADD]
        # What users did, in order: the requests, and the LoRA adapters they loaded through the API.
        self._user_actions = [f for f in session.inputs if f.kind is Kind.ADD or _loaded_adapter(f)]
        self._unmatched = list(self._adds)
        self._recorded_outputs = _outputs_by_request(session)
        self._utility_results = _utility_results(session)
        self._streams: dict[str, trio.Event] = {}  # open engine-side streams by the frontend's request id: ABORTed
        self._stream_ended = trio.Event()
        # Prompts as text (replay/text.py): the model's tokenizer once they are, and by recorded request id the
        # tokens its prompt's text encodes to where they are not the recorded ones.
        self._texts: Texts | None = None
        self._retokenized: dict[str, list[int]] = {}
        # Recorded request id -> seq of the first ABORT that named it.
        self._abort_seq: dict[str, int] = {}
        for frame in session.inputs:
            if frame.kind is Kind.ABORT:
                for rid in frame.tokens_before_abort:
                    self._abort_seq.setdefault(rid, frame.seq)

    def tally(self) -> Tally:
        """Requests sent (HTTP), requests answered, requests recorded, tokens users got."""
        tokens = sum(len(seen.token_ids) for seen in self.outcome.http.values())
        return Tally(len(self._adds) - len(self._unmatched), len(self.outcome.http), len(self._adds), tokens)

    async def run(self) -> ReplayOutcome:
        try:
            async with trio.open_nursery() as nursery:
                with trio.move_on_after(self.ready_timeout) as waiting:
                    for engine in self.session.engines:
                        await self._handshake(engine, nursery)
                    model = await self._wait_http_ready()
                if self.options.prompts is PromptForm.TEXT:
                    self._as_text(model, "asked for (--prompts text)")
                if waiting.cancelled_caught:
                    raise ReplayError(f"the frontend was not ready {self.ready_timeout:g} s after the recorded "
                                      "registration and READY: see its log for what it rejected")
                load = OtherLoad().start()  # what else the machine does while the session is timed
                async with trio.open_nursery() as clients:
                    start = trio.current_time()
                    first = self._user_actions[0].ts_ns if self._user_actions else 0
                    for frame in self._user_actions:
                        if self.factor is not None:
                            await trio.sleep_until(start + (frame.ts_ns - first) / 1e9 / self.factor)
                        if frame.kind is Kind.ADD:
                            clients.start_soon(self._http_request, model, frame)
                        else:  # the requests after it may name the adapter: loaded first
                            await self._load_adapter(_loaded_adapter(frame))
                with trio.move_on_after(self.finish_timeout):  # e.g. the ABORT that follows a disconnect
                    while self._streams:
                        await self._stream_ended.wait()
                self.outcome.other_cpu = load.share()
                nursery.cancel_scope.cancel()
        finally:
            self._close()
        self.outcome.findings += self._request_findings()
        self.outcome.sent, self.outcome.finished, _, self.outcome.tokens = self.tally()
        return self.outcome

    # --- the engine side --------------------------------------------------------------------

    def _recorded(self, kind: Kind, engine: int, client: int | None = None) -> RecordedFrame:
        frames = [f for f in self.session.handshake if f.kind == kind and f.engine_index == engine]
        return next((f for f in frames if client is None or f.client_index == client), frames[0])

    async def _handshake(self, engine: int, nursery: trio.Nursery) -> None:
        identity = engine_identity(engine)
        handshake = self._socket(zmq.DEALER, identity)
        handshake.connect(self.upstream)
        hello = self._recorded(Kind.HELLO, engine)
        await handshake.send(hello.parts)
        self._report(Channel.HANDSHAKE, Direction.TO_FRONTEND, engine, None, hello.parts)
        init = await handshake.receive()
        self._report(Channel.HANDSHAKE, Direction.TO_ENGINE, engine, None, init)
        self._compare_init(init[0])
        _, addresses = parse_init(init[0])
        if len(addresses.inputs) != self.session.api_servers:
            raise ReplayError(f"the frontend has {len(addresses.inputs)} API server socket(s), the recording "
                              f"{self.session.api_servers}: run it with the recorded number of API servers")
        for client, (input_address, output_address) in enumerate(zip(addresses.inputs, addresses.outputs)):
            dealer = self._socket(zmq.DEALER, identity)
            dealer.connect(input_address)
            push = self._socket(zmq.PUSH)
            push.connect(output_address)
            self._outputs[(engine, client)] = push
            registration = self._recorded(Kind.REGISTRATION, engine, client)
            await dealer.send(registration.parts)
            self._report(Channel.INPUT, Direction.TO_FRONTEND, engine, client, registration.parts)
            nursery.start_soon(self._serve, engine, client, dealer)
        ready = self._recorded(Kind.READY, engine)
        await handshake.send(ready.parts)
        self._report(Channel.HANDSHAKE, Direction.TO_FRONTEND, engine, None, ready.parts)

    def _compare_init(self, payload: bytes) -> None:
        recorded = self._recorded(Kind.INIT, self.session.engines[0]).decoded or {}
        new = decode_msgpack(payload)
        for key in sorted(set(recorded) ^ set(new)):
            self.outcome.findings.append(Finding(
                "schema", Severity.WARNING, Code.INIT_KEY_CHANGED,
                f"INIT {'lacks' if key in recorded else 'has a new key'} {key!r}", message_kind="INIT",
                struct="EngineHandshakeMetadata", field=key))
        if recorded.get("parallel_config") != new.get("parallel_config"):
            self.outcome.findings.append(Finding(
                "behaviour", Severity.WARNING, Code.INIT_PARALLEL_CONFIG_CHANGED,
                "INIT parallel_config differs from the recording", message_kind="INIT",
                baseline=recorded.get("parallel_config"), candidate=new.get("parallel_config")))

    async def _serve(self, engine: int, client: int, dealer: ZmqSocket) -> None:
        try:
            async with trio.open_nursery() as streams:
                while True:
                    frames = await dealer.receive()
                    self._report(Channel.INPUT, Direction.TO_ENGINE, engine, client, frames)
                    message = self.decoder.decode(Channel.INPUT, Direction.TO_ENGINE, frames)
                    if message.kind is Kind.ADD:
                        self._answer_add(engine, message.fields, streams)
                    elif message.kind is Kind.ABORT:
                        for request_id in message.fields["request_ids"]:
                            if request_id in self._streams:
                                self._streams[request_id].set()
                    elif message.kind is Kind.UTILITY:
                        await self._answer_utility(engine, client, message.fields)
        except SocketClosed:
            return

    def _answer_add(self, engine: int, fields: dict, streams: trio.Nursery) -> None:
        recorded = self._match(fields)
        request_id = fields["request_id"]
        if recorded is None:
            self.outcome.findings.append(Finding(
                "behaviour", Severity.REGRESSION, Code.REQUEST_UNEXPECTED,
                f"the frontend sent a request ({len(token_ids(fields.get('prompt_token_ids')) or [])} prompt tokens) "
                "that matches no recorded one", message_kind="ADD", request_id=request_id))
            return
        self._streams[request_id] = trio.Event()
        client = fields.get("client_index") or 0
        streams.start_soon(self._stream_outputs, engine, client, recorded, request_id)

    def _match(self, fields: dict) -> RecordedFrame | None:
        """The recorded ADD that asked for what ``fields`` asks for (``store/session.request_key``)."""
        keys = self.options.rules.match_sampling_keys
        key = lambda request: request_key(self.decoder.schema, token_ids(request.get("prompt_token_ids")),  # noqa: E731
                                          request.get("sampling_params") or {}, keys)
        wanted = key(fields)
        for frame in self._unmatched:
            if key(frame.decoded) == wanted:
                self._unmatched.remove(frame)
                return frame
        for frame in self._unmatched:  # a prompt sent as text that does not encode back to the recorded tokens
            again = self._retokenized.get(frame.decoded["request_id"])
            if again is not None and key({**frame.decoded, "prompt_token_ids": again}) == wanted:
                self._unmatched.remove(frame)
                recorded = token_ids(frame.decoded["prompt_token_ids"])
                differs = next((i for i, (a, b) in enumerate(zip(again, recorded)) if a != b),
                               min(len(again), len(recorded)))
                self.outcome.findings.append(Finding(
                    "behaviour", Severity.WARNING, Code.PROMPT_RETOKENIZED,
                    f"the prompt sent as text came to the engine as {len(again)} tokens, recorded as "
                    f"{len(recorded)}, first differing at position {differs}: the text does not encode back to the "
                    "recorded tokens (a re-tokenization, not the frontend's)",
                    message_kind="ADD", request_id=frame.decoded["request_id"], baseline=recorded[:8],
                    candidate=again[:8]))
                return frame
        return None

    async def _stream_outputs(self, engine: int, client: int, recorded: RecordedFrame, request_id: str) -> None:
        """The recorded outputs of ``recorded``, as the frontend's ``request_id``, at the recorded delays.

        A request the recorded frontend aborted is held where its ABORT crossed
        (its recorded progress) until this frontend's ABORT comes (at most the
        rules' ``abort_wait_s``); then what was in flight in the recording
        follows. So the ABORT lands where it was recorded, however fast the
        frontend under test notices its client's disconnect.
        """
        start = trio.current_time()
        rid = recorded.decoded["request_id"]
        aborted = self._streams[request_id]
        held_until = None  # (a frontend that never aborts it holds it no longer: rules abort_wait_s)
        for frame, position in self._recorded_outputs.get(rid, []):
            if frame.seq > self._abort_seq.get(rid, frame.seq):
                held_until = held_until or trio.current_time() + self.options.rules.abort_wait_s
                with trio.move_on_at(held_until):
                    await aborted.wait()
            elif self.factor is not None:
                await trio.sleep_until(start + (frame.ts_ns - recorded.ts_ns) / 1e9 / self.factor)
            body = decode_msgpack(frame.parts[0])
            outputs = self._position("outputs")
            output = list(body[outputs][position])
            output[self.session.schema.position("EngineCoreOutput", "request_id")] = request_id  # must change
            body[outputs] = [output]
            body[self._position("scheduler_stats")] = None  # they went out once, with the batch they belonged to
            body[self._position("timestamp")] = time.monotonic()  # an engine stamps its outputs as it makes them
            finished = self._position("finished_requests")
            if len(body) > finished and body[finished]:
                body[finished] = [request_id] if rid in body[finished] else None
            parts = [encode(body), *frame.parts[1:]]
            await self._outputs[(engine, client)].send(parts)
            self._report(Channel.OUTPUT, Direction.TO_FRONTEND, engine, client, parts)
        if rid in self._abort_seq:  # the recorded engine was still generating when the ABORT came
            with trio.move_on_at(held_until or trio.current_time() + self.options.rules.abort_wait_s):
                await aborted.wait()
        del self._streams[request_id]
        self._stream_ended.set()
        self._stream_ended = trio.Event()

    async def _answer_utility(self, engine: int, client: int, fields: dict) -> None:
        method, call_id = fields["method"], fields["call_id"]
        recorded = self._utility_results.get(method)
        if recorded is None:
            self.outcome.findings.append(Finding(
                "behaviour", Severity.WARNING, Code.UTILITY_CALL_UNEXPECTED,
                f"the frontend called {method!r}, which the recorded frontend never did; answered with a failure",
                message_kind="UTILITY", field=method))
            utility = [None] * len(self.session.schema.structs["UtilityOutput"].fields)
            utility[self.session.schema.position("UtilityOutput", "failure_message")] = \
                f"{method} is not in the recording"
            body: list = [None] * (self._position("utility_output") + 1)
            for field, value in (("engine_index", engine), ("outputs", []), ("timestamp", 0.0)):
                body[self._position(field)] = value
        else:
            body = decode_msgpack(recorded.parts[0])
            utility = list(body[self._position("utility_output")])
        utility[self.session.schema.position("UtilityOutput", "call_id")] = call_id
        body[self._position("utility_output")] = utility
        parts = [encode(body)]
        await self._outputs[(engine, client)].send(parts)
        self._report(Channel.OUTPUT, Direction.TO_FRONTEND, engine, client, parts)

    def _position(self, field: str) -> int:
        """Where ``field`` stands in an EngineCoreOutputs of the recorded release."""
        return self.session.schema.position("EngineCoreOutputs", field)

    # --- the user side ----------------------------------------------------------------------

    async def _wait_http_ready(self) -> str:
        """Poll /v1/models until it answers; return the served model's name."""
        while True:
            try:
                models = await trio.to_thread.run_sync(_get_json, f"{self.http}/v1/models", 2.0)
                return models["data"][0]["id"]
            except (OSError, ValueError, KeyError, IndexError):
                await trio.sleep(0.5)

    async def _http_request(self, model: str, frame: RecordedFrame) -> None:
        recorded = frame.decoded
        aborted_after = next((f.tokens_before_abort[recorded["request_id"]] for f in self.session.inputs
                              if f.seq == self._abort_seq.get(recorded["request_id"])), None)
        if recorded.get("pooling_params") is not None:  # a pooling request: the prompt's tokens embedded
            seen = await self._ask(functools.partial(embedding, f"{self.http}/v1/embeddings", {
                "model": model, "input": token_ids(recorded["prompt_token_ids"])}, self.finish_timeout))
        else:
            # (only a prompt of token ids has text to send instead: not prompt embeddings)
            as_tokens = self._texts is None and bool(token_ids(recorded["prompt_token_ids"]))
            seen = await self._ask(self._completion(model, recorded, aborted_after))
            if (as_tokens and self.options.prompts is PromptForm.AUTO and rejects_token_prompts(seen.error)
                    and self._as_text(model, seen.error)):
                seen = await self._ask(self._completion(model, recorded, aborted_after))  # (it never reached one)
        seen.aborted_after = aborted_after
        self.outcome.http[recorded["request_id"]] = seen

    def _completion(self, model: str, recorded: dict, aborted_after: int | None):
        """The completion a recorded request's user asked for, its prompt as this frontend takes it."""
        params = recorded.get("sampling_params") or {}
        lora = recorded.get("lora_request")
        body = {"model": lora["lora_name"] if lora else model, "prompt": self._prompt(recorded),
                "return_token_ids": True, **{k: params[k] for k in HTTP_PARAMS if k in params}}
        if params.get("structured_outputs"):  # what it asked for, not what the frontend chose (_backend)
            body["structured_outputs"] = {k: v for k, v in params["structured_outputs"].items()
                                          if not k.startswith("_") and v is not None}
        delta = self.decoder.schema.enums["RequestOutputKind"]["DELTA"]  # what a streaming client asks for
        stream = params.get("output_kind") == delta or aborted_after is not None
        before_abort = None
        if aborted_after is not None and self._texts is not None:
            tokens = [t for o in self._recorded_outputs.get(recorded["request_id"], []) for t in _output_tokens(o)]
            before_abort = len(_complete(self._texts.text(tokens[:aborted_after])))
        return functools.partial(completion, f"{self.http}/v1/completions", body, stream, aborted_after,
                                 self.finish_timeout, before_abort)

    async def _ask(self, ask) -> UserSaw:
        """What the HTTP client gets from ``ask``, within the finish timeout."""
        with trio.move_on_after(self.finish_timeout):
            try:
                return await trio.to_thread.run_sync(ask, abandon_on_cancel=True)
            except (OSError, ValueError) as exc:
                return UserSaw(error=f"{type(exc).__name__}: {exc}")
        return UserSaw(error=f"no complete response within {self.finish_timeout:g} s")

    def _prompt(self, recorded: dict) -> list[int] | str:
        """A recorded request's prompt as this frontend takes it: its token ids, or their text (noting the tokens
        the text encodes to where they are not the recorded ones: ``_match`` finds the request by them)."""
        prompt = token_ids(recorded["prompt_token_ids"])
        if self._texts is None or not prompt:  # (a prompt of embeddings goes as it was recorded)
            return prompt
        text = self._texts.text(prompt)
        if (again := self._texts.tokens(text)) != prompt:
            self._retokenized[recorded["request_id"]] = again
        return text

    def _as_text(self, model: str, why: str | None) -> bool:
        """Send prompts as text from now on (once, with a finding that says why); False where they cannot be:
        a redacted recording's tokens have no text, and a model with no tokenizer here has none to give."""
        if self._texts is not None:
            return True
        if self.session.redacted:
            cannot = "a redacted recording's prompts are pseudonyms, with no text: it needs token-id prompts"
        else:
            try:
                self._texts = Texts(self.options.tokenizer or Path(model))
            except TokenizerError as exc:
                cannot = str(exc)
        if self._texts is None:
            self.outcome.findings.append(Finding("behaviour", Severity.REGRESSION, Code.PROMPT_AS_TEXT,
                                                 f"prompts cannot be sent as text: {cannot} ({why})"))
            return False
        self.outcome.findings.append(Finding(
            "behaviour", Severity.INFO, Code.PROMPT_AS_TEXT,
            f"prompts sent as text, detokenized with {self._texts.path}: {why}"))
        return True

    async def _load_adapter(self, lora: dict) -> None:
        """Load the LoRA adapter the recorded frontend loaded, as its user did (the frontend's add_lora call,
        answered from the recording); a failure is a finding, and the requests naming it fail after it."""
        body = {"lora_name": lora["lora_name"], "lora_path": lora["lora_path"]}
        with trio.move_on_after(self.finish_timeout) as waiting:
            failure = await trio.to_thread.run_sync(load_adapter, f"{self.http}/v1/load_lora_adapter", body,
                                                    self.finish_timeout, abandon_on_cancel=True)
        if waiting.cancelled_caught:
            failure = f"no answer within {self.finish_timeout:g} s"
        if failure is not None:
            self.outcome.findings.append(Finding(
                "behaviour", Severity.REGRESSION, Code.HTTP_FAILED,
                f"loading the LoRA adapter {lora['lora_name']!r} through the API failed: {failure}",
                message_kind="UTILITY", field="add_lora"))

    def _request_findings(self) -> list[Finding]:
        """What the users saw, and how the new frontend's requests differ from the recorded ones."""
        findings = []
        for frame in self._adds:
            rid = frame.decoded["request_id"]
            seen = self.outcome.http.get(rid, UserSaw(error="never sent"))
            tokens = [t for o in self._recorded_outputs.get(rid, []) for t in _output_tokens(o)]
            finish = next((_finish(o, self.decoder.schema) for o in self._recorded_outputs.get(rid, [])
                           if _finish(o, self.decoder.schema)), None)
            if seen.error is not None:
                findings.append(Finding("behaviour", Severity.REGRESSION, Code.HTTP_FAILED,
                                        f"the HTTP request failed: {seen.error}", request_id=rid))
            elif seen.embedding is not None:
                recorded = next(filter(None, map(_pooled_values, self._recorded_outputs.get(rid, []))), [])
                if seen.embedding != recorded:  # float32 on the wire: the same floats in the JSON
                    findings.append(Finding(
                        "behaviour", Severity.REGRESSION, Code.HTTP_RESPONSE_DIFFERS,
                        f"the user got an embedding of {len(seen.embedding)} values, the recorded engine "
                        f"pooled {len(recorded)}, and they differ", request_id=rid,
                        baseline=recorded[:4], candidate=seen.embedding[:4]))
            elif seen.aborted_after is None and not seen.token_ids and tokens and self._texts is not None:
                if (_complete(seen.text or ""), seen.finish_reason) != (_complete(self._texts.text(tokens)), finish):
                    findings.append(Finding(
                        "behaviour", Severity.REGRESSION, Code.HTTP_RESPONSE_DIFFERS,
                        f"the user got {seen.text!r} ({seen.finish_reason}), the recorded engine's tokens are "
                        f"{self._texts.text(tokens)!r} ({finish})", request_id=rid))
            elif seen.aborted_after is None and (seen.token_ids, seen.finish_reason) != (tokens, finish):
                findings.append(Finding(
                    "behaviour", Severity.REGRESSION, Code.HTTP_RESPONSE_DIFFERS,
                    f"the user got {len(seen.token_ids)} tokens ({seen.finish_reason}), the recorded engine "
                    f"produced {len(tokens)} ({finish})", request_id=rid,
                    baseline=tokens[:8], candidate=seen.token_ids[:8]))
        return findings


def _outputs_by_request(session: Session) -> dict[str, list[tuple[RecordedFrame, int]]]:
    """Recorded output messages per request id, with the position of its output in each."""
    by_request: dict[str, list[tuple[RecordedFrame, int]]] = defaultdict(list)
    for frame in session.outputs:
        for position, output in enumerate((frame.decoded or {}).get("outputs") or []):
            by_request[output["request_id"]].append((frame, position))
    return by_request


def _utility_results(session: Session) -> dict[str, RecordedFrame]:
    calls = {f.decoded["call_id"]: f.decoded["method"] for f in session.inputs if f.kind is Kind.UTILITY}
    results = {}
    for frame in session.outputs:
        utility = (frame.decoded or {}).get("utility_output") if frame.kind is Kind.UTILITY_OUTPUT else None
        if utility and utility.get("call_id") in calls:
            results.setdefault(calls[utility["call_id"]], frame)
    return results


def _loaded_adapter(frame: RecordedFrame) -> dict | None:
    """The LoRARequest of a recorded ``add_lora`` call (what a user's load through the API sends)."""
    if frame.kind is not Kind.UTILITY or (frame.decoded or {}).get("method") != "add_lora":
        return None
    return (frame.decoded.get("args") or [None])[0]


def _complete(text: str) -> str:
    """A completion's text without the replacement characters that end it: the bytes of a character its tokens
    did not finish, which a detokenizer that streams holds back."""
    return text.rstrip("\ufffd")


def _output_tokens(entry: tuple[RecordedFrame, int]) -> list[int]:
    frame, position = entry
    return frame.decoded["outputs"][position].get("new_token_ids") or []


def _pooled_values(entry: tuple[RecordedFrame, int]) -> list[float] | None:
    frame, position = entry
    tensor = frame.decoded["outputs"][position].get("pooling_output")
    return tensor.values if tensor is not None else None


def _finish(entry: tuple[RecordedFrame, int], schema) -> str | None:
    frame, position = entry
    return schema.finish_name(frame.decoded["outputs"][position].get("finish_reason"))


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def _failure(exc: urllib.error.HTTPError) -> str:
    """What a user sees of a request the frontend refused: its status and the start of its body."""
    return f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"


def load_adapter(url: str, body: dict, timeout: float) -> str | None:
    """Load a LoRA adapter through the frontend's API: None, or why it failed."""
    try:
        with urllib.request.urlopen(_post(url, body), timeout=timeout):
            return None
    except urllib.error.HTTPError as exc:
        return _failure(exc)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def embedding(url: str, body: dict, timeout: float) -> UserSaw:
    """One embedding as an HTTP client sees it."""
    try:
        with urllib.request.urlopen(_post(url, body), timeout=timeout) as response:
            return UserSaw(embedding=json.load(response)["data"][0]["embedding"])
    except urllib.error.HTTPError as exc:
        return UserSaw(error=_failure(exc))


def completion(url: str, body: dict, stream: bool, stop_after_tokens: int | None, timeout: float,
               stop_after_text: int | None = None) -> UserSaw:
    """One completion as an HTTP client sees it; with ``stop_after_tokens``, disconnect early (an abort). Its
    text too, for a frontend that does not return token ids (``return_token_ids`` is vLLM's): it disconnects
    once it has ``stop_after_text`` characters (the text of the tokens before the recorded abort)."""
    try:
        with urllib.request.urlopen(_post(url, {**body, "stream": stream}), timeout=timeout) as response:
            if not stream:
                choice = json.load(response)["choices"][0]
                return UserSaw(token_ids=choice.get("token_ids") or [], finish_reason=choice.get("finish_reason"),
                               text=choice.get("text"))
            tokens, text, finish = [], "", None
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    tokens += choice.get("token_ids") or []
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
                if stop_after_tokens is not None and (len(tokens) >= stop_after_tokens or not tokens and (
                        stop_after_text is not None and len(text) >= stop_after_text)):
                    break  # closing the connection makes the frontend abort the request
            return UserSaw(token_ids=tokens, finish_reason=finish, text=text)
    except urllib.error.HTTPError as exc:
        return UserSaw(error=_failure(exc))
