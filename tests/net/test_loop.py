"""The compiled forwarding loop: forwards untouched, and its batches of copies say what passed, when."""

import time
import uuid

import pytest
import zmq

from replay_proxy.net.loop import Counter
from replay_proxy.net.relay import Forwarder
from replay_proxy.wire.capture import batch_counts, capture_tag, unbatch
from replay_proxy.wire.messages import Channel

MESSAGES = [[b"\x00", b"payload"], [b""], [b"a" * 70_000, b"", b"z"], [bytes(range(256))]]


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def collector(context):
    """Where the forwarders' batches of copies go, as in the recorder."""
    collector = context.socket(zmq.ROUTER)
    collector.bind("inproc://capture")
    return collector


def pipe(context, forwarders, capture, counter, *, name=None, sink_connected=True):
    """PUSH -> (PULL | forwarder | PUSH) -> PULL; returns the two ends (the sink connected, or for the
    caller to connect to inproc://out-NAME)."""
    name = name or uuid.uuid4().hex
    source, sink = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    engine_side, frontend_side = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    engine_side.bind(f"inproc://in-{name}")
    frontend_side.bind(f"inproc://out-{name}")
    source.connect(f"inproc://in-{name}")
    if sink_connected:
        sink.connect(f"inproc://out-{name}")
    forwarders.append(Forwarder(context, engine_side, frontend_side, capture=capture, counter=counter,
                                tag=capture_tag(Channel.OUTPUT, 0, len(forwarders))))
    return source, sink


def copies(collector, timeout_ms=2000):
    """Every (tag, seq, ts_ns, parts) copied, until none come for ``timeout_ms``."""
    found = []
    while collector.poll(timeout_ms):
        tag, batch = collector.recv_multipart()
        messages, nbytes = batch_counts(batch)
        unpacked = list(unbatch(batch))
        assert len(unpacked) == messages and nbytes == sum(len(p) for _, _, parts in unpacked for p in parts)
        found += [(tag, seq, ts_ns, parts) for seq, ts_ns, parts in unpacked]
        timeout_ms = 200
    return found


def test_messages_pass_untouched_and_their_copies_are_numbered_and_stamped(context, collector):
    counter, forwarders = Counter(), []
    source, sink = pipe(context, forwarders, "inproc://capture", counter)
    before = time.time_ns()
    for message in MESSAGES:
        source.send_multipart(message)
    assert [sink.recv_multipart() for _ in MESSAGES] == MESSAGES  # every part, byte-identical, in order
    got = copies(collector)
    assert [parts for _, _, _, parts in got] == MESSAGES
    assert [seq for _, seq, _, _ in got] == [1, 2, 3, 4]
    stamps = [ts for _, _, ts, _ in got]
    assert stamps == sorted(stamps) and before <= stamps[0] <= stamps[-1] <= time.time_ns()
    for forwarder in forwarders:
        forwarder.stop()


def test_links_share_one_numbering_in_the_order_they_forwarded(context, collector):
    counter, forwarders = Counter(), []
    first, first_sink = pipe(context, forwarders, "inproc://capture", counter)
    second, second_sink = pipe(context, forwarders, "inproc://capture", counter)
    order = []
    for k in range(6):  # alternate links, each message through before the next is sent
        source, sink = (first, first_sink) if k % 2 == 0 else (second, second_sink)
        source.send_multipart([b"%d" % k])
        sink.recv_multipart()
        order.append(b"%d" % k)
        if k == 2:
            order.append(b"python")
            assert counter.next() == 4  # the relay's own reports take numbers from the same counter
    got = sorted(copies(collector), key=lambda copy: copy[1])
    assert [seq for _, seq, _, _ in got] == [1, 2, 3, 5, 6, 7]
    assert [parts[0] for _, _, _, parts in got] == [m for m in order if m != b"python"]
    assert [tag for tag, *_ in got] == [capture_tag(Channel.OUTPUT, 0, k % 2) for k in range(6)]
    for forwarder in forwarders:
        forwarder.stop()


def test_stopping_sends_what_is_batched_and_closes_the_sockets(context, collector):
    forwarders = []
    source, sink = pipe(context, forwarders, "inproc://capture", Counter())
    source.send_multipart([b"last"])
    sink.recv_multipart()
    forwarders[0].stop()  # at once, before the batch is due
    assert [parts for _, _, _, parts in copies(collector, 1000)] == [[b"last"]]
    assert not forwarders[0]._thread.is_alive()


def test_a_large_batch_goes_before_it_is_due(context, collector):
    forwarders = []
    source, sink = pipe(context, forwarders, "inproc://capture", Counter())
    big = [b"x" * 100_000]
    for _ in range(20):  # 2 MB at once: far more than one batch (256 KiB) holds
        source.send_multipart(big)
    assert all(sink.recv_multipart() == big for _ in range(20))
    sizes = []
    while collector.poll(1000):
        sizes.append(batch_counts(collector.recv_multipart()[1])[1])
    assert sum(sizes) == 2_000_000 and max(sizes) <= 256 * 1024 + 100_000
    forwarders[0].stop()


def test_a_copy_is_not_held_up_behind_a_peer_that_cannot_take_the_message(context, collector):
    forwarders = []
    source, sink = pipe(context, forwarders, "inproc://capture", Counter(), name="later",
                        sink_connected=False)
    source.send_multipart([b"to nobody yet"])  # the loop waits to forward it (as zmq_proxy does) ...
    assert [parts for _, _, _, parts in copies(collector, 1000)] == [[b"to nobody yet"]]  # ... copied already
    sink.connect("inproc://out-later")
    assert sink.recv_multipart() == [b"to nobody yet"]
    forwarders[0].stop()
