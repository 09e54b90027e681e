"""Redacting captured frames: the wire values walked with the release's schema and the policy, re-encoded.

Sans-IO: ``Redactor.frames`` takes frames in seq order and gives back their
redacted copies, which the writer then tabulates like any others, so what the
tables say is what ``raw`` holds and what a replay sends.

Token ids are redacted in the context of their request: its prompt, then
its outputs in order (``tokens.py``). An output can reach the redactor before
its request's ADD (the two cross the proxy on different links, copied by
different forwarders): such outputs wait, and every output after them, until
the ADD comes, or ``WAIT_FRAMES`` later (or at the end) go on with a context
drawn from the request id alone, counted as ``outputs_without_prompt``.

Whatever cannot be walked (a frame that does not decode, a value of another
kind than its schema says, a field or aux frame the policy does not reach) is
blanked and counted: default deny.

A busy engine's traffic takes fast paths that give what the walk would
(``tests/redact``: the two agree), in C on the frames' msgpack (``_chain.c``):
a step whose fields besides its outputs the walk gives back as they are is
never decoded (``_plain_step``), and an ADD whose fields besides its prompt
and ids are so is not walked (``_plain_request``).
"""

from __future__ import annotations

import collections
import enum
import hashlib
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Literal

import msgspec

from replay_proxy.redact import _chain
from replay_proxy.redact.policy import Action, Policy
from replay_proxy.redact.tokens import Key, Prefix, RedactionError, TokenMap
from replay_proxy.wire.capture import CapturedFrame, EngineLoss
from replay_proxy.wire.messages import ENGINE_CORE_DEAD, Channel, Direction, RequestType
from replay_proxy.wire.schema import Field, read
from replay_proxy.wire.registry import schema_for
from replay_proxy.wire.values import RAW_VIEW, Ext, decode_msgpack, kind_of

WAIT_FRAMES = 10_000  # outputs waiting for their request's ADD, at most
ENDED_KEPT = 4_096  # contexts of ended requests kept for outputs that follow their end (an ABORT's last step)
_encode = msgspec.msgpack.Encoder().encode

# Token fields whose context is a position of their request: the others are token lists of no position.
_PROMPT, _OUTPUT = ("EngineCoreRequest", "prompt_token_ids"), ("EngineCoreOutput", "new_token_ids")
_OUTPUT_CANDIDATES = ("LogprobsLists", "logprob_token_ids")
_PROMPT_CANDIDATES = ("LogprobsTensors", "logprob_token_ids")
_STOP_TOKENS = ("_eos_token_id", "_all_stop_token_ids", "stop_token_ids")


class Hasher:
    """Keyed, deterministic hashes of text: equal stays equal under one key."""

    def __init__(self, key: Key):
        self._key = key.subkey(b"hash")
        self.known: dict[str, str] = {}  # what was hashed lately

    def text(self, text: str) -> str:
        hashed = self.known.get(text)
        if hashed is None:
            if len(self.known) > 100_000:  # request ids come back every step; this only spares work
                self.known.clear()
            digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), key=self._key, digest_size=12)
            hashed = self.known[text] = f"h-{digest.hexdigest()}"
        return hashed

    def data(self, data: bytes) -> bytes:
        """Bytes keyed to bytes of the same length (a digest: 0.34.0's ``none_hash``), up to 64 of them."""
        return hashlib.blake2b(data, key=self._key, digest_size=len(data)).digest()


class Pending(enum.Enum):
    """What a frame's redaction gives instead of its copy when the copy cannot be made yet (h11's NEED_DATA)."""

    WAIT_FOR_ADD = "outputs of a request whose ADD has not come"


WAIT_FOR_ADD = Pending.WAIT_FOR_ADD
Redacted = list[bytes] | Literal[Pending.WAIT_FOR_ADD]


class Context:
    """One request's place in the token chain."""

    __slots__ = ("prefix", "fixed", "prompt_states", "prompt_rows", "output_states")

    def __init__(self, prefix: Prefix, fixed: frozenset[int], keep_prompt_states: bool = False):
        self.prefix, self.fixed = prefix, fixed  # the tokens so far, and the tokens that stay as they are
        self.prompt_states: list[bytes] | None = [] if keep_prompt_states else None  # for prompt logprobs
        self.prompt_rows = 0  # prompt logprob rows seen (they come in chunks)
        self.output_states: list[bytes] = []  # the contexts of the last output's tokens


