"""A fake executor PROCESS that speaks the real router <-> executor wire protocol (DESIGN §2)
and does no model work: no torch import, it starts in well under a second and holds a few
tens of MB, so clusters of fake executors are cheap.

    python tests/wire_fake_executor.py --router tcp://127.0.0.1:5557 --executor-id f0 \
        --num-gpu-blocks 64 --num-cpu-blocks 16 --block-size 16 --model DIR

Like `executor/process.py` it registers with a Hello (two DEALER sockets: main + heartbeat
thread), re-registers with an empty state when the router asks (Shutdown(exit=False)) or goes
silent, and says goodbye on SIGTERM. Every StepPlan is answered, in order, with a StepResult
whose sampled token is deterministic, ``(position * 31 + 7) % vocab`` (bumped past EOS and
stop ids, so only max_tokens ends a request), after sleeping ``--step-delay-s`` (its
``forward_s``; ``gap_s`` is the time from the end of the previous step to the start of this
one's "forward", ``sample_s`` the fake's own bookkeeping). With ``--eos-at N`` the token
sampled at output position N (0 = the first output token) is the model's first EOS id
(``--eos-token-id``, else read from the model directory as the router does), unless
min_tokens masks it, as the real sampler does; an ignore_eos request then goes on.

Pipelining (protocol 2): plans are received as they come, also while earlier ones are still
unanswered (the router may send plan N+1 before N's result is back). A decode marked in
``feed_sampled`` has the -1 placeholder as its token: the fake feeds it the token it sampled
for that request in step N-1. If it sampled none there because step N-1 errored the request
(or failed as a whole), the row is answered with a RequestError in this step, as the real
executor does; a marked row whose request was simply not sampled in N-1, or a -1 in an
unmarked row, is a violation.

It tracks requests the way a real executor does (new requests, forks, finished ids, block
tables from their changes, swapped-out tables) and VERIFIES each plan against that state:
unknown request ids, block ids out of range, a block both source and destination, a token or
position that disagrees with what the request holds, a slot that is not where the block table
says, a write into a block another live request's table holds, the marked-decode rules above.
A request that fails a check gets an error in the result (as a real executor would); every
failed check is also kept as a "violation" in the state file, so tests double as protocol
checks. That model and its checks are `fake_plan_checker.PlanChecker`; this file is the
process around it (sockets, heartbeats, registration, control and state files).

Control (for reaching states deterministically): ``--control-file`` holds an integer, the
number of steps the executor may have answered in total; plans beyond it are received and
held, unanswered, until the file allows them (empty or missing file: no limit). Heartbeats go
on meanwhile. "N hang" also stops the fake from registering again (`FakeControl.hang`: a
main thread stuck in a kernel cannot; `pause` re-registers when the router drops it).
``--state-file`` is rewritten (atomically) whenever something changes: steps answered, every
unanswered plan (``unanswered``, oldest first; ``held`` is the oldest, the next to be
answered), known requests, violations, registrations. `FakeControl` wraps both for tests.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path

import msgspec
import zmq

# Its sibling modules: run as a script under PYTHONSAFEPATH=1 (the GPU check's steps), the
# script's own folder is not on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_plan_checker import PlanChecker  # noqa: E402
from pagedserve.protos.codec import Codec
from pagedserve.protos.wire import (
    ErrorReport,
    Heartbeat,
    Hello,
    Shutdown,
    StepPlan,
    Welcome,
    WireError,
)
from pagedserve.router.tokenizer import read_eos_token_ids

POLL_MS = 5
WELCOME_TIMEOUT_S = 3.0
MAX_BACKOFF_S = 4.0


class FakeExecutor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.codec = Codec()
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.steps_done = 0
        self.registrations = 0
        # Received, not yet answered, oldest first (the router may send up to
        # --pipeline-depth plans before the first is answered).
        self.unanswered: deque[StepPlan] = deque()
        self.last_end = 0.0  # monotonic end of the previous step's sampling (0: none yet)
        self.checker = PlanChecker(args, self._eos_token_id(args))
        self.stopping = False
        self.registered = threading.Event()
        self.reregister = threading.Event()
        self.hb_stop = threading.Event()
        self.hb_last_reply = 0.0
        self.last_heard = 0.0
        self.hello = Hello(
            executor_id=args.executor_id, model_fingerprint=args.model_fingerprint,
            device="fake", dtype="float32", block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks, num_cpu_blocks=args.num_cpu_blocks,
            max_model_len=args.max_model_len, pid=os.getpid(), hostname="fake")

    @staticmethod
    def _eos_token_id(args: argparse.Namespace) -> int | None:
        """The id --eos-at samples: --eos-token-id, else the model's first EOS id."""
        if args.eos_at is None:
            return None
        if args.eos_token_id is not None:
            return args.eos_token_id
        ids = read_eos_token_ids(args.model) if args.model else ()
        if not ids:
            raise SystemExit("wire_fake_executor: --eos-at needs --eos-token-id or a --model "
                             "whose config names an eos_token_id")
        return ids[0]

    # ------------------------------------------------------------------------ state file
    @staticmethod
    def _plan_state(p: StepPlan) -> dict:
        """What a test needs to know about an unanswered plan."""
        arr = lambda a: [] if a is None else a.tolist()  # noqa: E731
        marked = arr(p.feed_sampled) or [0] * len(p.request_ids)
        return {"step_id": p.step_id, "request_ids": list(p.request_ids),
                "num_computed": arr(p.num_computed_tokens), "num_new": arr(p.num_new_tokens),
                "do_sample": arr(p.do_sample), "feed_sampled": marked,
                "marked_ids": [r for r, m in zip(p.request_ids, marked, strict=True) if m],
                "new_requests": [r.request_id for r in p.new_requests],
                "finished_ids": list(p.finished_ids), "deadline_s": p.deadline_s}

    def write_state(self) -> None:
        if not self.args.state_file:
            return
        plans = [self._plan_state(p) for p in self.unanswered]
        state = {"steps_done": self.steps_done, "held": plans[0] if plans else None,
                 "unanswered": plans, "num_unanswered": len(plans), **self.checker.state(),
                 "registrations": self.registrations, "pid": os.getpid()}
        tmp = self.args.state_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self.args.state_file)

    def may_answer(self, budget: int | None) -> bool:
        return budget is None or self.steps_done < budget

    def read_control(self) -> tuple[int | None, bool]:
        """(step budget or None, hung): the control file holds "", "N" or "N hang"."""
        if not self.args.control_file:
            return None, False
        try:
            words = Path(self.args.control_file).read_text().split()
        except FileNotFoundError:
            return None, False
        budget = int(words[0]) if words and words[0].isdigit() else None
        return budget, "hang" in words

    # ------------------------------------------------------------------------ heartbeat
    def heartbeat_loop(self) -> None:
        codec = Codec()
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.args.router)
        interval = self.args.heartbeat_timeout / 4
        next_beat = 0.0
        try:
            while not self.hb_stop.is_set():
                now = time.monotonic()
                if self.registered.is_set() and now >= next_beat:
                    beat = Heartbeat(executor_id=self.args.executor_id, time_s=time.time(),
                                     steps_done=self.steps_done)
                    with contextlib.suppress(zmq.Again):
                        sock.send_multipart(codec.encode(beat), flags=zmq.NOBLOCK, copy=False)
                    next_beat = now + interval
                if sock.poll(min(100, int(interval * 1000))):
                    frames = sock.recv_multipart(copy=False)
                    try:
                        msg = codec.decode(frames)
                    except WireError as exc:
                        print(f"fake {self.args.executor_id}: heartbeat socket rejected: {exc}",
                              file=sys.stderr, flush=True)
                        continue
                    self.hb_last_reply = time.monotonic()
                    if isinstance(msg, Shutdown) and not msg.exit:
                        self.reregister.set()
        finally:
            sock.close(0)

    # ------------------------------------------------------------------------ main socket
    def _send(self, msg) -> None:
        self.sock.send_multipart(self.codec.encode(msg), copy=False)

    def _recv(self):
        frames = self.sock.recv_multipart(copy=False)
        self.last_heard = time.monotonic()
        try:
            return self.codec.decode(frames)
        except WireError as exc:
            self.checker.violations.append(f"undecodable message: {exc}")
            print(f"fake {self.args.executor_id}: rejected a message: {exc}", file=sys.stderr,
                  flush=True)
            self._send(ErrorReport(message=f"rejected: {exc}",
                                   executor_id=self.args.executor_id))
            return None

    def register(self) -> None:
        self.registered.clear()
        self.checker.reset()
        self.unanswered.clear()
        self.last_end = 0.0
        attempt = 0
        while not self.stopping:
            if self.sock is not None:
                self.sock.close(0)
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(self.args.router)
            self._send(self.hello)
            deadline = time.monotonic() + WELCOME_TIMEOUT_S
            while time.monotonic() < deadline and not self.stopping:
                if not self.sock.poll(100):
                    continue
                msg = self._recv()
                if isinstance(msg, Welcome):
                    if not msg.accepted:
                        print(f"fake executor: refused by the router: {msg.reason}",
                              file=sys.stderr, flush=True)
                        raise SystemExit(3)
                    self.registrations += 1
                    self.last_heard = time.monotonic()
                    self.hb_last_reply = 0.0
                    self.reregister.clear()
                    self.registered.set()
                    print(f"fake {self.args.executor_id}: registered", flush=True)
                    self.write_state()
                    return
                if isinstance(msg, Shutdown) and msg.exit:
                    raise SystemExit(0)
            backoff = min(MAX_BACKOFF_S, 0.25 * 2 ** attempt)
            attempt += 1
            end = time.monotonic() + backoff
            while time.monotonic() < end and not self.stopping:
                time.sleep(0.05)
        raise SystemExit(0)

    def router_lost(self) -> bool:
        if self.reregister.is_set():
            return True
        if self.hb_last_reply == 0.0:
            return False
        silent = time.monotonic() - max(self.last_heard, self.hb_last_reply)
        return silent > 2.5 * self.args.heartbeat_timeout

    def serve(self) -> int:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        hb = threading.Thread(target=self.heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        try:
            self.register()
            while True:
                if self.stopping:
                    self.sock.setsockopt(zmq.LINGER, 1000)
                    self._send(Shutdown(reason="executor stopping",
                                        executor_id=self.args.executor_id))
                    return 0
                budget, hung = self.read_control()
                # Hung: the main thread is "stuck in a kernel": it answers nothing and never
                # re-registers; plans still arrive (a real executor's I/O thread takes them)
                # and heartbeats go on.
                if not hung and self.router_lost():
                    self.register()
                    continue
                # Take in whatever has arrived first (plans queue up behind an unanswered
                # one), then answer the oldest plan if the budget allows.
                ready = bool(self.unanswered) and not hung and self.may_answer(budget)
                if not self.sock.poll(0 if ready else POLL_MS):
                    if ready:
                        self.answer(self.unanswered.popleft())
                    continue
                msg = self._recv()
                if isinstance(msg, StepPlan):
                    self.unanswered.append(msg)
                    self.write_state()
                elif isinstance(msg, Shutdown):
                    if msg.exit:
                        return 0
                    if hung:
                        self.reregister.set()  # done once the main thread is unstuck
                    else:
                        self.register()
                elif msg is not None and not isinstance(msg, Welcome):
                    self.checker.violations.append(
                        f"unexpected {type(msg).__name__} on main socket")
        except SystemExit as exc:
            return int(exc.code or 0)
        finally:
            self.hb_stop.set()
            hb.join(timeout=2)
            if self.sock is not None:
                self.sock.close(0)
            self.ctx.term()

    def answer(self, plan: StepPlan) -> None:
        """Run one plan: "forward" (sleep --step-delay-s), then check and sample."""
        t_start = time.monotonic()
        gap_s = t_start - self.last_end if self.last_end else 0.0
        forward_s = 0.0
        if self.args.step_delay_s > 0:
            time.sleep(self.args.step_delay_s)
            forward_s = time.monotonic() - t_start
        t_sample = time.monotonic()
        result = self.checker.execute(plan)
        self.last_end = time.monotonic()
        self.checker.record(plan.step_id, result)
        self.steps_done += 1
        self.write_state()  # before the result: a test that saw the result sees the state
        self._send(msgspec.structs.replace(result, forward_s=forward_s,
                                           sample_s=self.last_end - t_sample, gap_s=gap_s))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="wire_fake_executor")
    p.add_argument("--router", default="tcp://127.0.0.1:5557")
    p.add_argument("--executor-id", default=f"fake-{os.getpid()}")
    p.add_argument("--num-gpu-blocks", type=int, default=256)
    p.add_argument("--num-cpu-blocks", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--model", help="model directory (fingerprint = sha256 of config.json)")
    p.add_argument("--model-fingerprint", default="")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--step-delay-s", type=float, default=0.0,
                   help="seconds each step's 'forward' takes (its forward_s)")
    p.add_argument("--eos-at", type=int, default=None, metavar="N",
                   help="the token sampled at output position N (0: the first) is EOS "
                        "(default: never EOS)")
    p.add_argument("--eos-token-id", type=int, default=None,
                   help="the EOS id --eos-at samples (default: the model's first EOS id)")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0)
    p.add_argument("--control-file", default="")
    p.add_argument("--state-file", default="")
    p.add_argument("--verbose", action="store_true", help="print every plan on stderr")
    args = p.parse_args(argv)
    if args.model and not args.model_fingerprint:
        data = (Path(args.model) / "config.json").read_bytes()
        args.model_fingerprint = hashlib.sha256(data).hexdigest()
    if not args.model_fingerprint:
        p.error("--model or --model-fingerprint is required")
    return args


