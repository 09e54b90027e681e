"""Which proxy of a fleet a session was recorded by, where ``record --instance`` does not say."""

import pytest

from replay_proxy.record import default_instance


@pytest.mark.parametrize(("listen", "instance"), [("tcp://127.0.0.1:29560", "29560"), ("tcp://[::1]:5555", "5555"),
                                                  ("ipc:///run/vllm/handshake-0", "handshake-0")])
def test_a_proxy_is_named_by_its_handshake_port_or_socket(listen, instance):
    assert default_instance(listen) == instance