class Walk:
    """One frame's walk through its values: what it has redacted so far, and where in the frame it is."""

    __slots__ = ("payload", "visited", "current", "engine", "client", "call_id")

    def __init__(self, payload: list[bytes], engine: int | None = None, client: int | None = None):
        self.payload = payload  # the frame's body and aux frames, as redacted so far
        self.visited: set[int] = set()  # aux frames a walked field reached
        self.current: Context | None = None  # the request whose fields are being walked
        self.engine, self.client = engine, client  # of the EngineCoreOutputs being walked ...
        self.call_id: Any = None  # ... and the utility call it answers


class Redactor:
    """Redacts one session's frames (see the module's docstring). It holds the session's state (the
    requests' contexts, the calls, the outputs waiting); each frame's own is a ``Walk``."""

    def __init__(self, key: Key, policy: Policy, vocab_size: int, vllm_version: str | None = None):
        self.tokens = TokenMap(key, vocab_size)
        self.policy = policy
        self.hasher, self._noise_key = Hasher(key), key.subkey(b"noise")
        self.schema, _ = schema_for(vllm_version)
        self.live: dict[str, Context] = {}
        self.ended: collections.OrderedDict[str, Context] = collections.OrderedDict()
        self.calls: dict[tuple, Any] = {}  # (engine, API server, call id) -> the method called
        self.waiting: collections.deque[CapturedFrame] = collections.deque()
        self.blanked: collections.Counter[str] = collections.Counter()  # what default deny blanked, by where
        self.dropped: collections.Counter[str] = collections.Counter()  # what the policy dropped, by field
        self.outputs_without_prompt = 0
        self._plain: dict[tuple[str, str], PlainOutput | PlainRequest | None] = {}  # by release and struct
        self._kept: dict[tuple[str, str], Kept | None] = {}  # by release and struct: see _unchanged
        self._shapes: dict[tuple, _chain.Shape] = {}  # by release, struct and fields not looked at: see _shape_of

    # --- the stream ---------------------------------------------------------------------------

    def frames(self, items: Iterable[CapturedFrame | EngineLoss],
               before_each: Callable[[], object] | None = None) -> list[CapturedFrame | EngineLoss]:
        """The redacted copies of ``items`` (and of earlier outputs that were waiting), in seq order;
        ``before_each`` is called before each item is taken (the redactor process gives way there)."""
        out: list[CapturedFrame | EngineLoss] = []
        for item in sorted(items, key=lambda numbered: numbered.seq):
            if before_each is not None:
                before_each()
            if isinstance(item, EngineLoss):
                out.append(item)
            elif _is_outputs(item):
                self.waiting.append(item)
            else:
                out.append(self._redact(item))
            self._release(out, force=len(self.waiting) > WAIT_FRAMES)
        return out

    def flush(self) -> list[CapturedFrame]:
        """The end: outputs still waiting for their request go on without it."""
        out: list[CapturedFrame] = []
        self._release(out, force=True)
        return out

    def _release(self, out: list, force: bool) -> None:
        while self.waiting:
            frame = self.waiting[0]
            redacted = self._redact(frame, force=force)
            if redacted is WAIT_FOR_ADD:
                return
            self.waiting.popleft()
            out.append(redacted)
            force = force and len(self.waiting) > WAIT_FRAMES

    # --- one frame ----------------------------------------------------------------------------

    def _redact(self, frame: CapturedFrame, force: bool = False) -> CapturedFrame | Literal[Pending.WAIT_FOR_ADD]:
        """The frame's redacted copy; WAIT_FOR_ADD for outputs of a request whose ADD has not come (unless
        ``force``)."""
        try:
            parts = self._parts(frame, frame.parts, force)
            if parts is WAIT_FOR_ADD:
                return WAIT_FOR_ADD
            forwarded = self._parts(frame, frame.forwarded, force) if frame.forwarded else None
        except (RedactionError, msgspec.DecodeError, ValueError, TypeError, KeyError, IndexError) as exc:
            self.blanked[f"frame ({type(exc).__name__})"] += 1
            return msgspec.structs.replace(frame, parts=[b""] * len(frame.parts),
                                           forwarded=[b""] * len(frame.forwarded) if frame.forwarded else None)
        return msgspec.structs.replace(frame, parts=parts, forwarded=forwarded)

    def _parts(self, frame: CapturedFrame, parts: list[bytes], force: bool) -> Redacted:
        channel, first = frame.channel, parts[0] if parts else b""
        if channel is Channel.HANDSHAKE:
            value = decode_msgpack(first)
            if frame.direction is Direction.TO_ENGINE:
                return self._message(Walk(list(parts)), "EngineHandshakeMetadata", value)
            rules = self.policy.handshake.get(value.get("status")) if isinstance(value, dict) else None
            if rules is None:
                raise ValueError("not a HELLO or READY")
            walk = Walk(list(parts))
            return [_encode({key: self._value(walk, "handshake", key, rules.get(key), item)
                             for key, item in value.items()})]
        if channel is Channel.INPUT and frame.direction is Direction.TO_FRONTEND:  # an engine's registration
            value = decode_msgpack(first) if first else None
            if not isinstance(value, dict):
                return parts if first == b"" else _raise("a registration is a map")
            version = value.get("vllm_version")
            if isinstance(version, str):
                self.schema, _ = schema_for(version)
            return self._message(Walk(list(parts)), "EngineCoreReadyResponse", value)
        if channel in (Channel.OUTPUT, Channel.COORDINATOR_OUTPUT):
            if parts == [ENGINE_CORE_DEAD]:
                return parts
            return self._outputs(frame, parts, force)
        if frame.direction is Direction.TO_FRONTEND or parts == [b"READY"]:
            return parts  # subscriptions, and the coordinator's READY: no payload
        return self._request(frame, parts)

    def _message(self, walk: Walk, struct: str, value: Any) -> list[bytes]:
        """A message whose first part (``walk.payload[0]``) holds ``struct``, the parts after it its aux frames."""
        redacted = self._struct(walk, struct, value)
        payload = walk.payload
        for index in range(1, len(payload)):
            if index not in walk.visited:  # an aux frame no kept field refers to
                payload[index] = b""
                self.blanked[f"{struct} aux frame"] += 1
        payload[0] = _encode(redacted)
        return payload

    def _request(self, frame: CapturedFrame, parts: list[bytes]) -> list[bytes]:
        kind = RequestType(parts[0])
        if kind is RequestType.ADD:
            value = decode_msgpack(parts[1])
            walk = Walk(list(parts[1:]))  # (a prompt tensor's bytes are read from it)
            if len(parts) == 2 and self._plain_request(walk, parts[1], value):
                return [parts[0], _encode(value)]
            return [parts[0], *self._message(walk, "EngineCoreRequest", value)]
        body = decode_msgpack(parts[1])
        if kind is RequestType.ABORT:
            if not (isinstance(body, list) and all(isinstance(rid, str) for rid in body)):
                raise ValueError("an ABORT is a list of request ids")
            for rid in body:
                self._end(rid)
            return [parts[0], _encode([self.hasher.text(rid) for rid in body]), *([b""] * len(parts[2:]))]
        if kind is RequestType.UTILITY:
            client, call_id, method, args = body
            self.calls[(frame.engine_index, client, call_id)] = method
            args = self._apply(Walk(list(parts[1:])), self.policy.utility_action(method, "args"), args,
                               "utility args")
            return [parts[0], _encode([client, call_id, method, args]), *([b""] * len(parts[2:]))]
        if not (isinstance(body, list) and all(type(v) is int or v is None for v in body)):  # START_DP_WAVE
            raise ValueError("a START_DP_WAVE is numbers")
        return parts

    def _outputs(self, frame: CapturedFrame, parts: list[bytes], force: bool) -> Redacted:
        outputs_at = self.schema.position("EngineCoreOutputs", "outputs")
        step = self._plain_step(parts[0], outputs_at) if len(parts) == 1 else None
        if step is not None:
            return [step]
        # The walk, after waiting for any request not known.
        value = decode_msgpack(parts[0])
        outputs = self.schema.read(value, "EngineCoreOutputs", "outputs")
        for output in outputs if isinstance(outputs, list) else ():
            rid = self.schema.read(output, "EngineCoreOutput", "request_id")
            if isinstance(rid, str) and rid not in self.live and rid not in self.ended:
                if not force:
                    return WAIT_FOR_ADD
                self.live[rid] = Context(self.tokens.start(salt=rid.encode()), frozenset())
                self.outputs_without_prompt += 1
        return self._message(Walk(list(parts), frame.engine_index, frame.client_index), "EngineCoreOutputs", value)

    # --- walking values -----------------------------------------------------------------------

    def _struct(self, walk: Walk, name: str, value: Any) -> Any:
        if name not in _ENTER and self._unchanged(name, value):
            return value
        kept = self._kept_of(name)
        as_is = kept.as_is if kept is not None else {}  # (fields given back without a call, by their type)
        spec = self.schema.structs.get(name)
        rules = self.policy.structs.get(name, {})
        if spec is None or not isinstance(value, list if spec.encoding == "array" else dict):
            self.blanked[f"{name} (not a {spec.encoding if spec else 'known struct'})"] += 1
            return None
        enter = _ENTER.get(name)
        if enter is not None:
            enter(self, walk, spec, value)
        if spec.encoding == "array":
            fields = spec.fields
            # (nil fields, most of an output's, are nil whatever the policy: not walked)
            out = [None if item is None else item if type(item) in as_is.get(i, ())
                   else self._field(walk, name, fields[i], rules.get(fields[i].name), item)
                   if i < len(fields) else self._blank(f"{name}[{i}]") for i, item in enumerate(value)]
        else:
            fields = spec.by_name
            out = {key: item if type(item) in as_is.get(key, ())
                   else self._field(walk, name, fields[key], rules.get(key), item)
                   if key in fields else self._blank(f"{name}.{key}") for key, item in value.items()}
        if name == "EngineCoreOutput":
            self._output_done(walk, spec, value)
        return out

    def _unchanged(self, name: str, value: Any, but: tuple = ()) -> bool:
        """Whether the walk would give ``value`` back as it is (``tests/redact``: the two agree): every
        field set is one the policy keeps, of a kind its schema takes, and holds no tensor, or is such a
        struct itself (a busy engine's scheduler stats, each step). ``but``: fields not looked at."""
        kept = self._kept_of(name)
        if kept is None or type(value) is not kept.encoding:
            return False
        as_is, fields = kept.as_is, kept.fields
        for key, item in value.items() if type(value) is dict else enumerate(value):
            if item is None or key in but or type(item) in as_is.get(key, ()):
                continue
            field = fields.get(key)
            if field is None:
                return False
            types, struct, container = field
            if type(item) not in types:
                return False
            if item if container else not self._unchanged(struct, item):
                return False  # (a list or map of structs is walked unless it is empty)
        return True

    def _kept_of(self, name: str) -> Kept | None:
        kept = self._kept.get((self.schema.release, name), _UNSET)
        if kept is _UNSET:
            kept = self._kept[self.schema.release, name] = Kept.of(self.schema, self.policy, name)
        return kept

    def _shape_of(self, name: str, but: tuple = ()) -> _chain.Shape:
        """``Kept.compiled`` for this release and policy, made once."""
        key = (self.schema.release, name, but)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = Kept.compiled(self.schema, self._kept_of, name, but)
        return shape

    def _plain_of(self, plain: type[PlainOutput] | type[PlainRequest]) -> PlainOutput | PlainRequest | None:
        """``plain.of`` for this release and policy, made once (None: no fast path for this struct)."""
        key = (self.schema.release, plain.STRUCT)
        made = self._plain.get(key, _UNSET)
        if made is _UNSET:
            made = self._plain[key] = plain.of(self.schema, self.policy)
        return made

    def _plain_step(self, data: bytes, outputs_at: int) -> bytes | None:
        """A busy engine's step (``EngineCoreOutputs``) redacted without a walk: its outputs by the fast
        path, the rest as it is, when the walk would give that back. None if it would not."""
        span = _chain.unchanged(data, self._shape_of("EngineCoreOutputs"), outputs_at)
        if not span:
            return None
        start, end = span
        outputs = self._plain_outputs(memoryview(data)[start:end])
        return None if outputs is None else b"".join((data[:start], outputs, data[end:]))

    def _plain_outputs(self, outputs: bytes | memoryview) -> bytes | None:
        """``outputs`` (their msgpack) redacted as the walk would, byte for byte (``tests/redact``: the two
        agree), if they were a busy engine's: outputs whose only set fields are their id, tokens, finish and
        stop reasons and NaN count, of requests known. If any is another, None, and no context moved."""
        plain = self._plain_of(PlainOutput)
        if plain is None:
            return None
        # In C (_chain.c), as TokenMap.chain and Hasher.text would do it. (An output's logprobs would need
        # its tokens' contexts: these have none, so none are kept.)
        redacted = _chain.outputs(outputs, plain.length, plain.columns, self.live, self.ended, self.hasher.text,
                                  self.hasher.known, self.tokens.permutation)
        if redacted is None:
            return None
        outputs, finished = redacted
        for rid in finished:
            self._end(rid)
        return outputs

    def _plain_request(self, walk: Walk, data: bytes, value: Any) -> bool:
        """Whether ``value`` (decoded from ``data``) was an ADD whose fields but its prompt and texts hashed
        the walk gives back unchanged, now redacted as the walk would (``tests/redact``: the two agree) but
        without one: its context entered, its texts hashed, its prompt chained."""
        at = self._plain_of(PlainRequest)
        if at is None or _chain.unchanged(data, self._shape_of(at.STRUCT, but=at.but)) is False:
            return False
        prompt = value[at.prompt] if at.prompt < len(value) else None
        texts = [i for i in at.texts if i < len(value) and value[i] is not None]
        if not (prompt is None or type(prompt) is list) or any(type(value[i]) is not str for i in texts):
            return False
        self._enter_request(walk, self.schema.structs["EngineCoreRequest"], value)
        for i in texts:
            value[i] = self.hasher.text(value[i])
        if prompt is not None:
            value[at.prompt] = self._tokens(walk, _PROMPT, prompt)
        return True

    def _field(self, walk: Walk, owner: str, field: Field, action: Action | None, value: Any) -> Any:
        if value is None:
            return None
        if action is None or ("any" not in field.kinds and kind_of(value) not in field.kinds):
            return self._blank(f"{owner}.{field.name}")
        if action == "keep" and field.struct is not None:
            if field.struct == "EngineCoreOutput" and type(value) is list:  # in a step that is walked
                outputs = self._plain_outputs(_encode(value))
                if outputs is not None:
                    return decode_msgpack(outputs)
            container = field.type.split("[", 1)[0]
            if container in ("list", "set", "frozenset", "tuple") and isinstance(value, list):
                return [self._struct(walk, field.struct, item) for item in value]
            if container == "dict" and isinstance(value, dict):
                return {key: self._struct(walk, field.struct, item) for key, item in value.items()}
            return self._struct(walk, field.struct, value)
        if action == "drop":  # an empty value of its kind where the field takes one, else its default
            empty = _empty(value)
            dropped = empty if field.struct is None and kind_of(empty) in field.kinds else field.default
            if dropped != value:
                self.dropped[f"{owner}.{field.name}"] += 1
            return dropped
        if action == "tokens":
            return self._tokens(walk, (owner, field.name), value)
        if action == "utility":
            method = self.calls.pop((walk.engine, walk.client, walk.call_id), None)
            return self._apply(walk, self.policy.utility_action(method, "result"), value, "utility result")
        if field.tensor and action == "keep" and isinstance(value, list) and len(value) == 3 and type(value[2]) is int:
            walk.visited.add(value[2])  # its aux frame goes on as it is
        return self._apply(walk, action, value, f"{owner}.{field.name}")

    def _value(self, walk: Walk, owner: str, key: Any, action: Action | None, value: Any) -> Any:
        """A value with no schema (the handshake's HELLO and READY): by the policy alone."""
        if action is None:
            return None if value is None else self._blank(f"{owner}.{key}")
        return self._apply(walk, action, value, f"{owner}.{key}")

    def _apply(self, walk: Walk, action: Action, value: Any, where: str) -> Any:
        if action == "keep":
            return value
        if action == "hash":
            return self._hashed(value, where)
        if action == "noise":
            return self._noised(walk, value, where)
        if action == "drop":
            self.dropped[where] += 1
            return _empty(value)
        return self._blank(where)  # tokens and utility have a place, only the walk knows it

    def _blank(self, where: str) -> None:
        self.blanked[where] += 1
        return None

    # --- hash and noise -----------------------------------------------------------------------

    def _hashed(self, value: Any, where: str) -> Any:
        """Strings and map keys hashed, bytes of a digest's length keyed, numbers kept, other bytes blanked."""
        if isinstance(value, str):
            return self.hasher.text(value)
        if isinstance(value, list):
            return [self._hashed(item, where) for item in value]
        if isinstance(value, dict):
            return {self._hashed(k, where): self._hashed(v, where) for k, v in value.items()}
        if isinstance(value, bytes) and 0 < len(value) <= 64:
            return self.hasher.data(value)
        if isinstance(value, (bytes, Ext)):
            return self._blank(f"{where} (bytes)")
        return value

    def _noised(self, walk: Walk, value: Any, where: str) -> Any:
        """Tensors replaced by keyed noise of their shape and dtype; strings hashed, numbers kept."""
        tensor = _tensor_bytes(value, walk.payload)
        if tensor is not None:
            dtype, data = value[0], tensor
            noise = _noise(dtype, data, hashlib.blake2b(data, key=self._noise_key, digest_size=16).digest())
            return _put(walk, value, noise)
        if isinstance(value, list):
            return [self._noised(walk, item, where) for item in value]
        if isinstance(value, dict):
            return {k if isinstance(k, str) else self._hashed(k, where): self._noised(walk, v, where)
                    for k, v in value.items()}
        if isinstance(value, str):
            return self.hasher.text(value)
        if isinstance(value, (bytes, Ext)):
            return self._blank(f"{where} (bytes)")
        return value

    # --- tokens -------------------------------------------------------------------------------

    def _tokens(self, walk: Walk, where: tuple[str, str], value: Any) -> Any:
        context = walk.current
        # Stop tokens stay themselves where the engine generates (outputs, their candidates, the stop lists),
        # so that a request stops where it did. A prompt is never generated: every token of it is hidden, and
        # equal prompts stay equal whatever their requests' stop lists.
        fixed = context.fixed if context is not None and where not in (_PROMPT, _PROMPT_CANDIDATES) else frozenset()
        tokens = self.tokens
        if where == _PROMPT and context is not None:
            tensor = _tensor_bytes(value, walk.payload)
            if tensor is None and isinstance(value, list):
                return tokens.chain(context.prefix, value, fixed, context.prompt_states)
            if tensor is not None and len(value[1]) == 1:  # 0.34.0 on: an int ndarray, inline or in an aux frame
                import numpy as np

                array = np.frombuffer(tensor, dtype=_dtype(value[0]))
                chained = tokens.chain(context.prefix, array.tolist(), fixed, context.prompt_states)
                return _put(walk, value, np.array(chained, dtype=array.dtype).tobytes())
        if where == _OUTPUT and context is not None and isinstance(value, list):
            context.output_states = []
            return tokens.chain(context.prefix, value, fixed, context.output_states)
        tensor = _tensor_bytes(value, walk.payload)
        if tensor is not None:  # candidates (logprobs), a row per position, or a token tensor of no position
            import numpy as np  # here: most frames have no tensor, and a command's start should not wait for it

            array = np.frombuffer(tensor, dtype=_dtype(value[0])).reshape(value[1] if value[1] else -1)
            rows = array.reshape(len(array), -1) if array.ndim else array.reshape(1, 1)
            states = self._candidate_states(walk.current, where, len(rows))
            mapped = np.array([tokens.at(state, row.tolist(), fixed) for state, row in zip(states, rows)],
                              dtype=array.dtype)
            return _put(walk, value, mapped.tobytes())
        if isinstance(value, dict):  # logit_bias
            return dict(zip(self._tokens(walk, where, list(value)), value.values()))
        if isinstance(value, list) and value and isinstance(value[0], list):  # bad words' token ids
            return [self._tokens(walk, where, item) for item in value]
        if isinstance(value, list):
            return tokens.at(tokens.empty, value, fixed)
        return tokens.at(tokens.empty, [value], fixed)[0]

    def _candidate_states(self, context: Context | None, where: tuple[str, str], rows: int) -> list[bytes]:
        """The context of each row of a logprobs tensor (the tokens that one row's candidates follow)."""
        empty = self.tokens.empty
        if context is None:
            return [empty] * rows
        now = self.tokens.state(context.prefix)
        if where == _OUTPUT_CANDIDATES:
            states = context.output_states
            return [states[i] if i < len(states) else now for i in range(rows)]
        if where == _PROMPT_CANDIDATES:  # row j: the prompt token at j + 1, after the first j + 1
            first, context.prompt_rows = context.prompt_rows, context.prompt_rows + rows
            states = context.prompt_states or []
            return [states[i + 1] if i + 1 < len(states) else now for i in range(first, first + rows)]
        return [empty] * rows

    # --- the requests a walk is in ------------------------------------------------------------

    def _enter_request(self, walk: Walk, spec: Any, value: list) -> None:
        params = read(value, spec.by_name.get("sampling_params"))
        fixed: set[int] = set()
        if isinstance(params, dict):
            for key in _STOP_TOKENS:
                stops = params.get(key)
                if type(stops) is int:
                    fixed.add(stops)
                elif type(stops) is list:
                    fixed.update(t for t in stops if type(t) is int)
        wants_prompt_logprobs = isinstance(params, dict) and params.get("prompt_logprobs") is not None
        walk.current = Context(self.tokens.start(), frozenset(fixed), wants_prompt_logprobs)
        rid = read(value, spec.by_name.get("request_id"))
        if isinstance(rid, str):
            self.live[rid] = walk.current

    def _enter_output(self, walk: Walk, spec: Any, value: list) -> None:
        rid = read(value, spec.by_name.get("request_id"))
        walk.current = self.live.get(rid) or self.ended.get(rid) if isinstance(rid, str) else None

    def _output_done(self, walk: Walk, spec: Any, value: list) -> None:
        rid = read(value, spec.by_name.get("request_id"))
        if read(value, spec.by_name.get("finish_reason")) is not None and isinstance(rid, str):
            self._end(rid)
        walk.current = None

    def _enter_outputs(self, walk: Walk, spec: Any, value: list) -> None:
        utility = read(value, spec.by_name.get("utility_output"))
        walk.call_id = utility[0] if isinstance(utility, list) and utility else None

    def _end(self, rid: str) -> None:
        context = self.live.pop(rid, None)
        if context is not None:
            self.ended[rid] = context
            if len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)


