"""The executor process: registers with the router over ZeroMQ and serves StepPlans.

Threads and sockets (zmq sockets are not thread-safe: each has one owner at a time).
* The main thread registers (Hello -> Welcome on a fresh main DEALER), then runs the plans
  one after another, in the order they came, and never touches the main socket while
  registered: it reads decoded messages from a queue and hands results to the I/O thread.
* The I/O thread (``MainSocketIO`` in io_threads.py, one per registration) owns the
  registered main DEALER
  from Welcome until re-registration or exit, when the main thread joins it and takes the
  socket back. It receives and decodes every message (its own Codec) into the main
  thread's queue while a step runs (torch releases the GIL in its kernels), so plan N+1 is
  decoded and waiting when step N ends; and it encodes and sends what the main thread
  queues (StepResult, ErrorReport, the goodbye), woken through an inproc PAIR socket polled
  together with the DEALER, so encoding overlaps the next forward. Messages keep their order
  both ways; a new registration gets a new I/O thread and new queues, so nothing queued for
  an old registration is ever sent on the new socket or executed after it.
* The heartbeat thread owns a second DEALER and sends ``Heartbeat(executor_id)`` every
  ``--heartbeat-timeout / 4`` seconds while registered, except while the main thread is
  inside a step that has run past its ``deadline_s`` (a hung kernel): then it stays silent
  (one ERROR line per step), so the router declares this executor dead and moves its
  requests; heartbeats resume when the step ends (the router then answers
  ``Shutdown(exit=False)`` and the executor registers again, below).
Neither DEALER sets a routing id: the router keys executors by the ``executor_id`` inside
the messages and answers on the routing id a message came from.

Router loss and return (what the router does):
* it echoes every Heartbeat of a registered executor back on the heartbeat socket (any
  message will do; an echoed Heartbeat is simplest);
* to a Heartbeat, StepResult or ErrorReport from an executor it does not know (it restarted,
  or declared the executor dead), it answers ``Shutdown(exit=False)`` on that socket.
The executor:
* treats ``Shutdown(exit=False)`` (on either socket) as "register again": it forgets every
  request, drops the plans not yet run, closes its main socket and sends a new Hello (its
  cache is empty from then on). On the main socket it is acted on in order, after the plans
  that came before it;
* once it has seen one heartbeat echo (ever), declares the router lost after
  ``2.5 * --heartbeat-timeout`` seconds without hearing anything from it (echo or message),
  and re-registers the same way. (A router that never echoes is tolerated: no loss detection.)
* registering: Hello, then up to 5 s for Welcome; otherwise the socket is dropped and Hello
  is sent again on a fresh one after a backoff of 0.5, 1, 2, 4, 8, 8, ... s, forever.
  ``Welcome(accepted=False)`` exits with code 3 and the reason on stderr.
* with ``--parent-pid`` (or ``PAGEDSERVE_PARENT_PID``, set by ``serve``) it exits (code 1)
  within about a second of its parent's death, whatever it is doing between steps.
* ``Shutdown(exit=True)`` exits with code 0 (after sending the results of the plans before it).
* SIGTERM (SIGINT when standalone) ends serving between two steps: it sends
  ``Shutdown(executor_id)`` ("I am stopping") after the results already due, and exits 0.
A message that does not decode (unknown type/version, malformed) is logged and answered with
``ErrorReport`` in its place in the order; it is never executed.

Testing hook (never set in production): ``PAGEDSERVE_FAULT_SLEEP_IN_STEP="<step_id>:<s>"``,
read once at start, makes the first step with that id sleep ``s`` seconds inside its forward
timing (a hung kernel, for the deadline tests); a malformed value exits with code 2.

``PAGEDSERVE_OVERLAP_STEPS=1`` or ``0`` turns overlapped steps (ModelRunner.submit: a step
left in flight while the next is launched) on or off whatever the device (default: on for
CUDA): on a CPU the tests run the overlapped loop with it; on a GPU it is the way back to one
step at a time.

``PAGEDSERVE_PLAN_PREP=io`` (default) or ``main``: which thread prepares a plan's plan-only
inputs (`ModelRunner.precompute`): the I/O thread as the plan arrives (on a CPU it overlaps
the forward, which releases the GIL), or the main thread when it runs the plan (the I/O
thread then only decodes: on a GPU its ~0.2 ms of numpy can otherwise take the GIL while the
main thread prepares and launches a step). A bad value exits with code 2. For A/B runs
(benchmarks/README, GPU check).

The kernels' switches, read where they apply and checked here at start (a bad value exits
with code 2): ``PAGEDSERVE_DECODE_FUSED_ROPE``, ``PAGEDSERVE_DECODE_TRITON_GEMM``,
``PAGEDSERVE_GRAPH_FEED`` and ``PAGEDSERVE_MIXED_DECODE_SPLIT`` (kernels/host_math.py,
executor/graph_feed.py); on a CPU, ``PAGEDSERVE_HOST_MALLOC=0`` leaves glibc's allocator as
it is (executor/host_malloc.py) and ``PAGEDSERVE_CPU_PACKED_WEIGHTS=0`` a 16-bit model's
projections in torch's layout (executor/packed_weights.py).

Exit codes: 0 shutdown, 1 parent died, 2 bad flags or model directory, 3 refused by router.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import queue
import signal
import sys
import time

import msgspec
import zmq
from pagedserve.executor.env_switches import FAULT_SLEEP_ENV, OVERLAP_ENV, PLAN_PREP_ENV
from pagedserve.executor.io_threads import (
    IDLE_WAKE_MS,
    POLL_MS,
    FlightWatch,
    HeartbeatThread,
    IOFailed,
    MainSocketIO,
    PlanReady,
    Rejected,
    StepDone,
)
from pagedserve.protos.codec import Codec
from pagedserve.protos.wire import (
    ErrorReport,
    Hello,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
    WireError,
)

from pagedserve.subprocs import ParentWatch

log = logging.getLogger("pagedserve.executor")

WELCOME_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 256 << 20
MAX_BACKOFF_S = 8.0


def _setup_logging(fmt: str) -> None:
    from pagedserve.logs import setup_logging
    setup_logging(fmt)


# --------------------------------------------------------------------------------- process


class ExecutorProcess:
    def __init__(self, runner, args: argparse.Namespace, hello: Hello,
                 curve: tuple[bytes, bytes, bytes] | None = None,
                 fault_sleep: tuple[int, float] | None = None,
                 io_cores: list[int] = (),
                 profile_window: tuple | None = None, plan_prep: str = "io") -> None:
        """`curve`: (public, secret, router public) as `load_curve_keys` returns; loaded
        from ``args.curve_keys`` when not given. `fault_sleep`: the testing hook (see the
        module docstring), set on the runner. `io_cores`: where the I/O and heartbeat
        threads run when the compute thread is pinned (pagedserve.affinity).
        `profile_window`: (folder, first step, count) of steps to profile
        (executor/step_trace.py, from ``PAGEDSERVE_TORCH_PROFILER_DIR``). `plan_prep`: "io"
        or "main", the thread that precomputes plans (``PAGEDSERVE_PLAN_PREP``)."""
        self.plan_prep = plan_prep
        if plan_prep != "io":
            log.info("%s=%s: plans prepared on the main thread", PLAN_PREP_ENV, plan_prep)
        self.io_cores = list(io_cores)
        self.curve = curve if curve is not None else load_curve_keys(args)
        self.runner = runner
        runner.before_forward = self._flush_results
        runner.result_ready = self._send_now
        overlap = os.environ.get(OVERLAP_ENV, "")
        if overlap in ("0", "1"):
            runner.overlap_steps = overlap == "1"
            log.info("%s=%s: overlapped steps %s", OVERLAP_ENV, overlap,
                     "on" if runner.overlap_steps else "off")
        if fault_sleep is not None:
            runner.fault_sleep = fault_sleep
            log.warning("testing hook %s: step %d will sleep %.3g s", FAULT_SLEEP_ENV,
                        *fault_sleep)
        self.args = args
        self.hello = hello
        self.executor_id = hello.executor_id
        self.codec = Codec()  # the main thread's, for registration
        self.ctx = zmq.Context()
        self.parent = ParentWatch(args.parent_pid)
        self.loss_timeout_s = 2.5 * args.heartbeat_timeout
        self.sock: zmq.Socket | None = None  # the main DEALER, when the main thread holds it
        self.io: MainSocketIO | None = None  # holds the main DEALER while registered
        self.last_heard = 0.0
        self.stopping = False
        self.heartbeat = HeartbeatThread(self.ctx, args.router, self.executor_id,
                                         args.heartbeat_timeout / 4, self._configure)
        self.heartbeat.cores = self.io_cores
        self.flight_watch = FlightWatch()  # started for the first step it watches
        self.profiler = None
        if profile_window is not None:
            from pagedserve.executor.step_trace import StepProfiler
            self.profiler = StepProfiler(runner, *profile_window, name=self.executor_id)

    def _flush_results(self) -> None:
        if self.io is not None:
            self.io.flush()

    def _send_now(self, result: StepResult) -> None:
        """A previous step's result read back after the next step's launch: the device is
        busy with that step, and the router plans the one after from this result."""
        self.io.send(result, wake=True)

    def _configure(self, sock: zmq.Socket) -> None:
        """Both DEALERs (main and heartbeat): a CURVE client with --curve-keys (our pair and
        the router's public key from the keygen folder, see pagedserve.keygen); the router's
        ZAP handler admits only authorized keys, so an unauthorized executor never hears a
        Welcome and keeps retrying (logged). Messages over MAX_MESSAGE_BYTES are dropped by
        ZeroMQ before they are read (a plan for 256 running requests is ~12 KB)."""
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.curve is None:
            return
        public, secret, server_public = self.curve
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_public

    # ---------------------------------------------------------------------------- sockets
    def _send(self, msg) -> None:
        """Registration only (the main thread holds the socket then)."""
        self.sock.send_multipart(self.codec.encode(msg), copy=False)

    def _new_socket(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.sock = self.ctx.socket(zmq.DEALER)
        self._configure(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.args.router)

    def _take_socket_back(self) -> None:
        """Stop this registration's I/O thread (it sends what is queued first) and hold
        the main socket in this thread again."""
        io, self.io = self.io, None
        if io is not None:
            io.close()
            self.sock = io.sock
            self.last_heard = max(self.last_heard, io.last_heard)

    def _check_parent(self) -> None:
        if self.stopping and not self.heartbeat.registered.is_set():
            raise SystemExit(0)  # SIGTERM while (re-)registering: nothing to hand over
        if not self.parent.alive():
            log.error("parent process %s died; exiting", self.parent.pid)
            raise SystemExit(1)

    def register(self) -> None:
        """Hello until Welcome, with backoff; starts from an empty cache state. The previous
        registration's I/O thread is stopped first: nothing queued for it reaches the new
        socket, and its plans not yet run are dropped."""
        self.heartbeat.registered.clear()
        self._take_socket_back()
        self.runner.reset()
        self.flight_watch.watched = -1  # the next registration's step ids may repeat
        attempt = 0
        while True:
            self._check_parent()
            self._new_socket()
            log.info("registering with %s as %s", self.args.router, self.executor_id)
            # the weights it runs now (a weight update since start: executor/weight_ops.py)
            self._send(msgspec.structs.replace(self.hello,
                                               weights_path=self.runner.weights.path))
            deadline = time.monotonic() + WELCOME_TIMEOUT_S
            while time.monotonic() < deadline:
                self._check_parent()
                if not self.sock.poll(POLL_MS):
                    continue
                msg = self._recv()
                if isinstance(msg, Welcome):
                    if not msg.accepted:
                        print(f"pagedserve executor: refused by the router: {msg.reason}",
                              file=sys.stderr)
                        raise SystemExit(3)
                    log.info("registered with %s", self.args.router)
                    self.last_heard = time.monotonic()
                    self.heartbeat.reregister.clear()
                    self.io = MainSocketIO(
                        self.ctx, self.sock, self.io_cores,
                        self.runner.precompute if self.plan_prep == "io" else None)
                    self.sock = None  # the I/O thread's until _take_socket_back
                    self.io.start()
                    self.heartbeat.registered.set()
                    return
                if isinstance(msg, Shutdown) and msg.exit:
                    raise SystemExit(0)
            backoff = min(MAX_BACKOFF_S, 0.5 * 2 ** attempt)
            attempt += 1
            log.warning("no Welcome from %s%s; retrying in %.1f s", self.args.router,
                        " (is this executor's CURVE key authorized there?)"
                        if self.curve else "", backoff)
            end = time.monotonic() + backoff
            while time.monotonic() < end:
                self._check_parent()
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))

    def _recv(self):
        """One message from the main socket while registering, or None when it does not
        decode."""
        frames = self.sock.recv_multipart(copy=False)
        self.last_heard = time.monotonic()
        try:
            return self.codec.decode(frames)
        except WireError as exc:
            log.error("rejected a message from the router: %s", exc)
            self._send(ErrorReport(message=f"rejected: {exc}", executor_id=self.executor_id))
            return None

    def _router_lost(self) -> bool:
        hb = self.heartbeat
        if hb.reregister.is_set():
            log.warning("router asked us to register again")
            return True
        if hb.last_reply == 0.0:
            return False  # this router never echoed a heartbeat: loss detection off
        heard = max(self.last_heard, self.io.last_heard if self.io is not None else 0.0)
        silent = time.monotonic() - max(heard, hb.last_reply)
        if silent > self.loss_timeout_s:
            log.warning("router silent for %.1f s; registering again", silent)
            return True
        return False

    def _install_signal_handlers(self) -> None:
        """SIGTERM (and SIGINT, unless `serve` is the parent: Ctrl-C reaches the whole
        process group, and the parent drains) ends serving between two steps: the executor
        tells the router it is stopping, so its requests move to other executors at once."""
        def stop(signum, frame):
            self.stopping = True
        signal.signal(signal.SIGTERM, stop)
        if self.args.parent_pid is None:
            signal.signal(signal.SIGINT, stop)
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _say_goodbye(self) -> None:
        log.info("stopping: handing my requests back to the router")
        if self.io is not None:  # after the results already queued
            self.io.send(Shutdown(reason="executor stopping", executor_id=self.executor_id))
            self._take_socket_back()
        if self.sock is not None:
            self.sock.close(linger=1000)  # let the goodbye leave before the socket goes
            self.sock = None

    def _execute(self, plan: StepPlan, inputs=None) -> None:
        """Run one plan (ModelRunner.submit: it may stay in flight until the next plan is
        launched or `_collect`); the results that became ready go out through the I/O
        thread. A result whose step left nothing in flight (the runner computed it all)
        waits for the next forward's start or the idle flush, as before: the I/O thread
        then encodes it while torch computes, not while the main thread prepares the next
        step. A previous step's result read back after this step's launch goes at once:
        the device is busy with this step, and the router plans the step after from it."""
        hb = self.heartbeat
        if self.profiler is not None and not self.profiler.done:
            self.profiler.io_owner = self.io
            self.profiler.before_step(plan.step_id)  # may write a trace: before the step
        hb.begin_step(plan.step_id, plan.deadline_s)
        start = time.monotonic()
        try:
            results = self.runner.submit(plan, inputs)
            hb.steps_done = self.runner.steps_done  # before end_step: a beat that says
        finally:  # "steps_done" N+1 left after step N+1 ended (the deadline test reads it)
            hb.end_step()
        for result in results:
            self.io.send(result, wake=result.step_id != plan.step_id)
        if plan.deadline_s > 0 and time.monotonic() - start > plan.deadline_s:
            log.warning("step %d ended %.3g s after it started (deadline %.3g s); heartbeats "
                        "resume", plan.step_id, time.monotonic() - start, plan.deadline_s)

    def _collect(self) -> None:
        """No plan waiting: the step in flight is read back and its result sent."""
        inflight = self.runner.inflight_step
        if inflight is None:
            return
        hb = self.heartbeat
        hb.begin_step(*inflight)
        try:
            result = self.runner.collect()
            hb.steps_done = self.runner.steps_done
        finally:
            hb.end_step()
        if result is not None:
            self.io.send(result, wake=False)

    def serve(self) -> int:
        """Register, then execute plans in order until Shutdown(exit=True) or SIGTERM.

        The main loop blocks on the I/O thread's inbox (no polling sleeps: a plan already
        decoded is taken at once); every IDLE_WAKE_MS without a message, and between
        messages at most every POLL_MS, it checks the parent and the router's liveness. An
        idle wait also ends IDLE_WAKE_MS after SIGTERM at most (a signal handler cannot
        safely put on the inbox: the main thread may hold its lock)."""
        self.stopping = False
        with contextlib.suppress(ValueError):  # not the main thread (in-process tests)
            self._install_signal_handlers()
        self.heartbeat.start()
        poll_s = POLL_MS / 1000
        idle_s = IDLE_WAKE_MS / 1000
        try:
            self.register()
            next_check = 0.0
            while True:
                if self.stopping:
                    self._collect()  # the step in flight answered before the goodbye
                    self._say_goodbye()
                    return 0
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + poll_s
                    self._check_parent()
                    if self._router_lost():
                        self.register()
                        continue
                try:
                    msg = self.io.inbox.get_nowait()
                except queue.Empty:
                    # Nothing to run next: results go out now; a step in flight answers
                    # now if the device is done with it, else when it is (StepDone) or
                    # when the next plan comes, whichever is first.
                    self.io.flush()
                    if self.flight_watch.ask(self.runner, self.io.inbox):
                        self._collect()
                        self.io.flush()
                        continue
                    msg = None
                try:
                    if msg is None:
                        msg = self.io.inbox.get(timeout=idle_s)
                except queue.Empty:
                    next_check = 0.0
                    continue
                if isinstance(msg, PlanReady):
                    self._execute(msg.plan, msg.inputs)
                elif isinstance(msg, StepDone):
                    inflight = self.runner.inflight_step
                    if inflight is not None and inflight[0] == msg.step_id:
                        self._collect()
                        self.io.flush()
                elif isinstance(msg, Rejected):
                    self.io.send(ErrorReport(message=f"rejected: {msg.reason}",
                                             executor_id=self.executor_id))
                elif isinstance(msg, Shutdown):
                    if msg.exit:
                        log.info("shutdown: %s", msg.reason or "asked by the router")
                        self._collect()
                        self._take_socket_back()
                        self.sock.close(linger=1000)  # the last results leave first
                        self.sock = None
                        return 0
                    log.info("router asked us to forget all state: %s", msg.reason)
                    self.register()
                elif isinstance(msg, IOFailed):
                    log.error("main socket failed (%s); registering again", msg.reason)
                    self.register()
                elif not isinstance(msg, Welcome):
                    log.warning("ignoring %s on the main socket", type(msg).__name__)
        finally:
            if self.profiler is not None:
                self.profiler.close()
            self._take_socket_back()  # sends the results still queued (Shutdown(exit=True))
            self.flight_watch.stop()
            self.heartbeat.stop.set()
            if self.sock is not None:
                self.sock.close(0)
            # Terminating the context ends the heartbeat thread's poll at once (ETERM), and
            # returns when its socket is closed.
            self.ctx.term()
            self.heartbeat.join(timeout=2)


def load_curve_keys(args: argparse.Namespace) -> tuple[bytes, bytes, bytes] | None:
    """(own public, own secret, router public) from ``--curve-keys``; None without it.
    Raises pagedserve.keygen.KeyFolderError."""
    if not getattr(args, "curve_keys", None):
        return None
    from pagedserve.keygen import KeyFolderError, executor_keys
    if not zmq.has("curve"):
        raise KeyFolderError("this libzmq was built without CURVE")
    return executor_keys(args.curve_keys)


def main(argv: list[str] | None = None) -> int:
    """`python -m pagedserve.executor.process ...` is `pagedserve executor ...`: one flag table
    (pagedserve/flags.py, DESIGN §4) for every way of starting an executor."""
    from pagedserve.cli import main as cli_main

    return cli_main(["executor", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
