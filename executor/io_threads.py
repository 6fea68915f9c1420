"""The executor process's two socket threads (executor/process.py has the protocol).

* `HeartbeatThread`: its own DEALER; a Heartbeat every interval while registered and while
  the main thread's current step is within its deadline (a step past it silences the
  heartbeats, so the router declares a hung executor dead); records router echoes and
  "register again" requests.
* `FlightWatch`: waits for a step left in flight to finish on the device and puts
  `StepDone` in the main thread's inbox (asked only when the inbox is empty and the step
  is still running, so the main thread would otherwise wait for the next plan alone).
* `MainSocketIO`: owns the registered main DEALER for one registration. It decodes every
  message into `inbox` (a plan with its plan-only inputs prepared ahead, `PlanReady`; an
  undecodable message as `Rejected`; its own failure as `IOFailed`) and sends what the main
  thread queues, in order, when woken.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import queue
import threading
import time
from typing import NamedTuple

import zmq
from pagedserve.protos.codec import Codec
from pagedserve.protos.wire import Heartbeat, Shutdown, StepPlan, WireError
from pagedserve.protos.zmq_io import NOBLOCK, recv_frames, send_frames

from pagedserve.affinity import name_current_thread, pin_current_thread

log = logging.getLogger("pagedserve.executor")

POLL_MS = 200
IDLE_WAKE_MS = 50  # the executor's idle main loop looks at its stop flag this often
IO_JOIN_TIMEOUT_S = 5.0


# --------------------------------------------------------------------------------- heartbeat


class HeartbeatThread(threading.Thread):
    """Sends Heartbeats on its own DEALER while ``registered`` is set and the current step
    (``begin_step``/``end_step``, from the main thread) is within its deadline; records
    when the router last answered and whether it asked us to register again."""

    def __init__(self, ctx: zmq.Context, address: str, executor_id: str, interval_s: float,
                 configure) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.ctx, self.address, self.executor_id = ctx, address, executor_id
        self.interval_s = interval_s
        self.configure = configure
        self.cores: list[int] = []  # where this thread runs (empty: where it is created)
        self.registered = threading.Event()
        self.stop = threading.Event()
        self.reregister = threading.Event()
        self.last_reply = 0.0  # monotonic; 0 = never
        self.steps_done = 0
        # (step id, monotonic start, deadline_s) of the step the main thread is in, when it
        # has a deadline; replaced as a whole (one attribute store), read without a lock.
        self._step: tuple[int, float, float] | None = None
        self._overrun_logged: tuple[int, float, float] | None = None

    def begin_step(self, step_id: int, deadline_s: float) -> None:
        self._step = (step_id, time.monotonic(), deadline_s) if deadline_s > 0 else None

    def end_step(self) -> None:
        self._step = None

    def overran(self, now: float) -> bool:
        """Is the main thread inside a step past its deadline? Logs once per step."""
        step = self._step
        if step is None or now - step[1] <= step[2]:
            return False
        if self._overrun_logged is not step:
            self._overrun_logged = step
            log.error("step %d overran its deadline of %.3g s: heartbeats stop until it ends, "
                      "so the router declares this executor dead", step[0], step[2])
        return True

    def run(self) -> None:
        name_current_thread(self.name)
        pin_current_thread(self.cores)  # off the compute cores (pagedserve.affinity)
        codec = Codec()
        sock = self.ctx.socket(zmq.DEALER)
        self.configure(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.address)
        next_beat = 0.0
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                if self.registered.is_set() and now >= next_beat and not self.overran(now):
                    beat = Heartbeat(executor_id=self.executor_id, time_s=time.time(),
                                     steps_done=self.steps_done)
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(codec.encode(beat), flags=zmq.NOBLOCK, copy=False)
                    next_beat = now + self.interval_s
                if sock.poll(min(POLL_MS, int(self.interval_s * 1000))):
                    frames = sock.recv_multipart(copy=False)
                    try:
                        msg = codec.decode(frames)
                    except WireError as exc:
                        log.warning("heartbeat socket: rejected message: %s", exc)
                        continue
                    self.last_reply = time.monotonic()
                    if isinstance(msg, Shutdown) and not msg.exit:
                        self.reregister.set()
        except zmq.ContextTerminated:  # the process is stopping (ExecutorProcess.serve)
            pass
        finally:
            sock.close(0)


# --------------------------------------------------------------------------------- main I/O


class Rejected(NamedTuple):
    """In the inbox in place of a message that did not decode: answer with an ErrorReport."""

    reason: str


class PlanReady(NamedTuple):
    """In the inbox for a StepPlan: the plan and what the I/O thread prepared from it alone
    (`ModelRunner.precompute`, None when it could not)."""

    plan: StepPlan
    inputs: object


class IOFailed(NamedTuple):
    """In the inbox when the I/O thread stopped on an error: register again."""

    reason: str


_STOP = object()  # in the outbox: send nothing more, stop the I/O thread
_IO_IDS = itertools.count()


class MainSocketIO(threading.Thread):
    """The registered main DEALER of one registration, owned by this thread until
    ``close()`` hands it back.

    Inbound: every message is decoded here and put on ``inbox`` in arrival order (a message
    that does not decode as ``Rejected``), ``last_heard`` updated. Outbound: ``send(msg)``
    (main thread) queues a message and wakes this thread through an inproc PAIR; it encodes
    and sends queued messages in order. No polling sleeps: one ``zmq.Poller`` over the
    DEALER and the wake-up socket, blocking until either has something.
    """

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, cores: list[int] = (),
                 precompute=None) -> None:
        super().__init__(name="executor-io", daemon=True)
        # plan -> its plan-only inputs, prepared here while the main thread computes the
        # step before (ModelRunner.precompute); None: the main thread does it all.
        self.precompute = precompute
        self.cores = list(cores)  # where this thread runs (empty: where it is created)
        self.sock = sock
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.last_heard = time.monotonic()  # written here, read by the main thread
        self._outbox: collections.deque = collections.deque()
        address = f"inproc://pagedserve-executor-io-{next(_IO_IDS)}"
        self._wake_rx = ctx.socket(zmq.PAIR)  # this thread's, from start()
        self._wake_rx.setsockopt(zmq.LINGER, 0)
        self._wake_rx.bind(address)
        self._wake_tx = ctx.socket(zmq.PAIR)  # the main thread's
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(address)

    # main thread ---------------------------------------------------------------------
    def send(self, msg, wake: bool = True) -> None:
        """Queue ``msg`` to go out after everything queued before it. ``wake=False`` leaves
        it queued until the next ``flush()`` (or a send that wakes)."""
        self._outbox.append(msg)
        if wake:
            self.flush()

    def flush(self) -> None:
        """Wake this thread to send what is queued (a no-op when nothing is)."""
        if not self._outbox:
            return
        # Never blocks: if the thread is gone (IOFailed is on its way) nobody needs waking;
        # if 1,000 wake-ups are unread, the thread will find this message with the others.
        with contextlib.suppress(zmq.Again):
            self._wake_tx.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Send what is queued, stop the thread and take the main socket back (the caller
        closes it). Inbound messages not yet read are dropped."""
        if self.is_alive():
            self.send(_STOP)
            self.join(IO_JOIN_TIMEOUT_S)
            if self.is_alive():  # a send stuck for seconds: the socket stays with it
                log.error("main socket I/O thread did not stop; abandoning its socket")
                self.sock = None
        self._wake_tx.close(0)

    # this thread ---------------------------------------------------------------------
    def run(self) -> None:
        name_current_thread(self.name)
        pin_current_thread(self.cores)  # off the compute cores (pagedserve.affinity)
        codec = Codec()
        sock, wake = self.sock, self._wake_rx
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            wake.recv(zmq.NOBLOCK)
                    while self._outbox:
                        msg = self._outbox.popleft()
                        if msg is _STOP:
                            return
                        send_frames(sock, codec.encode(msg))
                if sock in ready:
                    self._receive(sock, codec)
        except Exception as exc:  # noqa: BLE001 - handed to the main thread, which re-registers
            log.exception("main socket I/O failed")
            self.inbox.put(IOFailed(f"{type(exc).__name__}: {exc}"))
        finally:
            wake.close(0)

    def _receive(self, sock: zmq.Socket, codec: Codec) -> None:
        with contextlib.suppress(zmq.Again):
            while True:
                frames = recv_frames(sock, NOBLOCK)
                self.last_heard = time.monotonic()
                try:
                    msg = codec.decode(frames)
                except WireError as exc:
                    log.error("rejected a message from the router: %s", exc)
                    self.inbox.put(Rejected(str(exc)))
                    continue
                if isinstance(msg, StepPlan):
                    inputs = None
                    if self.precompute is not None:
                        try:
                            inputs = self.precompute(msg)
                        except Exception:  # noqa: BLE001 - the main thread redoes it, reports
                            log.exception("preparing plan %d ahead failed", msg.step_id)
                    msg = PlanReady(msg, inputs)
                self.inbox.put(msg)


