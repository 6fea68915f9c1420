"""Reading a plain ZeroMQ socket from the asyncio event loop's thread.

The loop watches the socket's file descriptor (``add_reader``); zmq.asyncio's future per
receive cost ~50 µs a round trip (benchmarks/hop_bench.py). ZeroMQ's descriptor is
edge-triggered: it signals a change, not a level, so each wake-up reads until the socket says
it is empty, and after a send the owner calls ``poke()`` (a send processes the socket's
pending commands and can consume the signal of messages that arrived meanwhile). At most
``batch`` messages a turn: then the loop runs its other callbacks (step loops, gRPC) and the
drain comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq

from ..protos.zmq_io import EVENTS, NOBLOCK, POLLIN, recv_frames

DRAIN_BATCH = 64  # messages received per event-loop turn before yielding


class SocketReader:
    """Calls `on_frames(frames)` (a list of zmq.Frame) for every message of `sock`, on the
    running loop. `on_frames` must not raise (the owner logs its own errors)."""

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list], None],
                 log: logging.Logger, batch: int = DRAIN_BATCH) -> None:
        self._sock = sock
        self._on_frames = on_frames
        self._log = log
        self._batch = batch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd: int | None = None
        self._scheduled = False

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = self._sock.getsockopt(zmq.FD)
        self._loop.add_reader(self._fd, self._drain)
        self._schedule()  # anything that arrived before the reader was added

    def stop(self) -> None:
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)
        self._fd = None

    def poke(self) -> None:
        """After a send on the socket: drain soon if it holds messages (asking the socket
        costs a few microseconds: not when a drain is already coming)."""
        if self._fd is not None and not self._scheduled \
                and self._sock.getsockopt(EVENTS) & POLLIN:
            self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._loop is not None:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        self._scheduled = False
        for _ in range(self._batch):
            try:
                frames = recv_frames(self._sock, NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                if self._fd is not None:  # else closing
                    self._log.error("socket error: %s", exc)
                return
            self._on_frames(frames)
        self._schedule()
