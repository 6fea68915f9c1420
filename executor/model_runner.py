"""One step: StepPlan in, StepResult out (DESIGN §2). No sockets here.

Hot path: between two steps (the gap) the main thread does a fixed number of numpy calls
over the step's rows plus one C-level pass over the request ids (their rows); per-request and
per-block state lives in `RequestRows` columns. Plan-only work is done ahead by `precompute`
on the I/O thread; appending the sampled tokens waits for the next forward's launch. Add no
per-request or per-token Python loops to the gap, nor device syncs beyond the one that reads
the sampled tokens back.

Pipelining (DESIGN §2): the router may send plan N+1 before it has seen step N's tokens. A
decode marked in ``feed_sampled`` gets as its input the token this executor sampled for
that request in step N (pending, then in its `RequestRows` row); a request that sampled
nothing here in step N gets an error in N+1 instead, never a made-up token.

Overlapped steps (on a GPU; `ModelRunner.submit`): a step that samples is left in flight,
its tokens on the device and their copy to the host queued behind the sampling kernels.
Step N+1's marked decodes are fed on the device from those tokens, its forward is launched,
and only then are step N's tokens read back (the device ran them first) and its result
returned, so the device always has the next step queued while the host reads a result,
sends it and prepares the step after. Order on the device: ... N's sampling, N's copies,
N+1's forward, N+1's sampling ...; on the host: prepare N+1, launch N+1, read N, record N's
tokens in the sampling states, launch N+1's sampling, send N's result. What needs N's
tokens on the host before N+1's launch reads them then (a fork, a checked step, a state
read, a swap); a dropped request's row waits for them before it is reused. Sampling avoids
device-to-host reads (pinned, non-blocking copies of its small inputs; no data-dependent
branch; the penalties by dense counts; top-p past the first 256 tokens by a whole-row
threshold kernel, kernels/sampling_ops.py) except for prompt logprobs, which wait.

Timings in the StepResult: ``forward_s`` is the forward and logits (on a GPU as the device ran
it, between two CUDA events; on a CPU as it was called); ``sample_s`` sampling (on a GPU:
from the forward's end to the tokens' copy to the host, device time);
``swap_s`` block moves; ``gap_s`` runs from the end of sampling of the previous step this
runner executed to the start of this step's forward (waiting for the plan, decoding it,
block moves, preparing inputs). On a GPU it is device time, between a CUDA event after the
previous step's sampling and one before this forward: the device idle between the two
steps, near 0 when the host had this step queued behind the previous one (overlapped
steps), and the idle time when the host fell behind (a host clock cannot tell those apart
once steps overlap). On a CPU it is host time. The first step after construction or
``reset()`` reports ``gap_s = 0`` (no previous step to measure from; registration time would
pollute it); a step with no forward measures up to where it would start. The previous
step's tokens join the sampling states once this step's forward and logits are launched
(a GPU overlaps that with the forward; a CPU counts it in ``forward_s``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from pagedserve.executor import batch_prep, runner_requests
from pagedserve.executor.batch_prep import Batch
from pagedserve.executor.cache_engine import CacheEngine
from pagedserve.executor.cuda_graphs import DecodeGraphs
from pagedserve.executor.draft_rows import confirmed, draft_states, kept_rows
from pagedserve.executor.grammar import GrammarCompiler
from pagedserve.executor.host_pool import HostPool
from pagedserve.executor.mixed_graphs import MixedGraphs
from pagedserve.executor.models import LlamaForCausalLM
from pagedserve.executor.models.lora import LoraSet
from pagedserve.executor.plan_inputs import PlanInputs, PlanLimits, precompute
from pagedserve.executor.prompt_scores import prompt_outputs
from pagedserve.executor.request_rows import RequestRows
from pagedserve.executor.sample_chunks import launch_sampling, step_logits
from pagedserve.executor.sampler import SampledOnDevice, Sampler
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.executor.step_records import InFlight, PendingSamples, RequestState, export_kv
from pagedserve.executor.weight_ops import RunningWeights, apply_model_ops
from pagedserve.protos.wire import RequestError, StepPlan, StepResult

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the cache and the per-request state of one executor."""

    def __init__(self, model: LlamaForCausalLM, cache: CacheEngine, executor_id: str = "",
                 max_model_len: int | None = None, graphs: DecodeGraphs | None = None,
                 grammars: GrammarCompiler | None = None,
                 mixed_graphs: MixedGraphs | None = None, loras: LoraSet | None = None) -> None:
        self.model = model
        self.graph_steps = 0  # steps that replayed a graph
        self._graph_logits: torch.Tensor | None = None  # the last replay's, every row's
        self._graph_tokens: torch.Tensor | None = None  # and their argmax
        # Steps with prompt tokens in graph pieces around the attention (mixed_graphs.py).
        self.mixed_graphs = mixed_graphs
        self.mixed_graph_steps = 0
        self.cache = cache
        self.executor_id = executor_id
        self.device = cache.device
        self.block_size = cache.block_size
        self.vocab_size = model.config.vocab_size
        self.max_model_len = min(max_model_len or model.config.max_model_len,
                                 model.config.max_model_len)
        self.sampler = Sampler()
        self.sample_chunk_rows = 256  # sampled at most this many rows at once (--max-num-seqs)
        # The read-backs' events and host buffers, used again (host_pool.py)
        self.host_pool = self.sampler.pool = HostPool(self.device)
        self.limits = PlanLimits(self.block_size, cache.num_gpu_blocks, cache.num_cpu_blocks,
                                 self.max_model_len, self.vocab_size, self.device, grammars,
                                 kv_block_bytes=cache.block_bytes)
        # Captured decode steps (CUDA), None: every step eager; the setter tells the limits
        # the fed graphs' sizes.
        self.graphs = graphs
        self.loras = loras  # the LoRA adapters installed on the model (None: none)
        self.weights = RunningWeights(model_dir="")  # which (build_runner names --model's)
        self.requests: dict[str, RequestState] = {}
        self._row_of: dict[str, int] = {}  # request id -> its row of self.rows
        self._scoring: dict[str, SamplingState] = {}  # prompt logprobs or embedding
        self._not_plain = 0  # requests whose sampling is not plain greedy (runner_requests)
        self.rows = RequestRows(width=-(-self.max_model_len // self.block_size))
        self._pending = PendingSamples(self.rows, self._resolve)
        self.steps_done = 0
        self.sampled_first_steps = 0  # steps sampled before the previous read back (_sample_first)
        self._prev_end: float | None = None  # perf_counter: end of the previous step's sampling
        # CUDA: the event after the previous step's device work (None: none, or that step
        # ran no forward; then gap_s is host time), and that step's pooled objects, given
        # back once the next step's gap has been read from it.
        self._prev_end_event = self._prev_end_pooled = None
        self._inflight: InFlight | None = None  # launched, tokens not yet read back
        # Leave sampling steps in flight (submit): on a GPU, whose work runs apart from the
        # host's. On a CPU the forward is done when launched, so a step left in flight
        # would only hold its result back a step (tests set it to exercise the path).
        self.overlap_steps = self.device.type == "cuda"
        self._ready: list[StepResult] = []  # results built, not yet returned (step order)
        # The previous step's plan, inputs and batch, released once the next forward is
        # launched: freeing their arrays and tensors is tens of microseconds of the gap.
        self._retired: tuple | None = None
        # TESTING HOOK (never set in production): (step_id, seconds) sleeps that long inside
        # the first step with that id, after its forward timing starts. The executor
        # process sets it from PAGEDSERVE_FAULT_SLEEP_IN_STEP (see process.py).
        self.fault_sleep: tuple[int, float] | None = None
        # Called as each forward starts (the process sends the previous step's result then,
        # so its encoding overlaps the forward rather than the preparation of this step).
        self.before_forward: Callable[[], None] | None = None
        # Called with a previous step's result as soon as it is read back after the next
        # step's launch (overlapped steps; else submit() returns it).
        self.result_ready: Callable[[StepResult], None] | None = None

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @graphs.setter
    def graphs(self, graphs: DecodeGraphs | None) -> None:
        """Set the decode graphs (tests set them after construction): the plans'
        precompute learns the fed steps' limits, for which it builds no tensors."""
        self._graphs = graphs
        rows = graphs.feed_rows if graphs is not None else 0
        self.limits = dataclasses.replace(self.limits, graph_rows=rows,
                                          graph_width=graphs.width if rows else 0)

    @property
    def loras(self) -> LoraSet | None:
        return self._loras

    @loras.setter
    def loras(self, loras: LoraSet | None) -> None:
        """Set (or after a load, refresh) the LoRA adapters installed on the model: the
        plans' precompute learns their names (a new request naming another is condemned)."""
        self._loras = loras
        self.limits = dataclasses.replace(
            self.limits, lora_names=frozenset(loras.slots) if loras is not None else frozenset())

    def reset(self) -> None:
        """Forget every request (a new registration starts with an empty cache state)."""
        self.requests.clear()
        self._row_of.clear()
        self._scoring.clear()
        self._not_plain = 0
        flight, self._inflight, self._ready = self._inflight, None, []
        if flight is not None and flight.sampled is not None:
            flight.sampled.result()  # its kernels done before the cache is used again
        self.rows.clear()
        self._pending = PendingSamples(self.rows, self._resolve)
        self._retired = None
        self._prev_end = None
        self._prev_end_event = self._prev_end_pooled = None
        if self.loras is not None:  # the new registration's router loads its own adapters
            self.loras = self.loras.unload_all()

    def block_table(self, request_id: str) -> list[int]:
        """The block table this runner holds for a request (KeyError when none)."""
        return self.rows.table(self.requests[request_id].row)

    # ------------------------------------------------------------------------------ step
    def execute(self, plan: StepPlan, inputs: PlanInputs | None = None) -> StepResult:
        """Run one plan to its result: `submit`, then `collect` (nothing may be in flight;
        the executor process overlaps steps with `submit`/`collect` themselves)."""
        if self._inflight is not None or self._ready:
            raise RuntimeError("execute() with a step in flight: use submit() and collect()")
        results = self.submit(plan, inputs)
        return results[0] if results else self.collect()

    def submit(self, plan: StepPlan, inputs: PlanInputs | None = None) -> list[StepResult]:
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

        Overlapped steps. A step that samples is left in flight: its tokens stay on the
        device (their copy to the host queued behind the sampling kernels) and this returns
        before they are read. The next `submit` feeds its marked decodes from those device
        tokens, launches its forward, and only then reads the previous step's tokens back
        (they were ready long before: the device ran them first), so the device has the
        next step queued while the host finishes the previous one and prepares the one
        after. Anything that needs the in-flight tokens on the host earlier (a fork, a
        checked step, a state read) reads them then. Returns the results that became ready,
        in step order: the previous step's, and this one's when it did not stay in flight;
        `collect()` returns the one in flight (call it when no plan is waiting).

        Runs in inference mode (entered here unless the caller holds it: the executor
        process enters it once for its whole loop, which keeps it out of the gap).
        """
        if torch.is_inference_mode_enabled():
            now = self._submit(plan, inputs)
        else:
            with torch.inference_mode():
                now = self._submit(plan, inputs)
        ready, self._ready = self._ready, []
        if now is not None:
            ready.append(now)
        return ready

    def collect(self) -> StepResult | None:
        """The result of the step in flight, once its tokens are read back (None: none)."""
        self._resolve()
        ready, self._ready = self._ready, []
        assert len(ready) <= 1, ready
        return ready[0] if ready else None

    @property
    def inflight_step(self) -> tuple[int, float] | None:
        """(step id, deadline_s) of the step in flight, if any."""
        f = self._inflight
        return None if f is None else (f.plan.step_id, f.plan.deadline_s)

    def inflight_sampled(self) -> SampledOnDevice | None:
        """The step in flight's tokens (`wait()` blocks without the GIL until the device is
        done with them, `done()` asks); None when no step that samples is in flight."""
        f = self._inflight
        return None if f is None else f.sampled

    def _finished_now(self, result: StepResult) -> StepResult:
        """A step that ends without staying in flight: the previous one's result first."""
        self._resolve()
        self.steps_done += 1
        self._prev_end = time.perf_counter()
        self._prev_end_event = self._prev_end_pooled = None  # the next gap: host time
        return result

    def _submit(self, plan: StepPlan, pre: PlanInputs | None) -> StepResult | None:
        step = plan.step_id
        prev_end = self._prev_end
        # new weights, adapter loads and unloads first (weight_ops.py); failures: in the result
        result = dict(step_id=step, executor_id=self.executor_id, **apply_model_ops(self, plan))
        if pre is None:
            pre = self.precompute(plan)
        if pre.move_error:
            log.error("step %d rejected: %s", step, pre.move_error)
            now = time.perf_counter()
            return self._finished_now(StepResult(
                **result, errors=[RequestError("", pre.move_error)],
                gap_s=0.0 if prev_end is None else now - prev_end))
        result["swap_s"] = self.cache.apply_moves(pre.moves, plan.kv_import, plan.kv_import_data)
        errors = self._update_requests(plan, pre.new_states)
        batch = self._prepare(plan, errors, pre)
        t0 = time.perf_counter()
        # The gap: host time here; on a GPU replaced by the device's idle time between the
        # previous step's end and this forward once this step is read back (_resolve).
        result["gap_s"] = 0.0 if prev_end is None else t0 - prev_end
        after = self._prev_end_event, self._prev_end_pooled
        if batch is None:  # (a plan exporting blocks only: router/prefix_pull.py)
            export_kv(self.cache, plan, result)
            return self._finished_now(StepResult(**result, errors=errors))
        if self.before_forward is not None:
            self.before_forward()
        events = self.host_pool.timing_pair()
        try:
            if events is not None:
                self.host_pool.record(events[0])
            if self.fault_sleep is not None and self.fault_sleep[0] == step:
                seconds, self.fault_sleep = self.fault_sleep[1], None
                log.warning("step %d: fault injection: sleeping %.3g s", step, seconds)
                time.sleep(seconds)
            hidden = self._forward(batch)
            logits, argmax = self._logits(hidden, batch)
            if events is not None:
                self.host_pool.record(events[1])
            states = [self.requests[r]._sampling for r in batch.sample_ids]
            plain = True if self._not_plain == 0 else None  # None: rows looked at
            t1 = time.perf_counter()
            sampled = None
            if states and batch.drafts is None and self._sample_first(states, plain):
                self.sampled_first_steps += 1
                sampled = launch_sampling(self.sampler, logits, states, argmax=argmax,
                                          plain=True)
            # Launched (on a GPU the host is free until the sampler reads its tokens back):
            # now the previous step is read back if still in flight; its result goes out
            # at once, then its tokens go into the sampling states this step's sampling
            # reads (the router plans from the result, not from these records), and its
            # objects are freed.
            self._pending.read_back()
            if self.result_ready is not None and self._ready:
                # The previous step, read back after this launch: out now, before this
                # step's sampling (which may wait for the device: top-p, penalties).
                for ready in self._ready:
                    self.result_ready(ready)
                self._ready.clear()
            self._pending.apply()
            self._retired = None
            if sampled is None and states:
                # Positions after drafts sample as if the drafts were output, a grammar's
                # mask included (draft_rows.py). Structured output's masks are host work:
                # done while a GPU runs the forward.
                rows = states if batch.drafts is None else draft_states(states, batch.drafts)
                grammar_bits = None if plain else Sampler.grammar_masks(rows)
                t1 = time.perf_counter()
                # No sync before sampling: the sampler's host work also overlaps the
                # forward, and its kernels queue right behind it.
                sampled = launch_sampling(self.sampler, logits, rows, grammar_bits,
                                          argmax=argmax, plain=plain)
            scores = None
            if self._scoring:  # prompt logprobs or an embedding asked for
                scores = prompt_outputs(self.model, hidden, plan.request_ids,
                                        plan.num_computed_tokens, plan.num_new_tokens,
                                        batch.kept, self._scoring)
        except Exception as exc:  # reported to the router, which fails the step's requests
            log.exception("step %d: forward/sampling failed", step)
            errors.append(RequestError("", f"step {step} failed: {type(exc).__name__}: {exc}"))
            return self._finished_now(StepResult(**result, errors=errors))
        self._retired = plan, pre, batch
        if scores is not None:
            result.update(scores)
        flight = InFlight(plan, batch, sampled, result, errors, events, t0, t1, *after)
        self._prev_end_event, self._prev_end_pooled = flight.end_event, flight.pooled()
        if sampled is not None:
            # Recorded once read back (after the next forward is launched); the next
            # step's marked decodes are fed from here.
            pending = self._pending
            pending.states, pending.token_ids = states, None
            pending.device_tokens = sampled.tokens
            pending.rows, pending.step_id = batch.sample_state_rows, step
            pending.drafted = batch.drafts is not None
        self._inflight = flight
        if sampled is not None and self.overlap_steps:
            return None
        self._resolve()  # read back now
        return self._ready.pop()

    def _sample_first(self, states: list, plain: bool | None = None) -> bool:
        """Launch this step's sampling before the previous step is read back? Only when
        that read would wait for the device (the previous step still running there: its
        event not reached) and no row's sampling reads the tokens it appends (every row
        plain greedy: the argmax of its logits, `SamplingState.plain`, which appending
        never changes). Then the sampler's launch (~0.1-0.3 ms of host time on a GPU)
        overlaps that wait instead of sitting between the device's end of the previous
        step and the preparation of the step after this one, the host's critical path when
        a forward is short. Otherwise the previous step's result goes out first.
        ``plain``: True when every request is plain greedy (the runner's count), None: the
        rows are walked."""
        prev = self._inflight
        event = None if prev is None or prev.sampled is None else prev.sampled.event
        # The event first: when the device is done, the rows are not walked at all; when it
        # is not, the host has the wait to spare for the walk (and the sampler's own).
        return (event is not None and not event.query()
                and (plain or all(s.plain for s in states)))

    def _resolve(self) -> None:
        """Read the step in flight back and queue its StepResult (nothing when none)."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        out = flight.sampled.result() if flight.sampled is not None else None
        events = flight.events
        if events is not None and out is None:  # else done: the tokens' event came after it
            events[1].synchronize()
        end = self._prev_end = time.perf_counter()
        if events is not None:  # the forward as the device ran it; sampling the rest
            forward_s = events[0].elapsed_time(events[1]) / 1e3
            if flight.after_event is not None:  # done: it came before events[0]
                flight.result["gap_s"] = max(
                    0.0, flight.after_event.elapsed_time(events[0]) / 1e3)
            sampled = flight.sampled
            sample_s = (sampled.elapsed_s(events[1])
                        if sampled is not None and sampled.event is not None else 0.0)
        else:  # a CPU ran it all as it was called
            forward_s, sample_s = flight.t1 - flight.t0, end - flight.t1
        self.steps_done += 1
        # (the forward wrote them: router/handoff.py)
        export_kv(self.cache, flight.plan, flight.result)
        if flight.after_pooled:  # the step before this one: nothing reads its objects now
            self.host_pool.give(flight.after_pooled)
        result, errors = flight.result, flight.errors
        if out is None:
            self._ready.append(StepResult(**result, errors=errors, forward_s=forward_s))
            return
        batch = flight.batch
        sample_ids = batch.sample_ids
        pending = self._pending
        if batch.drafts is not None:  # each row's confirmed drafts and one token more
            keep = confirmed(out.token_ids, batch.drafts)
            out = kept_rows(out, keep)
            sample_ids = [r for r, k in zip(sample_ids, keep.tolist(), strict=True) if k]
            if pending.step_id == flight.plan.step_id:
                pending.states = [s for s, k in zip(pending.states, keep.tolist(),
                                                    strict=True) if k]
                pending.rows = pending.rows[keep]
        if pending.step_id == flight.plan.step_id:
            pending.token_ids = out.token_ids
        self._ready.append(StepResult(
            **result, request_ids=sample_ids, token_ids=out.token_ids,
            logprobs=out.logprobs, top_counts=out.top_counts, top_token_ids=out.top_token_ids,
            top_logprobs=out.top_logprobs, errors=errors, forward_s=forward_s,
            sample_s=sample_s,
        ))

    # ------------------------------------------------------------------------------ parts
    def _forward(self, batch: Batch) -> torch.Tensor:
        """The hidden states of every scheduled token: a captured graph for a decode batch
        it fits (cuda_graphs.py), graph pieces for a step with prompt tokens that fits
        (mixed_graphs.py), else the model eagerly."""
        self._graph_logits = self._graph_tokens = None
        if batch.feed is not None:
            self.graph_steps += 1
            hidden = self.graphs.run_feed(batch.feed, batch.input_ids, batch.lora_slots)
            self._graph_logits, self._graph_tokens = self.graphs.logits, self.graphs.tokens
            return hidden
        # Graphs captured without the LoRA adapters cannot run a step with adapter tokens.
        slots = batch.lora_slots
        graphs = self.graphs
        if graphs is not None and (slots is None or graphs.loras is not None) \
                and graphs.can_run(batch.input_ids, batch.attn):
            self.graph_steps += 1
            hidden = graphs.run(batch.input_ids, batch.positions, batch.attn, slots)
            self._graph_logits, self._graph_tokens = graphs.logits, graphs.tokens
            return hidden
        mixed = self.mixed_graphs
        if mixed is not None and (slots is None or mixed.loras is not None) \
                and mixed.can_run(batch.input_ids, batch.attn):
            self.mixed_graph_steps += 1
            return mixed.run(batch.input_ids, batch.positions, batch.attn, slots)
        # Eagerly: the adapters the step's tokens use, made here only (graphs need none).
        attn = batch.attn if slots is None else \
            dataclasses.replace(batch.attn, lora=self.loras.step(slots))
        return self.model(batch.input_ids, batch.positions, self.cache.kv_cache, attn)

    def _logits(self, hidden: torch.Tensor,
                batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the logits of the rows that sample, their greedy tokens or None): a decode
        graph's own (it computes every row's logits and argmax: all of them when every row
        samples, the usual decode step), else the vocabulary matmul over those rows' hidden
        states (the sampler computes what it needs)."""
        ready, self._graph_logits = self._graph_logits, None
        tokens, self._graph_tokens = self._graph_tokens, None
        if ready is None:  # (more rows than a chunk: their hidden states, sample_chunks.py)
            return step_logits(self.model.compute_logits, hidden, batch.sample_rows,
                               self.sample_chunk_rows), None
        if batch.sample_rows is None or batch.sample_rows.shape[0] == ready.shape[0]:
            return ready, tokens
        return ready[batch.sample_rows], None

    def precompute(self, plan: StepPlan) -> PlanInputs:
        """`plan_inputs.precompute` against this runner's sizes (thread-safe: the I/O thread
        calls it on plan N+1 while step N's forward runs)."""
        return precompute(plan, self.limits)

    # ---------------------------------------------------------------- batch_prep.py
    _prepare = batch_prep.prepare
    _full_batch = batch_prep.full_batch
    _prepare_checked = batch_prep.prepare_checked
    _condemned = batch_prep.condemned
    _batch_of = batch_prep.batch_of

    # ---------------------------------------------------------------- runner_requests.py
    _put = runner_requests.put
    _drop = runner_requests.drop
    _update_requests = runner_requests.update_requests
