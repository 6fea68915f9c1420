"""What the model runner keeps between steps besides the request rows: the tokens of the last
step not yet recorded (`PendingSamples`), each request's sampling state behind them
(`RequestState`), and a step launched whose result is not yet built (`InFlight`); and the
KV blocks a step's result carries (`export_kv`). model_runner.py has the step itself and the
order things happen in."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
from pagedserve.executor.batch_prep import Batch
from pagedserve.executor.cache_engine import CacheEngine
from pagedserve.executor.request_rows import RequestRows
from pagedserve.executor.sampler import SampledOnDevice
from pagedserve.executor.sampling_state import SamplingState
from pagedserve.protos.wire import RequestError, StepPlan

log = logging.getLogger(__name__)


class PendingSamples:
    """The tokens sampled in the last step (``step_id``) by the requests in ``rows``, not
    yet recorded: `apply` appends them to the requests' sampling ``states`` and writes them
    into the `RequestRows` columns. `ModelRunner` applies them once the next forward is
    launched, or earlier when something reads those records: a row about to change hands
    (released, or forked), a step that does not feed from them directly, any read of a
    `RequestState.sampling`. Until then a marked decode of the next step is fed from here
    (`ModelRunner._prepare`), so the gap between two steps does neither."""

    __slots__ = ("table", "states", "token_ids", "rows", "step_id", "device_tokens",
                 "resolve", "released", "drafted")

    def __init__(self, table: RequestRows, resolve: Callable[[], None]) -> None:
        self.table = table
        self.resolve = resolve  # reads an in-flight step's tokens back (ModelRunner._resolve)
        self.states: list[SamplingState] = []  # empty: nothing pending
        self.token_ids: np.ndarray | None = None  # None while the step is in flight
        self.rows: np.ndarray | None = None
        self.step_id = -1
        # the step had rows with drafts: a request may have several tokens (in order; its
        # last is what a marked decode would be fed: `_prepare_checked` records them first)
        self.drafted = False
        # While the step is in flight (launched, tokens not read back): its tokens on the
        # device, and rows whose release waits for the record (a dropped request's row
        # must not change hands before).
        self.device_tokens: torch.Tensor | None = None
        self.released: list[int] = []

    def read_back(self) -> None:
        """The tokens on the host (the step in flight read back, waiting for the device if
        need be), not yet recorded."""
        if self.states and self.token_ids is None:
            self.resolve()  # sets token_ids

    def apply(self) -> None:
        self.read_back()
        states, self.states = self.states, []
        if states:
            rows, tokens = self.rows, self.token_ids
            if self.drafted:  # a request's last token is its record
                _, first_from_end = np.unique(rows[::-1], return_index=True)
                last = rows.shape[0] - 1 - first_from_end
                rows, tokens = rows[last], tokens[last]
            self.table.record_samples(rows, tokens, self.step_id)
            for state, token in zip(states, self.token_ids.tolist(), strict=True):
                state.append(token)
        released, self.released = self.released, []
        for row in released:
            self.table.release(row)


class RequestState:
    """What the executor keeps per request between steps, besides its row of the runner's
    `RequestRows` (block table, last sampled token): its sampling state. Reading
    ``sampling`` first appends the tokens sampled in the last step, when that is still
    pending, so a reader always sees every token sampled so far."""

    __slots__ = ("row", "_sampling", "_pending")

    def __init__(self, row: int, sampling: SamplingState, pending: PendingSamples) -> None:
        self.row = row
        self._sampling = sampling
        self._pending = pending

    @property
    def sampling(self) -> SamplingState:
        if self._pending.states:
            self._pending.apply()
        return self._sampling


class InFlight:
    """A step launched whose result is not yet built (ModelRunner.submit)."""

    __slots__ = ("plan", "batch", "sampled", "result", "errors", "events", "t0", "t1",
                 "after_event", "after_pooled")

    def __init__(self, plan: StepPlan, batch: Batch, sampled: SampledOnDevice | None,
                 result: dict, errors: list[RequestError], events: tuple | None, t0: float,
                 t1: float, after_event=None, after_pooled: list | None = None) -> None:
        self.plan, self.batch, self.sampled = plan, batch, sampled
        self.result, self.errors, self.events = result, errors, events
        self.t0, self.t1 = t0, t1
        # CUDA: the event at the end of the previous step's device work (its gap_s is
        # measured from there to events[0] once both are done); None: the host's gap_s.
        self.after_event = after_event
        # The HostPool's objects of the step that event ends (its events, its tokens' host
        # buffers): given back once this step is read back, the last that reads them.
        self.after_pooled = after_pooled

    def pooled(self) -> list:
        """This step's HostPool objects (its forward's events, its sampling's)."""
        return [*(self.events or ()), *(self.sampled.pooled() if self.sampled else ())]

    @property
    def end_event(self):
        """CUDA: the event after this step's last device work (its sampling's copies, else
        its forward); None on a CPU."""
        if self.sampled is not None and self.sampled.event is not None:
            return self.sampled.event
        return self.events[1] if self.events is not None else None


def export_kv(cache: CacheEngine, plan: StepPlan, result: dict) -> None:
    """The plan's `kv_export` blocks as bytes in its ``result``. A failure sends none (the
    receiving executor computes them again: the router imports what arrives), and takes
    down neither the step nor the executor."""
    if plan.kv_export is None:
        return
    try:
        result["kv_export_data"] = cache.export_blocks(plan.kv_export)
    except Exception:
        log.exception("step %d: exporting %d KV blocks failed; none sent", plan.step_id,
                      len(plan.kv_export))