class PlainOutput(msgspec.Struct, frozen=True):
    """Where a release's EngineCoreOutput holds what a busy engine's outputs set; the rest must be nil."""

    STRUCT: ClassVar[str] = "EngineCoreOutput"
    length: int
    columns: tuple[int, int, int, int, int]  # request_id, new_token_ids, finish_reason, stop_reason, num_nans_in_logits

    @classmethod
    def of(cls, schema: Any, policy: Policy) -> PlainOutput | None:
        """None where the policy treats those fields otherwise than the fast path does."""
        spec = schema.structs["EngineCoreOutput"]
        if policy.structs.get("EngineCoreOutput", {}).keys() and any(
                policy.structs["EngineCoreOutput"].get(name) != action for name, action in _PLAIN.items()):
            return None
        try:
            columns = tuple(spec.by_name[name].position for name in _PLAIN)
        except KeyError:
            return None
        return cls(len(spec.fields), columns)


_PLAIN = {"request_id": "hash", "new_token_ids": "tokens", "finish_reason": "keep", "stop_reason": "hash",
          "num_nans_in_logits": "keep"}


class PlainRequest(msgspec.Struct, frozen=True):
    """Where a release's EngineCoreRequest holds its prompt, and the texts the policy hashes (its ids)."""

    STRUCT: ClassVar[str] = "EngineCoreRequest"
    prompt: int
    texts: tuple[int, ...]
    but: tuple[int, ...]  # both: what Redactor._unchanged does not look at

    @classmethod
    def of(cls, schema: Any, policy: Policy) -> PlainRequest | None:
        """None where the policy does not chain the prompt (as the fast path does)."""
        spec, rules = schema.structs.get("EngineCoreRequest"), policy.structs.get("EngineCoreRequest", {})
        if spec is None or spec.encoding != "array" or "prompt_token_ids" not in spec.by_name \
                or rules.get("prompt_token_ids") != "tokens":
            return None
        prompt = spec.by_name["prompt_token_ids"].position
        texts = tuple(f.position for f in spec.fields
                      if rules.get(f.name) == "hash" and set(f.kinds) <= {"str", "nil"})
        return cls(prompt, texts, (prompt, *texts))


