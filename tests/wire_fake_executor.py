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
checks.

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
import numpy as np
import zmq
from pagedserve.protos.wire import (
    Codec,
    ErrorReport,
    Heartbeat,
    Hello,
    RequestError,
    Shutdown,
    StepPlan,
    StepResult,
    Welcome,
    WireError,
)
from pagedserve.router.tokenizer import read_eos_token_ids

POLL_MS = 5
WELCOME_TIMEOUT_S = 3.0
MAX_BACKOFF_S = 4.0


def fake_token(position: int, vocab_size: int, banned: set[int]) -> int:
    """The token sampled for output position `position` (never an id in `banned`)."""
    tok = (position * 31 + 7) % vocab_size
    while tok in banned:
        tok = (tok + 1) % vocab_size
    return tok


class _Request:
    __slots__ = ("tokens", "num_prompt", "num_computed", "table", "swapped", "banned",
                 "logprobs", "eos_allowed_from", "last_sampled_step")

    def __init__(self, tokens: list[int], num_prompt: int, banned: set[int],
                 logprobs: int | None, eos_allowed_from: int) -> None:
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.num_computed = 0
        self.table: list[int] = []
        self.swapped = False  # its device blocks were swapped out; table invalid until start 0
        self.banned = banned
        self.logprobs = logprobs
        self.eos_allowed_from = eos_allowed_from  # output position (min_tokens masks EOS)
        self.last_sampled_step = -1  # step id that sampled its last token (-1: none yet)

    def fork(self) -> _Request:
        """A child starts as a copy of the parent's state, its last sample included (a
        marked decode of the child is fed the parent's token)."""
        child = _Request(list(self.tokens), self.num_prompt, self.banned, self.logprobs,
                         self.eos_allowed_from)
        child.num_computed, child.table, child.swapped = self.num_computed, list(self.table), \
            self.swapped
        child.last_sampled_step = self.last_sampled_step
        return child


