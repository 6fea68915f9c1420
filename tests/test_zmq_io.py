"""protos/zmq_io.py: multipart messages frame by frame, as pyzmq's send/recv_multipart."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from pagedserve.protos.zmq_io import NOBLOCK, recv_frames, send_frames


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://zmq-io-test")
    b.connect("inproc://zmq-io-test")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


def test_a_message_arrives_whole_and_in_order(pair):
    a, b = pair
    arr = np.arange(5, dtype=np.int64)
    send_frames(a, [b"head", memoryview(b"mid"), arr, b""], NOBLOCK)
    send_frames(a, [b"second"])
    frames = recv_frames(b, NOBLOCK)
    assert [f.bytes for f in frames] == [b"head", b"mid", arr.tobytes(), b""]
    assert [f.bytes for f in recv_frames(b)] == [b"second"]
    with pytest.raises(zmq.Again):
        recv_frames(b, NOBLOCK)


def test_interoperates_with_pyzmq_multipart(pair):
    a, b = pair
    a.send_multipart([b"x", b"yy", b"zzz"])
    assert [f.bytes for f in recv_frames(b, NOBLOCK)] == [b"x", b"yy", b"zzz"]
    send_frames(b, [b"1", b"22"])
    assert a.recv_multipart() == [b"1", b"22"]


def test_a_frame_that_is_no_buffer_sends_nothing(pair):
    a, b = pair
    with pytest.raises(TypeError):
        send_frames(a, [b"first", object()], NOBLOCK)
    send_frames(a, [b"next"], NOBLOCK)  # not glued to a half-sent message
    assert [f.bytes for f in recv_frames(b, NOBLOCK)] == [b"next"]
    with pytest.raises(zmq.Again):
        recv_frames(b, NOBLOCK)
