"""``record --sample-requests F``: a keyed sample of the requests, the same on every proxy.

A request is in the sample when a keyed hash of its id (BLAKE2b, keyed by ``--sample-seed``) falls
under ``F``. Each proxy, engine link and API server decides alone, and all decide alike: a request's
ADD, ABORT and outputs are recorded, or none of them. What is left out is counted
(``frames_sampled_out``, ``outputs_sampled_out``), never as dropped. Handshakes, registrations,
utility calls and their results, stats-only steps and engine events are always recorded. An
EngineCoreOutputs frame that carries both kinds of request keeps only the sample's outputs, rebuilt
as ``cut`` rebuilds them (``store/subset.py``); one that loses nothing keeps its bytes.

It runs in the writer process. Recording redacted, the writer sees the redacted request ids (keyed
hashes of the frontend's): the decision is then the same on every proxy given the same seed and the
same redaction key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import msgspec

from replay_proxy.store.subset import Cutter
from replay_proxy.wire.capture import CapturedFrame, EngineLoss


class RequestSample(msgspec.Struct, frozen=True):
    """Which requests are recorded: those whose keyed hash falls under ``fraction`` (0 < fraction <= 1)."""

    fraction: float
    seed: str = "0"


class InSample:
    """``request_id in InSample(sample)``: the keyed decision itself."""

    def __init__(self, sample: RequestSample):
        self._key = hashlib.sha256(sample.seed.encode()).digest()  # (BLAKE2b takes a key of 64 bytes at most)
        self._under = int(sample.fraction * 2**64)

    def __contains__(self, request_id: object) -> bool:
        if not isinstance(request_id, str):  # not a request id this release sends: kept, as anything not understood
            return True
        digest = hashlib.blake2b(request_id.encode(), key=self._key, digest_size=8).digest()
        return int.from_bytes(digest, "big") < self._under


class Sampler:
    """The frames of a live session as the sample keeps them; ``outputs_left_out`` counts what it took out."""

    def __init__(self, sample: RequestSample):
        self._cutter = Cutter(InSample(sample), None, in_window=lambda _: True, first_add_ns=None, every_call=True)

    @property
    def outputs_left_out(self) -> int:
        return self._cutter.outputs_left_out

    def frames(self, items: Iterable[CapturedFrame | EngineLoss]) -> list[CapturedFrame | EngineLoss]:
        """The frames (and engine losses) the sample keeps, in seq order."""
        return [cut for item in sorted(items, key=lambda numbered: numbered.seq)
                if (cut := self._cutter.frame(item)) is not None]