_UNSET = object()

_ENTER = {"EngineCoreRequest": Redactor._enter_request, "EngineCoreOutput": Redactor._enter_output,
          "EngineCoreOutputs": Redactor._enter_outputs}


class Kept(msgspec.Struct, frozen=True):
    """For ``Redactor._unchanged`` and ``_struct``: which of a struct's fields the walk gives back as they
    are, by name (map) or position (array). The policy keeps or hashes them and they hold no tensor."""

    encoding: type  # list or dict
    as_is: dict[Any, frozenset[type]]  # values of these types, as they are: kept, or numbers hashed
    # The others: (types, their struct, whether only an empty one is kept as it is: a list or map of
    # structs, which is walked otherwise, or a list or map hashed)
    fields: dict[Any, tuple[frozenset[type], str | None, bool]]

    @classmethod
    def of(cls, schema: Any, policy: Policy, name: str) -> Kept | None:
        spec = schema.structs.get(name)
        if spec is None:
            return None
        rules = policy.structs.get(name, {})
        as_is, fields = {}, {}
        for field in spec.fields:
            action, key = rules.get(field.name), field.name if spec.encoding == "map" else field.position
            types = frozenset(_TYPES.values()) if "any" in field.kinds else \
                frozenset(_TYPES[kind] for kind in field.kinds if kind in _TYPES)
            if field.tensor or action not in ("keep", "hash") or (field.struct and action == "hash"):
                continue
            if field.struct is not None:
                fields[key] = types, field.struct, field.type.split("[", 1)[0] in _CONTAINERS
            elif action == "keep":
                as_is[key] = types
            else:  # hashing keeps numbers, and empty lists and maps, as they are
                as_is[key], fields[key] = types & {int, float, bool}, (types & {list, dict}, None, True)
        return cls(list if spec.encoding == "array" else dict, as_is, fields)

    @staticmethod
    def compiled(schema: Any, kept_of: Callable[[str], Kept | None], name: str, but: tuple = ()) -> _chain.Shape:
        """The tables of ``name`` and of the structs in it, for ``_chain.unchanged``: it checks a struct's
        msgpack as ``Redactor._unchanged`` checks its values (``tests/redact``: the two agree). ``but``:
        fields of ``name`` not looked at (any value but an ext, which the walk takes)."""
        names, structs = [name], []
        for struct in names:  # (names grows by the structs nested in those before)
            kept = kept_of(struct)
            if kept is None:
                structs.append((0, []))
                continue
            fields = []
            for field in schema.structs[struct].fields:
                key = field.name if kept.encoding is dict else field.position
                types, nested, container = kept.fields.get(key, ((), None, False))
                if not structs and key in but:  # (of the struct asked about)
                    fields.append((key, _kinds(_KINDS), 0, -1, False))
                elif key in kept.as_is or key in kept.fields:
                    if nested is not None and nested not in names:
                        names.append(nested)
                    fields.append((key, _kinds(kept.as_is.get(key, ())), _kinds(types),
                                   -1 if nested is None else names.index(nested), container))
            structs.append((_kinds((kept.encoding,)), fields))
        return _chain.Shape(structs)


