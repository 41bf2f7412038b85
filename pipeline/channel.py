"""A direct byte channel for a remote role's image batches: the actor sends each batch's
pixels over one TCP connection, straight into the buffer the trainer hands out.

Why: through Ray's object store a batch is copied into the sending node's store, pulled
over gRPC by the trainer node's raylet into its own store, then copied out (measured on
one host: 0.25 ms of raylets' CPU an image, 0.15 of it on the trainer's node, beside the
trainer's own 0.05). Over a socket it is one kernel copy on each side. Ray still carries
everything else (which batch, its keys and counts, the actor's life and its failure).

Safety: the actor listens on its node's address on a free port and takes the first
connection that presents the run's 32-byte token (made by the trainer, handed over by
Ray) within `HANDSHAKE_S`; any other is closed. A frame is a fixed header (magic,
sequence number, byte count) and the bytes; the receiver checks the sequence number and
that the count is the one the batch's metadata announced before it reads a byte, so a
stray, short or oversized frame is a `ChannelError` (the role is started again, like a
lost one), never wrong pixels or an allocation the sender chose.
"""

from __future__ import annotations

import contextlib
import hmac
import math
import queue
import secrets
import socket
import struct
import threading
from dataclasses import dataclass

import numpy as np

from shards.errors import ShardpipeError

HANDSHAKE_S = 30.0  # how long an accepted connection has to present the token
RECEIVE_S = 60.0  # the longest a receive waits for the next bytes of a frame
TOKEN_BYTES = 32
MAX_HANDSHAKES = 16  # connections presenting their token at once; more wait in the backlog
_HEADER = struct.Struct("!8sQQ")  # magic, sequence number, byte count
_MAGIC = b"SPBATCH1"


class ChannelError(ShardpipeError, ConnectionError):
    """The channel of a remote role broke or carried something other than the batch
    announced; the role is started again from the batches received."""


@dataclass(frozen=True)
class ChannelImages:
    """An image batch sent over the channel: the metadata Ray carries in its place."""

    shape: tuple[int, ...]  # [B, H, W, 3], uint8
    sequence: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape)


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


class ChannelSender:
    """The actor's side for one start of its role: a listening socket, then one thread
    writing the frames of `send` in order to the connection that presented the token. At
    most `depth` frames wait (the trainer's outstanding calls); `close` ends it all, so
    the next start of the role gets a fresh channel and no stale frame."""

    def __init__(self, token: bytes, host: str, depth: int) -> None:
        self.token = token
        family = socket.AF_INET6 if ":" in host else socket.AF_INET  # a node's IPv6 address
        self.listener = socket.create_server((host, 0), family=family)
        self.address = (host, self.listener.getsockname()[1])
        self.frames: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.connection: socket.socket | None = None
        self.sequence = 0
        self.error: BaseException | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._serve, name="channel-sender", daemon=True)
        self.thread.start()

    def send(self, pixels: np.ndarray) -> ChannelImages:
        """Queue `pixels` (uint8) as the next frame; returns what Ray carries in its place.

        Raises:
            ChannelError: the connection broke (the trainer then starts the role again).
        """
        if self.closed or self.error is not None:
            raise ChannelError(f"the batch channel to the trainer broke: {self.error or 'closed'}")
        self.sequence += 1
        self.frames.put((self.sequence, np.ascontiguousarray(pixels)))
        return ChannelImages(tuple(pixels.shape), self.sequence)

    def close(self) -> None:
        self.closed = True
        for sock in (self.listener, self.connection):
            if sock is not None:
                with contextlib.suppress(OSError):  # wakes a blocked accept or send
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        with contextlib.suppress(queue.Full):  # full: the thread is not waiting for one
            self.frames.put_nowait((0, None))  # else one waiting for a frame wakes up

    def _serve(self) -> None:
        try:
            self.connection = self._accept()
            while True:
                sequence, pixels = self.frames.get()
                if self.closed:
                    return
                self.connection.sendall(_HEADER.pack(_MAGIC, sequence, pixels.nbytes))
                self.connection.sendall(memoryview(pixels).cast("B"))
        except OSError as error:  # the trainer went away, or `close`
            self.error = error
        finally:
            self.listener.close()
            if self.connection is not None:
                self.connection.close()

    def _accept(self) -> socket.socket:
        """The first connection that presents the token. Each one gets `HANDSHAKE_S` to
        present it, in a thread of its own, `MAX_HANDSHAKES` at once (more wait in the
        backlog), so a silent stranger delays nobody; the others are closed."""
        chosen: queue.Queue = queue.Queue(maxsize=1)
        pending = threading.BoundedSemaphore(MAX_HANDSHAKES)
        while True:
            pending.acquire()
            if not chosen.empty():
                break
            connection, _ = self.listener.accept()  # a chosen one wakes it by a connect
            if not chosen.empty():
                connection.close()
                break
            threading.Thread(
                target=self._handshake, args=(connection, chosen, pending), daemon=True
            ).start()
        return chosen.get()

    def _handshake(self, connection: socket.socket, chosen: queue.Queue, pending) -> None:
        try:
            connection.settimeout(HANDSHAKE_S)
            offered = _read_exactly(connection, TOKEN_BYTES)
            if hmac.compare_digest(offered, self.token):
                connection.settimeout(None)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                chosen.put_nowait(connection)
                # wake the accept loop, which then sees a connection chosen
                with contextlib.suppress(OSError):
                    socket.create_connection(self.address, timeout=1).close()
                return
        except (OSError, ChannelError, queue.Full):
            pass
        finally:
            pending.release()
        connection.close()


class ChannelReceiver:
    """The trainer's side: one connection to a role's actor, frames read in order."""

    def __init__(self, address: tuple[str, int], token: bytes) -> None:
        self.address = f"{address[0]}:{address[1]}"
        try:
            self.connection = socket.create_connection(address, timeout=RECEIVE_S)
            self.connection.sendall(token)
        except OSError as error:
            raise ChannelError(
                f"cannot reach the role's batch channel at {self.address}: {error}"
            ) from error
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sequence = 0

    def receive_into(self, announced: ChannelImages, out: np.ndarray) -> None:
        """Read the next frame into `out` (C-contiguous uint8 of `announced.shape`).

        Raises:
            ChannelError: the connection broke or stalled past `RECEIVE_S`, or the frame
                is not the one announced (sequence number or byte count).
        """
        expected = self.sequence + 1
        try:
            magic, sequence, count = _HEADER.unpack(_read_exactly(self.connection, _HEADER.size))
        except OSError as error:
            raise ChannelError(f"batch channel {self.address}: {error}") from error
        if magic != _MAGIC or sequence != expected or sequence != announced.sequence:
            raise ChannelError(
                f"batch channel {self.address}: frame {sequence} where batch {expected} "
                "was announced"
            )
        if count != announced.nbytes or count != out.nbytes:
            raise ChannelError(
                f"batch channel {self.address}: frame of {count} bytes where "
                f"{announced.nbytes} were announced"
            )
        view = memoryview(out).cast("B")
        try:
            while view:
                read = self.connection.recv_into(view)
                if not read:
                    raise ChannelError(f"batch channel {self.address}: closed mid-frame")
                view = view[read:]
        except OSError as error:
            raise ChannelError(f"batch channel {self.address}: {error}") from error
        self.sequence = expected

    def close(self) -> None:
        self.connection.close()


def _read_exactly(connection: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = connection.recv(count - len(data))
        if not chunk:
            raise ChannelError("the connection closed")
        data += chunk
    return bytes(data)
