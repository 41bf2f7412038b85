"""pipeline.channel: a remote role's image batches over one token-checked TCP connection.

Real sockets on loopback; the hostile cases are a peer that sends what it likes.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from pipeline import channel
from pipeline.channel import (
    ChannelError,
    ChannelImages,
    ChannelReceiver,
    ChannelSender,
    new_token,
)

HOST = "127.0.0.1"


def batches(count: int, shape=(4, 6, 5, 3)) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(count)]


def one_batch_through(sender: ChannelSender, token: bytes) -> None:
    """The trainer connects with `token` and receives one batch whole."""
    receiver = ChannelReceiver(sender.address, token)
    pixels = batches(1)[0]
    announced = sender.send(pixels)
    out = np.empty_like(pixels)
    receiver.receive_into(announced, out)
    assert np.array_equal(out, pixels)
    receiver.close()


def ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", [HOST, "::1"], ids=["ipv4", "ipv6"])
def test_frames_arrive_in_order_into_the_buffers_given(host):
    if host == "::1" and not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    token = new_token()
    sender = ChannelSender(token, host, depth=2)
    receiver = ChannelReceiver(sender.address, token)
    sent = batches(5)
    got = []

    def produce():
        for pixels in sent:
            got.append(sender.send(pixels))  # blocks while `depth` frames wait

    producer = threading.Thread(target=produce)
    producer.start()
    for index, pixels in enumerate(sent):
        while len(got) <= index:
            time.sleep(0.001)
        out = np.empty_like(pixels)
        receiver.receive_into(got[index], out)
        assert np.array_equal(out, pixels)
    producer.join(5)
    assert [announced.sequence for announced in got] == [1, 2, 3, 4, 5]
    sender.close()
    receiver.close()


def test_a_connection_without_the_token_is_closed_and_the_trainer_still_gets_in():
    token = new_token()
    sender = ChannelSender(token, HOST, depth=1)
    stranger = socket.create_connection(sender.address)
    stranger.sendall(b"x" * channel.TOKEN_BYTES)  # the wrong token
    stranger.settimeout(5)
    assert stranger.recv(1) == b""  # closed on it, nothing sent
    one_batch_through(sender, token)
    sender.close()


def test_silent_strangers_do_not_hold_the_trainer_up():
    """Each connection presents its token in a thread of its own: strangers who connect
    and say nothing (up to the handshake cap) keep nobody waiting."""
    token = new_token()
    sender = ChannelSender(token, HOST, depth=1)
    silent = [socket.create_connection(sender.address) for _ in range(5)]
    started = time.monotonic()
    one_batch_through(sender, token)
    assert time.monotonic() - started < channel.HANDSHAKE_S / 3
    for stranger in silent:
        stranger.close()
    sender.close()


class FakeSender:
    """A peer that accepts the trainer's connection and then sends the given bytes."""

    def __init__(self, payload: bytes, close: bool = True) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.address = self.listener.getsockname()
        self.payload, self.close = payload, close
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        connection, _ = self.listener.accept()
        connection.recv(channel.TOKEN_BYTES)
        connection.sendall(self.payload)
        if self.close:
            connection.close()
        else:
            self.held = connection


def header(sequence: int, count: int, magic: bytes = b"SPBATCH1") -> bytes:
    return channel._HEADER.pack(magic, sequence, count)


SHAPE = (2, 3, 4, 3)
ANNOUNCED = ChannelImages(SHAPE, 1)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (header(2, 72) + bytes(72), r"frame 2 where batch 1 was announced"),
        (header(1, 72, magic=b"HTTP/1.1") + bytes(72), r"frame 1 where batch 1"),
        (header(1, 2**62), r"frame of 4611686018427387904 bytes where 72 were announced"),
        (header(1, 71) + bytes(71), r"frame of 71 bytes where 72"),
        (header(1, 72) + bytes(40), r"closed mid-frame"),
        (header(1, 72)[:10], r"the connection closed"),
        (b"", r"the connection closed"),
    ],
    ids=["sequence", "magic", "huge", "short-count", "cut-payload", "cut-header", "nothing"],
)
def test_a_frame_other_than_announced_is_one_error_and_no_pixels_change(payload, message):
    peer = FakeSender(payload)
    receiver = ChannelReceiver(peer.address, new_token())
    out = np.full(SHAPE, 7, dtype=np.uint8)
    with pytest.raises(ChannelError, match=message):
        receiver.receive_into(ANNOUNCED, out)
    if "mid-frame" not in message:
        assert (out == 7).all()  # refused before a byte was read into the batch


def test_a_stalled_sender_is_an_error_after_the_receive_timeout(monkeypatch):
    monkeypatch.setattr(channel, "RECEIVE_S", 0.3)
    peer = FakeSender(header(1, 72) + bytes(10), close=False)  # then nothing, socket open
    receiver = ChannelReceiver(peer.address, new_token())
    started = time.monotonic()
    with pytest.raises(ChannelError, match="timed out"):
        receiver.receive_into(ANNOUNCED, np.empty(SHAPE, np.uint8))
    assert time.monotonic() - started < 5


def test_nobody_listening_is_one_error_naming_the_address():
    free = socket.create_server((HOST, 0))
    address = free.getsockname()
    free.close()
    with pytest.raises(ChannelError, match=rf"cannot reach the role's batch channel at {HOST}:"):
        ChannelReceiver(address, new_token())


def test_closing_ends_a_sender_blocked_on_a_reader_that_stopped():
    token = new_token()
    sender = ChannelSender(token, HOST, depth=2)
    receiver = ChannelReceiver(sender.address, token)
    big = np.zeros((64, 224, 224, 3), np.uint8)  # 9.6 MB: more than the socket buffers
    sender.send(big)
    sender.send(big)
    time.sleep(0.2)  # the thread is blocked sending the first
    sender.close()
    sender.thread.join(5)
    assert not sender.thread.is_alive()
    with pytest.raises(ChannelError, match="broke"):
        sender.send(big)
    receiver.close()