_KINDS = {bool: 1, int: 2, float: 4, str: 8, bytes: 16, list: 32, dict: 64}  # _chain.c's (an Ext has none)


def _kinds(types: Iterable[type]) -> int:
    return sum(_KINDS.get(kind, 0) for kind in set(types))


_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "bin": bytes, "array": list, "map": dict, "ext": Ext}
_CONTAINERS = ("list", "set", "frozenset", "tuple", "dict")


def _is_outputs(frame: CapturedFrame) -> bool:
    return frame.channel in (Channel.OUTPUT, Channel.COORDINATOR_OUTPUT) and frame.parts != [ENGINE_CORE_DEAD]


def _raise(message: str) -> Any:
    raise ValueError(message)


def _empty(value: Any) -> Any:
    """A value of the same kind that says nothing."""
    return type(value)() if isinstance(value, (list, dict, str, bytes, int, float, bool)) else None


# numpy's names for vLLM's tensor dtypes (torch names and numpy ``dtype.str``)
_TORCH = {"float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4", "int16": "<i2",
          "int8": "|i1", "uint8": "|u1", "bool": "|b1", "bfloat16": "<u2"}


def _dtype(name: str) -> Any:
    import numpy as np

    return np.dtype(_TORCH.get(name, name))


def _put(walk: Walk, tensor: list, data: bytes) -> list:
    """``tensor`` holding ``data`` instead, where it held its bytes (inline, or its aux frame)."""
    if isinstance(tensor[2], Ext):
        return [tensor[0], tensor[1], Ext(RAW_VIEW, data)]
    walk.payload[tensor[2]] = data
    walk.visited.add(tensor[2])
    return tensor