def main(argv: list[str] | None = None) -> int:
    return FakeExecutor(parse_args(argv)).serve()


# ============================================================================ test helpers

SCRIPT = str(Path(__file__).resolve())


class FakeControl:
    """The control and state files of one fake executor."""

    def __init__(self, folder: Path, executor_id: str) -> None:
        self.control = folder / f"{executor_id}.control"
        self.state_file = folder / f"{executor_id}.state.json"
        self.control.write_text("")

    def state(self) -> dict:
        for _ in range(50):
            try:
                return json.loads(self.state_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.02)
        return {}

    def pause(self) -> int:
        """Answer no plan beyond those answered already; returns that count. Plans keep
        arriving and are held (see `unanswered`); heartbeats go on."""
        done = self.state().get("steps_done", 0)
        self.control.write_text(str(done))
        return done

    def hang(self) -> int:
        """Stop answering plans while heartbeating, as an executor stuck in a GPU kernel
        looks to the router: plans still arrive and are listed (`unanswered`; both of a
        depth-2 pipeline), none is answered, and unlike `pause` the fake never registers
        again meanwhile, even when the router declares it dead or asks it to. `resume()` or
        `allow()` ends the hang (then it answers what it holds and re-registers if the
        router has dropped it). Returns the steps answered so far."""
        done = self.state().get("steps_done", 0)
        self.control.write_text(f"{done} hang")
        return done

    def allow(self, num_steps: int) -> None:
        """Answer `num_steps` more plans than answered now, then hold again."""
        self.control.write_text(str(self.state().get("steps_done", 0) + num_steps))

    def resume(self) -> None:
        self.control.write_text("")

    def wait(self, predicate, timeout_s: float = 20.0, what: str = "state") -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = self.state()
            if st and predicate(st):
                return st
            time.sleep(0.005)
        raise TimeoutError(f"fake executor: no {what} within {timeout_s} s: {self.state()}")

    def wait_held(self, timeout_s: float = 20.0) -> dict:
        """The oldest unanswered plan (the next one to be answered)."""
        return self.wait(lambda s: s.get("held") is not None, timeout_s, "held plan")["held"]

    def unanswered(self) -> list[dict]:
        """Every plan received and not yet answered, oldest first: step_id, request_ids,
        num_computed, num_new, do_sample, feed_sampled, marked_ids, new_requests,
        finished_ids, deadline_s."""
        return self.state().get("unanswered", [])

    def wait_unanswered(self, num_plans: int = 2, timeout_s: float = 20.0) -> list[dict]:
        """Wait until at least `num_plans` plans are held unanswered (with --pipeline-depth
        2 and the fake paused, the router sends a second plan before the first's result)."""
        return self.wait(lambda s: s.get("num_unanswered", 0) >= num_plans, timeout_s,
                         f"{num_plans} unanswered plans")["unanswered"]


