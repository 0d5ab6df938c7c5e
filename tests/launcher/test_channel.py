"""The driver's control channel: bound before its port is published, authenticated both ways,
and nothing is unpickled before its HMAC checks out."""
from __future__ import annotations

import os
import pickle
import socket
import struct
import threading
import time

import pytest

from spark_dl.transport import channel


class Recorder:
    def __init__(self):
        self.messages = []
        self.closed = []
        self.event = threading.Event()

    def on_message(self, conn, kind, data):
        self.messages.append((kind, data))
        self.event.set()

    def on_close(self, conn, error):
        self.closed.append(error)
        self.event.set()


class Boom:
    """Unpickling this creates a file: proof that a frame was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def server():
    rec = Recorder()
    srv = channel.ControlServer(channel.new_secret(), rec.on_message, rec.on_close, host="127.0.0.1")
    srv.rec = rec
    yield srv
    srv.close()


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_port_is_listening_as_soon_as_it_is_known(server):
    # no sleep, no retry: the constructor returns a bound, listening socket
    conn = channel.connect("127.0.0.1", server.port, server._secret)
    conn.send("hello", {"x": 1})
    conn.send("blob", b"\x01" * (8 * 1024 * 1024))
    assert wait_for(lambda: len(server.rec.messages) == 2)
    assert server.rec.messages[0] == ("hello", {"x": 1})
    assert len(server.rec.messages[1][1]) == 8 * 1024 * 1024
    conn.close()


def test_wrong_secret_is_refused_and_nothing_is_delivered(server):
    with pytest.raises(channel.ChannelError, match="secret"):
        channel.connect("127.0.0.1", server.port, channel.new_secret())
    assert wait_for(lambda: server.rejected == 1)
    assert server.rec.messages == []


def test_a_rank_does_not_talk_to_an_impostor_driver():
    impostor = channel.ControlServer(channel.new_secret(), lambda *a: None, lambda *a: None, host="127.0.0.1")
    try:
        with pytest.raises(channel.ChannelError):
            channel.connect("127.0.0.1", impostor.port, channel.new_secret())
    finally:
        impostor.close()


def test_unauthenticated_pickle_is_never_unpickled(server, tmp_path):
    marker = tmp_path / "pwned"
    body = pickle.dumps(("hello", Boom(str(marker))))
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.recv(20)  # the server's challenge, ignored by the attacker
        s.sendall(struct.pack(">Q", len(body)) + body + b"\x00" * 32)
        s.settimeout(5)
        try:
            assert s.recv(100) == b""  # dropped...
        except ConnectionResetError:
            pass  # ...or reset, with unread bytes still in its buffer
    assert wait_for(lambda: server.rejected == 1)
    assert not marker.exists()
    assert server.rec.messages == []


def test_tampered_frame_after_handshake_is_dropped_unread(server, tmp_path):
    marker = tmp_path / "pwned"
    conn = channel.connect("127.0.0.1", server.port, server._secret)
    conn.send("ok", 1)
    body = pickle.dumps(("evil", Boom(str(marker))))
    conn.sock.sendall(struct.pack(">Q", len(body)) + body + os.urandom(32))  # bad MAC
    assert wait_for(lambda: server.rec.closed)
    assert server.rec.messages == [("ok", 1)]
    assert isinstance(server.rec.closed[0], channel.ChannelError)
    assert not marker.exists()
    conn.close()


def test_replayed_frame_is_rejected(server):
    conn = channel.connect("127.0.0.1", server.port, server._secret)
    frames = []
    real_sendall = conn.sock.sendall
    conn.sock = _Tee(conn.sock, frames)
    conn.send("pay", 100)
    assert wait_for(lambda: len(server.rec.messages) == 1)
    real_sendall(b"".join(frames))  # the same bytes again: sequence number no longer matches
    assert wait_for(lambda: server.rec.closed)
    assert server.rec.messages == [("pay", 100)]
    assert isinstance(server.rec.closed[0], channel.ChannelError)


class _Tee:
    def __init__(self, sock, frames):
        self._sock, self._frames = sock, frames

    def sendall(self, data):
        self._frames.append(bytes(data))
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_large_buffers_travel_out_of_band_intact(server):
    blob = os.urandom(5_000_000)
    conn = channel.connect("127.0.0.1", server.port, server._secret)
    conn.send("result", {"blob": pickle.PickleBuffer(blob), "n": 1})
    conn.send("small", [1, 2])
    assert wait_for(lambda: len(server.rec.messages) == 2)
    (kind, data), second = server.rec.messages
    assert kind == "result" and bytes(data["blob"]) == blob and data["n"] == 1
    assert second == ("small", [1, 2])
    conn.close()


def test_a_tampered_out_of_band_buffer_is_rejected(server):
    conn = channel.connect("127.0.0.1", server.port, server._secret)
    conn.send("ok", 1)
    assert wait_for(lambda: len(server.rec.messages) == 1)
    # the next message's bytes, captured unsent, then sent by hand with one byte of its buffer flipped
    capture = []
    real, conn.sock = conn.sock, _Tee(_Null(), capture)
    conn.send("blob", pickle.PickleBuffer(b"x" * 1000))
    conn.sock = real
    raw = bytearray(b"".join(capture))
    raw[-40] ^= 1  # inside the buffer frame's data (its MAC is the last 32 bytes)
    real.sendall(bytes(raw))
    assert wait_for(lambda: server.rec.closed)
    assert [k for k, _ in server.rec.messages] == ["ok"]
    assert isinstance(server.rec.closed[0], channel.ChannelError)


class _Null:
    def sendall(self, data):
        pass


def test_a_driver_of_another_version_is_named_as_such():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def old_driver():
        s, _ = listener.accept()
        s.sendall(b"SDL1" + os.urandom(16))
        time.sleep(1)
        s.close()

    threading.Thread(target=old_driver, daemon=True).start()
    with pytest.raises(channel.ChannelError,
                       match=r"speaks channel version SDL1, this executor SDL2: install the same spark-dl version"):
        channel.connect("127.0.0.1", port, channel.new_secret())
    listener.close()


def test_a_driver_the_executor_cannot_reach_is_named_with_the_fix():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    t = time.monotonic()
    with pytest.raises(channel.ChannelError, match=rf"cannot reach the spark-dl driver at 127.0.0.1:{port} "
                                                   r"\(ConnectionRefusedError.*spark.driver.host.*Spark Connect"):
        channel.connect("127.0.0.1", port, channel.new_secret())
    assert time.monotonic() - t < 5