# ----------------------------------------------------------------------------- flight watch


class StepDone(NamedTuple):
    """In the inbox when the step in flight (ModelRunner.submit) is done on the device."""
    step_id: int


class FlightWatch(threading.Thread):
    """Waits for the steps it is given to finish on the device (an event wait, the GIL
    released) and then puts `StepDone` in the inbox it was given: the main loop blocks on
    the inbox alone, and wakes for whichever comes first, the next plan (then the step in
    flight is read back after the next launch) or the device's end of the step (then it is
    read back and answered at once, as the router may be waiting for it).

    `ask` is the main thread's rule for when to use it (the thread starts at the first
    step it is given)."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="flight-watch")
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.watched = -1  # the step id last given (-1: none; reset on registering again)

    def ask(self, runner, inbox: queue.SimpleQueue) -> bool:
        """The main thread has no plan and is about to wait on ``inbox``: True when the
        `ModelRunner`'s step in flight is done on the device already (read it back now, no
        thread hand-over); else the watch puts `StepDone` there once it is (given each step
        once), False. Only then: while plans keep coming, each is launched before the step
        in flight is read back, and watching every step was a wake-up, a GIL hand-over and
        an inbox message a step, each thrown away."""
        sampled = runner.inflight_sampled()
        if sampled is None:
            return False
        if sampled.done():
            return True
        step_id = runner.inflight_step[0]
        if step_id != self.watched:
            if not self.is_alive():
                self.start()
            self.watched = step_id
            self.jobs.put((step_id, sampled.wait, inbox))
        return False

    def stop(self) -> None:
        if self.is_alive():
            self.jobs.put(None)

    def run(self) -> None:
        name_current_thread(self.name)
        while (job := self.jobs.get()) is not None:
            step_id, wait, inbox = job
            with contextlib.suppress(Exception):  # the main thread meets it when it reads
                wait()
            inbox.put(StepDone(step_id))
