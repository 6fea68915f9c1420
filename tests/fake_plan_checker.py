"""The fake executor's model of a real executor's state, and its checks (see
wire_fake_executor.py): request tracking from StepPlans (new requests, forks, finished ids,
block tables from their changes, swapped-out tables), every plan verified against it, and the
deterministic tokens it "samples". No sockets, no processes: `PlanChecker.execute` turns a
plan into a StepResult and `record` keeps what the next plan's checks need."""

from __future__ import annotations

import argparse
import sys

import numpy as np
from pagedserve.protos.wire import RequestError, StepPlan, StepResult


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


class PlanChecker:
    """One executor's view of its requests. A failed check is an error for the request (as a
    real executor answers) and a "violation" kept in `violations`."""

    def __init__(self, args: argparse.Namespace, eos_token_id: int | None) -> None:
        self.args = args
        self.bs = args.block_size
        self.eos_token_id = eos_token_id
        self.requests: dict[str, _Request] = {}
        self.last_step_id = 0
        self.violations: list[str] = []
        self.errored_at: dict[str, int] = {}  # request -> step that errored it (recent ones)
        self.failed_step = -1  # last step answered with a whole-step error
        self.num_marked_fed = 0  # marked decodes fed their own previous sample
        self.num_request_errors = 0

    def reset(self) -> None:
        """Registered again: an executor starts with no requests."""
        self.requests.clear()
        self.errored_at.clear()
        self.failed_step = -1
        self.last_step_id = 0

    def record(self, step: int, result: StepResult) -> None:
        """After answering plan `step` with `result`: which requests (or the whole step)
        errored, for the next plan's marked decodes."""
        self.num_request_errors += sum(1 for e in result.errors if e.request_id)
        if any(not e.request_id for e in result.errors):
            self.failed_step = step
        for err in result.errors:
            if err.request_id:
                self.errored_at[err.request_id] = step
        if len(self.errored_at) > 4096:  # only the previous step's errors matter
            self.errored_at = {r: s for r, s in self.errored_at.items() if s >= step - 1}

    def state(self) -> dict:
        """Its part of the fake's state file."""
        return {"last_step_id": self.last_step_id, "known": len(self.requests),
                "swapped_ids": [r for r, q in self.requests.items() if q.swapped],
                "violations": self.violations[-50:], "num_violations": len(self.violations),
                "num_marked_fed": self.num_marked_fed,
                "num_request_errors": self.num_request_errors}

    def _violation(self, step: int, text: str) -> str:
        message = f"step {step}: {text}"
        self.violations.append(message)
        print(f"fake {self.args.executor_id}: VIOLATION {message}", file=sys.stderr,
              flush=True)
        return message

    def _forked_from_sample_0(self, rid: str, computed: int) -> bool:
        """`rid` is a later sample (#1, #2, ...) whose sample 0 is known here with at least
        `computed` tokens computed: the router forked it from sample 0's table."""
        base, _, index = rid.rpartition("#")
        first = self.requests.get(f"{base}#0")
        return index not in ("", "0") and first is not None and first.num_computed >= computed

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
                    and (computed[i] % bs == 0 or self._forked_from_sample_0(rid, computed[i]))):
                # a fresh request may start at a cached prefix, or (a later sample forked
                # again after a recompute, sent as a new request with its own outputs)
                # where sample 0's table, which it starts from, is computed
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
