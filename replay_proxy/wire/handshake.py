"""The startup handshake: engine identities and the INIT address rewrite.

The frontend's INIT (``EngineHandshakeMetadata``) tells the engine where to
connect its input DEALERs and output PUSHes. To see that traffic, the proxy
replaces those addresses with its own, keeping list length and order: the
engine routes outputs by list index (= ``client_index``, the API server).
Everything else in INIT passes through unchanged, in its original key order.
"""

from __future__ import annotations

from typing import Any

import msgspec

from replay_proxy.errors import ReplayProxyError
from replay_proxy.wire.values import decode_msgpack

_encoder = msgspec.msgpack.Encoder()


class HandshakeError(ReplayProxyError):
    """A handshake message is not what the protocol says it must be."""


class Addresses(msgspec.Struct, frozen=True):
    """The socket addresses an INIT hands to one engine."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    coordinator_input: str | None = None
    coordinator_output: str | None = None


def engine_identity(engine_index: int) -> bytes:
    """The ZMQ routing identity of an engine: its index, 2 bytes little-endian."""
    return engine_index.to_bytes(2, "little")


def engine_index(identity: bytes) -> int:
    return int.from_bytes(identity, "little")


def parse_init(payload: bytes) -> tuple[dict[str, Any], Addresses]:
    """Decode an INIT payload into its map and the addresses in it."""
    value = decode_msgpack(payload)
    addresses = value.get("addresses") if isinstance(value, dict) else None
    if not isinstance(addresses, dict):
        raise HandshakeError(f"INIT has no 'addresses' map: {value!r:.200}")
    try:
        parsed = msgspec.convert(
            {k: v for k, v in addresses.items() if k in Addresses.__struct_fields__}, Addresses
        )
    except msgspec.ValidationError as exc:
        raise HandshakeError(f"INIT addresses: {exc}") from None
    return value, parsed


def rewrite_init(payload: bytes, inputs: list[str], outputs: list[str],
                 coordinator_input: str | None = None, coordinator_output: str | None = None) -> bytes:
    """Return INIT with its input/output (and optionally coordinator) addresses replaced."""
    value, original = parse_init(payload)
    if (len(inputs), len(outputs)) != (len(original.inputs), len(original.outputs)):
        raise HandshakeError(
            f"INIT lists {len(original.inputs)} inputs and {len(original.outputs)} outputs; "
            f"the rewrite gave {len(inputs)} and {len(outputs)}"
        )
    addresses = value["addresses"]
    addresses["inputs"] = list(inputs)
    addresses["outputs"] = list(outputs)
    if coordinator_input is not None:
        addresses["coordinator_input"] = coordinator_input
    if coordinator_output is not None:
        addresses["coordinator_output"] = coordinator_output
    return _encoder.encode(value)