class FakeExecutor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.bs = args.block_size
        self.codec = Codec()
        self.ctx = zmq.Context()
        self.sock: zmq.Socket | None = None
        self.requests: dict[str, _Request] = {}
        self.steps_done = 0
        self.last_step_id = 0
        self.registrations = 0
        self.violations: list[str] = []
        # Received, not yet answered, oldest first (the router may send up to
        # --pipeline-depth plans before the first is answered).
        self.unanswered: deque[StepPlan] = deque()
        self.errored_at: dict[str, int] = {}  # request -> step that errored it (recent ones)
        self.failed_step = -1  # last step answered with a whole-step error
        self.last_end = 0.0  # monotonic end of the previous step's sampling (0: none yet)
        self.num_marked_fed = 0  # marked decodes fed their own previous sample
        self.num_request_errors = 0
        self.eos_token_id = self._eos_token_id(args)
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
                 "unanswered": plans, "num_unanswered": len(plans),
                 "last_step_id": self.last_step_id, "known": len(self.requests),
                 "swapped_ids": [r for r, q in self.requests.items() if q.swapped],
                 "violations": self.violations[-50:], "num_violations": len(self.violations),
                 "num_marked_fed": self.num_marked_fed,
                 "num_request_errors": self.num_request_errors,
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
            self.violations.append(f"undecodable message: {exc}")
            print(f"fake {self.args.executor_id}: rejected a message: {exc}", file=sys.stderr,
                  flush=True)
            self._send(ErrorReport(message=f"rejected: {exc}",
                                   executor_id=self.args.executor_id))
            return None

    def register(self) -> None:
        self.registered.clear()
        self.requests.clear()
        self.unanswered.clear()
        self.errored_at.clear()
        self.failed_step = -1
        self.last_end = 0.0
        self.last_step_id = 0
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
                    self.violations.append(f"unexpected {type(msg).__name__} on main socket")
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
        result = self.execute(plan)
        self.last_end = time.monotonic()
        self.num_request_errors += sum(1 for e in result.errors if e.request_id)
        if any(not e.request_id for e in result.errors):
            self.failed_step = plan.step_id
        for err in result.errors:
            if err.request_id:
                self.errored_at[err.request_id] = plan.step_id
        if len(self.errored_at) > 4096:  # only the previous step's errors matter
            self.errored_at = {r: s for r, s in self.errored_at.items()
                               if s >= plan.step_id - 1}
        self.steps_done += 1
        self.write_state()  # before the result: a test that saw the result sees the state
        self._send(msgspec.structs.replace(result, forward_s=forward_s,
                                           sample_s=self.last_end - t_sample, gap_s=gap_s))

    # ------------------------------------------------------------------------ execute
    def _violation(self, step: int, text: str) -> str:
        message = f"step {step}: {text}"
        self.violations.append(message)
        print(f"fake {self.args.executor_id}: VIOLATION {message}", file=sys.stderr,
              flush=True)
        return message

    def _check_moves(self, plan: StepPlan) -> str:
        g, c = self.args.num_gpu_blocks, self.args.num_cpu_blocks
        limits = {"swap_out": (g, c), "swap_in": (c, g), "copy": (g, g)}
        pairs = {}
        for name, (src_limit, dst_limit) in limits.items():
            arr = getattr(plan, name)
            pairs[name] = np.zeros((0, 2), np.int64) if arr is None else arr
            p = pairs[name]
            if p.shape[0] and (p[:, 0].min() < 0 or p[:, 0].max() >= src_limit
                               or p[:, 1].min() < 0 or p[:, 1].max() >= dst_limit):
                return f"{name} names a block out of range"
        dev_src = set(pairs["swap_out"][:, 0].tolist()) | set(pairs["copy"][:, 0].tolist())
        dev_dst = set(pairs["swap_in"][:, 1].tolist()) | set(pairs["copy"][:, 1].tolist())
        cpu_dst = set(pairs["swap_out"][:, 1].tolist())
        cpu_src = set(pairs["swap_in"][:, 0].tolist())
        if dev_src & dev_dst:
            return f"device blocks both source and destination: {sorted(dev_src & dev_dst)}"
        if cpu_src & cpu_dst:
            return f"cpu blocks both source and destination: {sorted(cpu_src & cpu_dst)}"
        for name in ("swap_out", "swap_in", "copy"):
            dst = pairs[name][:, 1].tolist()
            if len(set(dst)) != len(dst):
                return f"{name} names one destination twice"
        return ""

    def execute(self, plan: StepPlan) -> StepResult:
        step = plan.step_id
        me = self.args.executor_id
        if self.args.verbose:
            print(f"fake {me}: plan {step} new={[r.request_id for r in plan.new_requests]} "
                  f"forks={[(f.parent_id, f.child_id) for f in plan.forks]} "
                  f"reqs={plan.request_ids} computed={plan.num_computed_tokens} "
                  f"new={plan.num_new_tokens} sample={plan.do_sample} "
                  f"finished={plan.finished_ids}", file=sys.stderr, flush=True)
        if step <= self.last_step_id:
            self._violation(step, f"step id not increasing (last {self.last_step_id})")
        self.last_step_id = step
        error = self._check_moves(plan)
        if error:
            return StepResult(step_id=step, executor_id=me,
                              errors=[RequestError("", self._violation(step, error))])
        # Swap-out invalidates the device tables that held those blocks.
        if plan.swap_out is not None and plan.swap_out.shape[0]:
            out_blocks = set(plan.swap_out[:, 0].tolist())
            for req in self.requests.values():
                if not req.swapped and out_blocks & set(req.table):
                    req.swapped = True
        errors: list[RequestError] = []
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)
        for new in plan.new_requests:
            if new.request_id in self.requests:
                self._violation(step, f"new request {new.request_id} already known")
            sp = new.sampling
            banned = set(sp.eos_token_ids) | set(sp.stop_token_ids)
            prompt = new.prompt_token_ids.tolist()
            self.requests[new.request_id] = _Request(
                prompt + new.output_token_ids.tolist(), len(prompt), banned, sp.logprobs,
                0 if sp.ignore_eos else sp.min_tokens)
        for fork in plan.forks:
            parent = self.requests.get(fork.parent_id)
            if parent is None:
                errors.append(RequestError(fork.child_id, self._violation(
                    step, f"fork of unknown {fork.parent_id}")))
                continue
            self.requests[fork.child_id] = parent.fork()

        n = plan.num_seqs
        if n == 0:
            return StepResult(step_id=step, executor_id=me, errors=errors)
        bs = self.bs
        computed = plan.num_computed_tokens.tolist()
        num_new = plan.num_new_tokens.tolist()
        do_sample = plan.do_sample.tolist()
        starts = plan.block_table_starts.tolist()
        lens = plan.block_table_lens.tolist()
        ids = [] if plan.block_table_ids is None else plan.block_table_ids.tolist()
        tokens = plan.token_ids.tolist()
        feed = [0] * n if plan.feed_sampled is None else plan.feed_sampled.tolist()
        positions = plan.positions.tolist()
        # Pipelining: a request that step - 1 errored (or all of it, when it failed) may
        # still be in this plan, sent before the router knew: an error, not a violation.
        prev_failed = self.failed_step == step - 1
        slots = plan.slot_mapping.tolist()
        ofs, t = 0, 0
        ok: list[tuple[str, _Request, int, bool]] = []
        ok_starts: list[int] = []
        written: dict[int, str] = {}  # device block -> request writing it this step
        for i, rid in enumerate(plan.request_ids):
            change = ids[ofs:ofs + lens[i]]
            ofs += lens[i]
            k = num_new[i]
            tok_i, pos_i, slot_i = tokens[t:t + k], positions[t:t + k], slots[t:t + k]
            t += k
            req = self.requests.get(rid)
            if (feed[i] or req is None) and (prev_failed or self.errored_at.get(rid) == step - 1):
                errors.append(RequestError(rid, f"step {step}: {rid} errored in step "
                                                f"{step - 1}; its input was not sampled"))
                self.requests.pop(rid, None)
                continue
            problem = ""
            if feed[i] and req is not None:
                if k != 1:
                    problem = f"marked for feed_sampled with {k} new tokens (a decode has 1)"
                elif tok_i != [-1]:
                    problem = f"marked for feed_sampled but its token is {tok_i[0]}, not -1"
                elif req.last_sampled_step != step - 1:
                    problem = (f"marked for feed_sampled but not sampled in step {step - 1} "
                               f"(last sampled in {req.last_sampled_step})")
                else:
                    tok_i = [req.tokens[-1]]  # the fake's own sample of step - 1
            elif not feed[i] and -1 in tok_i:
                problem = "placeholder token -1 in a row not marked for feed_sampled"
            if problem:
                pass
            elif req is None:
                problem = "unknown request (never sent as a new request)"
            elif k <= 0:
                problem = "scheduled with no new tokens"
            elif starts[i] > len(req.table):
                problem = f"table change at {starts[i]} beyond its {len(req.table)} blocks"
            elif req.swapped and starts[i] != 0:
                problem = "scheduled while swapped out without a full table"
            elif any(b < 0 or b >= self.args.num_gpu_blocks for b in change):
                problem = "block id out of range"
            elif computed[i] != req.num_computed and not (
                    req.num_computed == 0 and not req.table and starts[i] == 0
                    and computed[i] % bs == 0):  # a fresh request may start at a cached prefix
                problem = f"num_computed {computed[i]}, executor has {req.num_computed}"
            elif pos_i != list(range(computed[i], computed[i] + k)):
                problem = "positions are not consecutive from num_computed"
            elif computed[i] + k > len(req.tokens):
                problem = f"computes {computed[i] + k} tokens, request holds {len(req.tokens)}"
            elif tok_i != req.tokens[computed[i]:computed[i] + k]:
                problem = "token ids differ from the request's tokens"
            elif bool(do_sample[i]) != (computed[i] + k == len(req.tokens)):
                problem = f"do_sample={do_sample[i]} at {computed[i] + k}/{len(req.tokens)}"
            if not problem:
                table = req.table[:starts[i]] + change
                if (computed[i] + k) > len(table) * bs:
                    problem = f"{computed[i] + k} tokens do not fit {len(table)} blocks"
                else:
                    want = [table[p // bs] * bs + p % bs for p in pos_i]
                    if slot_i != want:
                        problem = "slot_mapping disagrees with the block table"
            if problem:
                errors.append(RequestError(rid, self._violation(step, f"{rid}: {problem}")))
                self.requests.pop(rid, None)
                continue
            req.table, req.swapped = table, False
            for s in slot_i:
                written.setdefault(s // bs, rid)
            ok.append((rid, req, k, bool(do_sample[i])))
            ok_starts.append(computed[i])
            self.num_marked_fed += feed[i]
        # No block written this step may belong to another live (device-resident) request.
        for other_id, other in self.requests.items():
            if other.swapped:
                continue
            for b in other.table:
                writer = written.get(b)
                if writer is not None and writer != other_id:
                    self._violation(step, f"{writer} writes block {b} that {other_id} holds")
        sampled_ids, sampled = [], []
        for (rid, req, k, sample), start in zip(ok, ok_starts, strict=True):
            req.num_computed = start + k
            if sample:
                out_pos = len(req.tokens) - req.num_prompt
                if out_pos == self.args.eos_at and out_pos >= req.eos_allowed_from:
                    tok = self.eos_token_id
                else:
                    tok = fake_token(len(req.tokens), self.args.vocab_size, req.banned)
                req.tokens.append(tok)
                req.last_sampled_step = step
                sampled_ids.append(rid)
                sampled.append(tok)
        if not sampled_ids:
            return StepResult(step_id=step, executor_id=me, errors=errors)
        want_lp = [self.requests[r].logprobs for r in sampled_ids]
        extra = {}
        if any(k is not None for k in want_lp):
            counts = [k or 0 for k in want_lp]
            extra = dict(
                logprobs=np.array([0.0 if k is not None else np.nan for k in want_lp],
                                  np.float32),
                top_counts=np.array(counts, np.int32),
                top_token_ids=np.array([j % self.args.vocab_size for c in counts
                                        for j in range(c)], np.int32),
                top_logprobs=np.full(sum(counts), -1.0, np.float32))
        return StepResult(step_id=step, executor_id=me, request_ids=sampled_ids,
                          token_ids=np.array(sampled, np.int32), errors=errors, **extra)


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
