"""New weights while the cluster serves, and pausing generation for them (what an RL trainer
drives: SGLang's ``/update_weights_from_disk``, ``/pause_generation``,
``/continue_generation``, ``/get_weight_version``; vLLM's ``/reset_prefix_cache``).

The router decides and the executors follow, as with LoRA adapters (lora_registry.py). An
update from a directory of the same model's ``*.safetensors``:

    1. admission is held on every executor (`Scheduler.hold`): new requests queue, the
       running ones go on (or are aborted first: ``abort_all_requests``);
    2. once no request runs or is swapped on any executor (none holds KV of the old
       weights), every executor gets a check (``wire.WeightOp``, load false) with its next
       plan (a plan with nothing else); one refusing it (a path it cannot read, another
       model's config or shapes) fails the update with its reason, nothing changed;
    3. then the load: the executors copy the weights in place; one failing (partway, or
       the files changed since the check) is taken out of service (it registers again and
       gets the cluster's weights before any request);
    4. every executor's prefix cache is reset (`KVCacheManager.reset_prefix_cache`: no
       block of the old weights is found again), the version is recorded, and admission
       resumes unless generation is paused.

Pausing (``mode``): "abort" ends every live request (finish reason abort) and holds new
ones; "retract" preempts every running and swapped request by recompute and holds them
with the new ones (they keep their tokens and compute them again, with the weights then
loaded, once generation continues); "wait" holds new ones and lets the running finish;
"keep" (vLLM's; SGLang's "in_place") freezes the running ones where they are, their KV
kept, until generation continues. A paused cluster updates at once (nothing runs; frozen
requests are retracted first: their KV is the old weights').

An executor joining (a new one, one restarted, one re-registering after a router restart)
reports the weights it runs (``Hello.weights_path``; "" its own ``--model``); when they are
not the router's, its first plan loads the router's, and no request is routed to it until
that is done (`ready`). A router that restarts knows only ``--model`` ("" again): executors
that loaded other weights load their own back.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

from ..protos import wire
from .errors import InvalidRequest, NotFound, Unavailable

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle

log = logging.getLogger(__name__)

# /pause_generation's modes (SGLang's; "in_place" is "keep") and vLLM's /pause's
PAUSE_MODES = ("abort", "retract", "wait", "keep", "in_place")
DRAIN_POLL_S = 0.01  # how often an update looks whether the running requests have ended


class WeightSync:
    """One per engine. ``enabled``: the routes that change weights or pause are served
    (``--enable-weight-updates``); the prefix-cache reset always is."""

    def __init__(self, engine: RouterEngine, enabled: bool, version: str = "default") -> None:
        self.engine = engine
        self.enabled = enabled
        self.version = version  # --weight-version, then each update's weight_version
        self.path = ""  # the weights the executors run ("": each one's --model)
        self.paused = ""  # the mode of /pause_generation until /continue_generation
        self.updating = False
        self._lock = asyncio.Lock()  # one update at a time
        # executor id -> its ops queued or in flight, with their answers, in order
        self._answers: dict[str, collections.deque] = {}

    # ------------------------------------------------------------------ the routes

    async def update_from_disk(self, path: str, *, abort_all_requests: bool = False,
                               weight_version: str | None = None) -> int:
        """Load the weights of directory ``path`` on every executor (module docstring).
        Returns how many requests waited for it. Raises InvalidRequest (a refusal: nothing
        changed), Unavailable (no executor), NotFound (updates are off)."""
        self._check_enabled()
        # Once ops go out the executors apply them: a caller leaving must not stop it halfway
        return await asyncio.shield(self._update(path, abort_all_requests, weight_version))

    async def _update(self, path: str, abort_all_requests: bool,
                      weight_version: str | None) -> int:
        async with self._lock:
            self.updating = True
            self._hold("hold")
            t0 = time.monotonic()
            outcome = "failed"
            try:
                if abort_all_requests:
                    self._abort_all()
                self._hold("retract", only="freeze")  # frozen ones hold the old weights' KV
                await self._drained()
                outcome = "refused"
                await self._everywhere(wire.WeightOp(path=path, load=False), refusals=True)
                outcome = "failed"
                await self._everywhere(wire.WeightOp(path=path, load=True), refusals=False)
                outcome = "loaded"
                self.path = path
                if weight_version is not None:
                    self.version = weight_version
                for handle in self._healthy():
                    handle.kv.reset_prefix_cache()
                    self._catch_up(handle)  # one that joined meanwhile
                waited = self._num_held()
                log.info("weights updated from %s (version %s) in %.2f s; %d requests waited",
                         path, self.version, time.monotonic() - t0, waited)
                return waited
            finally:
                self.updating = False
                self._hold("hold" if self.paused else "")  # (frozen ones were retracted)
                self._metric("inc_weight_update", outcome)

    async def pause(self, mode: str) -> None:
        """Hold generation (module docstring: ``mode`` "abort", "retract", "wait" or
        "keep"); returns once nothing runs ("keep": at once, the running requests frozen
        where they are)."""
        self._check_enabled()
        if mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode: {mode!r} is not one of {', '.join(PAUSE_MODES)}",
                                 field="mode")
        mode = "keep" if mode == "in_place" else mode
        if mode == "keep" and self.updating:
            raise InvalidRequest("mode: a weight update is waiting for the running requests; "
                                 "pause with abort, retract or wait", field="mode")
        self.paused = mode
        self._hold("")  # (the latest pause's mode is the one that holds)
        if mode == "keep":
            self._hold("freeze")
            log.info("generation paused (keep)")
            return
        self._hold("retract" if mode == "retract" else "hold")
        if mode == "abort":
            self._abort_all()
        await self._drained()
        log.info("generation paused (%s)", mode)

    async def is_paused(self) -> bool:
        self._check_enabled()
        return bool(self.paused)

    async def resume(self) -> None:
        """/continue_generation: the held requests are admitted again (an update running
        holds them until it ends)."""
        self._check_enabled()
        self.paused = ""
        if not self.updating:
            self._hold("")
        log.info("generation continues")

    async def current_version(self) -> str:
        self._check_enabled()
        return self.version

    async def flush(self, idle_only: bool) -> int:
        """Every executor forgets the cached prefixes no request holds (the cache stays
        otherwise correct: the weights did not change); returns how many blocks stayed
        cached because live requests hold them. ``idle_only`` (SGLang's /flush_cache):
        nothing is flushed while a request is live (InvalidRequest)."""
        live = len(self.engine.live)
        if idle_only and live:
            raise InvalidRequest(f"Cache not flushed: {live} requests are running or waiting")
        kept = sum(h.kv.reset_prefix_cache() for h in self._healthy())
        log.info("prefix caches reset (%d blocks held by live requests kept)", kept)
        return kept

    # ------------------------------------------------------------------ executors

    def holds(self) -> bool:
        return bool(self.paused or self.updating)

    def executor_joined(self, handle: ExecutorHandle) -> None:
        """A new registration: held like the others; given the router's weights first when
        it runs others (it takes no request until it has them: `ready`)."""
        if self.holds():
            handle.scheduler.hold = "hold"
        handle.weights_path = handle.hello.weights_path
        self._catch_up(handle)

    def executor_lost(self, handle: ExecutorHandle) -> None:
        for _, answer in self._answers.pop(handle.id, ()):
            if not answer.done():
                answer.set_result(None)  # gone: it is not waited for any more

    def answered(self, handle: ExecutorHandle, op: wire.WeightOp, failed: str) -> None:
        """The result of the plan that carried ``op`` on ``handle`` (ops are answered in the
        order they were queued). A load that failed leaves the executor without the
        cluster's weights (maybe half loaded): it is taken out of service."""
        queue = self._answers.get(handle.id)
        if queue:
            _, answer = queue.popleft()
            if not answer.done():
                answer.set_result(failed)
        if not op.load:
            return
        if failed:
            self.engine.membership.executor_lost(handle, f"new weights: {failed}")
            return
        handle.weights_path = op.path
        if self.ready(handle):
            log.info("executor %s runs weights %s", handle.id, self.path or "of its --model")

    def ready(self, handle: ExecutorHandle) -> bool:
        """May requests be routed to ``handle``: does it run the router's weights?"""
        return handle.weights_path == self.path

    # ------------------------------------------------------------------ parts

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise NotFound("weight updates are off: start the router with "
                           "--enable-weight-updates")

    def _healthy(self) -> list[ExecutorHandle]:
        return [h for h in self.engine.executors.values() if h.healthy]

    def _hold(self, mode: str, only: str | None = None) -> None:
        """Every executor's `Scheduler.hold` to ``mode`` (``only``: those at that mode); a
        retract not carried out yet stays (it holds after), and so does a freeze (a pause
        "keep") unless ``mode`` is "" or "retract"."""
        for handle in self._healthy():
            current = handle.scheduler.hold
            if only is not None and current != only:
                continue
            if mode in ("", "retract") or current not in ("retract", "freeze"):
                handle.scheduler.hold = mode
            handle.wakeup.set()
        self._metric("set_generation_held", self.holds() or bool(mode))

    def _metric(self, name: str, value) -> None:
        metrics = getattr(self.engine, "metrics", None)  # (none over fake executors)
        if metrics is not None:
            getattr(metrics, name)(value)

    def _abort_all(self) -> None:
        for request_id in list(self.engine.live):
            self.engine.abort(request_id)

    def _num_held(self) -> int:
        return sum(len(h.scheduler.waiting) for h in self._healthy())

    def has_work(self, handle: ExecutorHandle) -> bool:
        """Does ``handle``'s step loop have a plan to send for weights or a retract?"""
        return bool(handle.weight_ops) or handle.scheduler.hold == "retract"

    async def _drained(self) -> None:
        """Until no executor runs or holds swapped a request (nothing holds KV), and every
        "retract" has been carried out."""
        while any(h.scheduler.running or h.scheduler.swapped or h.scheduler.hold == "retract"
                  for h in self._healthy()):
            await asyncio.sleep(DRAIN_POLL_S)

    def _send(self, handle: ExecutorHandle, op: wire.WeightOp) -> asyncio.Future:
        """Queue ``op`` for one of ``handle``'s next plans (one op a plan, in order)."""
        answer = asyncio.get_running_loop().create_future()
        self._answers.setdefault(handle.id, collections.deque()).append((op, answer))
        handle.weight_ops.append(op)
        handle.wakeup.set()
        return answer

    def _catch_up(self, handle: ExecutorHandle) -> None:
        """Queue a load of the router's weights on ``handle`` unless it runs them or one is
        queued already."""
        queued = [op for op, _ in self._answers.get(handle.id, ())]
        if handle.weights_path != self.path and not any(
                op.load and op.path == self.path for op in queued):
            self._send(handle, wire.WeightOp(path=self.path, load=True))

    async def _everywhere(self, op: wire.WeightOp, refusals: bool) -> None:
        """Send ``op`` to every executor and wait for their answers. A check's refusal
        raises InvalidRequest (``refusals``); a load failing takes its executor out."""
        handles = self._healthy()
        if not handles:
            raise Unavailable("no executor is up")
        answers = [(h, self._send(h, op)) for h in handles]
        for handle, answer in answers:
            failed = await answer
            if failed and refusals:
                raise InvalidRequest(f"executor {handle.id}: {failed}", field="model_path")
        if not self._healthy():
            raise Unavailable("no executor is up after the weight update")
