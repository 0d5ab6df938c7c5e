"""The authenticated driver <-> task/rank channel.

Every job has a fresh 32-byte secret that reaches the tasks inside the Spark task closure (the
same path Spark uses for the training function itself). A peer proves it knows the secret with
an HMAC challenge-response, the driver proves it back, and every frame after that carries an
HMAC over (sequence number, body) under a per-connection key. Frames are unpickled only after
their MAC checks out, so nothing unauthenticated is ever unpickled.

Frame: u64 length | body | 32-byte HMAC-SHA256(key, seq || body), body = u32 n | pickle((kind, data)),
then n frames of raw bytes, each framed and authenticated the same way: the ``pickle.PickleBuffer``
objects inside ``data`` (checkpoints, results) travel out of band, so a large payload is neither
copied into the pickle nor out of it; the receiver gets each one back as a buffer over the
received bytes (a read-only ``memoryview`` when the sender wrapped ``bytes``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

from spark_dl import protocol

SECRET_BYTES = 32
_MAGIC = b"SDL2"  # bumped with the frame format: a driver and executors on different versions say so
_NONCE = 16
_MAC = hashlib.sha256().digest_size
_LEN = struct.Struct(">Q")
_SEQ = struct.Struct(">Q")
_COUNT = struct.Struct(">I")
MAX_BUFFERS = 1024
HANDSHAKE_TIMEOUT_S = 60.0  # generous: a loaded executor can stall a peer for seconds


class ChannelError(ConnectionError):
    """The peer is not part of this job, or the connection broke mid-frame."""


def send_reply(conn: "Connection", reply: dict) -> None:
    """Answer a rank's request (``spark_dl.rank.request``); a rank gone meanwhile is reported on its own."""
    try:
        conn.send(protocol.REPLY, reply)
    except OSError:
        pass


def new_secret() -> bytes:
    return os.urandom(SECRET_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int, conn: "Connection | None" = None) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise EOFError("connection closed")
        got += k
        if conn is not None:
            conn.heard = time.monotonic()
    return buf


class Connection:
    """One authenticated, framed, bidirectional connection. ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket, key: bytes, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._key = key
        self._send_lock = threading.Lock()
        self._send_seq = 0
        self._recv_seq = 0
        self.closed = False
        self.info: dict[str, Any] = {}
        # time.monotonic() of the last bytes received: a peer sending one large frame over a slow
        # link is not silent, although no whole message arrives for a while
        self.heard = time.monotonic()

    def send(self, kind: str, data: Any = None) -> None:
        buffers: list[pickle.PickleBuffer] = []
        body = pickle.dumps((kind, data), protocol=5, buffer_callback=buffers.append)
        if len(buffers) > MAX_BUFFERS:
            raise ValueError(f"a message may carry at most {MAX_BUFFERS} out-of-band buffers, got {len(buffers)}")
        with self._send_lock:
            self._send_frame(_COUNT.pack(len(buffers)), body)
            for b in buffers:
                self._send_frame(b.raw())

    def _send_frame(self, *parts: Any) -> None:
        mac = _mac(self._key, _SEQ.pack(self._send_seq), *parts)
        self._send_seq += 1
        self.sock.sendall(_LEN.pack(sum(memoryview(p).nbytes for p in parts)))
        for p in parts:  # separate sendall calls: a large part is never copied into one buffer
            self.sock.sendall(p)
        self.sock.sendall(mac)

    def _recv_frame(self) -> bytearray:
        (n,) = _LEN.unpack(_recv_exact(self.sock, _LEN.size, self))
        body = _recv_exact(self.sock, n, self)
        mac = _recv_exact(self.sock, _MAC, self)
        expected = _mac(self._key, _SEQ.pack(self._recv_seq), body)
        if not hmac.compare_digest(mac, expected):
            raise ChannelError(f"frame from {self.peer} failed authentication; dropping the connection")
        self._recv_seq += 1
        return body

    def recv(self) -> tuple[str, Any]:
        body = self._recv_frame()
        if len(body) < _COUNT.size:
            raise ChannelError(f"malformed frame from {self.peer}")
        (count,) = _COUNT.unpack_from(body)
        if count > MAX_BUFFERS:
            raise ChannelError(f"malformed frame from {self.peer}: {count} buffers")
        buffers = [self._recv_frame() for _ in range(count)]
        return pickle.loads(memoryview(body)[_COUNT.size:], buffers=buffers)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(host: str, port: int, secret: bytes, timeout: float = 30.0, relay: bool = False) -> Connection:
    """Connect to a :class:`ControlServer` and authenticate both ways (``relay``: the one that
    barrier task 0 runs for a client the executors cannot reach)."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        if relay:
            raise ChannelError(
                f"cannot reach barrier task 0's relay at {host}:{port} ({type(e).__name__}: {e}): the executors "
                "must be able to connect to each other (torch.distributed needs that too). Check firewalls "
                "between executors."
            ) from e
        raise ChannelError(
            f"cannot reach the spark-dl driver at {host}:{port} ({type(e).__name__}: {e}): the executors must be "
            "able to connect to the driver's host (spark.driver.host); a Spark Connect client off the driver's host "
            "must set SPARK_DL_CHANNEL=relay (task 0 then stands in for it). Check firewalls between executors "
            "and driver."
        ) from e
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        hello = bytes(_recv_exact(sock, len(_MAGIC) + _NONCE))
        if hello[: len(_MAGIC)] != _MAGIC:
            if hello[:3] == _MAGIC[:3]:
                raise ChannelError(
                    f"the driver at {host}:{port} speaks channel version {hello[:4].decode(errors='replace')}, "
                    f"this executor {_MAGIC.decode()}: "
                    "install the same spark-dl version on the driver and the executors"
                )
            raise ChannelError(f"{host}:{port} is not a spark-dl driver")
        nonce = hello[len(_MAGIC):]
        sock.sendall(_mac(secret, b"client", nonce))
        try:
            proof = _recv_exact(sock, _MAC)
        except (EOFError, ConnectionResetError) as e:
            raise ChannelError(f"{host}:{port} refused this connection's proof: not this job's secret") from e
        if not hmac.compare_digest(proof, _mac(secret, b"server", nonce)):
            raise ChannelError(f"{host}:{port} did not prove it is this job's driver")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return Connection(sock, _mac(secret, b"key", nonce), f"{host}:{port}")


