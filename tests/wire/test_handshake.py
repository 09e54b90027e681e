import msgspec
import pytest

from replay_proxy.wire.encode import encode
from replay_proxy.wire.handshake import HandshakeError, engine_identity, engine_index, parse_init, rewrite_init

INIT = encode({
    "addresses": {"inputs": ["tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001"],
                  "outputs": ["tcp://10.0.0.1:6000", "tcp://10.0.0.1:6001"],
                  "coordinator_input": "tcp://10.0.0.1:7000", "coordinator_output": "tcp://10.0.0.1:7001",
                  "frontend_stats_publish_address": "ipc:///tmp/stats"},
    "parallel_config": {"data_parallel_size": 2},
})


def test_identity_is_two_bytes_little_endian():
    assert [engine_identity(i) for i in (0, 1, 258)] == [b"\x00\x00", b"\x01\x00", b"\x02\x01"]
    assert engine_index(b"\x02\x01") == 258


def test_rewrite_replaces_only_inputs_and_outputs_in_order():
    rewritten = msgspec.msgpack.decode(rewrite_init(INIT, ["tcp://p:1", "tcp://p:2"], ["tcp://p:3", "tcp://p:4"]))
    original = msgspec.msgpack.decode(INIT)
    assert rewritten["addresses"]["inputs"] == ["tcp://p:1", "tcp://p:2"]
    assert rewritten["addresses"]["outputs"] == ["tcp://p:3", "tcp://p:4"]
    for key in ("coordinator_input", "coordinator_output", "frontend_stats_publish_address"):
        assert rewritten["addresses"][key] == original["addresses"][key]
    assert rewritten["parallel_config"] == original["parallel_config"]
    assert list(rewritten) == list(original)


def test_rewrite_can_relay_the_coordinator():
    rewritten = msgspec.msgpack.decode(rewrite_init(INIT, ["a", "b"], ["c", "d"], coordinator_input="tcp://p:9"))
    assert rewritten["addresses"]["coordinator_input"] == "tcp://p:9"


def test_rewrite_refuses_a_different_number_of_addresses():
    with pytest.raises(HandshakeError, match="2 inputs and 2 outputs"):
        rewrite_init(INIT, ["a"], ["b"])


def test_parse_init_rejects_what_is_not_an_init():
    with pytest.raises(HandshakeError):
        parse_init(encode({"status": "HELLO"}))
    with pytest.raises(HandshakeError):
        parse_init(encode({"addresses": {"inputs": "not-a-list", "outputs": []}}))