def _tensor_bytes(value: Any, payload: list[bytes]) -> bytes | None:
    """The bytes of a tensor ``[dtype, shape, data]`` (inline, or in its aux frame), or None if it is none."""
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str) and isinstance(value[1], list)):
        return None
    data = value[2]
    if isinstance(data, Ext) and data.code == RAW_VIEW:
        return data.data
    if type(data) is int and 0 < data < len(payload):
        return payload[data]
    return None


def _noise(dtype: str, data: bytes, seed: bytes) -> bytes:
    """Pseudo-random values drawn from ``seed``, as many and of the same dtype as ``data`` holds."""
    import numpy as np

    generator = np.random.Generator(np.random.PCG64(int.from_bytes(seed, "little")))
    if dtype == "bfloat16":  # the top half of a float32
        return (generator.standard_normal(len(data) // 2).astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
    try:
        kind = _dtype(dtype)
    except TypeError:
        return generator.bytes(len(data))
    count = len(data) // kind.itemsize
    if kind.kind == "f":
        return generator.standard_normal(count).astype(kind).tobytes()
    if kind.kind == "b":
        return (generator.random(count) < 0.5).tobytes()
    original = np.frombuffer(data[:count * kind.itemsize], dtype=kind)
    low, high = (int(original.min()), int(original.max())) if count else (0, 0)
    return generator.integers(low, high, size=count, endpoint=True).astype(kind).tobytes()
