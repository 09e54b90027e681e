"""What both players share: the outcome, pacing, their sockets and how they report what crossed.

A player plays one side of a recorded session against a peer under test:
``play_frontend.FrontendPlayer`` plays the recorded frontend (against a new
engine), ``play_engine.EnginePlayer`` the recorded engines (against a new
frontend). Everything either sends or receives is reported to its observer
(the recorder, in practice) as a numbered ``CapturedFrame``, so the replay
is a session of its own, queried and compared like any recording.
"""

from __future__ import annotations

import abc
import itertools
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
import zmq

from replay_proxy.compare.findings import Finding
from replay_proxy.compare.rules import Rules, load_rules
from replay_proxy.errors import ReplayProxyError
from replay_proxy.net.relay import Observer
from replay_proxy.net.zmq_socket import ZmqSocket
from replay_proxy.replay.text import PromptForm
from replay_proxy.store.session import Session
from replay_proxy.wire.capture import CapturedFrame
from replay_proxy.wire.messages import Channel, Direction, Kind, Side, WireDecoder


class ReplayError(ReplayProxyError):
    """The replay could not run: the peer under test never became ready, or has another shape."""


class Tally(NamedTuple):
    sent: int  # requests sent to the peer under test
    finished: int
    recorded: int  # requests in the recording
    tokens: int  # that the peer's users got (against a frontend), or that it produced (against an engine)


class UserSaw(msgspec.Struct, kw_only=True):
    """What a recorded request's HTTP client got from the frontend under test: its tokens and finish reason
    (a completion), its vector (an embedding), or why it got neither."""

    token_ids: list[int] = []
    finish_reason: str | None = None
    embedding: list[float] | None = None
    text: str | None = None  # a completion's text, where the frontend returns no token ids
    error: str | None = None
    aborted_after: int | None = None  # the client disconnected after this many tokens, as the recorded one did


class ReplayOutcome(msgspec.Struct):
    """What a player did; its findings join the comparison's in the report."""

    requests: int = 0  # recorded requests
    sent: int = 0  # messages sent to an engine under test; HTTP requests sent to a frontend under test
    finished: int = 0  # requests that finished (an engine's finish reason; a complete HTTP response)
    tokens: int = 0
    findings: list[Finding] = []
    summary: str = ""
    pacing_errors_ms: list[float] = []  # how late each paced send went out
    send_seconds: float = 0.0  # from the first send to the last
    scoring_seconds: float = 0.0  # the teacher-forced scoring passes after the session (against an engine)
    other_cpu: float = 0.0  # the machine's CPU share other processes took while the session ran (processes.OtherLoad)
    http: dict[str, UserSaw] = {}  # against a frontend: recorded request id -> what its HTTP client saw


class PeerUnderTest(msgspec.Struct, frozen=True, kw_only=True):
    """The new build a session is replayed against; the proxy plays the other side."""

    side: Side
    address: str  # an engine: the handshake address it dials (the proxy binds it); a frontend: its handshake
    http: str | None = None  # a frontend: its HTTP API, which the proxy drives as the recorded users did
    command: str | None = None  # start it with this (own process group, log kept, stopped by PID at the end)


class ReplayOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How a replay runs: the same for its noise runs and for the replay itself."""

    pace: str = "original"  # 'original' recorded timing, 'fast', or a speed-up factor like 2
    ready_timeout_s: float = 300.0  # for the peer under test to be ready
    finish_timeout_s: float = 120.0  # for outstanding requests at the end
    rules: Rules = msgspec.field(default_factory=load_rules)
    noise_runs: int = 0  # replays against the baseline build first: what varies between them is noise
    baseline_command: str | None = None  # starts the baseline build (the one the recording was made with)
    report_dir: Path | None = None  # the peers' logs (and, for the command, the reports); default: a temporary one
    hold_lengths: bool = False  # against an engine: each request asks for exactly its recorded number of tokens
    prompts: PromptForm = PromptForm.AUTO  # against a frontend
    tokenizer: Path | None = None  # against a frontend, prompts as text: the model's (default: the served model's)

    def __post_init__(self) -> None:
        pace_factor(self.pace)
        if self.noise_runs and not self.baseline_command:
            raise ReplayError("noise runs need the baseline build's command")


def pace_factor(pace: str) -> float | None:
    """``original`` -> 1.0, a number -> that speed-up, ``fast`` -> None (no pacing)."""
    if pace == "fast":
        return None
    if pace == "original":
        return 1.0
    try:
        factor = float(pace)
    except ValueError:
        raise ReplayError(f"--pace takes original, fast or a number, not {pace!r}") from None
    if factor <= 0:
        raise ReplayError(f"--pace must be positive, not {pace!r}")
    return factor


class Player(abc.ABC):
    """The sockets, decoder, outcome and reporting of a player; ``run`` and ``tally`` are each one's own."""

    def __init__(self, session: Session, observer: Observer, options: ReplayOptions,
                 context: zmq.Context | None = None):
        self.session = session
        self.observer = observer
        self.options = options
        self.factor = pace_factor(options.pace)
        self.ready_timeout = options.ready_timeout_s
        self.finish_timeout = options.finish_timeout_s
        self.context = context or zmq.Context.instance()
        self.decoder = WireDecoder()
        self.outcome = ReplayOutcome(requests=sum(f.kind is Kind.ADD for f in session.inputs))
        self._sockets: list[ZmqSocket] = []
        self._seq = itertools.count(1)  # one Python thread reports: no forwarders to share a counter with

    @abc.abstractmethod
    async def run(self) -> ReplayOutcome:
        """Play the session to the peer under test, then return the outcome."""

    @abc.abstractmethod
    def tally(self) -> Tally:
        """What it has done so far: for the progress bar and the outcome."""

    def _socket(self, socket_type: int, identity: bytes | None = None) -> ZmqSocket:
        sock = ZmqSocket(self.context, socket_type, identity=identity, linger_ms=1000)
        self._sockets.append(sock)
        return sock

    def _close(self) -> None:
        for sock in self._sockets:
            sock.close()

    def _report(self, channel: Channel, direction: Direction, engine: int | None, client: int | None,
                parts: list[bytes], ts_ns: int | None = None) -> CapturedFrame:
        """Report a frame that crossed now, or at ``ts_ns``."""
        frame = CapturedFrame(next(self._seq), ts_ns or time.time_ns(), channel, direction, engine, client, parts)
        self.observer.frame(frame)
        return frame
