"""LoRA adapters loaded and unloaded while the cluster serves (``--max-loras N``; vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

The router decides and the executors follow. Every executor has ``--max-loras`` adapter
slots of ``--max-lora-rank`` allocated at start (executor/models/lora.py: captured graphs
stay valid, a load copies in place); the ``--lora-modules`` adapters hold the first ones
for good. A load or unload is an ``wire.LoraOp`` queued per executor and sent, in order,
with that executor's next StepPlan (a plan with no requests when it has nothing else to
run); the executor applies a plan's ops before its new requests and names the loads that
failed in the plan's StepResult, so the plan's result is the acknowledgement:

    load(name, path): every live executor gets the load; once each answered (or left),
        the adapter is live: requests may name it. One executor refusing it (a path it
        cannot read, a rank over --max-lora-rank) undoes it on the others and the load
        fails with that executor's message.
    unload(name): no new request may name it at once; the executors unload it when no
        live request uses it any more (its running streams finish with it).
    an executor joining: the live adapters are loaded on it first; requests naming one go
        to the executors that have it until it answers (`ready`).

With ``--lora-dir DIR`` adapters also load on demand (`resolve`): a request naming an
adapter that is not loaded, whose PEFT directory is DIR/<name>, loads it first (requests
for it at once share the one load; loads of different adapters go one at a time, so a slot
freed for one is not taken by another); when every slot is taken, the loaded adapter used least
recently that no live request runs is unloaded for it (none idle: the request waits until
one of theirs ends). `--lora-modules` adapters are never unloaded.

A load's generation is part of the adapter's prefix-cache salt (`admitted`): KV computed under
an unloaded adapter is never served to a request of a later adapter of the same name.
Requests name adapters; an executor maps names to its slots. A router that restarts knows
only ``--lora-modules`` (executors drop loaded adapters when they register again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..protos import wire
from .errors import InvalidRequest, NotFound, Unavailable
from .types import RequestSpec

if TYPE_CHECKING:
    from .engine import RouterEngine
    from .membership import ExecutorHandle

log = logging.getLogger("pagedserve.router")

MAX_NAME_CHARS = 256


def valid_name(name) -> bool:
    """A name an adapter may take (one path component under --lora-dir too)."""
    return isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS \
        and name not in (".", "..") and not any(c.isspace() or c in "\x00,/\\" for c in name)


def resolvable(lora_dir: str | None, name: str) -> bool:
    """Would a request naming ``name`` load it from ``--lora-dir`` (a PEFT directory there)?"""
    return bool(lora_dir) and valid_name(name) \
        and (Path(lora_dir) / name / "adapter_config.json").is_file()


@dataclass
class LoadedAdapter:
    """A runtime adapter as the router tracks it."""

    name: str
    path: str
    generation: int
    state: str = "loading"  # -> "live" -> "unloading" (then forgotten)
    waiting: set[str] = field(default_factory=set)  # executors whose answer is awaited
    loaded_on: set[str] = field(default_factory=set)  # executors that answered the load
    failures: list[str] = field(default_factory=list)  # "executor: message"
    done: asyncio.Future | None = None  # set when `waiting` empties
    forgotten: asyncio.Event = field(default_factory=asyncio.Event)  # unloaded everywhere
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # the load ended (or not)
    last_used: float = 0.0  # when a request last named it (the LRU's order)


class LoraRegistry:
    """The adapters requests may name: ``--lora-modules`` and those loaded since."""

    def __init__(self, engine: RouterEngine, static: tuple[str, ...], max_loras: int,
                 lora_dir: str | None = None) -> None:
        self.engine = engine
        self.lora_dir = lora_dir
        self.static = static
        self.max_loras = max_loras
        self.loaded: dict[str, LoadedAdapter] = {}
        self._resolving: dict[str, asyncio.Future] = {}  # on-demand loads under way
        self._slot_waiters: list[asyncio.Future] = []  # on-demand loads waiting for a slot
        self._on_demand = asyncio.Lock()
        self._generation = 0
        self.names: tuple[str, ...] = static  # what a request may name now (`_publish`)
        self._publish()

    # ------------------------------------------------------------------ requests

    def admitted(self, spec: RequestSpec) -> RequestSpec:
        """``spec`` as the engine admits it: InvalidRequest unless a new request may run
        its adapter now; a loaded adapter's generation added to its prefix-cache salt
        (validation salted it with the name; no NUL is in a name or a client's salt)."""
        name = spec.lora_adapter
        if not name or name in self.static:
            return spec
        adapter = self.loaded.get(name)
        if adapter is None or adapter.state != "live":
            served = ", ".join(self.names) or "none"
            raise InvalidRequest(f"lora_adapter: unknown LoRA adapter {name!r} (served: "
                                 f"{served})", field="lora_adapter")
        adapter.last_used = time.monotonic()
        return dataclasses.replace(
            spec, cache_salt=f"{spec.cache_salt}\x00gen:{adapter.generation}")

    def ready(self, handle: ExecutorHandle, name: str) -> bool:
        """Does executor ``handle`` run adapter ``name`` ("": the base model) now?"""
        return not name or name in self.static or name in handle.lora_ready

    def request_ended(self, name: str) -> None:
        """A request of adapter ``name`` left the live set: an unload waiting for its
        streams may go out now."""
        adapter = self.loaded.get(name)
        if adapter is not None and adapter.state == "unloading" and not adapter.waiting \
                and not self._in_use(name):
            self._send_unloads(adapter)
        self._wake_slot_waiters()

    # ------------------------------------------------------------------ load / unload

    async def load(self, name: str, path: str) -> None:
        """Load adapter ``name`` from ``path`` (a PEFT directory each executor reads) on
        every live executor; returns once it serves requests. Raises InvalidRequest (a bad
        or taken name, no free slot, an executor refusing it) or Unavailable."""
        self._check_enabled()
        if not valid_name(name):
            raise InvalidRequest(f"lora_name: must be 1 to {MAX_NAME_CHARS} characters "
                                 "without spaces, commas or slashes", field="lora_name")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise InvalidRequest("lora_path: must be the adapter's directory",
                                 field="lora_path")
        # An unload the executors are applying (its requests done) takes a step or two: a
        # load of its name, or one that needs its slot, waits for it rather than failing.
        while True:
            settling = [a for a in self.loaded.values()
                        if a.state == "unloading" and a.waiting]
            full = len(self.static) + len(self.loaded) >= self.max_loras
            if not settling or not (full or self.loaded.get(name) in settling):
                break
            await settling[0].forgotten.wait()
        if name in self.static or name in self.loaded:
            state = self.loaded[name].state if name in self.loaded else "live"
            raise InvalidRequest(
                f"The lora adapter {name!r} has already been loaded" if state != "unloading"
                else f"The lora adapter {name!r} is being unloaded (its last requests are "
                "running); load it again once they have finished", field="lora_name")
        if len(self.static) + len(self.loaded) >= self.max_loras:
            raise InvalidRequest(f"all {self.max_loras} LoRA adapter slots are in use "
                                 "(--max-loras): unload an adapter first", field="lora_name")
        handles = self._healthy()
        if not handles:
            raise Unavailable("no executor is up")
        self._generation += 1
        adapter = LoadedAdapter(name, path, self._generation)
        self.loaded[name] = adapter
        for handle in handles:
            self._queue(handle, adapter, load=True)
        try:
            await self._answers(adapter)
        finally:
            adapter.settled.set()
        if adapter.failures or not adapter.loaded_on:
            undo = [h for h in self._healthy() if h.id in adapter.loaded_on]
            adapter.state = "unloading"
            for handle in undo:
                self._queue(handle, adapter, load=False)
            await self._answers(adapter)
            self._forget(adapter)
            if adapter.failures:
                raise InvalidRequest(f"LoRA adapter {name!r} could not be loaded: "
                                 f"{adapter.failures[0]}", field="lora_path")
            raise Unavailable(f"LoRA adapter {name!r}: every executor left while loading it")
        adapter.state = "live"
        self._publish()
        log.info("LoRA adapter %s loaded from %s on %d executor(s)", name, path,
                 len(adapter.loaded_on))

    async def resolve(self, name: str) -> bool:
        """Make adapter ``name`` live if --lora-dir has it (module docstring): True when a
        request may name it now, False when it is not an adapter of --lora-dir. Raises as
        `load` does; waits while every slot runs requests."""
        adapter = self.loaded.get(name)
        if name in self.static or (adapter is not None and adapter.state == "live"):
            return True
        if not resolvable(self.lora_dir, name):
            return False
        if adapter is not None and adapter.state == "loading":  # a load through the API
            await adapter.settled.wait()
            return name in self.names
        pending = self._resolving.get(name)
        if pending is not None:  # another request is loading it: one load for all
            await asyncio.shield(pending)
            return name in self.names
        done = self._resolving[name] = asyncio.get_running_loop().create_future()
        try:
            # One on-demand load at a time: a slot freed for one is never taken by another
            async with self._on_demand:
                await self._load_on_demand(name, self.loaded.get(name))
        finally:
            del self._resolving[name]
            done.set_result(None)
        return True

    async def _load_on_demand(self, name: str, adapter: LoadedAdapter | None) -> None:
        """`resolve`'s load: a slot freed first when all are taken (the least recently
        used idle adapter unloaded), then the load from --lora-dir."""
        if len(self.static) >= self.max_loras:
            raise InvalidRequest(f"LoRA adapter {name!r}: every slot of --max-loras "
                                 f"{self.max_loras} holds a --lora-modules adapter",
                                 field="lora_adapter")
        while adapter is None and len(self.static) + len(self.loaded) >= self.max_loras:
            idle = [a for a in self.loaded.values()
                    if a.state == "live" and not self._in_use(a.name)]
            if idle:
                victim = min(idle, key=lambda a: a.last_used)
                log.info("LoRA adapter %s unloaded for %s (least recently used)", victim.name,
                         name)
                self.unload(victim.name)
                break
            # Every slot runs requests: wait for one of them to end (as a request waits for
            # a seat), then look again; a client that leaves cancels the wait.
            ended = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(ended)
            await ended
        await self.load(name, str(Path(self.lora_dir) / name))

    def unload(self, name: str) -> int:
        """Stop serving adapter ``name``: no new request may name it; the executors unload
        it once its live requests have finished. Returns how many still run."""
        self._check_enabled()
        if name in self.static:
            raise InvalidRequest(f"The lora adapter {name!r} was given with --lora-modules "
                                 "and cannot be unloaded", field="lora_name")
        adapter = self.loaded.get(name)
        if adapter is None or adapter.state == "unloading":
            raise NotFound(f"The lora adapter {name!r} cannot be found.")
        if adapter.state == "loading":
            raise InvalidRequest(f"The lora adapter {name!r} is still loading",
                                 field="lora_name")
        adapter.state = "unloading"
        self._publish()
        running = self._in_use(name)
        if not running:
            self._send_unloads(adapter)
        log.info("LoRA adapter %s unloading (%d requests still run it)", name, running)
        return running

    # ------------------------------------------------------------------ executors

    def executor_joined(self, handle: ExecutorHandle) -> None:
        """A new executor gets every adapter being loaded or live (an unloading one's
        requests never go to it)."""
        for adapter in self.loaded.values():
            if adapter.state == "unloading":
                continue
            self._queue(handle, adapter, load=True)

    def executor_lost(self, handle: ExecutorHandle) -> None:
        """An executor left: nothing waits for its answers any more."""
        for adapter in list(self.loaded.values()):
            adapter.loaded_on.discard(handle.id)
            if handle.id in adapter.waiting:
                adapter.waiting.discard(handle.id)
                self._maybe_done(adapter)

    def answered(self, handle: ExecutorHandle, ops: list[wire.LoraOp],
                 failures: list[wire.LoraFailure]) -> None:
        """The result of a plan that carried ``ops``: each load not in ``failures`` and each
        unload took effect on ``handle``."""
        failed = {f.name: f.message for f in failures}
        for op in ops:
            adapter = self.loaded.get(op.name)
            if op.load:
                if op.name in failed:
                    handle.lora_ready.discard(op.name)
                    message = f"executor {handle.id}: {failed[op.name]}"
                    log.error("LoRA adapter %s could not be loaded on %s", op.name, message)
                    if adapter is not None and adapter.state == "loading":
                        adapter.failures.append(message)
                else:
                    handle.lora_ready.add(op.name)
                    if adapter is not None:
                        adapter.loaded_on.add(handle.id)
            else:
                handle.lora_ready.discard(op.name)
                if adapter is not None:
                    adapter.loaded_on.discard(handle.id)
            if adapter is not None and handle.id in adapter.waiting \
                    and self._last_op_of(handle, op, ops):
                adapter.waiting.discard(handle.id)
                self._maybe_done(adapter)

    # ------------------------------------------------------------------ parts

    def _check_enabled(self) -> None:
        if self.max_loras <= 0:
            raise NotFound("runtime LoRA loading is off: start the router and the executors "
                           "with --max-loras N")

    def _healthy(self) -> list[ExecutorHandle]:
        return [h for h in self.engine.executors.values() if h.healthy]

    def _in_use(self, name: str) -> int:
        return sum(1 for g in self.engine.live.values() if g.spec.lora_adapter == name)

    def _queue(self, handle: ExecutorHandle, adapter: LoadedAdapter, load: bool) -> None:
        """Queue an op for ``handle``'s next plan; the adapter waits for its answer."""
        handle.lora_ops.append(wire.LoraOp(name=adapter.name, load=load,
                                           path=adapter.path if load else ""))
        if adapter.state != "live":  # a live adapter's replay on a joiner waits for nobody
            adapter.waiting.add(handle.id)
        handle.wakeup.set()

    @staticmethod
    def _last_op_of(handle: ExecutorHandle, op: wire.LoraOp, ops: list[wire.LoraOp]) -> bool:
        """Is ``op`` the last op naming its adapter that was queued for ``handle`` (in this
        plan or still waiting for the next)? An earlier one's answer is not the one
        awaited."""
        later = ops[ops.index(op) + 1:]
        return not any(o.name == op.name for o in (*later, *handle.lora_ops))

    def _send_unloads(self, adapter: LoadedAdapter) -> None:
        targets = [h for h in self._healthy()
                   if adapter.name in h.lora_ready
                   or any(o.name == adapter.name for o in h.lora_ops)
                   or any(o.name == adapter.name for p in h.in_flight for o in p.lora_ops)]
        for handle in targets:
            self._queue(handle, adapter, load=False)
        if not targets:
            self._forget(adapter)

    def _maybe_done(self, adapter: LoadedAdapter) -> None:
        if adapter.waiting:
            return
        if adapter.done is not None and not adapter.done.done():
            adapter.done.set_result(None)
        if adapter.state == "unloading" and adapter.done is None:
            self._forget(adapter)

    def _wake_slot_waiters(self) -> None:
        """On-demand loads waiting for a slot look again (a request ended, a slot freed, an
        adapter went live with no request yet)."""
        waiters, self._slot_waiters = self._slot_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _forget(self, adapter: LoadedAdapter) -> None:
        adapter.forgotten.set()
        self._wake_slot_waiters()
        if self.loaded.get(adapter.name) is adapter:
            del self.loaded[adapter.name]
            log.info("LoRA adapter %s unloaded", adapter.name)

    async def _answers(self, adapter: LoadedAdapter) -> None:
        """Until every executor the adapter waits for has answered or left."""
        if not adapter.waiting:
            return
        adapter.done = asyncio.get_running_loop().create_future()
        try:
            await adapter.done
        finally:
            adapter.done = None

    def _publish(self) -> None:
        """What requests may name: the static adapters, then the live loaded ones (and the
        gauges, when the engine has metrics)."""
        self.names = (*self.static, *(a.name for a in self.loaded.values()
                                      if a.state == "live"))
        metrics = getattr(self.engine, "metrics", None)
        if metrics is not None:
            metrics.set_lora_adapters(len(self.names), self.max_loras)
        self._wake_slot_waiters()