class ControlServer:
    """The driver's listening end. The socket is bound and listening when the constructor
    returns, so its port can be published to tasks with no race.

    ``on_message(conn, kind, data)`` runs on the connection's reader thread;
    ``on_close(conn, error)`` runs once when a connection ends (error is None on a clean EOF).
    """

    def __init__(
        self,
        secret: bytes,
        on_message: Callable[[Connection, str, Any], None],
        on_close: Callable[[Connection, BaseException | None], None],
        host: str = "0.0.0.0",
    ) -> None:
        self._secret = secret
        self._on_message = on_message
        self._on_close = on_close
        self._sock = socket.create_server((host, 0), backlog=128)
        self.port: int = self._sock.getsockname()[1]
        self.rejected = 0
        self._conns: list[Connection] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name="spark-dl-accept", daemon=True)
        self._accept_thread.start()

    def connections(self) -> list[Connection]:
        with self._lock:
            return list(self._conns)

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(
                target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"), name="spark-dl-conn", daemon=True
            ).start()

    def _handshake(self, sock: socket.socket, peer: str) -> Connection | None:
        nonce = os.urandom(_NONCE)
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            sock.sendall(_MAGIC + nonce)
            proof = _recv_exact(sock, _MAC)
            if not hmac.compare_digest(proof, _mac(self._secret, b"client", nonce)):
                raise ChannelError("bad proof")
            sock.sendall(_mac(self._secret, b"server", nonce))
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, EOFError, ChannelError):
            self.rejected += 1
            sock.close()
            return None
        return Connection(sock, _mac(self._secret, b"key", nonce), peer)

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn = self._handshake(sock, peer)
        if conn is None:
            return
        with self._lock:
            if self._stopped:
                conn.close()
                return
            self._conns.append(conn)
        error: BaseException | None = None
        try:
            while True:
                kind, data = conn.recv()
                try:
                    self._on_message(conn, kind, data)
                except Exception:  # noqa: BLE001 - the owner's fault (a log line it cannot print), not the peer's:
                    # say so and keep reading, rather than drop the peer and lose what it sends next
                    import traceback

                    print(f"[spark-dl] handling a {kind!r} message from {peer} failed (the run goes on):\n"
                          f"{traceback.format_exc()}", file=sys.__stderr__, flush=True)
        except EOFError:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the owner, never swallowed silently
            error = e
        finally:
            conn.close()
            self._on_close(conn, error)

    def close(self) -> None:
        self._stopped = True
        try:
            self._sock.close()
        except OSError:
            pass
        for c in self.connections():
            c.close()