def fake_command(router: str, executor_id: str, model_dir, *, num_gpu_blocks: int = 256,
                 num_cpu_blocks: int = 0, block_size: int = 16, step_delay_s: float = 0.0,
                 eos_at: int | None = None, control: FakeControl | None = None,
                 extra: list[str] | None = None) -> list:
    cmd = [sys.executable, SCRIPT, "--router", router, "--executor-id", executor_id,
           "--model", str(model_dir), "--num-gpu-blocks", str(num_gpu_blocks),
           "--num-cpu-blocks", str(num_cpu_blocks), "--block-size", str(block_size),
           "--step-delay-s", str(step_delay_s), "--heartbeat-timeout", "1"]
    if eos_at is not None:
        cmd += ["--eos-at", str(eos_at)]
    if control is not None:
        cmd += ["--control-file", str(control.control), "--state-file", str(control.state_file)]
    return cmd + list(extra or [])


def fake_cluster(model_dir, folder: Path, num_executors: int = 1, *,
                 router_args: list[str] | None = None, **fake_kwargs):
    """A `cluster_harness.Cluster` whose executors are fake executor processes; returns
    (cluster, {executor id: FakeControl}). Executor ids are f0, f1, ..."""
    import subprocess

    from cluster_harness import Cluster, _Reader

    cluster = Cluster(model_dir, num_executors=num_executors, router_args=router_args)
    controls: dict[str, FakeControl] = {}

    def start_executor(executor_id: str) -> subprocess.Popen:
        control = controls.setdefault(executor_id, FakeControl(folder, executor_id))
        proc = subprocess.Popen(
            fake_command(cluster.zmq, executor_id, model_dir, control=control, **fake_kwargs),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        reader = _Reader(proc, executor_id)
        reader.start()
        cluster.readers.append(reader)
        cluster.executors[executor_id] = proc
        return proc

    cluster.start_executor = start_executor
    orig_start = cluster.start

    def start(timeout_s: float = 60.0):
        # Cluster.start names executors exec0, exec1, ...; ours are f0, f1, ...
        n = cluster.num_executors
        cluster.num_executors = 0
        orig_start(timeout_s)
        cluster.num_executors = n
        for i in range(n):
            start_executor(f"f{i}")
        cluster.wait_executors(n, timeout_s)
        return cluster

    cluster.start = start
    return cluster, controls


if __name__ == "__main__":
    sys.exit(main())
