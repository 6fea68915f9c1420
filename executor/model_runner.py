"""One step: StepPlan in, StepResult out (DESIGN §2). No sockets here.

Hot path: the per-request Python work in ``_prepare`` is O(S) list operations; per-token
work is numpy/torch. Do not add per-token Python loops or device syncs beyond the one that
reads the sampled tokens back.

Pipelining (DESIGN §2): the router may send plan N+1 before it has seen step N's tokens. A
decode marked in ``feed_sampled`` gets as its input the token this executor sampled for
that request in step N (kept in its ``RequestState``); a request that sampled nothing here
in step N gets an error in N+1 instead, never a made-up token.

Timings in the StepResult: ``forward_s`` is the forward and logits; ``sample_s`` sampling;
``swap_s`` block moves; ``gap_s`` runs from the end of sampling of the previous step this
runner executed to the start of this step's forward (waiting for the plan, decoding it,
block moves, preparing inputs). The first step after construction or ``reset()`` reports
``gap_s = 0`` (there is no previous step to measure from; registration time would
otherwise pollute the figure). A step with no forward measures up to where it would start.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from pagedserve.executor.cache_engine import CacheEngine
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.models import AttentionMetadata, LlamaForCausalLM
from pagedserve.executor.sampler import Sampler, SamplingState
from pagedserve.protos.wire import RequestError, StepPlan, StepResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    """What the executor keeps per request between steps: its block table (the router's
    copy, updated by the plan's changes), its sampling state, and the token it last sampled
    here with the step id it was sampled in (a marked decode of step N+1 is fed the token
    of step N; -1: none sampled on this executor yet)."""

    block_table: list[int]
    sampling: SamplingState
    sampled_token: int = -1
    sampled_step: int = -1


@dataclass(frozen=True)
class _Batch:
    """The valid part of a plan, as device tensors."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # index into the hidden states of the tokens that sample
    sample_ids: list[str]  # their requests, same order


@dataclass(slots=True)
class PlanInputs:
    """What `ModelRunner.precompute` finds in a plan alone (no request state)."""

    num_new: np.ndarray  # int64 [S]
    seq_lens: np.ndarray  # int64 [S]
    starts: list[int]
    lens: list[int]
    ids: np.ndarray
    offsets: list[int]
    row_of_token: np.ndarray
    slots: np.ndarray  # int64 [T]
    token_ids: np.ndarray  # int64 [T], a copy: the marked decodes' tokens are written in
    marked: list[tuple[int, int, int]]  # (row, its first token, its token count)
    bad: dict[int, str]  # rows the plan alone condemns
    # When no row is condemned by the plan: its tensors, but the input ids.
    positions: torch.Tensor | None = None
    slot_mapping: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    seq_lens_t: torch.Tensor | None = None
    max_query_len: int = 0
    sample_rows: torch.Tensor | None = None
    sample_ids: list[str] | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ModelRunner:
    """Owns the model, the cache and the per-request state of one executor."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheEngine, executor_id: str = "",
                 max_model_len: int | None = None, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.graphs = graphs  # captured decode steps (CUDA), None: every step eager
        self.graph_steps = 0  # steps that replayed a graph
        self.cache = cache
        self.executor_id = executor_id
        self.device = cache.device
        self.block_size = cache.block_size
        self.vocab_size = model.config.vocab_size
        self.max_model_len = min(max_model_len or model.config.max_model_len,
                                 model.config.max_model_len)
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.steps_done = 0
        self._prev_end: float | None = None  # perf_counter: end of the previous step's sampling
        self._sampled_at: float | None = None
        # TESTING HOOK (never set in production): (step_id, seconds) sleeps that long inside
        # the first step with that id, after its forward timing starts. The executor
        # process sets it from PAGEDSERVE_FAULT_SLEEP_IN_STEP (see process.py).
        self.fault_sleep: tuple[int, float] | None = None
        # Called as each forward starts (the process sends the previous step's result then,
        # so its encoding overlaps the forward rather than the preparation of this step).
        self.before_forward: Callable[[], None] | None = None

    def reset(self) -> None:
        """Forget every request (a new registration starts with an empty cache state)."""
        self.requests.clear()
        self._prev_end = None

    # ------------------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute(self, plan: StepPlan, inputs: PlanInputs | None = None) -> StepResult:
        """Run one plan (with `inputs`, its `precompute`, when done ahead), in the order
        DESIGN §2 fixes:

        1. check the block moves; a bad one fails the whole step before anything moves;
        2. swap-out, swap-in, copy;
        3. drop finished requests, register new ones (state rebuilt from the record, so any
           executor can take over a request mid-generation), create forked children;
        4. fill each marked decode's placeholder with the token sampled for it in step
           ``step_id - 1`` (a marked row that sampled none there is an error), then apply
           each scheduled request's block-table change; a request that is unknown or names
           a block, slot, position or token out of range gets an error and is left out of
           the batch (its state is dropped);
        5. one forward over all scheduled tokens (prefill chunks and decodes mixed), logits
           only for rows with ``do_sample``, sample, append the tokens to the states and
           remember them for the next step's marked decodes.
        An exception in 5 is reported as a step error (empty request id), never swallowed;
        then no request sampled in this step, so the next plan's marked decodes all fail.
        """
        self._sampled_at = None
        try:
            return self._execute(plan, self._prev_end, inputs)
        finally:  # the next step's gap starts at the end of this one's sampling
            self._prev_end = self._sampled_at or time.perf_counter()

    def _execute(self, plan: StepPlan, prev_end: float | None,
                 inputs: PlanInputs | None) -> StepResult:
        step = plan.step_id

        def gap_s(now: float) -> float:
            return 0.0 if prev_end is None else now - prev_end

        error = self._check_block_moves(plan)
        if error:
            log.error("step %d rejected: %s", step, error)
            return StepResult(step_id=step, executor_id=self.executor_id,
                              errors=[RequestError("", error)], gap_s=gap_s(time.perf_counter()))
        swap_s = self._move_blocks(plan)
        errors = self._update_requests(plan)
        batch = self._prepare(plan, errors, inputs)
        result = dict(step_id=step, executor_id=self.executor_id, swap_s=swap_s)
        if batch is None:
            self.steps_done += 1
            return StepResult(**result, errors=errors, gap_s=gap_s(time.perf_counter()))
        t0 = time.perf_counter()
        result["gap_s"] = gap_s(t0)
        if self.before_forward is not None:
            self.before_forward()
        try:
            if self.fault_sleep is not None and self.fault_sleep[0] == step:
                seconds, self.fault_sleep = self.fault_sleep[1], None
                log.warning("step %d: fault injection: sleeping %.3g s", step, seconds)
                time.sleep(seconds)
            hidden = self._forward(batch)
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            _sync(self.device)
            t1 = time.perf_counter()
            reqs = [self.requests[r] for r in batch.sample_ids]
            out = self.sampler(logits, [r.sampling for r in reqs]) if reqs else None
            t2 = self._sampled_at = time.perf_counter()
        except Exception as exc:  # reported to the router, which fails the step's requests
            log.exception("step %d: forward/sampling failed", step)
            errors.append(RequestError("", f"step {step} failed: {type(exc).__name__}: {exc}"))
            return StepResult(**result, errors=errors)
        self.steps_done += 1
        if out is None:
            return StepResult(**result, errors=errors, forward_s=t1 - t0)
        for req, token in zip(reqs, out.token_ids.tolist(), strict=True):
            req.sampling.append(token)
            req.sampled_token, req.sampled_step = token, step
        return StepResult(
            **result, request_ids=batch.sample_ids, token_ids=out.token_ids,
            logprobs=out.logprobs, top_counts=out.top_counts, top_token_ids=out.top_token_ids,
            top_logprobs=out.top_logprobs, errors=errors, forward_s=t1 - t0, sample_s=t2 - t1,
        )

    # ------------------------------------------------------------------------------ parts
    def _forward(self, batch: _Batch) -> torch.Tensor:
        """The hidden states of every scheduled token: a captured graph for a decode batch
        it fits (cuda_graphs.py), else the model eagerly."""
        if self.graphs is not None and self.graphs.can_run(batch.input_ids, batch.attn):
            self.graph_steps += 1
            return self.graphs.run(batch.input_ids, batch.positions, batch.attn)
        return self.model(batch.input_ids, batch.positions, self.cache.kv_cache, batch.attn)

    def _check_block_moves(self, plan: StepPlan) -> str:
        limits = {
            "swap_out": (self.cache.num_gpu_blocks, self.cache.num_cpu_blocks),
            "swap_in": (self.cache.num_cpu_blocks, self.cache.num_gpu_blocks),
            "copy": (self.cache.num_gpu_blocks, self.cache.num_gpu_blocks),
        }
        for name, (src_limit, dst_limit) in limits.items():
            pairs = getattr(plan, name)
            if pairs is None or pairs.shape[0] == 0:
                continue
            for col, limit in ((0, src_limit), (1, dst_limit)):
                if pairs[:, col].min() < 0 or pairs[:, col].max() >= limit:
                    return f"{name} names a block out of range (have {limit})"
        return ""

    def _move_blocks(self, plan: StepPlan) -> float:
        moves = [(name, getattr(plan, name)) for name in ("swap_out", "swap_in", "copy")]
        moves = [(n, p) for n, p in moves if p is not None and p.shape[0]]
        if not moves:
            return 0.0
        t0 = time.perf_counter()
        for name, pairs in moves:
            getattr(self.cache, name)(torch.from_numpy(pairs.astype(np.int64)))
        _sync(self.device)
        return time.perf_counter() - t0

    def _update_requests(self, plan: StepPlan) -> list[RequestError]:
        errors = []
        for rid in plan.finished_ids:
            self.requests.pop(rid, None)
        for req in plan.new_requests:
            self.requests[req.request_id] = RequestState([], SamplingState.from_new_request(req))
        for fork in plan.forks:
            parent = self.requests.get(fork.parent_id)
            if parent is None:
                errors.append(RequestError(fork.child_id, f"fork of unknown {fork.parent_id!r}"))
                continue
            # The child inherits the parent's last sample too: a fork planned while that
            # token was in flight feeds it to both (their common input).
            self.requests[fork.child_id] = RequestState(
                list(parent.block_table), parent.sampling.fork(fork.sample_index),
                parent.sampled_token, parent.sampled_step)
        return errors

    def precompute(self, plan: StepPlan) -> PlanInputs | None:
        """The part of a plan's batch that depends on the plan alone: its arrays, every
        check that needs no request state, and (when no row fails those) the batch tensors
        but the input ids. Thread-safe (reads only the runner's fixed sizes): the executor's
        I/O thread calls it on plan N+1 while step N's forward runs, so the main thread is
        left with the fed tokens and the table changes (the executor's gap)."""
        num_seqs = plan.num_seqs
        if num_seqs == 0:
            return None
        bs, num_blocks = self.block_size, self.cache.num_gpu_blocks
        num_new = plan.num_new_tokens.astype(np.int64)
        seq_lens = plan.num_computed_tokens.astype(np.int64) + num_new
        starts_np, lens_np = plan.block_table_starts, plan.block_table_lens
        ids = plan.block_table_ids if plan.block_table_ids is not None else np.zeros(0, np.int32)
        row_of_token = np.repeat(np.arange(num_seqs), num_new)
        first_token = np.cumsum(num_new) - num_new
        slots = plan.slot_mapping.astype(np.int64)
        token_ids = plan.token_ids.astype(np.int64)  # a copy: fed tokens are written in
        marked_rows = np.zeros(num_seqs, dtype=bool)
        if plan.feed_sampled is not None:
            marked_rows = plan.feed_sampled.astype(bool)
        marked = [(i, int(first_token[i]), int(num_new[i]))
                  for i in np.flatnonzero(marked_rows).tolist()]

        # Vectorised checks; a bad token, block id or length condemns its request. The
        # tokens of marked rows are checked when fed (a -1 left unfed is an error there).
        bad_token = (
            (slots < -1) | (slots >= num_blocks * bs)
            | (plan.positions < 0) | (plan.positions >= self.max_model_len)
            | (((token_ids < 0) | (token_ids >= self.vocab_size)) & ~marked_rows[row_of_token])
        )
        bad: dict[int, str] = {}
        for rows, message in (
            (row_of_token[bad_token], "a slot, position or token id out of range"),
            (np.repeat(np.arange(num_seqs), lens_np)[(ids < 0) | (ids >= num_blocks)],
             f"block id out of range (have {num_blocks})"),
            (np.flatnonzero(seq_lens > np.minimum(self.max_model_len, (starts_np + lens_np) * bs)),
             "its tokens do not fit its blocks or max_model_len"),
            (np.flatnonzero(num_new == 0), "scheduled with no new tokens"),
        ):
            if rows.shape[0]:
                for i in rows.tolist():
                    bad.setdefault(i, message)
        inputs = PlanInputs(
            num_new=num_new, seq_lens=seq_lens, starts=starts_np.tolist(),
            lens=lens_np.tolist(), ids=ids,
            offsets=np.concatenate([[0], np.cumsum(lens_np)]).tolist(),
            row_of_token=row_of_token, slots=slots, token_ids=token_ids, marked=marked,
            bad=bad)
        if not bad:  # the usual case: the tensors of every row, built here
            query_start_loc = np.concatenate([[0], np.cumsum(num_new)])
            do_sample = plan.do_sample.astype(bool)
            inputs.positions = self._dev(plan.positions, np.int64)
            inputs.slot_mapping = self._dev(slots, np.int64)
            inputs.query_start_loc = self._dev(query_start_loc, np.int32)
            inputs.seq_lens_t = self._dev(seq_lens, np.int32)
            inputs.max_query_len = int(num_new.max())
            inputs.sample_rows = self._dev(query_start_loc[1:][do_sample] - 1, np.int64)
            inputs.sample_ids = [r for r, d in zip(plan.request_ids, do_sample.tolist(),
                                                   strict=True) if d]
        return inputs

    def _dev(self, arr: np.ndarray, dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=dtype)).to(
            self.device, non_blocking=True)

    def _prepare(self, plan: StepPlan, errors: list[RequestError],
                 pre: PlanInputs | None = None) -> _Batch | None:
        """Feed the marked decodes, apply the table changes of the valid requests and build
        the batch tensors (the plan-only part from `precompute`, done here when not given).
        The loop over requests only looks each one up, feeds it and applies its change."""
        if plan.num_seqs == 0:
            return None
        if pre is None:
            pre = self.precompute(plan)
        states = list(map(self.requests.get, plan.request_ids))
        token_ids = pre.token_ids
        bad = self._feed_sampled(plan, pre, states)
        for i, message in pre.bad.items():
            bad.setdefault(i, message)
        starts, lens, ids, offsets = pre.starts, pre.lens, pre.ids, pre.offsets
        tables = []
        for i, state in enumerate(states):
            if state is None:
                bad.setdefault(i, "unknown request (never sent as a new request)")
            elif i in bad:
                pass
            elif starts[i] > len(state.block_table):
                bad[i] = f"block table change at {starts[i]} beyond its {len(state.block_table)}"
            else:
                if lens[i] or starts[i] < len(state.block_table):
                    state.block_table[starts[i]:] = ids[offsets[i]:offsets[i + 1]].tolist()
                tables.append(state.block_table)
        for i, message in sorted(bad.items()):
            rid = plan.request_ids[i]
            log.error("step %d: request %s: %s", plan.step_id, rid, message)
            errors.append(RequestError(rid, message))
            self.requests.pop(rid, None)
        if not tables:
            return None
        table_lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        block_tables = np.zeros((len(tables), int(table_lens.max())), dtype=np.int32)
        block_tables[np.arange(block_tables.shape[1]) < table_lens[:, None]] = list(
            itertools.chain.from_iterable(tables))
        if not bad:  # every row kept: the tensors precompute built
            return _Batch(
                input_ids=self._dev(token_ids, np.int64), positions=pre.positions,
                attn=AttentionMetadata(
                    slot_mapping=pre.slot_mapping, block_tables=self._dev(block_tables, np.int32),
                    query_start_loc=pre.query_start_loc, seq_lens=pre.seq_lens_t,
                    max_query_len=pre.max_query_len),
                sample_rows=pre.sample_rows, sample_ids=pre.sample_ids)

        keep = np.ones(plan.num_seqs, dtype=bool)
        keep[list(bad)] = False
        keep_token = keep[pre.row_of_token]
        num_new, seq_lens = pre.num_new[keep], pre.seq_lens[keep]
        query_start_loc = np.concatenate([[0], np.cumsum(num_new)])
        do_sample = plan.do_sample[keep].astype(bool)
        kept_ids = [r for r, k in zip(plan.request_ids, keep.tolist(), strict=True) if k]
        return _Batch(
            input_ids=self._dev(token_ids[keep_token], np.int64),
            positions=self._dev(plan.positions[keep_token], np.int64),
            attn=AttentionMetadata(
                slot_mapping=self._dev(pre.slots[keep_token], np.int64),
                block_tables=self._dev(block_tables, np.int32),
                query_start_loc=self._dev(query_start_loc, np.int32),
                seq_lens=self._dev(seq_lens, np.int32),
                max_query_len=int(num_new.max()),
            ),
            sample_rows=self._dev(query_start_loc[1:][do_sample] - 1, np.int64),
            sample_ids=[r for r, s in zip(kept_ids, do_sample.tolist(), strict=True) if s],
        )

    def _feed_sampled(self, plan: StepPlan, pre: PlanInputs,
                      states: list[RequestState | None]) -> dict[int, str]:
        """Write into `pre.token_ids` each marked decode's token: the one this executor
        sampled for it in step ``step_id - 1``; returns {row: error} for the marked rows
        that cannot be fed (their placeholder stays, and they are left out). O(marked
        rows) Python, one numpy scatter."""
        if not pre.marked:
            return {}
        prev = plan.step_id - 1
        unfed: dict[int, str] = {}
        at, fed = [], []
        for i, first, n in pre.marked:
            state = states[i]
            if n != 1:
                unfed[i] = (f"marked to be fed its sample of step {prev} but scheduled with "
                            f"{n} tokens (a marked row is a decode of one token)")
            elif state is None:
                unfed[i] = (f"marked to be fed its sample of step {prev}, but the request is "
                            "unknown here (never sent, or dropped after an error)")
            elif state.sampled_step != prev:
                unfed[i] = (f"marked to be fed its sample of step {prev}, but it sampled "
                            f"nothing in step {prev} (that step failed or did not sample it)")
            else:
                at.append(first)
                fed.append(state.sampled_token)
        pre.token_ids[at] = fed
        return unfed


def build_runner(
    model_dir: str, *, device: str | torch.device = "cpu", dtype: str = "auto",
    block_size: int = 16, num_gpu_blocks: int | None = None, num_cpu_blocks: int | None = None,
    kv_cache_space: float = 1.0, swap_space: float | None = None,
    gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
    max_num_batched_tokens: int = 8192, executor_id: str = "", progress: bool = True,
    max_num_seqs: int = 256, enforce_eager: bool = False,
) -> ModelRunner:
    """Load the model, size the caches (DESIGN §4 flags) and, on CUDA unless
    ``enforce_eager``, capture the decode graphs for up to ``max_num_seqs`` sequences (their
    memory is set aside before the KV cache is sized). Raises ModelNotSupported,
    FileNotFoundError or ValueError with a one-line message."""
    from pagedserve.executor.cache_engine import (
        blocks_for_space,
        memory_baseline,
        profile_num_gpu_blocks,
    )
    from pagedserve.executor.cuda_graphs import graph_memory_bytes, graphs_supported
    from pagedserve.executor.models import load_config, load_model, resolve_dtype

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    config = load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, config, device)
    if block_size not in (8, 16, 32, 64, 128):
        raise ValueError(f"--block-size {block_size}: must be one of 8, 16, 32, 64, 128")
    if max_model_len is not None and max_model_len > config.max_model_len:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's "
                         f"{config.max_model_len}")
    baseline = memory_baseline(device) if device.type == "cuda" else None
    model = load_model(model_dir, torch_dtype, device, config, progress=progress)
    max_len = max_model_len or config.max_model_len
    why_eager = "--enforce-eager" if enforce_eager else graphs_supported(device)
    if num_gpu_blocks is None:
        if device.type == "cuda":
            reserve = 0 if why_eager else graph_memory_bytes(
                model, block_size, max_len, max_num_seqs, device)
            num_gpu_blocks = profile_num_gpu_blocks(
                model, block_size, min(max_num_batched_tokens, 8 * max_len),
                gpu_memory_utilization, device, reserve_bytes=reserve, baseline=baseline)
        else:
            num_gpu_blocks = blocks_for_space(kv_cache_space, config, block_size, torch_dtype)
    if num_cpu_blocks is None:
        if swap_space is None:
            swap_space = 4.0 if device.type == "cuda" else 0.5
        num_cpu_blocks = blocks_for_space(swap_space, config, block_size, torch_dtype)
    if num_gpu_blocks <= 0:
        raise ValueError("no memory left for the KV cache (num_gpu_blocks = 0)")
    cache = CacheEngine(config, block_size, num_gpu_blocks, num_cpu_blocks, torch_dtype, device)
    graphs = None if why_eager else _capture_graphs(model, cache, max_len, max_num_seqs)
    return ModelRunner(model, cache, executor_id=executor_id, max_model_len=max_len,
                       graphs=graphs)


def _capture_graphs(model: LlamaForCausalLM, cache: CacheEngine, max_model_len: int,
                    max_num_seqs: int) -> DecodeGraphs | None:
    """The decode graphs, or None (logged) when capturing fails: the executor runs eager."""
    graphs = DecodeGraphs(model, cache.kv_cache, cache.block_size, max_model_len, max_num_seqs)
    if not graphs.sizes:
        return None
    before = torch.cuda.memory_reserved(cache.device) if cache.device.type == "cuda" else 0
    try:
        graphs.capture()
    except Exception as exc:  # a kernel that cannot be captured: lose speed, not service
        log.warning("CUDA graphs off, every step eager: capture failed: %s: %s",
                    type(exc).__name__, exc)
        return None
    held = (torch.cuda.memory_reserved(cache.device) - before
            if cache.device.type == "cuda" else 0)
    log.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s (%.0f MiB)",
             len(graphs.sizes), graphs.max_batch, graphs.capture_s, held / 2**20)
    return graphs
